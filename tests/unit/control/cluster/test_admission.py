"""Admission (issue 17): the arithmetic of :mod:`sbx.control.cluster.capacity`, and the control plane refusing new,
resume,
resize and fork with 507 insufficient_capacity, atomically and without leaving anything behind."""

from __future__ import annotations

import threading
from contextlib import closing
from pathlib import Path

import pytest

from sbx.config import TEST_SIZES
from sbx.control.cluster import capacity
from sbx.control.cluster.capacity import GiB, HostResources
from sbx.control.cluster.trim import FOLLOW_UP_SLACK, FOLLOW_UPS, Trimmer
from sbx.control.errors import ControlError
from sbx.control.service import ControlPlane
from sbx.control.store.database import SandboxRow, utcnow
from tests.fakes import FakeNode, fake_settings, wait_until

SMALL = TEST_SIZES["small"]  # 256 MiB, 2 GiB disk
ROOMY_DISK = 100 * GiB


def _row(sid: str, state: str, type: str = "small") -> SandboxRow:
    now = utcnow()
    return SandboxRow(id=sid, name=sid, type=type, state=state, subdomain=sid, ttl=0, env={}, memory_restored=None,
                      resume_reason=None, has_memory=False, created_at=now, updated_at=now)


def test_every_sandbox_but_stopped_ones_counts_at_its_memory_limit(tmp_path: Path) -> None:
    settings = fake_settings(tmp_path)
    rows = [_row("a", "running"), _row("b", "provisioning", "default"), _row("c", "stopped"),
            _row("d", "resuming", "large"), _row("e", "error"), _row("f", "stopping"), _row("g", "forking"),
            _row("h", "deleting"), _row("i", "deleted", "xlarge")]
    # 256 (a) + 512 (b) + 1024 (d) + 256 (e) + 256 (f) + 256 (g) + 256 (h); c stopped, i deleted
    assert capacity.committed_memory_mib(rows, settings) == 2816
    assert capacity.committed_memory_mib(rows, settings, exclude="d") == 1792
    assert capacity.committed_memory_mib([_row("x", "running", "gone")], settings) == 2048  # unknown: the largest


def test_the_memory_limit_is_ram_minus_reserve_times_the_ratio(tmp_path: Path) -> None:
    settings = fake_settings(tmp_path, memory_reserve_mib=1024, memory_overcommit=4.0)
    assert capacity.memory_limit_mib(settings, HostResources(24105, ROOMY_DISK, "/v")) == 92324
    assert capacity.memory_limit_mib(settings, HostResources(512, ROOMY_DISK, "/v")) == 0  # never negative


def test_the_default_ratio_admits_300_idle_bench_small_sandboxes_on_24_gib(tmp_path: Path) -> None:
    settings = fake_settings(tmp_path)  # the defaults, test profile as python -m bench uses
    host = HostResources(24105, ROOMY_DISK, "/v")
    assert settings.memory_overcommit == 4.0
    assert capacity.refusal(settings, host, 299 * SMALL.memory_mib, SMALL, "a new small sandbox") is None


def test_a_request_that_exactly_fills_memory_passes_and_one_more_mib_is_refused(tmp_path: Path) -> None:
    settings = fake_settings(tmp_path, memory_reserve_mib=1000, memory_overcommit=1.0)
    host = HostResources(1000 + 3 * 256, ROOMY_DISK, "/v")
    assert capacity.refusal(settings, host, 512, SMALL, "x") is None
    err = capacity.refusal(settings, host, 513, SMALL, "a new small sandbox")
    assert err is not None and err.status == 507 and err.code == "insufficient_capacity"
    assert "memory" in err.message and "513 MiB" in err.message and "768 MiB" in err.message
    assert "a new small sandbox (256 MiB)" in err.message and "overcommit 1" in err.message


