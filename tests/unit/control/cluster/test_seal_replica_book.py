"""Seal replicas in the store (issue 10, sbx.control.cluster.replicas): a replica row is written only for the seal it
was
copied from, any state change forgets it, and a resume whose node is unreachable is placed on the replica's node
(its memory kept when the fingerprints match), on two fake nodes."""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path

import pytest

from tests.fakes import two_node_plane, wait_until


def _stopped_on_two(cp, one) -> str:  # type: ignore[no-untyped-def]
    cp.registry.cordon(one.name, True)
    sid = str(cp.create("small").id)
    wait_until(lambda: cp.get(sid).state == "running")
    cp.registry.cordon(one.name, False)
    cp.stop(sid)
    wait_until(lambda: cp.get(sid).state == "stopped")
    assert cp.get(sid).node == "fake2"
    return sid


def test_a_replica_row_is_only_for_the_current_seal(tmp_path: Path) -> None:
    with two_node_plane(tmp_path) as (cp, one, _two):
        sid = _stopped_on_two(cp, one)
        row = cp.get(sid)
        older = row.updated_at - dt.timedelta(seconds=1)
        assert cp.replicas.record(sid, "fake", older, 10, True, {"cpu": "x"}) is False  # an older seal's copy
        assert cp.replicas.get(sid) is None
        assert cp.replicas.record(sid, "fake", row.updated_at, 10, True, {"cpu": "x"}) is True
        assert cp.replicas.get(sid).node == "fake"  # type: ignore[union-attr]
        assert cp.view(cp.get(sid))["replicaNode"] == "fake"
        # a state change (a resume begins) forgets it in the same transaction
        cp.lifecycle.transition(sid, "resuming")
        assert cp.replicas.get(sid) is None
        # and a row of a sandbox that is not stopped is never written
        assert cp.replicas.record(sid, "fake", cp.get(sid).updated_at, 10, True, None) is False


def test_a_resume_whose_node_is_unreachable_takes_the_replica(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    with two_node_plane(tmp_path) as (cp, one, _two):
        sid = _stopped_on_two(cp, one)
        row = cp.get(sid)
        size = cp._size(row.type)
        real = cp._candidates

        def two_gone(exclude: str | None = None):  # type: ignore[no-untyped-def]
            return [dataclasses.replace(c, status="unreachable") if c.name == "fake2" else c for c in real(exclude)]

        monkeypatch.setattr(cp, "_candidates", two_gone)
        # no replica: placement picks the other node, and the move from the gone node would fail (node_unreachable)
        place = cp._resume_place(row, size, False, False)
        assert (place.node, place.moves, place.replica) == ("fake", True, False)
        fp = {c.name: c.fingerprint for c in real()}["fake2"]
        assert cp.replicas.record(sid, "fake", row.updated_at, 10, True, fp)
        place = cp._resume_place(row, size, False, False)
        assert (place.node, place.moves, place.memory, place.replica) == ("fake", True, True, True)
        # a replica made on a node whose CPU differs boots from disk (and --require-memory waits)
        assert cp.replicas.record(sid, "fake", row.updated_at, 10, True, {**fp, "cpu_model": "another"})
        place = cp._resume_place(row, size, False, False)
        assert (place.node, place.memory, place.replica) == ("fake", False, True)
        assert cp._resume_place(row, size, False, True) is None
        # a replica on a cordoned node can't be used
        assert cp.replicas.record(sid, "fake", row.updated_at, 10, True, fp)
        cp.registry.cordon(one.name, True)
        with pytest.raises(Exception) as e:
            cp._resume_place(row, size, False, False)
        assert getattr(e.value, "code", None) == "insufficient_capacity"
