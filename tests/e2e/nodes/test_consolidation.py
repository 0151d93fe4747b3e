"""Consolidation (issue 11, item 3): one `sbx server` driving three node agents, each in a network namespace of its
own (tests/nodenet.py, nodes 9, 10 and 11): node 9 is the server's configured node (SBX_NODE_URL), 10 and 11 are
added with `sbx node add`. The loop runs every 2 s (SBX_CONSOLIDATE_SECONDS=2); each node may promise 2048 MiB
(SBX_MEMORY_OVERCOMMIT chosen from the host's RAM), so one running `small` (256 MiB) is 12.5% of a node: light
(below 25%), two are 25%: not light.

Light load: node 10 holds a running sandbox (a Python process holding 128 MiB of random bytes and an unlinked file
open at a known offset) and a stopped one (a `sleep` process in its memory image); node 11 holds two running
sandboxes; node 9 none. With every node ready the loop empties node 10 onto node 11 (the fullest node that keeps
its headroom, not the emptier node 9): the running sandbox keeps its PID, the SHA-256 of its memory and its file
offset; the stopped one resumes on node 11 with its memory and its process; their events say `migrated`/`moved`
with reason `consolidation`; node 10 is reported removable (cordoned, empty, consolidatedAt set) by `sbx node list`
and `sbx node consolidation`. Several periods later no second node was emptied (node 11 is not light, node 9 is
the configured node) and the plan says why; an uncordon clears the mark. Empty nodes are never touched: while
nodes 10 and 11 were freshly added and empty the loop left them alone.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator

import pytest

from tests.e2e.cluster import cordon as _cordon
from tests.e2e.cluster import holder as _holder
from tests.e2e.cluster import info as _info
from tests.e2e.cluster import node_cluster, ok, start_holder
from tests.e2e.conftest import Server
from tests.e2e.helpers import poll
from tests.nodenet import NodeHost

NODE_MIB = 2048
"""What each node may promise: (RAM - 1024 MiB reserve) x the overcommit the test sets."""


def _overcommit() -> str:
    ram = next(int(ln.split()[1]) // 1024 for ln in open("/proc/meminfo") if ln.startswith("MemTotal:"))
    return repr((NODE_MIB + 0.5) / (ram - 1024))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, list[NodeHost]]]:
    with node_cluster(tmp_path_factory.mktemp("sbx-consolidate"), [9, 10, 11], "cosrv", "sbxcosv", "10.81.0.0/16",
                      SBX_CONSOLIDATE_SECONDS="2", SBX_MEMORY_OVERCOMMIT=_overcommit()) as (srv, nodes):
        assert not any(_nodes(srv)[n.node_name]["removable"] for n in nodes)
        yield srv, nodes


def _nodes(srv: Server) -> dict[str, dict]:  # type: ignore[type-arg]
    return {n["name"]: n for n in json.loads(ok(srv, "node", "list", "--json"))["nodes"]}


def _consolidation(srv: Server) -> dict:  # type: ignore[type-arg]
    return json.loads(ok(srv, "node", "consolidation", "--json"))["consolidation"]  # type: ignore[no-any-return]


def _events(srv: Server, sid: str) -> list[dict]:  # type: ignore[type-arg]
    req = urllib.request.Request(f"{srv.url}/v1/sandboxes/{sid}/events",
                                 headers={"Authorization": f"Bearer {srv.token}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return [json.loads(ln) for ln in resp.read().decode().splitlines() if ln.strip()]


def test_the_loop_empties_a_light_node_onto_a_fuller_one_and_no_sandbox_loses_a_process(
        cluster: tuple[Server, list[NodeHost]]) -> None:
    srv, nodes = cluster
    n9, n10, n11 = (n.node_name for n in nodes)
    # freshly added, empty nodes are left alone
    poll(lambda: len((_consolidation(srv)["plan"] or {}).get("nodes", [])) == 3, "a pass over the three nodes", 30)
    k = _consolidation(srv)
    assert (k["enabled"], k["leader"], k["plan"]["action"], k["plan"]["reason"]) == (True, True, "none",
                                                                                   "no light node"), k
    assert {n["name"]: n["capacityMiB"] for n in k["plan"]["nodes"]} == {n9: NODE_MIB, n10: NODE_MIB, n11: NODE_MIB}

    _cordon(srv, nodes, 9, 11)  # node 10: the running holder and a stopped sandbox
    live = ok(srv, "new", "--type", "small").strip()
    parked = ok(srv, "new", "--type", "small").strip()
    assert (_info(srv, live)["node"], _info(srv, parked)["node"]) == (n10, n10)
    start_holder(srv, live)
    before = _holder(srv, live)
    ok(srv, "exec", parked, "--detach", "sleep 100000")
    parked_pid = poll(lambda: ok(srv, "exec", parked, "pgrep -o -f '[s]leep 100000' || true").strip(),
                      "the job's sleep to start", 30, 0.1)  # its unit answers before the login shell runs it
    ok(srv, "stop", parked, "--wait")
    _cordon(srv, nodes, 9, 10)  # node 11: two running sandboxes (25%: not light)
    fillers = [ok(srv, "new", "--type", "small").strip() for _ in range(2)]
    assert {_info(srv, f)["node"] for f in fillers} == {n11}
    assert {n for n, v in _nodes(srv).items() if v["cordoned"]} == {n9, n10}

    t0 = time.monotonic()
    ok(srv, "node", "uncordon", n9)
    ok(srv, "node", "uncordon", n10)
    poll(lambda: _nodes(srv)[n10]["removable"], "the loop to empty node 10", 180, 1.0)
    took = time.monotonic() - t0
    k = _consolidation(srv)
    print(ok(srv, "node", "consolidation"))  # what a user sees, for the report
    print(ok(srv, "node", "list"))
    print(f"node 10 emptied {took:.1f} s after it was ready again")
    assert k["drain"]["node"] == n10 and k["drain"]["reason"] == "consolidation", k
    assert {i["id"]: (i["status"], i["to"]) for i in k["drain"]["sandboxes"]} == {
        live: ("done", n11), parked: ("done", n11)}, k["drain"]
    assert k["outcome"] == f"node {n10} is empty and cordoned: removable (`sbx node remove {n10}`)"
    assert k["removable"] == [n10]

    after = _info(srv, live)
    assert (after["state"], after["node"]) == ("running", n11), after
    assert _holder(srv, live) == before  # same PID, same memory, same offset of the unlinked file
    migrated = [e for e in _events(srv, live) if e.get("event") == "migrated"]
    assert [(e["from"], e["to"], e["reason"]) for e in migrated] == [(n10, n11, "consolidation")], migrated
    moved = [e for e in _events(srv, parked) if e.get("event") == "moved"]
    assert [(e["from"], e["to"], e["reason"], e["memory"]) for e in moved] == [(n10, n11, "consolidation", True)]
    assert (_info(srv, parked)["state"], _info(srv, parked)["node"]) == ("stopped", n11)
    ok(srv, "resume", parked, "--wait")
    resumed = _info(srv, parked)
    assert (resumed["node"], resumed["memoryRestored"]) == (n11, True), resumed
    assert ok(srv, "exec", parked, "pgrep -o -f 'sleep 100000'").strip() == parked_pid

    listed = _nodes(srv)
    assert (listed[n10]["status"], listed[n10]["sandboxes"], listed[n10]["removable"]) == ("cordoned", 0, True)
    assert listed[n10]["consolidatedAt"] is not None
    assert [(listed[n]["status"], listed[n]["removable"]) for n in (n9, n11)] == [("ready", False)] * 2
    assert "cordoned, removable" in ok(srv, "node", "list")

    # a few periods later: no second node emptied, and the plan says why
    seen = _consolidation(srv)["lastRunAt"]
    poll(lambda: _consolidation(srv)["lastRunAt"] != seen, "another pass", 30)
    time.sleep(6)
    k = _consolidation(srv)
    assert (k["plan"]["action"], k["plan"]["reason"]) == ("none", "no light node"), k["plan"]
    why = {n["name"]: n["why"] for n in k["plan"]["nodes"]}
    assert why[n11] == "50% of its memory is used (light: below 25%)", why
    assert why[n9].startswith("it is a server's configured node") and why[n10] == "it is cordoned", why
    listed = _nodes(srv)
    assert {n: listed[n]["sandboxes"] for n in (n9, n10, n11)} == {n9: 0, n10: 0, n11: 4}
    assert {n for n in listed if listed[n]["cordoned"]} == {n10}
    out = ok(srv, "node", "consolidation")
    assert "last pass" in out and "none: no light node" in out and f"removable: {n10}" in out, out

    # an uncordon puts the node back to work and clears the mark
    ok(srv, "node", "uncordon", n10)
    back = _nodes(srv)[n10]
    assert (back["status"], back["removable"], back["consolidatedAt"]) == ("ready", False, None)
    for sid in (live, parked, *fillers):
        ok(srv, "delete", sid, "--wait")