def test_disk_is_refused_when_growth_would_eat_into_the_reserve(tmp_path: Path) -> None:
    settings = fake_settings(tmp_path, disk_reserve_gib=5.0)
    growth = capacity.disk_growth_bytes(SMALL)
    assert growth == int(2 * GiB * capacity.DISK_GROWTH_SHARE)
    enough = HostResources(24105, 5 * GiB + growth, "/var/lib/sbx/volume.xfs")
    assert capacity.refusal(settings, enough, 0, SMALL, "x") is None
    short = HostResources(24105, 5 * GiB + growth - 1, "/var/lib/sbx/volume.xfs")
    err = capacity.refusal(settings, short, 0, SMALL, "a new small sandbox")
    assert err is not None and err.status == 507 and err.code == "insufficient_capacity"
    assert "disk" in err.message and "/var/lib/sbx/volume.xfs" in err.message and "5.0 GiB" in err.message


def test_the_host_probe_reads_real_figures(tmp_path: Path) -> None:
    host = capacity.probe_host(fake_settings(tmp_path))
    assert host.memory_mib > 256
    assert host.disk_free_bytes > 0


# --- the control plane ------------------------------------------------------------------------------------------


class Host:
    """A host probe whose figures a test sets: room for ``slots`` test small sandboxes of memory."""

    def __init__(self, slots: int, disk: int = ROOMY_DISK):
        self.memory_mib = 1000 + slots * SMALL.memory_mib
        self.disk = disk

    def __call__(self) -> HostResources:
        return HostResources(self.memory_mib, self.disk, "/host/volume.xfs")


def _control(tmp_path: Path, node: FakeNode, host: Host) -> ControlPlane:
    settings = fake_settings(tmp_path, memory_reserve_mib=1000, memory_overcommit=1.0, disk_reserve_gib=1.0)
    cp = ControlPlane(settings, node, wait=5.0, host=host, trim=lambda _min: None)
    cp.start()
    return cp


def _running(cp: ControlPlane, type: str = "small") -> str:
    row = cp.create(type=type)
    cp.wait_settled(row.id)
    return row.id


def _refused(fn, *args, **kw) -> ControlError:  # type: ignore[no-untyped-def]
    with pytest.raises(ControlError) as info:
        fn(*args, **kw)
    assert info.value.status == 507 and info.value.code == "insufficient_capacity", info.value.message
    return info.value


def test_create_beyond_memory_is_refused_and_leaves_nothing(tmp_path: Path, node: FakeNode) -> None:
    with closing(_control(tmp_path, node, Host(slots=3))) as cp:
        ids = [_running(cp) for _ in range(3)]
        before_events = {sid: len(cp.store.events(sid)) for sid in ids}
        err = _refused(cp.create, type="small", name="one-too-many")
        assert "memory" in err.message
        assert len(cp.list_sandboxes()) == 3 and not any(r.name == "one-too-many" for r in cp.list_sandboxes())
        assert len([c for c in node.calls if c[0] == "create"]) == 3
        assert {sid: len(cp.store.events(sid)) for sid in ids} == before_events
        cp.stop(ids[0])
        cp.wait_settled(ids[0])
        assert cp.wait_settled(_running(cp)).state == "running"  # a stopped sandbox frees its room


def test_create_beyond_disk_is_refused(tmp_path: Path, node: FakeNode) -> None:
    with closing(_control(tmp_path, node, Host(slots=10, disk=GiB))) as cp:
        err = _refused(cp.create, type="small")
        assert "disk" in err.message and cp.list_sandboxes() == []


def test_resume_when_full_is_refused_and_the_sandbox_stays_stopped(tmp_path: Path, node: FakeNode) -> None:
    with closing(_control(tmp_path, node, Host(slots=2))) as cp:
        sid = _running(cp)
        cp.stop(sid)
        stopped = cp.wait_settled(sid)
        assert stopped.state == "stopped" and stopped.has_memory
        _running(cp)
        other = _running(cp)
        n_events = len(cp.store.events(sid))
        _refused(cp.resume, sid)
        _refused(cp.resume, sid, type="default")  # a resize cold-boots bigger: refused as well
        after = cp.store.get_sandbox(sid)
        assert after is not None
        assert (after.state, after.has_memory, after.type) == ("stopped", True, "small")
        assert len(cp.store.events(sid)) == n_events
        assert not [c for c in node.calls if c[0] == "resume"]
        cp.delete(other)
        cp.wait_settled(other)
        assert cp.wait_settled(cp.resume(sid).id).state == "running"


