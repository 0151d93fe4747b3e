"""Two `sbx server` replicas at once on one PostgreSQL database, driving one node agent (issue 10): a replica
killed with SIGKILL in the middle of a stop, a resume or a fork leaves the sandbox to the other, which settles it
from what the node reports (the node finishes the work it was given) instead of leaving it ``stopping`` forever;
a replica that starts while the other works leaves the node alone (no reconcile that would remove or kill what
the other is doing).

The node agent runs in a network namespace of its own (tests/nodenet.py, node 6) with the test holds
``SBX_TEST_HOLD_STOP``, ``SBX_TEST_HOLD_FROZEN`` and ``SBX_TEST_HOLD_RESTORE``, which keep a stop, a fork's disk
copy and a resume paused for a few seconds with a marker file present, so the kill lands inside the operation
every time. The replicas share the installation's admin key and secrets key (copied from the first one's state
folder, as an operator would).
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.faultsrv import FaultServer, start_replicas
from tests.e2e.helpers import poll
from tests.nodenet import NodeHost, node_netns
from tests.pgcluster import PgCluster, pg_cluster

HOLD = 6.0  # seconds each held step waits on the node


@dataclass
class Replicas:
    pg: PgCluster
    node: NodeHost
    a: FaultServer
    b: FaultServer


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    tmp = tmp_path_factory.mktemp("sbx-replicas")
    with pg_cluster() as pg, node_netns(6, tmp) as node:
        node.extra_env = {"SBX_TEST_HOLD_FROZEN": str(HOLD), "SBX_TEST_HOLD_RESTORE": str(HOLD),
                          "SBX_TEST_HOLD_STOP": str(HOLD)}
        node.start()
        common = {"SBX_DATABASE_URL": pg.create_db("sbx_replicas"), "SBX_NODE_URL": node.url,
                  "SBX_NODE_TOKEN": node.token, "SBX_NODE_HEARTBEAT_SECONDS": "1"}
        (tmp / "a").mkdir()
        (tmp / "b").mkdir()
        a = FaultServer(tmp / "a", prefix="SBX_REPLA", node="repla", bridge="sbxrpa0", subnet="10.83.0.0/16",
                        **common)
        b = FaultServer(tmp / "b", prefix="SBX_REPLB", node="replb", bridge="sbxrpb0", subnet="10.82.0.0/16",
                        **common)
        try:
            start_replicas(a, b)
            yield Replicas(pg, node, a, b)
        finally:
            b.close()
            a.close()
            assert node.stop() == 0, node.logs()


def ok(fs: FaultServer, *args: str, timeout: float = 300) -> str:
    assert fs.srv is not None
    return fs.srv.sbx(*args, timeout=timeout, check=True).stdout


def info(fs: FaultServer, sid: str) -> dict:  # type: ignore[type-arg]
    return json.loads(ok(fs, "info", sid, "--json"))["sandbox"]  # type: ignore[no-any-return]


def held(node: NodeHost, sid: str, name: str) -> bool:
    """Whether the node's test hold ``name`` (``stop``, ``restore``, ``frozen``) is pausing ``sid`` now: its marker
    file exists (sbx.node.container.recovery; sbx.storage.disk puts the freeze's beside the mount point in the
    bundle)."""
    if name == "frozen":
        return bool(glob.glob(str(Path("/run/sbx") / node.node_name / "bundles" / sid / "*.frozen-hold")))
    return (Path("/var/lib/sbx/volume/nodes") / node.node_name / "sandboxes" / sid / f"{name}-hold").exists()


def settled(fs: FaultServer, sid: str, timeout: float = 120) -> dict:  # type: ignore[type-arg]
    """The sandbox once it is in no transient state (as ``fs`` reports it)."""
    transient = {"provisioning", "stopping", "resuming", "forking", "deleting"}
    got = poll(lambda: (lambda r: r if r["state"] not in transient else None)(info(fs, sid)),
               f"{sid} to settle", timeout=timeout)
    return got  # type: ignore[no-any-return]


def _sleeper(fs: FaultServer, sid: str) -> str:
    """Start a process that lives in the sandbox's memory only; its PID."""
    ok(fs, "exec", sid, "--detach", "exec -a sbx-replica-sleeper sleep 1000000")
    return poll(lambda: ok(fs, "exec", sid, "pgrep -f -o sbx-replica-sleeper || true", timeout=60).strip() or None,
                "the sleeper to start", timeout=60)  # type: ignore[no-any-return]


def test_a_replica_killed_mid_stop_and_mid_resume_leaves_the_sandbox_to_the_other(replicas: Replicas) -> None:
    a, b, node = replicas.a, replicas.b, replicas.node
    sid = ok(a, "new", "--type", "small").strip()
    assert ok(a, "exec", sid, "echo kept > ~/f && sync && cat ~/f", timeout=120).strip() == "kept"
    pid = _sleeper(a, sid)

    ok(a, "stop", sid)  # returns at once: the stop runs on the node, held for HOLD seconds before CRIU
    poll(lambda: held(node, sid, "stop"), "the stop to reach its hold", timeout=120, interval=0.05)
    a.kill9()
    assert info(b, sid)["state"] == "stopping"  # the other replica sees the operation in flight...
    got = settled(b, sid)  # ...and settles it once the node has finished it
    assert (got["state"], got["memorySaved"], got["stopReason"]) == ("stopped", True, "requested")

    a.start()  # A comes back while B is alive: it must not reconcile the node under B's feet
    ok(b, "resume", sid)
    poll(lambda: held(node, sid, "restore"), "the resume to reach its hold", timeout=120,
         interval=0.05)
    b.kill9()
    got = settled(a, sid)
    # running, with its memory (the same PID); how the resume went died with B, so memoryRestored is null
    assert (got["state"], got["memoryRestored"]) == ("running", None), got
    assert ok(a, "exec", sid, "cat ~/f", timeout=120).strip() == "kept"
    assert ok(a, "exec", sid, "pgrep -f -o sbx-replica-sleeper", timeout=60).strip() == pid
    b.start()
    assert info(b, sid)["state"] == "running"
    assert ok(b, "exec", sid, "pgrep -f -o sbx-replica-sleeper", timeout=60).strip() == pid
    ok(b, "delete", sid)


def test_a_replica_killed_mid_fork_leaves_no_half_state(replicas: Replicas) -> None:
    a, b, node = replicas.a, replicas.b, replicas.node
    src = ok(a, "new", "--type", "small").strip()
    ok(a, "exec", src, "echo from-source > ~/f && sync", timeout=120)
    ok(a, "fork", src)  # the disk copy is held frozen on the node
    poll(lambda: held(node, src, "frozen"), "the fork to reach its hold", timeout=120, interval=0.05)
    a.kill9()
    forks = [s for s in json.loads(ok(b, "list", "--json"))["sandboxes"] if s["id"] != src]
    assert len(forks) == 1 and forks[0]["state"] in ("forking", "provisioning"), forks
    fid = forks[0]["id"]
    got = settled(b, fid)
    # the node finished the copy it was given: the fork is a whole sandbox (running, or stopped when the boot
    # was still to come), never a half-made disk
    assert got["state"] in ("running", "stopped"), got
    if got["state"] == "stopped":
        ok(b, "resume", fid, "--wait", timeout=300)
    assert ok(b, "exec", fid, "cat ~/f", timeout=120).strip() == "from-source"
    assert info(b, src)["state"] == "running"
    a.start()
    for sid in (fid, src):
        ok(a, "delete", sid)
