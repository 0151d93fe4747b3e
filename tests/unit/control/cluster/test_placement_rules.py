"""Placement (issue 10): which node a new sandbox, a fork or a resume goes to, with the rules of
sbx.control.cluster.placement on hand-made candidates and on a control plane driving two fake nodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbx.control.cluster import placement
from sbx.control.cluster.capacity import HostResources
from sbx.control.errors import ControlError
from tests.fakes import FakeNode, fake_settings, two_node_plane, wait_until

GiB = 1 << 30
FP = {"cpuModel": "X", "kernel": "6.1"}


def _c(name: str, status: str = "ready", mem: int = 4096, committed: int = 0, disk: int = 50 * GiB,
       fp: dict[str, str] | None = None) -> placement.Candidate:
    return placement.Candidate(name, status, HostResources(mem, disk, "/v"), committed, dict(fp or FP))


def test_new_sandboxes_spread_to_the_node_with_most_room(tmp_path: Path) -> None:
    s = fake_settings(tmp_path)
    small = s.size("small")
    cands = [_c("a", committed=2048), _c("b", committed=512), _c("c", committed=1024)]
    assert placement.choose(cands, s, small, "x") == "b"
    # equal memory: the most free disk, then the name
    assert placement.choose([_c("a", disk=10 * GiB), _c("b", disk=20 * GiB)], s, small, "x") == "b"
    assert placement.choose([_c("b"), _c("a")], s, small, "x") == "a"


def test_cordoned_unreachable_and_full_nodes_take_nothing(tmp_path: Path) -> None:
    s = fake_settings(tmp_path)
    small = s.size("small")
    full = (4096 - s.memory_reserve_mib) * int(s.memory_overcommit)
    cands = [_c("a", "cordoned"), _c("b", "unreachable"), _c("c", committed=full), _c("d")]
    assert placement.choose(cands, s, small, "x") == "d"
    with pytest.raises(ControlError) as e:
        placement.choose(cands[:3], s, small, "a new small sandbox")
    assert (e.value.status, e.value.code) == (507, "insufficient_capacity")
    msg = e.value.message
    assert "node a is cordoned" in msg and "node b is unreachable" in msg and "node c: not enough memory" in msg
    # a fork (or new --from) is tied to one node, even when another has more room
    assert placement.choose(cands, s, small, "x", only="d") == "d"
    with pytest.raises(ControlError) as e:
        placement.choose(cands, s, small, "a fork", only="a")
    assert "node a is cordoned" in e.value.message


def test_a_resume_stays_home_else_goes_to_a_matching_node(tmp_path: Path) -> None:
    s = fake_settings(tmp_path)
    small = s.size("small")
    other = {"cpuModel": "Y", "kernel": "6.1"}
    home_ready = [_c("a"), _c("b", committed=0)]
    assert placement.choose_resume(home_ready, s, small, "r", "a", True) == placement.ResumePlace("a", False, True)
    # home cordoned: the matching node, even when a mismatching one has more room
    cands = [_c("a", "cordoned", fp=FP), _c("b", committed=1024, fp=FP), _c("c", fp=other)]
    assert placement.choose_resume(cands, s, small, "r", "a", True) == placement.ResumePlace("b", True, True)
    # only a mismatching node: it moves there and boots from disk
    cands = [_c("a", "cordoned", fp=FP), _c("c", fp=other)]
    assert placement.choose_resume(cands, s, small, "r", "a", True) == placement.ResumePlace("c", True, False)
    # nowhere else to go: a cordoned home still resumes what it holds
    assert placement.choose_resume([_c("a", "cordoned")], s, small, "r", "a", True) == \
        placement.ResumePlace("a", False, True)
    with pytest.raises(ControlError) as e:
        placement.choose_resume([_c("a", "unreachable")], s, small, "r", "a", True)
    assert e.value.code == "insufficient_capacity"


def test_fingerprints_match_only_when_equal_and_known() -> None:
    assert placement.fingerprint_matches(FP, dict(FP))
    assert not placement.fingerprint_matches(FP, {**FP, "kernel": "6.2"})
    assert not placement.fingerprint_matches({}, {})


def test_a_plane_with_two_fake_nodes_spreads_and_keeps_forks_home(tmp_path: Path) -> None:
    # the embedded node measures a 4 GiB host, as big as the fake one, so spreading alternates
    with two_node_plane(tmp_path) as (cp, one, two):
        assert [n["name"] for n in cp.registry.views()] == ["fake", "fake2"]
        rows = [cp.create("small") for _ in range(4)]
        for r in rows:
            wait_until(lambda r=r: cp.get(r.id).state == "running")  # type: ignore[misc]
        nodes = [cp.view(cp.get(r.id), stats=False)["node"] for r in rows]
        assert sorted(set(nodes)) == ["fake", "fake2"], nodes
        on_two = next(r for r, n in zip(rows, nodes, strict=True) if n == "fake2")
        assert on_two.id in two.boxes and on_two.id not in one.boxes
        # exec goes to the node that holds the sandbox
        assert cp.node.status(on_two.id) == "running"
        fork = cp.fork(on_two.id)
        wait_until(lambda: cp.get(fork.id).state == "running")
        assert cp.get(fork.id).node == "fake2" and fork.id in two.boxes
        # cordon fake2: new sandboxes all go to fake
        cp.registry.cordon("fake2", True)
        assert {cp.create("small").node for _ in range(3)} == {"fake"}


def test_a_move_off_a_node_never_stays_and_a_live_one_needs_a_matching_cpu(tmp_path: Path) -> None:
    s = fake_settings(tmp_path)
    small = s.size("small")
    other = {"cpuModel": "Y", "kernel": "6.1"}
    # never the node it is on, even when that one has the most room
    cands = [_c("a"), _c("b", committed=1024), _c("c", committed=512)]
    assert placement.choose_move(cands, s, small, "x", "a", live=True).node == "c"
    # a live migration only goes to a matching fingerprint; a stopped move prefers one, else takes any
    cands = [_c("a"), _c("b", fp=other), _c("c", committed=2048)]
    assert placement.choose_move(cands, s, small, "x", "a", live=True).node == "c"
    assert placement.choose_move(cands, s, small, "x", "a", live=False, has_memory=True).node == "c"
    assert placement.choose_move(cands, s, small, "x", "a", live=False).node == "b"
    with pytest.raises(ControlError) as e:
        placement.choose_move([_c("a"), _c("b", fp=other)], s, small, "the move", "a", live=True)
    assert (e.value.status, e.value.code) == (507, "insufficient_capacity")
    assert "node b: its CPU, kernel or CRIU differ from node a's" in e.value.message
    # cordoned nodes, nodes that can't receive, and no other node at all: refused, saying why
    with pytest.raises(ControlError) as e:
        placement.choose_move([_c("a"), _c("b", "cordoned"), _c("c")], s, small, "the move", "a", live=True,
                              unusable={"c": "no node API"})
    assert "node b is cordoned" in e.value.message and "node c: no node API" in e.value.message
    with pytest.raises(ControlError) as e:
        placement.choose_move([_c("a")], s, small, "the move", "a", live=False)
    assert "no other node is registered" in e.value.message


def test_a_live_migration_commits_the_node_or_leaves_the_sandbox_running_on_its_source(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sbx.control.sandboxes import migrating
    from sbx.node.types import NodeError

    with two_node_plane(tmp_path) as (cp, one, two):
        cp.registry.cordon("fake2", True)
        sid = cp.create("small").id
        wait_until(lambda: cp.get(sid).state == "running")
        assert cp.get(sid).node == "fake"
        # no other ready node: refused before anything changes
        with pytest.raises(ControlError) as e:
            cp.migrate(sid)
        assert (e.value.code, cp.get(sid).state) == ("insufficient_capacity", "running")
        cp.registry.cordon("fake2", False)

        def fail(src: object, dst: object, url: str, spec: object) -> dict[str, float]:
            raise NodeError("migration_failed", "restore: the destination answered restore_failed")

        monkeypatch.setattr(migrating.livemove, "migrate", fail)
        assert cp.migrate(sid).state == "migrating"
        wait_until(lambda: cp.get(sid).state == "running")
        row = cp.get(sid)
        assert (row.node, row.error_code) == ("fake", "migration_failed")
        failed = [ev for ev in cp.events(sid) if ev["event"] == "migrate_failed"]
        assert failed and failed[-1]["error"]["code"] == "migration_failed" and failed[-1]["state"] == "running"

        def move(src: FakeNode, dst: FakeNode, url: str, spec: object) -> dict[str, float]:
            assert (src, dst, url) == (one, two, "fake://two")
            dst.boxes[sid] = src.boxes.pop(sid)
            return {"pauseS": 0.25, "totalS": 0.5}

        monkeypatch.setattr(migrating.livemove, "migrate", move)
        cp.migrate(sid)
        wait_until(lambda: cp.get(sid).state == "running" and cp.get(sid).node == "fake2")
        assert cp.get(sid).error_code is None
        moved = [ev for ev in cp.events(sid) if ev["event"] == "migrated"][-1]
        assert (moved["from"], moved["to"], moved["pauseS"]) == ("fake", "fake2", 0.25)
        assert cp.node.status(sid) == "running"  # calls follow the node column
        # a stopped sandbox does not migrate
        cp.stop(sid)
        wait_until(lambda: cp.get(sid).state == "stopped")
        with pytest.raises(ControlError) as e:
            cp.migrate(sid)
        assert e.value.code == "not_running"


def test_a_server_restarted_mid_migration_finds_the_node_that_runs_the_sandbox(tmp_path: Path) -> None:
    """A row left ``migrating`` (the server died during the move) is pointed at the node that runs the sandbox
    when its source no longer has it, and left on its source when that still has it."""
    with two_node_plane(tmp_path) as (cp, one, two):
        cp.registry.cordon("fake2", True)
        stays, moved = cp.create("small").id, cp.create("small").id
        wait_until(lambda: cp.get(stays).state == "running" and cp.get(moved).state == "running")
        two.boxes[moved] = one.boxes.pop(moved)  # the node layer finished this move; the server did not record it
        for sid in (stays, moved):
            cp.store.update_sandbox(sid, state="migrating")
        cp._find_migrated()
        assert (cp.get(stays).node, cp.get(moved).node) == ("fake", "fake2")
        assert cp.node.status(moved) == "running"


def test_a_move_on_its_way_counts_against_its_destination(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 10, "capacity during a move": while a sandbox migrates, its memory counts against the destination
    (before, only against its source until the commit, so two moves at once could both take the destination's
    last room); once committed it counts there once, and a failed move gives the room back."""
    import threading

    from sbx.control.sandboxes import migrating
    from sbx.node.types import NodeError

    def committed(cp: object) -> dict[str, int]:
        return {c.name: c.committed_mib for c in cp._candidates()}  # type: ignore[attr-defined]

    with two_node_plane(tmp_path) as (cp, one, two):
        cp.registry.cordon("fake2", True)
        sid = cp.create("small").id
        wait_until(lambda: cp.get(sid).state == "running")
        cp.registry.cordon("fake2", False)
        mib = cp.settings.size("small").memory_mib
        assert committed(cp) == {"fake": mib, "fake2": 0}
        go, entered = threading.Event(), threading.Event()
        outcome: dict[str, bool] = {"fail": True}

        def move(src: FakeNode, dst: FakeNode, url: str, spec: object) -> dict[str, float]:
            entered.set()
            assert go.wait(10)
            if outcome["fail"]:
                raise NodeError("migration_failed", "restore: refused")
            dst.boxes[sid] = src.boxes.pop(sid)
            return {"pauseS": 0.1, "totalS": 0.2}

        monkeypatch.setattr(migrating.livemove, "migrate", move)
        for fail in (True, False):
            outcome["fail"], go = fail, threading.Event()
            entered.clear()
            cp.migrate(sid)
            assert entered.wait(10)
            assert committed(cp)["fake2"] == mib  # on its way: the destination's room is taken
            go.set()
            wait_until(lambda: cp.get(sid).state == "running")
            node = cp.get(sid).node
            assert node == ("fake" if fail else "fake2")
            assert committed(cp) == ({"fake": mib, "fake2": 0} if fail else {"fake": 0, "fake2": mib})
        assert cp.moving_to == {}
