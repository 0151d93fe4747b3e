"""Running sandboxes in the seal store (issue 34): a server with SBX_SEAL_STORE=s3://... on a real S3 server (moto's
server mode, tests/s3server.py), automatic snapshots every 5 s, and two node agents in their own network namespaces
(tests/e2e/cluster.py), no seal replicas. A running sandbox's automatic snapshots go to the bucket; its node agent is
killed -9 with the sandbox's container and its data on that node deleted (the host is lost); 5 s after the node is
unreachable the sandbox comes back on the other node from its newest stored seal, booted from that disk, with every
file written before that seal. The test prints how old the seal was."""

from __future__ import annotations

import datetime as dt
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import info, ok
from tests.e2e.conftest import Server
from tests.e2e.helpers import poll
from tests.e2e.nodes import test_seal_store as sealstore
from tests.e2e.nodes.test_seal_store import _new, _objects, _written, seal_store_cluster
from tests.nodenet import NodeHost
from tests.s3server import S3Server

VOLUME_NODES = Path("/var/lib/sbx/volume/nodes")


s3 = sealstore.s3  # the bucket's S3 server (module scope: one per module)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, s3: S3Server) -> Iterator[tuple[Server, list[NodeHost]]]:
    with seal_store_cluster(tmp_path_factory.mktemp("sbx-sealrun"), s3, "rssrv", "sbxrssv", "10.151.0.0/16",
                            SBX_SEAL_STORE_LOST_SECONDS="5", SBX_AUTO_SNAPSHOT_SECONDS="5") as c:
        yield c


def _when(iso: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")) if iso else None


def _events(srv: Server, sid: str) -> list[dict[str, Any]]:
    req = urllib.request.Request(f"{srv.url}/v1/sandboxes/{sid}/events",
                                 headers={"Authorization": f"Bearer {srv.token}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return [json.loads(ln) for ln in resp.read().decode().splitlines() if ln.strip()]


def _lose_host(node: NodeHost, sid: str) -> None:
    """The host of ``node`` is lost: its agent killed -9, the sandbox's container killed, its data deleted."""
    from sbx.runtime.runc import RuncRuntime, remove_tree

    node.kill()
    RuncRuntime(Path("/run/sbx") / node.node_name / "runc", Path("criu")).delete(sid)
    remove_tree(VOLUME_NODES / node.node_name / "sandboxes" / sid)


def test_a_running_sandbox_whose_node_is_lost_comes_back_from_its_newest_stored_seal(
        cluster: tuple[Server, list[NodeHost]], s3: S3Server) -> None:
    srv, nodes = cluster
    sid, home, other = _new(srv, nodes)
    kept = _written(srv, sid, "kept.bin", 3000000)
    written = dt.datetime.now(dt.UTC)

    # a snapshot recorded after the write, then a later one: that one's copy began after the file was synced
    first = poll(lambda: (t := _when(info(srv, sid)["sealStoredAt"])) and t > written and t,
                 "a snapshot made after the write to be in the bucket", 180)
    poll(lambda: (t := _when(info(srv, sid)["sealStoredAt"])) and t > first, "a later snapshot in the bucket", 180)
    assert info(srv, sid)["state"] == "running" and info(srv, sid)["sealStored"] is False  # not a stop's seal
    stored = _objects(s3)
    assert stored and all(k.startswith("seals/acct_") for k in stored), stored

    _lose_host(home, sid)
    try:
        after = poll(lambda: (i := info(srv, sid))["node"] == other.node_name and i["state"] == "running" and i,
                     "the sandbox to run again on the other node", 240)
        assert after["memoryRestored"] is not True, after  # booted from the seal's disk
        assert ok(srv, "exec", sid, "sha256sum ~/kept.bin", timeout=120).split()[0] == kept
        recovered = [e for e in _events(srv, sid) if e.get("event") == "recovered"]
        assert len(recovered) == 1, recovered
        ev = recovered[0]
        assert (ev["from"], ev["to"], ev["reason"], ev["seal"]) == (home.node_name, other.node_name, "node_lost",
                                                                   "snapshot"), ev
        assert ev["snapshot"].startswith(f"auto-{sid}-") and _when(ev["sealedAt"]) > written, ev
        print(f"\n{sid} came back on {ev['to']} from its automatic snapshot {ev['snapshot']} made at "
              f"{ev['sealedAt']}: the seal was {ev['sealAgeSeconds']} s old when node {ev['from']} was declared lost "
              f"({ev['bytes']} bytes from the bucket)")
    finally:
        home.start()

    # it keeps going: snapshots on its new node replace the stored seal, the old seal's objects go
    old = set(stored)
    poll(lambda: _when(info(srv, sid)["sealStoredAt"]) > _when(ev["sealedAt"]), "a snapshot from the new node", 180)
    ok(srv, "delete", sid, "--wait")
    poll(lambda: not set(_objects(s3)) & old, "the deleted sandbox's objects to go", 60)
