"""The node registry (issue 10): heartbeats register the node with its capacity and fingerprint, a node that stops
answering becomes unreachable (its sandboxes keep their state) and comes back, and a cordoned node refuses new
sandboxes and forks with 507 while its sandboxes keep working."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbx.control.errors import ControlError
from tests.fakes import FakeNode, make_control, wait_until


def _v(cp, sid: str) -> dict:  # type: ignore[no-untyped-def, type-arg]
    return cp.view(cp.get(sid), stats=False)  # type: ignore[no-any-return]


def test_heartbeats_unreachable_and_back(tmp_path: Path) -> None:
    node = FakeNode(tmp_path / "node")
    cp = make_control(tmp_path, node, node_heartbeat_seconds=0.1, node_unreachable_seconds=0.5)
    try:
        [view] = cp.registry.views()
        assert (view["name"], view["url"], view["status"], view["cordoned"]) == ("fake", "local", "ready", False)
        assert view["capacity"] == {"memoryMiB": 4096, "diskFreeBytes": 50 << 30, "diskPromisedBytes": 0, "vcpus": 2}
        assert view["fingerprint"] == {"cpuModel": "fake", "kernel": "6.1"}
        row = cp.create("small")
        wait_until(lambda: _v(cp, row.id)["state"] == "running")
        assert (_v(cp, row.id)["node"], _v(cp, row.id)["nodeStatus"]) == ("fake", "ready")
        assert cp.registry.views()[0]["sandboxes"] == 1
        disk = cp.settings.sizes["small"].disk_mib << 20
        assert cp.registry.views()[0]["capacity"]["diskPromisedBytes"] == disk  # its sparse disk may grow that far

        node.unreachable = True
        wait_until(lambda: _v(cp, row.id)["nodeStatus"] == "unreachable", timeout=10)
        assert _v(cp, row.id)["state"] == "running"
        assert cp.registry.views()[0]["status"] == "unreachable"
        with pytest.raises(ControlError) as e:
            cp.create("small")
        assert (e.value.status, e.value.code) == (507, "insufficient_capacity") and "unreachable" in e.value.message

        node.unreachable = False
        wait_until(lambda: _v(cp, row.id)["nodeStatus"] == "ready", timeout=10)
    finally:
        cp.close()
        node.close()


def test_a_cordoned_node_takes_no_new_sandbox(tmp_path: Path) -> None:
    node = FakeNode(tmp_path / "node")
    cp = make_control(tmp_path, node)
    try:
        row = cp.create("small")
        wait_until(lambda: _v(cp, row.id)["state"] == "running")
        assert cp.registry.cordon("fake", True)["status"] == "cordoned"
        before = len(cp.store.list_sandboxes())
        for attempt in (lambda: cp.create("small"), lambda: cp.fork(row.id)):
            with pytest.raises(ControlError) as e:
                attempt()
            assert (e.value.status, e.value.code) == (507, "insufficient_capacity") and "cordoned" in e.value.message
        assert len(cp.store.list_sandboxes()) == before
        assert _v(cp, row.id)["nodeStatus"] == "cordoned"
        assert cp.registry.cordon("fake", False)["status"] == "ready"
        fork = cp.fork(row.id)
        wait_until(lambda: _v(cp, fork.id)["state"] == "running")
        with pytest.raises(ControlError) as e:
            cp.registry.cordon("nope", True)
        assert (e.value.status, e.value.code) == (404, "not_found")
    finally:
        cp.close()
        node.close()
