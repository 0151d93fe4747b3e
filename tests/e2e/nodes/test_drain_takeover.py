"""A drain outlives the server replica running it (issue 11): two `sbx server` replicas on one PostgreSQL database
drive two node agents, each in a network namespace of its own (tests/nodenet.py, nodes 7 and 8; node 8 added with
`sbx node add`). Node 8's agent holds every arrival for a few seconds before its restore
(``SBX_TEST_HOLD_MIGRATION``), so a live migration takes long enough to kill a replica in the middle of a drain.

- replica A drains node 7 (three running sandboxes, one at a time: ``SBX_DRAIN_PARALLEL=1``); replica B answers
  ``GET /v1/nodes/{name}/drain`` with A's drain while it runs (the record is in the database);
- A is killed with SIGKILL once the first sandbox has moved, the second one in the middle of its migration;
- B takes the drain over (``resumes`` 1): the sandbox caught mid-move is found on node 8 (its move completed node
  to node), the third is migrated, node 7 ends empty; every sandbox runs on node 8 with the same process.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.e2e.faultsrv import FaultServer, start_replicas
from tests.e2e.helpers import poll
from tests.nodenet import NodeHost, node_netns_many
from tests.pgcluster import pg_cluster

HOLD = 3.0  # seconds node 8 holds each arrival before its restore


@dataclass
class Two:
    a: FaultServer
    b: FaultServer
    n7: NodeHost
    n8: NodeHost


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Two]:
    tmp = tmp_path_factory.mktemp("sbx-drain-takeover")
    with pg_cluster() as pg, node_netns_many([7, 8], tmp) as (n7, n8):
        n8.extra_env["SBX_TEST_HOLD_MIGRATION"] = str(HOLD)
        n7.start()
        n8.start()
        common = {"SBX_DATABASE_URL": pg.create_db("sbx_drain_takeover"), "SBX_NODE_URL": n7.url,
                  "SBX_NODE_TOKEN": n7.token, "SBX_NODE_HEARTBEAT_SECONDS": "1",
                  "SBX_NODE_UNREACHABLE_SECONDS": "5", "SBX_DRAIN_PARALLEL": "1"}
        (tmp / "a").mkdir()
        a = FaultServer(tmp / "a", prefix="SBX_DRTA", node="drta", bridge="sbxdta0", subnet="10.40.0.0/16", **common)
        b = FaultServer(tmp / "b", prefix="SBX_DRTB", node="drtb", bridge="sbxdtb0", subnet="10.41.0.0/16", **common)

        def add_node8() -> None:
            added = json.loads(ok(a, "node", "add", n8.url, "--token", n8.token, "--json"))["node"]
            assert added["name"] == n8.node_name

        try:
            start_replicas(a, b, add_node8)
            yield Two(a, b, n7, n8)
        finally:
            if a.proc is not None and a.proc.poll() is not None and b.proc is not None and b.proc.poll() is None:
                a.start()  # so that its close() stops it cleanly
            try:
                b.close()
            finally:
                a.close()
            for n in (n8, n7):
                assert n.stop() == 0, n.logs()


def ok(fs: FaultServer, *args: str, timeout: float = 300) -> str:
    assert fs.srv is not None
    return fs.srv.sbx(*args, timeout=timeout, check=True).stdout


def drain_of(fs: FaultServer, node: str) -> dict[str, Any]:
    assert fs.srv is not None
    return fs.srv.api("GET", f"/v1/nodes/{node}/drain")["drain"]  # type: ignore[no-any-return]


def test_a_drain_goes_on_after_the_replica_running_it_is_killed(two: Two) -> None:
    a, b, n7, n8 = two.a, two.b, two.n7.node_name, two.n8.node_name
    ok(a, "node", "cordon", n8)  # every sandbox starts on node 7
    sids, pids = [], {}
    for _ in range(3):
        sid = ok(a, "new", "--type", "small").strip()
        ok(a, "exec", sid, "--detach", "exec -a sbx-drain-sleeper sleep 1000000")
        pids[sid] = poll(lambda s=sid: ok(a, "exec", s, "pgrep -f -o sbx-drain-sleeper || true").strip() or None,
                         "the sleeper to start", timeout=60)
        sids.append(sid)
    assert {json.loads(ok(a, "info", s, "--json"))["sandbox"]["node"] for s in sids} == {n7}
    ok(a, "node", "uncordon", n8)

    started = json.loads(ok(a, "node", "drain", n7, "--json"))["drain"]
    assert [i["id"] for i in started["sandboxes"]] == sids and started["state"] == "draining"
    seen = drain_of(b, n7)  # the other replica answers for the drain A runs
    assert (seen["state"], seen["reason"], [i["id"] for i in seen["sandboxes"]]) == ("draining", "drain", sids)

    def first_moved_second_moving() -> bool:
        items = drain_of(a, n7)["sandboxes"]
        return items[0]["status"] == "done" and items[1]["status"] == "moving"

    poll(first_moved_second_moving, "the first sandbox to move and the second to start", timeout=300,
         interval=0.05)
    a.kill9()
    t0 = time.monotonic()

    done = poll(lambda: (lambda d: d if d["state"] == "done" else None)(drain_of(b, n7)),
                "the other replica to finish the drain", timeout=300)
    print(f"the drain was finished by the other replica {time.monotonic() - t0:.1f} s after the kill: "
          f"{json.dumps(done['sandboxes'])}")  # for the report
    assert (done["empty"], done["resumes"]) == (True, 1), done
    for item in done["sandboxes"]:
        assert (item["status"], item["to"], item["action"]) == ("done", n8, "migrate"), item
    for sid in sids:
        sb = json.loads(ok(b, "info", sid, "--json"))["sandbox"]
        assert (sb["state"], sb["node"]) == ("running", n8), sb
        assert ok(b, "exec", sid, "pgrep -f -o sbx-drain-sleeper").strip() == pids[sid]
    listed = {n["name"]: n for n in json.loads(ok(b, "node", "list", "--json"))["nodes"]}
    assert (listed[n7]["status"], listed[n7]["sandboxes"]) == ("cordoned", 0)
    for sid in sids:
        ok(b, "delete", sid, "--wait")
