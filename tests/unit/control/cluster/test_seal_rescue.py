"""Running sandboxes in the seal store (issue 34, sbx.control.cluster.rescue): which running sandboxes' automatic
snapshots go up, when a node counts as lost (counted from when the loop first saw it unreachable), which sandboxes
come back; a snapshot's seal row is written only when newer than the stored one, never for a deleted sandbox, and
never counts as a stopped sandbox's current seal; a recovery restores the disk alone (a seal directory store)."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sbx.control.cluster.rescue import LostNodes, lost_todo, seal_age, snapshot_todo
from tests.fakes import FakeNode, make_control, wait_until

T0 = dt.datetime(2026, 12, 7, 6, 0, tzinfo=dt.UTC)


def _row(sid: str, state: str = "running", node: str | None = "a", no_snapshots: bool = False) -> Any:
    return SimpleNamespace(id=sid, state=state, node=node, no_snapshots=no_snapshots)


def _at(seconds: float) -> Any:
    return SimpleNamespace(created_at=T0 + dt.timedelta(seconds=seconds), sealed_at=T0 + dt.timedelta(seconds=seconds))


def test_the_running_sandboxes_whose_newest_automatic_snapshot_is_newer_than_their_stored_seal_go_up() -> None:
    rows = [_row("new"), _row("older-stored"), _row("same"), _row("none-stored"), _row("no-snap"),
            _row("stopped", "stopped"), _row("nosnapshots", no_snapshots=True), _row("far", node="b"),
            _row("default", node=None)]
    stored = {"new": _at(0), "older-stored": _at(5), "same": _at(10), "stopped": _at(0)}
    newest = {sid: _at(10) for sid in ("new", "older-stored", "same", "none-stored", "stopped", "nosnapshots", "far",
                                       "default")}
    todo = snapshot_todo(rows, stored, newest, answering={"a"}, default="a")
    assert [r.id for r, _ in todo] == ["new", "older-stored", "none-stored", "default"]
    assert all(s is newest[r.id] for r, s in todo)
    assert snapshot_todo(rows, stored, newest, answering=set(), default="a") == []  # no node answers: none


def test_a_node_is_lost_after_the_loop_saw_it_unreachable_that_long_and_only_then() -> None:
    lost = LostNodes(after=30)
    lost.update({"a": "unreachable", "b": "ready", "c": "cordoned"}, now=100)  # a's heartbeat may be hours old
    assert not lost.lost("a", True, now=129.9)  # counted from when the loop first saw it unreachable
    assert lost.lost("a", True, now=130)
    lost.update({"a": "unreachable", "b": "ready"}, now=131)  # still unreachable: the first sighting stands
    assert lost.lost("a", True, now=131)
    assert not lost.lost("b", True, now=1000) and not lost.lost("c", True, now=1000)
    lost.update({"a": "ready"}, now=140)  # back: the count starts over the next time
    assert not lost.lost("a", True, now=1000)
    lost.update({"a": "unreachable"}, now=1000)
    assert not lost.lost("a", True, now=1029) and lost.lost("a", True, now=1030)
    assert lost.lost("gone", False, now=0)  # removed from the registry: lost at once


def test_the_running_sandboxes_with_a_stored_seal_on_a_lost_node_come_back() -> None:
    lost = LostNodes(after=5)
    lost.update({"a": "unreachable", "b": "ready"}, now=0)
    rows = [_row("back"), _row("nothing-stored"), _row("stopped", "stopped"), _row("elsewhere", node="b"),
            _row("removed", node="x")]
    stored = {sid: _at(0) for sid in ("back", "stopped", "elsewhere", "removed")}
    assert lost_todo(rows, stored, lost, {"a", "b"}, "a", now=4) == [rows[4]]  # only the unregistered node's yet
    assert [r.id for r in lost_todo(rows, stored, lost, {"a", "b"}, "a", now=5)] == ["back", "removed"]
    assert seal_age(T0, T0 + dt.timedelta(seconds=42.5)) == 42.5


class Destination:
    """A node that receives a seal as a replica and promotes it, keeping what it was sent."""

    def __init__(self) -> None:
        self.manifest: dict[str, Any] = {}
        self.got: dict[str, bytes] = {}

    def status(self, sid: str) -> str:
        return "absent"

    def begin_replica(self, manifest: dict[str, Any]) -> None:
        self.manifest = manifest

    def replica_stream(self, sid: str, name: str, chunks: Any) -> None:
        self.got[name] = b"".join(chunks)

    def seal_replica(self, sid: str) -> None:
        pass

    def promote_replica(self, sid: str) -> dict[str, Any]:
        return {"bytes": sum(map(len, self.got.values())), "files": len(self.got), "memory": self.manifest["memory"]}


def test_a_snapshot_seal_is_recorded_only_when_newer_and_a_recovery_takes_its_disk_alone(tmp_path: Path) -> None:
    cp = make_control(tmp_path, FakeNode(tmp_path / "node"), seal_store=str(tmp_path / "seals"),
                      seal_store_seconds=0)
    try:
        sid = str(cp.create("small").id)
        wait_until(lambda: cp.get(sid).state == "running")
        row, arch = cp.get(sid), cp.archive
        key = arch.key(row.account_id)
        files = {"disk.delta": os.urandom(300_000), "memory/pages-1.img": os.urandom(1000)}
        objects = {n: arch.objects.put(key, row.account_id, iter([b]), sha256=hashlib.sha256(b).hexdigest())[0]
                   for n, b in files.items()}
        manifest = {"id": sid, "memory": True, "fingerprint": {"cpu": "x"}, "snapshot": "auto-x",
                    "files": {n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in files.items()}}
        t1 = T0 + dt.timedelta(seconds=60)

        assert arch.record_snapshot(row, t1, manifest, objects) == []  # nothing stored before
        assert arch.record_snapshot(row, T0, manifest, {"disk.delta": "older"}) is None  # older: not written
        assert arch.record_snapshot(row, t1, manifest, {"disk.delta": "same age"}) is None
        assert arch.get(sid).objects == objects
        view = cp.view(cp.get(sid))
        assert (view["sealStored"], view["sealStoredAt"]) == (False, "2026-12-07T06:01:00.000Z")

        dst = Destination()
        info = arch.restore(dst, arch.get(sid), disk_only=True)
        assert set(dst.got) == {"disk.delta"} and dst.got["disk.delta"] == files["disk.delta"]
        assert (dst.manifest["memory"], dst.manifest["fingerprint"], list(dst.manifest["files"])) == (
            False, None, ["disk.delta"])
        assert (info["delta"], info["memory"]) == ("seal-store", False)

        # a snapshot's seal is never a stopped sandbox's current one
        cp.stop(sid)
        wait_until(lambda: cp.get(sid).state == "stopped")
        assert arch.current(cp.get(sid)) is None and cp.view(cp.get(sid))["sealStored"] is False

        replaced = arch.record_snapshot(row, t1 + dt.timedelta(seconds=1), manifest, {"disk.delta": "newer"})
        assert sorted(replaced or []) == sorted(objects.values())  # the caller frees what the old row named
        assert set(arch.free(row.account_id, replaced or [])) == set(objects.values())  # no row names them now

        cp.delete(sid)
        wait_until(lambda: cp.store.get_sandbox(sid).state == "deleted")
        assert arch.record_snapshot(row, t1 + dt.timedelta(seconds=9), manifest, objects) is None  # deleted
    finally:
        cp.close()


def test_an_exit_reported_by_a_node_the_sandbox_no_longer_runs_on_changes_nothing(tmp_path: Path) -> None:
    home = FakeNode(tmp_path / "node")
    cp = make_control(tmp_path, home)
    try:
        old = FakeNode(tmp_path / "old")
        cp.router.attach("old", "local-old", old)  # e.g. a lost node that answers again, its copy still running
        sid = str(cp.create("small").id)
        wait_until(lambda: cp.get(sid).state == "running")
        old.on_exit(sid, "crashed", "killed with its leftover copy")
        assert cp.get(sid).state == "running"
        home.on_exit(sid, "crashed", "really")  # its own node: it stopped
        wait_until(lambda: cp.get(sid).state == "stopped")
        assert cp.get(sid).stop_reason == "crashed"
    finally:
        cp.close()
