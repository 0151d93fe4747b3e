"""Consolidation (issue 11): one pass of sbx.control.cluster.consolidate.Consolidator on a control plane driving two
fake
nodes (the embedded ``fake`` and an added ``fake2``): what it plans from the store and the registry, the drain it
starts (reason ``consolidation`` in the record), and a drain that leaves a sandbox behind: the node is uncordoned
and held back, and the plan says why."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbx.control.cluster.consolidate import Consolidator
from sbx.node.types import NodeError
from tests.fakes import two_node_plane, wait_until

GiB = 1 << 30


def test_a_pass_drains_the_light_added_node_and_a_failed_move_puts_it_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with two_node_plane(tmp_path) as (cp, one, two):
        cp.store.add_node("fake2", "fake://two", "sealed-token", cp.registry.row("fake2").info or {})  # added
        k = Consolidator(cp, period=0)
        assert k.run_once().reason == "no light node"  # nothing anywhere
        cp.registry.cordon(one.name, True)
        sid = cp.create("small").id
        wait_until(lambda: cp.get(sid).state == "running")
        assert cp.get(sid).node == "fake2"
        cp.registry.cordon(one.name, False)
        # running on fake2, and the only other node is the embedded one (no node API): no live migration there
        plan = k.run_once()
        assert (plan.action, plan.node) == ("none", None)
        assert plan.reason.startswith("the rest lack room: fake2: no other ready node can take a live migration")
        cp.stop(sid)
        wait_until(lambda: cp.get(sid).state == "stopped")
        # stopped: it may move to fake; the move fails (the node says so) and the sandbox stays
        moves: list[tuple[str, str, str, str | None]] = []

        def failing_move(sandbox_id: str, src: str, dst: str, reason: str | None = None, replica: bool = False) -> None:
            moves.append((sandbox_id, src, dst, reason))
            raise NodeError("transfer_failed", "the destination went away")

        monkeypatch.setattr(cp, "_move", failing_move)
        plan = k.run_once()
        assert (plan.action, plan.node, plan.moves) == ("drain", "fake2", {sid: one.name}), plan.reason
        wait_until(lambda: k.view()["outcome"] is not None)
        view = k.view()
        assert moves == [(sid, "fake2", one.name, "consolidation")]
        assert view["drain"]["reason"] == "consolidation" and view["drain"]["empty"] is False
        [item] = view["drain"]["sandboxes"]
        assert (item["status"], item["error"]["code"]) == ("failed", "transfer_failed")
        assert view["outcome"] == f"node fake2 is not empty (left on it: {sid}): uncordoned again"
        assert cp.registry.row("fake2").cordoned is False  # type: ignore[union-attr]
        assert view["removable"] == []
        assert cp.get(sid).node == "fake2" and cp.get(sid).state == "stopped"
        # held back: the next pass does not try it again
        plan = k.run_once()
        assert (plan.action, plan.reason) == ("none", "no light node")
        why = {n["name"]: n["why"] for n in plan.nodes}["fake2"]
        assert why.startswith("its last consolidation left sandboxes on it: not tried again for"), why
        assert moves == [(sid, "fake2", one.name, "consolidation")]
