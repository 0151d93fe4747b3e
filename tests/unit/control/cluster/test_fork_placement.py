"""A fork when its source's node is full (issue 10 item 4): the rule of sbx.control.cluster.placement.choose_fork on
hand-made candidates, and the control plane's fork made on the source's node and moved (sbx.control.sandboxes.forking)
with two fake nodes and a fake move."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from sbx.control.cluster import placement
from sbx.control.cluster.capacity import HostResources
from sbx.control.errors import ControlError
from sbx.control.sandboxes import forking
from sbx.node.types import NodeError
from tests.fakes import FakeNode, _Box, fake_settings, wait_until

GiB = 1 << 30
FP = {"cpuModel": "X", "kernel": "6.1"}
OTHER = {"cpuModel": "Y", "kernel": "6.1"}


def _c(name: str, status: str = "ready", mem: int = 4096, committed: int = 0,
       fp: dict[str, str] | None = None) -> placement.Candidate:
    return placement.Candidate(name, status, HostResources(mem, 50 * GiB, "/v"), committed, dict(fp or FP))


def test_a_fork_stays_home_when_it_fits_else_goes_where_there_is_room(tmp_path: Path) -> None:
    s = fake_settings(tmp_path)
    small = s.size("small")
    full = (4096 - s.memory_reserve_mib) * int(s.memory_overcommit)
    # room at home: home, even when another node has more room (a reflink there)
    cands = [_c("a", committed=2048), _c("b")]
    assert placement.choose_fork(cands, s, small, "f", "a") == placement.ResumePlace("a", False, False)
    assert placement.choose_fork(cands, s, small, "f", "a", memory=True) == placement.ResumePlace("a", False, True)
    # home full or cordoned: the other node with most room
    for home in (_c("a", committed=full), _c("a", "cordoned")):
        cands = [home, _c("b", committed=1024), _c("c", committed=512), _c("d", "cordoned")]
        assert placement.choose_fork(cands, s, small, "f", "a") == placement.ResumePlace("c", True, False)
    # with memory only a matching fingerprint, even when a mismatching node has more room
    cands = [_c("a", committed=full), _c("b", committed=1024), _c("c", fp=OTHER)]
    assert placement.choose_fork(cands, s, small, "f", "a", memory=True) == placement.ResumePlace("b", True, True)
    assert placement.choose_fork(cands, s, small, "f", "a").node == "c"


def test_a_fork_nowhere_to_go_is_refused_naming_each_node(tmp_path: Path) -> None:
    s = fake_settings(tmp_path)
    small = s.size("small")
    full = (4096 - s.memory_reserve_mib) * int(s.memory_overcommit)
    # alone: the admission message of today, unchanged
    with pytest.raises(ControlError) as e:
        placement.choose_fork([_c("a", committed=full)], s, small, "a small fork of x", "a")
    assert (e.value.status, e.value.code) == (507, "insufficient_capacity")
    assert e.value.message.startswith("not enough memory on this node for a small fork of x")
    with pytest.raises(ControlError) as e:
        placement.choose_fork([_c("a", committed=full), _c("b", committed=full), _c("c", "cordoned")], s, small,
                              "a small fork of x", "a")
    msg = e.value.message
    assert msg.startswith("no node can take a small fork of x: node a: not enough memory"), msg
    assert "node b: not enough memory" in msg and "node c is cordoned" in msg
    # --memory and only a mismatching node with room: refused, never a cold boot
    with pytest.raises(ControlError) as e:
        placement.choose_fork([_c("a", committed=full), _c("b", fp=OTHER)], s, small, "f", "a", memory=True)
    assert "node b: its CPU, kernel or CRIU differ from node a's" in e.value.message
    # an unreachable home can't make the copy; an unknown one is not registered
    with pytest.raises(ControlError) as e:
        placement.choose_fork([_c("a", "unreachable"), _c("b")], s, small, "f", "a")
    assert "node a is unreachable" in e.value.message and "node b" not in e.value.message
    with pytest.raises(ControlError) as e:
        placement.choose_fork([_c("b")], s, small, "f", "a")
    assert "node a is not registered" in e.value.message


def _fake_move(gate: threading.Event | None = None, fail: NodeError | None = None):  # type: ignore[no-untyped-def]
    """A stand-in for relocate.move_stopped between two FakeNodes: copies the stopped box (the source keeps its)."""

    def move(src: FakeNode, dst: FakeNode, sid: str) -> dict[str, object]:
        if gate is not None:
            gate.wait(30)
        if fail is not None:
            raise fail
        box = src._box(sid)
        d = dst.root / sid
        shutil.copytree(box.dir, d)
        dst.boxes[sid] = _Box(spec=box.spec, dir=d, status=box.status)
        return {"bytes": 4096, "files": 1, "memory": box.status == "checkpointed", "delta": "incremental",
                "seconds": 0.01}

    return move


@contextmanager
def _full_home(tmp_path: Path) -> Iterator[tuple[Any, FakeNode, FakeNode, str, str]]:
    """A plane on fake nodes ``fake`` (embedded, may promise 512 MiB: filled by the two running small sandboxes
    ``a`` and ``b`` it yields) and ``fake2`` (4 GiB): ``(cp, one, two, a, b)``."""
    from sbx.control.service import ControlPlane

    one, two = FakeNode(tmp_path / "one"), FakeNode(tmp_path / "two")
    two.name = "fake2"
    cp = ControlPlane(fake_settings(tmp_path, node_heartbeat_seconds=0.1, memory_reserve_mib=0,
                                    memory_overcommit=1.0), one, wait=5.0,
                      host=lambda: HostResources(512, 50 * GiB, "/fake"))
    cp.start()
    try:
        cp.router.attach("fake2", "fake://two", two)
        cp.registry.beat()
        cp.registry.cordon("fake2", True)
        a, b = cp.create("small").id, cp.create("small").id
        for sid in (a, b):
            wait_until(lambda sid=sid: cp.get(sid).state == "running")  # type: ignore[misc]
        cp.registry.cordon("fake2", False)
        yield cp, one, two, a, b
    finally:
        cp.close()


def test_a_fork_of_a_full_node_is_made_there_stopped_and_moved(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    with _full_home(tmp_path) as (cp, one, two, a, b):
        monkeypatch.setattr(forking, "move_stopped", _fake_move())

        fork = cp.fork(a)
        assert fork.node == "fake2"  # the response names the node that takes it
        wait_until(lambda: cp.get(fork.id).state == "running")
        assert fork.id in two.boxes and fork.id not in one.boxes and cp.get(a).state == "running"
        assert [c[0] for c in one.calls if c[1] == fork.id] == ["fork_stopped", "delete"]
        resume = next(c for c in two.calls if c[:2] == ("resume", fork.id))
        assert resume[2]["require_memory"] is False
        moved = next(ev for ev in cp.events(fork.id) if ev["event"] == "moved")
        assert (moved["from"], moved["to"]) == ("fake", "fake2")

        # --memory: fake2's fingerprint matches; the fork restores and says so
        mem = cp.fork(a, memory=True)
        wait_until(lambda: cp.get(mem.id).state == "running")
        assert cp.get(mem.id).node == "fake2" and cp.get(mem.id).memory_restored is True
        assert next(c for c in two.calls if c[:2] == ("resume", mem.id))[2]["require_memory"] is True

        # --memory to a node with another CPU: 507, nothing created
        two.fingerprint = {"cpuModel": "other", "kernel": "6.1"}
        cp.registry.beat()
        ids = [r.id for r in cp.list_sandboxes()]
        with pytest.raises(ControlError) as e:
            cp.fork(a, memory=True)
        assert e.value.code == "insufficient_capacity" and "CPU, kernel or CRIU differ" in e.value.message
        assert [r.id for r in cp.list_sandboxes()] == ids

        # the move fails: the fork is error with the node's code, no copy on either node, the source runs on
        monkeypatch.setattr(forking, "move_stopped", _fake_move(fail=NodeError("transfer_failed", "cut")))
        bad = cp.fork(a)
        wait_until(lambda: cp.get(bad.id).state == "error")
        assert cp.get(bad.id).error_code == "transfer_failed"
        assert bad.id not in one.boxes and bad.id not in two.boxes and cp.get(a).state == "running"

        # cut short by a crash while moving: settling the row removes the copy on the source's node
        gate = threading.Event()
        monkeypatch.setattr(forking, "move_stopped", _fake_move(gate=gate, fail=NodeError("transfer_failed", "x")))
        cut = cp.fork(b)
        wait_until(lambda: cut.id in one.boxes and cp.get(cut.id).state == "provisioning")
        cp._settle_fork_copy(cp.get(cut.id))
        assert cut.id not in one.boxes
        gate.set()
        wait_until(lambda: cp.get(cut.id).state == "error")

        # room at home again: a fork stays there (a reflink), no move
        cp.stop(b, keep_memory=False)
        wait_until(lambda: cp.get(b).state == "stopped")
        home = cp.fork(a)
        wait_until(lambda: cp.get(home.id).state == "running")
        assert cp.get(home.id).node == "fake" and ("fork", home.id) in [c[:2] for c in one.calls]
        assert not [ev for ev in cp.events(home.id) if ev["event"] == "moved"]


def test_a_server_killed_mid_fork_leaves_no_copy_on_the_source_node(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """What a restarted server does with a fork cut short between its copy on the source's node and the move: the
    source node's reconcile is not told of it (so a real node removes that folder), the destination's is, and
    settling the row (``absent`` there) makes it ``error``/``interrupted`` and removes a copy still on the
    source's node (the replicas' orphan sweep has no reconcile)."""
    with _full_home(tmp_path) as (cp, one, two, a, _b):
        gate = threading.Event()
        monkeypatch.setattr(forking, "move_stopped", _fake_move(gate=gate, fail=NodeError("transfer_failed", "x")))
        cut = cp.fork(a).id
        wait_until(lambda: cut in one.boxes and cp.get(cut).state == "provisioning")
        found = cp.router.reconcile({r.id: r.state for r in cp.store.list_sandboxes()})
        told = [[set(c[2]["known"]) for c in n.calls if c[0] == "reconcile"][-1] for n in (one, two)]
        assert cut not in told[0] and cut in told[1] and found[cut] == "absent"
        cp.settle(cp.get(cut), "absent")
        row = cp.get(cut)
        assert (row.state, row.error_code) == ("error", "interrupted") and cut not in one.boxes
        gate.set()
