"""Locks across server replicas on PostgreSQL (issue 10): per-sandbox advisory locks exclude another process,
the reaper's leader lock is held by one process and taken over when the leader is killed with SIGKILL, lifecycle
operations started from two processes at once never both start, and a follower sees events another process wrote."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from sbx.control.errors import ControlError
from sbx.control.store.database import SandboxRow, Store, utcnow
from sbx.control.store.locks import LeaderLock, SandboxLocks
from sbx.control.store.state import Lifecycle
from tests.fakes import wait_until

ROOT = Path(__file__).resolve().parents[4]

HOLDER = textwrap.dedent("""
    import sys, time
    from sbx.control.store.database import Store
    from sbx.control.store.locks import LeaderLock, SandboxLocks
    store = Store(sys.argv[1])
    if sys.argv[2] == "sandbox":
        with SandboxLocks(store.engine).hold(sys.argv[3], timeout=60) as held:
            print("held" if held else "missed", flush=True)
            time.sleep(3600)
    else:
        leader = LeaderLock(store.engine, sys.argv[3])
        while not leader.try_lead():
            time.sleep(0.1)
        print("leader", flush=True)
        time.sleep(3600)
""")


class Holder:
    """A separate Python process that takes a lock and keeps it until killed."""

    def __init__(self, url: str, kind: str, key: str):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, url, kind, key], stdout=subprocess.PIPE,
                                     text=True, cwd=ROOT)

    def wait_line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)


@pytest.fixture
def pg_store(pg_url: str):  # type: ignore[no-untyped-def]
    s = Store(pg_url)
    yield s
    s.close()


def test_a_sandbox_lock_held_by_another_process_excludes_until_it_dies(pg_store: Store, pg_url: str) -> None:
    holder = Holder(pg_url, "sandbox", "sb_lockedaaaa")
    try:
        assert holder.wait_line() == "held"
        locks = SandboxLocks(pg_store.engine)
        with locks.hold("sb_lockedaaaa", timeout=0.5) as held:
            assert not held
        with locks.hold("sb_otheraaaaa", timeout=0) as held:  # other sandboxes are not affected
            assert held
        holder.kill9()  # PostgreSQL ends the dead session and drops its lock
        with locks.hold("sb_lockedaaaa", timeout=60) as held:
            assert held
        with locks.hold("sb_lockedaaaa", timeout=0) as held:  # released after the block
            assert held
    finally:
        holder.kill9()


def test_one_leader_and_takeover_after_kill9(pg_store: Store, pg_url: str) -> None:
    first = Holder(pg_url, "leader", "reaper")
    second: Holder | None = None
    try:
        assert first.wait_line() == "leader"
        mine = LeaderLock(pg_store.engine, "reaper")
        assert not mine.try_lead()
        second = Holder(pg_url, "leader", "reaper")  # waits, retrying, while the first leads
        first.kill9()
        assert second.wait_line() == "leader"
        assert not mine.try_lead()
        second.kill9()
        assert wait_until(mine.try_lead, timeout=60)
        assert mine.try_lead()  # stays leader on later ticks
        other = LeaderLock(pg_store.engine, "reaper")
        assert not other.try_lead()
        mine.release()
        assert other.try_lead()
        other.release()
    finally:
        first.kill9()
        if second is not None:
            second.kill9()


def test_leader_lock_is_always_held_on_sqlite(tmp_path: Path) -> None:
    s = Store(f"sqlite:///{tmp_path / 'sbx.db'}")
    assert LeaderLock(s.engine, "reaper").try_lead() and LeaderLock(s.engine, "reaper").try_lead()
    s.close()


def _add(store: Store, sid: str) -> None:
    now = utcnow()
    store.add_sandbox(SandboxRow(id=sid, name="n", type="small", state="running", subdomain=f"s-{sid}", ttl=0,
                                 env={}, no_snapshots=False, has_memory=False, created_at=now, updated_at=now))


def test_two_replicas_never_both_start_an_operation(pg_url: str) -> None:
    """Two Lifecycles on two stores (two connection pools, as two replicas) race to stop one running sandbox: one
    starts ``stopping``, the other waits and then gets 409 ``invalid_state`` or ``busy``, never a second start."""
    stores = [Store(pg_url), Store(pg_url)]
    try:
        _add(stores[0], "sb_raceaaaaaa")
        cycles = [Lifecycle(s, lambda row, old: None, wait=2.0) for s in stores]
        results: list[str] = []
        barrier = threading.Barrier(2)

        def go(lc: Lifecycle) -> None:
            barrier.wait()
            try:
                lc.begin("sb_raceaaaaaa", "stopping", wait=2.0)
                results.append("started")
            except ControlError as e:
                results.append(e.code)

        threads = [threading.Thread(target=go, args=(lc,)) for lc in cycles]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert sorted(results)[-1] == "started" and results.count("started") == 1, results
        assert set(results) - {"started"} <= {"busy", "invalid_state"}
        assert stores[1].get_sandbox("sb_raceaaaaaa").state == "stopping"  # type: ignore[union-attr]
    finally:
        for s in stores:
            s.close()


def test_a_follower_sees_events_written_by_another_replica(tmp_path: Path, pg_url: str) -> None:
    from sbx.control.service import ControlPlane
    from tests.fakes import FakeNode, fake_settings

    settings = fake_settings(tmp_path)
    node = FakeNode(tmp_path / "node")
    reader, writer = Store(pg_url), Store(pg_url)
    cp = ControlPlane(settings, node, store=reader)
    try:
        _add(writer, "sb_followaaaa")
        writer.add_event("sb_followaaaa", {"event": "state", "n": 1})
        stream = cp.events("sb_followaaaa", follow=True, poll=0.2)
        assert next(stream)["n"] == 1
        threading.Timer(0.5, lambda: writer.add_event("sb_followaaaa", {"event": "state", "n": 2})).start()
        ev = next(stream)  # blocks until the other store's event shows up (pytest's timeout bounds it)
        assert ev["n"] == 2 and ev["seq"] > 1
    finally:
        cp.close()
        node.close()
        writer.close()
