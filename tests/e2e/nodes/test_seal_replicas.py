"""Seal replicas (issue 10, "a stopped sandbox may resume on another node when its own is ... gone"): on the
several-node topology (tests/e2e/cluster.py, two node agents in their own network namespaces), with the
replicator every second (SBX_REPLICATE_SECONDS=1). A sandbox stopped with a 128 MiB process gets a copy of its
seal on the other node; its node agent is killed; the sandbox resumes on the replica's node with the same PID,
memory SHA-256 and files; when the dead agent comes back its old copy is removed and the sandbox is untouched."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import holder, info, node_cluster, ok, start_holder
from tests.e2e.conftest import Server
from tests.e2e.helpers import poll
from tests.nodenet import NodeHost

VOLUME_NODES = Path("/var/lib/sbx/volume/nodes")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, list[NodeHost]]]:
    with node_cluster(tmp_path_factory.mktemp("sbx-sealrep"), [12, 13], "srsrv", "sbxsrsv", "10.80.0.0/16",
                      SBX_REPLICATE_SECONDS="1", SBX_CONSOLIDATE_SECONDS="0") as c:
        yield c


def _replica_dir(node: NodeHost, sid: str) -> Path:
    return VOLUME_NODES / node.node_name / "replicas" / sid


def _sandbox_dir(node: NodeHost, sid: str) -> Path:
    return VOLUME_NODES / node.node_name / "sandboxes" / sid


def test_a_stopped_sandbox_outlives_its_node(cluster: tuple[Server, list[NodeHost]]) -> None:
    srv, nodes = cluster
    sid = ok(srv, "new", "--type", "small").strip()
    home = next(n for n in nodes if n.node_name == info(srv, sid)["node"])
    other = next(n for n in nodes if n is not home)
    start_holder(srv, sid)
    before = holder(srv, sid)
    ok(srv, "exec", sid, "head -c 3000000 /dev/urandom > ~/kept.bin && sha256sum ~/kept.bin > ~/kept.sha")
    kept = ok(srv, "exec", sid, "cat ~/kept.sha").split()[0]
    ok(srv, "stop", sid, "--wait")

    # the replicator copies its seal (disk delta and memory image) to the other node
    seen = poll(lambda: info(srv, sid).get("replicaNode"), "a replica of the stopped sandbox", 120)
    assert seen == other.node_name
    assert (_replica_dir(other, sid) / "manifest.json").is_file()
    assert not _sandbox_dir(other, sid).exists()  # a replica is not a sandbox there

    # its node goes away
    home.kill()
    poll(lambda: info(srv, sid)["nodeStatus"] == "unreachable", "the node to be unreachable", 60)
    answer = json.loads(ok(srv, "resume", sid, "--wait", "--json"))["sandbox"]
    assert answer["state"] == "running", answer
    after = info(srv, sid)
    assert (after["state"], after["node"], after["memoryRestored"]) == ("running", other.node_name, True), after
    assert after["replicaNode"] is None
    assert holder(srv, sid) == before  # same PID, memory SHA-256, unlinked file's offset and link count
    assert ok(srv, "exec", sid, "sha256sum ~/kept.bin").split()[0] == kept
    assert not _replica_dir(other, sid).exists()  # used up

    # the dead node comes back: its old copy goes, the sandbox stays where it runs
    home.start()
    poll(lambda: not _sandbox_dir(home, sid).exists(), "the old copy to be removed from the returned node", 120)
    assert info(srv, sid)["node"] == other.node_name
    assert holder(srv, sid) == before
    assert ok(srv, "exec", sid, "echo still here").strip() == "still here"

    # stopped again, it gets a replica on the returned node; deleted, no replica is left anywhere
    ok(srv, "stop", sid, "--wait")
    assert poll(lambda: info(srv, sid).get("replicaNode"), "a new replica", 120) == home.node_name
    ok(srv, "delete", sid, "--wait")
    poll(lambda: not _replica_dir(home, sid).exists(), "the replica of the deleted sandbox to go", 60)
    assert not _sandbox_dir(other, sid).exists()


def test_without_a_replica_the_resume_says_the_node_is_gone(cluster: tuple[Server, list[NodeHost]]) -> None:
    """Stopped while no other node may take a copy (cordoned), a sandbox has no replica: with its node gone a
    resume fails with node_unreachable and it stays stopped (what every resume did before seal replicas), then
    resumes at home, with its memory, when the node is back."""
    srv, nodes = cluster
    sid = ok(srv, "new", "--type", "small").strip()
    home = next(n for n in nodes if n.node_name == info(srv, sid)["node"])
    other = next(n for n in nodes if n is not home)
    ok(srv, "exec", sid, "echo mine > ~/mine")
    ok(srv, "exec", sid, "--detach", "sleep 545454")
    pid = poll(lambda: ok(srv, "exec", sid, "pgrep -o -f '[s]leep 545454' || true").strip(),
               "the job's sleep to start", 30, 0.1)  # its unit answers before the login shell runs it
    ok(srv, "node", "cordon", other.node_name)
    try:
        ok(srv, "stop", sid, "--wait")
        time.sleep(3)  # three replication passes
        assert info(srv, sid)["replicaNode"] is None
        home.kill()
        poll(lambda: info(srv, sid)["nodeStatus"] == "unreachable", "the node to be unreachable", 60)
    finally:
        ok(srv, "node", "uncordon", other.node_name)
    r = srv.sbx("resume", sid, "--wait", timeout=300)
    assert r.returncode != 0 and "node_unreachable" in r.stderr, (r.stdout, r.stderr)
    assert info(srv, sid)["state"] == "stopped"
    home.start()
    poll(lambda: info(srv, sid)["nodeStatus"] == "ready", "the node to be back", 60)
    ok(srv, "resume", sid, "--wait")
    after = info(srv, sid)
    assert (after["node"], after["memoryRestored"]) == (home.node_name, True), after
    assert ok(srv, "exec", sid, "pgrep -f 'sleep 545454'").strip() == pid
    assert ok(srv, "exec", sid, "cat ~/mine").strip() == "mine"
    ok(srv, "delete", sid, "--wait")


def test_a_mount_namespace_holding_the_disk_loses_no_write_on_a_move(
        cluster: tuple[Server, list[NodeHost]]) -> None:
    """A process on the host that made a mount namespace while the sandbox ran (any ``unshare -m``, a systemd
    unit with PrivateTmp, a container starting) holds a copy of the sandbox's disk mount, so its filesystem
    outlives the node's unmount at the stop. What the sandbox wrote just before the stop is still in the disk's
    seal and arrives on another node (seen in CI as a drained sandbox's file that came back empty)."""
    srv, nodes = cluster
    sid = ok(srv, "new", "--type", "small").strip()
    home = next(n for n in nodes if n.node_name == info(srv, sid)["node"])
    other = next(n for n in nodes if n is not home)
    holder_ns = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "300"])
    try:
        ok(srv, "exec", sid, "head -c 3000000 /dev/urandom > ~/late.bin && sha256sum ~/late.bin > ~/late.sha "
                             "&& echo written > ~/note")
        want = ok(srv, "exec", sid, "cat ~/late.sha").split()[0]
        ok(srv, "stop", sid, "--wait")
        ok(srv, "node", "cordon", home.node_name)
        try:
            ok(srv, "resume", sid, "--wait")
        finally:
            ok(srv, "node", "uncordon", home.node_name)
        assert info(srv, sid)["node"] == other.node_name
        assert ok(srv, "exec", sid, "cat ~/note").strip() == "written"
        assert ok(srv, "exec", sid, "sha256sum ~/late.bin").split()[0] == want
    finally:
        holder_ns.kill()
        holder_ns.wait()
    ok(srv, "delete", sid, "--wait")
