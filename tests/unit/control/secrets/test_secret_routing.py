"""Which node's egress proxy may learn which sandbox's secrets (sbx.control.secrets.nodes), with a control plane on
two fake nodes: a question is answered only for a sandbox the store places on the asking node; bindings follow a
sandbox to its new node; a node without a proxy refuses a binding by name."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from sbx.control.errors import ControlError
from tests.fakes import FakeNode, two_node_plane, wait_until

RULE = [{"hosts": ["api.example.com"], "action": "header", "header": "Authorization", "value": "Bearer {secret}"}]
ASK = {"op": "resolve", "host": "api.example.com", "method": "GET", "path": "/x"}


@contextmanager
def _two_nodes(tmp_path: Path) -> Iterator[tuple[Any, FakeNode, FakeNode, str, str]]:
    """A plane on ``fake`` (the configured node) and ``fake2`` (attached) with secret ``tok`` bound to a running
    sandbox on each: ``(cp, one, two, a, b)``."""
    with two_node_plane(tmp_path) as (cp, one, two):
        placed = []
        for cordoned in ("fake2", "fake"):
            cp.registry.cordon(cordoned, True)
            placed.append(cp.create("small").id)
            cp.registry.cordon(cordoned, False)
        a, b = placed
        for sid in placed:
            wait_until(lambda sid=sid: cp.get(sid).state == "running")  # type: ignore[misc]
        assert (cp.get(a).node or "fake", cp.get(b).node) == ("fake", "fake2")
        account = cp.get(a).account_id
        cp.secrets.put(account, "tok", "s3cret-value", RULE)
        for sid in placed:
            cp.secrets.bind(account, sid, "tok")
        yield cp, one, two, a, b


def _values(node: FakeNode, sid: str) -> list[str]:
    return [act["value"] for act in node.egress_handler(sid, dict(ASK))["actions"]]


def test_a_node_learns_only_the_secrets_of_sandboxes_the_store_places_on_it(tmp_path: Path) -> None:
    with _two_nodes(tmp_path) as (cp, one, two, a, b):
        # each node's proxy gets its own sandbox's secret
        assert _values(one, a) == ["Bearer s3cret-value"]
        assert _values(two, b) == ["Bearer s3cret-value"]
        # ...and nothing for the other node's sandbox, an unknown id or a deleted one, whatever it claims
        assert _values(one, b) == [] and _values(two, a) == []
        assert _values(two, "sb_doesnotexist") == []
        assert two.egress_handler(a, {"op": "used", "secrets": ["tok"], "host": "api.example.com", "method": "GET",
                                      "path": "/x", "status": 200}) == {"actions": []}
        assert cp.secrets.log(cp.get(a).account_id, "tok") == []  # the refused "used" recorded nothing
        # the store moves a to fake2 (the commit point of a move): from then on fake2 asks for it, fake can't
        cp.store.update_sandbox(a, node="fake2")
        assert _values(two, a) == ["Bearer s3cret-value"] and _values(one, a) == []
        assert cp.secrets.nodes.may_ask("fake2", b)
        cp.delete(b)
        wait_until(lambda: cp.store.get_sandbox(b).state == "deleted")
        assert not cp.secrets.nodes.may_ask("fake2", b) and _values(two, b) == []


def test_bindings_follow_a_move_and_each_node_is_told_its_own(tmp_path: Path) -> None:
    with _two_nodes(tmp_path) as (cp, one, two, a, b):
        assert one.egress == {a: True} and two.egress == {b: True}  # bind told the sandbox's own node
        cp.store.update_sandbox(a, node="fake2")
        cp.secrets.nodes.reapply(a)
        assert two.egress == {b: True, a: True}
        two.egress.clear()  # the agent restarted: its redirect set is empty
        assert cp.secrets.nodes.sync_node("fake2") == 2 and two.egress == {a: True, b: True}
        assert cp.secrets.nodes.sync_node(None) == 0  # the configured node holds none of them now


def test_a_node_without_a_proxy_refuses_a_binding_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _two_nodes(tmp_path) as (cp, one, two, a, b):
        monkeypatch.setattr(two, "egress_ready", lambda: False)
        cp.secrets.put(cp.get(b).account_id, "other", "v", RULE)
        with pytest.raises(ControlError) as e:
            cp.secrets.bind(cp.get(b).account_id, b, "other")
        assert (e.value.status, e.value.code) == (409, "egress_proxy_unavailable")
        assert "node fake2 runs no egress proxy" in e.value.message
        assert cp.secrets.names(cp.get(a).account_id, ["other"])  # another node has one: a create may go on
        cp.secrets.bind(cp.get(a).account_id, a, "other")
        monkeypatch.setattr(one, "egress_ready", lambda: False)
        with pytest.raises(ControlError) as e:
            cp.secrets.names(cp.get(a).account_id, ["other"])
        assert "no node runs an egress proxy" in e.value.message