def test_a_resize_is_counted_at_its_new_size(tmp_path: Path, node: FakeNode) -> None:
    with closing(_control(tmp_path, node, Host(slots=2))) as cp:  # 512 MiB: a default fits alone
        sid = _running(cp)
        cp.stop(sid)
        cp.wait_settled(sid)
        assert cp.wait_settled(cp.resume(sid, type="default").id).type == "default"
        _refused(cp.create, type="small")


def test_an_error_sandbox_is_not_counted_twice_when_it_is_resumed(tmp_path: Path, node: FakeNode) -> None:
    with closing(_control(tmp_path, node, Host(slots=1))) as cp:
        sid = _running(cp)
        cp.stop(sid)
        cp.wait_settled(sid)
        cp.store.update_sandbox(sid, state="error", error_code="x", error_message="x")
        assert cp.wait_settled(cp.resume(sid).id).state == "running"


def test_fork_when_full_is_refused_and_releases_the_source(tmp_path: Path, node: FakeNode) -> None:
    with closing(_control(tmp_path, node, Host(slots=1))) as cp:
        sid = _running(cp)
        _refused(cp.fork, sid)
        assert [r.id for r in cp.list_sandboxes()] == [sid]
        assert not [c for c in node.calls if c[0] == "fork"]
        cp.stop(sid, wait=1.0)  # no hold left on the source
        assert cp.wait_settled(sid).state == "stopped"
        assert cp.wait_settled(cp.fork(sid).id).state == "running"  # room again once the source stopped


def test_concurrent_creates_never_overfill(tmp_path: Path, node: FakeNode) -> None:
    with closing(_control(tmp_path, node, Host(slots=4))) as cp:
        outcomes: list[str] = []
        lock = threading.Lock()
        go = threading.Barrier(12)

        def one() -> None:
            go.wait()
            try:
                cp.create(type="small")
                result = "ok"
            except ControlError as e:
                result = e.code
            with lock:
                outcomes.append(result)

        threads = [threading.Thread(target=one) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes) == ["insufficient_capacity"] * 8 + ["ok"] * 4
        assert len(cp.list_sandboxes()) == 4


def test_deletes_ask_for_a_trim(tmp_path: Path, node: FakeNode) -> None:
    trims: list[float] = []
    settings = fake_settings(tmp_path, trim_seconds=0)
    with closing(ControlPlane(settings, node, wait=5.0, trim=lambda _min: trims.append(1) or 0)) as cp:
        cp.start()
        sid = _running(cp)
        cp.snapshot(sid, "keep")
        cp.delete_snapshot("keep")
        wait_until(lambda: len(trims) >= 1, timeout=10)
        cp.delete(sid)
        wait_until(lambda: len(trims) >= 2, timeout=10)


def test_the_trimmer_runs_on_its_timer_and_survives_a_failing_trim() -> None:
    calls: list[int] = []

    def trim(_min_slack: int | None) -> int:
        calls.append(1)
        raise OSError("fstrim failed")

    t = Trimmer(trim, every=0.05)
    t.start()
    try:
        wait_until(lambda: len(calls) >= 3, timeout=10)
    finally:
        t.stop()
    assert t.passes >= 3


def test_a_trim_that_ran_is_followed_by_passes_that_take_any_freed_space() -> None:
    mins: list[int | None] = []

    def trim(min_slack: int | None) -> int | None:
        mins.append(min_slack)
        return 1 if len(mins) == 1 else None  # the first pass gives space back, the rest find too little

    t = Trimmer(trim, every=0)
    t.request()
    t.start()
    try:
        wait_until(lambda: len(mins) >= 1 + FOLLOW_UPS, timeout=60)
    finally:
        t.stop()
    assert mins[: 1 + FOLLOW_UPS] == [None] + [FOLLOW_UP_SLACK] * FOLLOW_UPS
