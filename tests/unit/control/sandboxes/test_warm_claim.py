"""A create takes the warm sandbox of the node it is placed on (sbx.control.sandboxes.operations ``_warm_sandbox``,
sbx.node.memory.warmpool): the new row gets that sandbox's id and the node's create is sent with it; a create placed
elsewhere, a ``--cold`` or ``--from`` create, and a create the plan refuses take none. Two fake nodes
(tests.fakes.two_node_plane)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbx.control.errors import ControlError
from tests.fakes import FakeNode, two_node_plane, wait_until


def _offer(node: FakeNode, monkeypatch: pytest.MonkeyPatch, ids: list[str]) -> list[str]:
    """Make ``node`` hand out ``ids`` as warm sandboxes, one per take; returns the list of sizes asked."""
    asked: list[str] = []

    def take(size: str) -> str | None:
        asked.append(size)
        return ids.pop(0) if ids else None

    monkeypatch.setattr(node, "pool_take", take)
    return asked


def test_a_create_uses_the_warm_sandbox_of_its_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with two_node_plane(tmp_path) as (cp, one, two):
        first = cp.create("small")
        wait_until(lambda: cp.get(first.id).state == "running")
        emptier = two if cp.get(first.id).node == one.name else one  # where the next create goes (spread)
        fuller = one if emptier is two else two
        asked = _offer(emptier, monkeypatch, ["sb_warm000001"])
        asked_fuller = _offer(fuller, monkeypatch, ["sb_warm000002"])
        row = cp.create("small")
        assert (row.id, row.node) == ("sb_warm000001", emptier.name)
        assert asked == ["small"] and asked_fuller == []
        wait_until(lambda: cp.get(row.id).state == "running")
        assert "sb_warm000001" in emptier.boxes  # the node's create was sent with the warm sandbox's id
        # the next one takes the other node's, or, placed on the same node (none left there), a fresh id
        again = cp.create("small")
        if again.node == fuller.name:
            assert again.id == "sb_warm000002"
        else:
            assert again.id not in ("sb_warm000001", "sb_warm000002") and again.id.startswith("sb_")
        third = cp.create("small")
        assert third.id != "sb_warm000001" and (third.id == "sb_warm000002") == (third.node == fuller.name
                                                                                 and again.node != fuller.name)


def test_cold_from_and_refused_creates_take_no_warm_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with two_node_plane(tmp_path) as (cp, one, two):
        asked = _offer(one, monkeypatch, ["sb_warm000003"]) + _offer(two, monkeypatch, ["sb_warm000004"])
        asked_one, asked_two = _offer(one, monkeypatch, []), _offer(two, monkeypatch, [])
        cold = cp.create("small", cold=True)
        assert cold.id.startswith("sb_") and not cold.id.startswith("sb_warm")
        account, _, _ = cp.accounts.create_account("trialist", plan="trial")
        before = len(cp.store.list_sandboxes())
        with pytest.raises(ControlError) as e:
            cp.create("xlarge", account_id=account.id)
        assert (e.value.code, e.value.status) == ("plan_limit", 403)
        assert len(cp.store.list_sandboxes()) == before
        assert asked == [] and asked_one == [] and asked_two == []  # nobody was asked for a warm sandbox


def test_a_warm_id_that_names_a_row_already_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with two_node_plane(tmp_path) as (cp, one, two):
        first = cp.create("small")
        wait_until(lambda: cp.get(first.id).state == "running")
        _offer(one, monkeypatch, [first.id])
        _offer(two, monkeypatch, [first.id])
        row = cp.create("small")
        assert row.id != first.id
