"""Drain records (issue 11): a drain's record is a ``drains`` row written at every step, so another replica (here a
second :class:`sbx.control.cluster.drain.Drains` on the same store) answers for it, and a drain left ``draining`` by a
server that was killed is taken over by :meth:`Drains.resume_orphans` (what a server's start and every orphan sweep
call) and finishes what was left, counting the takeover in ``resumes``."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbx.control.cluster.drain import DrainRow, Drains
from sbx.control.store.database import iso, utcnow
from tests.fakes import two_node_plane, wait_until


def test_a_drain_left_by_a_killed_server_is_taken_over_and_finished(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with two_node_plane(tmp_path) as (cp, one, _two):
        cp.registry.cordon(one.name, True)
        done_id, left_id = (cp.create("small").id for _ in range(2))
        for sid in (done_id, left_id):
            wait_until(lambda s=sid: cp.get(s).state == "running")
            cp.stop(sid)
            wait_until(lambda s=sid: cp.get(s).state == "stopped")
            assert cp.get(sid).node == "fake2"
        cp.registry.cordon(one.name, False)
        moves: list[tuple[str, str, str, str | None]] = []

        def move(sandbox_id: str, src: str, dst: str, reason: str | None = None, replica: bool = False) -> None:
            moves.append((sandbox_id, src, dst, reason))
            cp.store.update_sandbox(sandbox_id, node=dst)

        monkeypatch.setattr(cp, "_move", move)
        cp.store.update_sandbox(done_id, node=one.name)  # the killed server had moved the first one already
        item = {"action": "move", "from": "fake2", "error": None, "pauseS": None, "totalS": None}
        record = {"node": "fake2", "reason": "drain", "state": "draining", "startedAt": iso(utcnow()),
                  "finishedAt": None, "empty": None, "resumes": 0, "sandboxes": [
                      {**item, "id": done_id, "name": "a", "status": "done", "to": one.name, "seconds": 1.0},
                      {**item, "id": left_id, "name": "b", "status": "pending", "to": None, "seconds": None}]}
        with cp.store.session() as s, s.begin():
            s.add(DrainRow(node="fake2", state="draining", record=record, plan={}, updated_at=utcnow()))

        other = Drains(cp)  # another replica reading the same database
        assert other.get("fake2")["state"] == "draining" and other.running() == ["fake2"]
        assert cp.drains.resume_orphans() == ["fake2"]
        wait_until(lambda: other.get("fake2")["state"] == "done")
        got = other.get("fake2")
        assert (got["empty"], got["resumes"]) == (True, 1), got
        assert [(i["id"], i["status"], i["to"]) for i in got["sandboxes"]] == [
            (done_id, "done", one.name), (left_id, "done", one.name)]
        assert moves == [(left_id, "fake2", one.name, "drain")]  # only what was left
        assert cp.drains.resume_orphans() == [] and other.running() == []
        assert cp.get(left_id).node == one.name and cp.registry.row("fake2").cordoned  # type: ignore[union-attr]


def test_a_node_never_drained_has_no_record(tmp_path: Path) -> None:
    with two_node_plane(tmp_path) as (cp, _one, _two):
        with pytest.raises(Exception, match="was never drained"):
            cp.drains.get("fake2")


def test_a_drain_that_fails_to_start_keeps_no_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A start that fails after it took the drain's lock (here the cordon) gives the lock up: held, it would tell
    the other replicas this one drains the node (they answer ``busy`` and never take it over)."""
    with two_node_plane(tmp_path) as (cp, _one, _two):
        def broken(name: str, cordoned: bool) -> None:
            raise RuntimeError("the database went away")

        monkeypatch.setattr(cp.registry, "cordon", broken)
        with pytest.raises(RuntimeError):
            cp.drains.start("fake2")
        assert "fake2" not in cp.drains._locks and cp.drains.running() == []
