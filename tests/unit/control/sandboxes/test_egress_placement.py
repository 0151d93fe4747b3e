"""A new sandbox that is to get secrets goes only to a node that runs an egress proxy (sbx.control.sandboxes.planebase
``_place(egress=True)``), so its secrets can be bound there and the create never answers 409 after making it; with
no such node it is refused and nothing is created. Two fake nodes (tests.fakes.two_node_plane)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbx.control.errors import ControlError
from tests.fakes import two_node_plane, wait_until


def test_a_create_with_secrets_goes_to_a_node_with_a_proxy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with two_node_plane(tmp_path) as (cp, one, two):
        first = cp.create("small")  # fills one node a little: the other has more room
        wait_until(lambda: cp.get(first.id).state == "running")
        emptier = two if cp.get(first.id).node == one.name else one
        fuller = one if emptier is two else two
        assert cp.create("small").node == emptier.name  # spread: the one with more room
        monkeypatch.setattr(emptier, "egress_ready", lambda: False)
        for _ in range(2):
            row = cp.create("small", egress=True)
            assert row.node == fuller.name
        monkeypatch.setattr(fuller, "egress_ready", lambda: False)
        before = len(cp.store.list_sandboxes())
        with pytest.raises(ControlError) as e:
            cp.create("small", egress=True)
        assert (e.value.code, e.value.status) == ("egress_proxy_unavailable", 409)
        assert len(cp.store.list_sandboxes()) == before  # nothing was made
