"""Consolidation (issue 11): the rules of sbx.control.cluster.packing.plan on hand-made node loads (which node is light,
which one is emptied, where each sandbox goes, and when nothing happens), and the store's consolidated mark."""

from __future__ import annotations

from pathlib import Path

from sbx.config import Size
from sbx.control.cluster.packing import Held, NodeLoad, Rules, plan
from sbx.control.store.database import Store, utcnow

SMALL = Size("small", 2, 256, 2048)
BIG = Size("large", 8, 1024, 4096)
FP = {"cpuModel": "X", "kernel": "6.1"}
RULES = Rules(light_fraction=0.25, headroom=0.2, max_moves=4, disk_reserve_gib=5.0)


def _n(name: str, *held: Held, status: str = "ready", cap: int = 4096, added: bool = True, live: bool = True,
       fp: dict[str, str] | None = None, disk: int = 100 << 30, consolidated: bool = False,
       held_back: str = "") -> NodeLoad:
    used = sum(h.memory_mib for h in held)
    return NodeLoad(name, status, cap, used, disk, added=added, live=live, fingerprint=dict(fp or FP),
                    consolidated=consolidated, sandboxes=held, held_back=held_back)


def _run(sid: str, size: Size = SMALL) -> Held:
    return Held(sid, "running", size)


def _stopped(sid: str, size: Size = SMALL, memory: bool = True) -> Held:
    return Held(sid, "stopped", size, memory)


def test_the_lightest_node_is_emptied_onto_the_fullest_that_keeps_headroom() -> None:
    nodes = [
        _n("a", *[_run(f"a{i}") for i in range(8)], added=False),  # 2048 of 4096: 50%, the fullest
        _n("b", _run("b1"), _stopped("b2")),                      # 256: 6%, light
        _n("c", _run("c1"), _run("c2"), _run("c3")),                # 768: 19%, light but fuller than b
    ]
    p = plan(nodes, RULES)
    assert (p.action, p.node) == ("drain", "b"), p.reason
    assert p.moves == {"b1": "a", "b2": "a"}  # packed onto the fullest, not spread onto c (most room)
    figures = {f["name"]: f for f in p.nodes}
    assert figures["b"]["light"] and figures["c"]["light"] and not figures["a"]["light"]
    assert "configured node" in figures["a"]["why"]
    assert (figures["b"]["usedMiB"], figures["b"]["capacityMiB"], figures["b"]["sandboxes"]) == (256, 4096, 2)


def test_a_destination_past_its_headroom_is_passed_over_for_the_next_fullest() -> None:
    # a holds 3072 of 4096: one more small (3328) would leave 19% free, under the 20% headroom
    nodes = [_n("a", *[_run(f"a{i}") for i in range(12)], added=False), _n("b", _run("b1")),
             _n("c", _run("c1"), _run("c2"), _run("c3"))]
    p = plan(nodes, RULES)
    assert (p.action, p.node, p.moves) == ("drain", "b", {"b1": "c"})


def test_no_light_node_and_light_nodes_the_rest_cannot_take_do_nothing_and_say_why() -> None:
    busy = [_n("a", *[_run(f"a{i}") for i in range(4)]), _n("b", *[_run(f"b{i}") for i in range(5)])]
    p = plan(busy, RULES)
    assert (p.action, p.node, p.reason) == ("none", None, "no light node")
    assert all(not f["light"] and "of its memory is used" in f["why"] for f in p.nodes)
    # b is light (a large on an 8 GiB node: 12.5%) but a can't take it and keep 20% free
    nodes = [_n("a", *[_run(f"a{i}") for i in range(13)], added=False),  # 3328: a large would break headroom
             _n("b", _run("big", BIG), cap=8192)]
    p = plan(nodes, RULES)
    assert (p.action, p.node) == ("none", None)
    assert p.reason.startswith("the rest lack room: b: no other ready node can take a live migration of big")
    assert "keep 20% of its memory free" in p.reason


def test_the_last_ready_node_is_never_emptied_and_the_rest_keep_headroom_together() -> None:
    alone = plan([_n("a", _run("a1"))], RULES)
    assert alone.action == "none"
    assert alone.reason == "the rest lack room: a: it is the only ready node (the last one is never emptied)"
    # the others cordoned: no destination
    p = plan([_n("a", _run("a1")), _n("b", status="cordoned")], RULES)
    assert p.action == "none" and "it is the only ready node" in p.reason
    # b holds only a stopped sandbox (no memory) and c may take it, but a is full: without b the ready nodes would
    # keep under 20% free together
    full = _n("a", *[_run(f"a{i}") for i in range(16)], added=False)  # 4096 of 4096
    c = _n("c", *[_run(f"c{i}") for i in range(11)], added=False)     # 2816 of 4096: 31% free
    p = plan([full, c, _n("b", _stopped("b1"))], RULES)
    assert p.action == "none"
    assert p.reason == ("the rest lack room: b: the other ready nodes would keep 16% of their memory free (at least "
                        "20% must stay free)")
    roomy = _n("a", *[_run(f"a{i}") for i in range(4)], added=False)
    p = plan([roomy, _n("b", _stopped("b1"))], RULES)
    assert (p.action, p.node, p.moves) == ("drain", "b", {"b1": "a"})


def test_an_empty_node_is_left_alone() -> None:
    p = plan([_n("a", _run("a1"), added=False), _n("b")], RULES)
    assert (p.action, p.reason) == ("none", "no light node")
    assert {f["name"]: f["why"] for f in p.nodes}["b"].startswith("it holds no sandbox")


def test_an_unreachable_node_stops_consolidation() -> None:
    p = plan([_n("a", *[_run(f"a{i}") for i in range(8)]), _n("b", _run("b1")), _n("c", status="unreachable")],
             RULES)
    assert (p.action, p.node) == ("none", None)
    assert p.reason == "node c is unreachable: no consolidation until every node answers"


def test_sandboxes_in_an_operation_or_in_error_too_many_sandboxes_and_held_back_nodes_are_not_light() -> None:
    base = _n("a", *[_run(f"a{i}") for i in range(8)], added=False)
    for held, why in ((Held("x", "stopping", SMALL), "sandbox x is stopping"),
                      (Held("x", "error", SMALL), "sandbox x is error")):
        p = plan([base, _n("b", held)], RULES)
        assert p.action == "none" and {f["name"]: f["why"] for f in p.nodes}["b"] == why
    many = _n("b", *[_stopped(f"s{i}") for i in range(5)])  # no memory held, but more than max_moves
    p = plan([base, many], RULES)
    assert p.action == "none" and "it holds 5 sandboxes (at most 4" in {f["name"]: f["why"] for f in p.nodes}["b"]
    p = plan([base, _n("b", _run("b1"), held_back="its last consolidation left sandboxes on it")], RULES)
    assert p.action == "none" and p.reason == "no light node"


def test_a_running_sandbox_needs_a_node_with_a_node_api_and_the_same_fingerprint_a_stopped_one_does_not() -> None:
    other = {"cpuModel": "Y", "kernel": "6.1"}
    nodes = [_n("a", *[_run(f"a{i}") for i in range(8)], added=False, fp=other),  # fuller, other CPU
             _n("c", *[_run(f"c{i}") for i in range(4)], added=False, live=False),  # embedded: no node API
             _n("b", _run("b1"))]
    p = plan(nodes, RULES)
    assert p.action == "none" and "live migration of b1" in p.reason
    nodes[2] = _n("b", _stopped("b2", memory=False))
    p = plan(nodes, RULES)
    assert (p.action, p.moves) == ("drain", {"b2": "a"})  # the fullest: no memory image to keep usable
    nodes[2] = _n("b", _stopped("b2", memory=True))
    p = plan(nodes, RULES)
    assert (p.action, p.moves) == ("drain", {"b2": "c"})  # its memory image stays usable on a matching node


def test_a_destination_without_disk_room_is_passed_over() -> None:
    nodes = [_n("a", *[_run(f"a{i}") for i in range(8)], added=False, disk=5 << 30),
             _n("c", *[_run(f"c{i}") for i in range(2)], added=False), _n("b", _stopped("b1"))]
    assert plan(nodes, RULES).moves == {"b1": "c"}


def test_biggest_sandboxes_are_placed_first_so_they_all_fit() -> None:
    # under its headroom a has 1228 MiB left (the large, or the small, not both), c 870 (the small only): the
    # small placed first would take a's room and leave the large nowhere
    nodes = [_n("a", *[_run(f"a{i}") for i in range(8)], added=False),           # 2048 of 4096: 50%
             _n("c", *[_run(f"c{i}") for i in range(3)], added=False, cap=2048),  # 768 of 2048: 37.5%
             _n("b", _run("s1"), _run("big", BIG), cap=16384)]
    p = plan(nodes, RULES)
    assert (p.action, p.moves) == ("drain", {"big": "a", "s1": "c"})


def test_a_node_consolidation_emptied_comes_back_when_the_rest_run_short() -> None:
    full = _n("a", *[_run(f"a{i}") for i in range(14)], added=False)  # 12.5% free
    back = _n("b", status="cordoned", consolidated=True)
    p = plan([full, back], RULES)
    assert (p.action, p.node) == ("return", "b")
    assert "takes sandboxes again" in p.reason
    roomy = _n("a", *[_run(f"a{i}") for i in range(4)], added=False)
    assert plan([roomy, back], RULES).action == "none"
    # a cordoned node the operator emptied (not consolidation) is not handed back
    assert plan([full, _n("b", status="cordoned")], RULES).action == "none"


def test_the_store_marks_a_consolidated_node_and_an_uncordon_clears_it(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'sbx.db'}")
    store.heartbeat_node("n1", "http://n1", {})
    store.set_node_cordoned("n1", True)
    store.set_node_consolidated("n1", utcnow())
    [row] = store.list_nodes()
    assert row.cordoned and row.consolidated_at is not None
    store.set_node_cordoned("n1", False)
    [row] = store.list_nodes()
    assert not row.cordoned and row.consolidated_at is None
    store.close()
