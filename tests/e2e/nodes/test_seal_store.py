"""Seals in the seal store (issue 34): a server with SBX_SEAL_STORE=s3://... on a real S3 server (moto's server
mode on loopback, tests/s3server.py) and two node agents in their own network namespaces (tests/e2e/cluster.py),
no seal replicas. A stopped sandbox's seal is uploaded; its node agent is killed -9 and the sandbox's data on that
node deleted; it resumes on the other node from the bucket with its files and memory. The S3 server killed during
an upload: nothing is recorded until a later pass uploads the seal whole, which then resumes a sandbox whose node
is gone. Deleting a sandbox deletes its objects."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
import pytest

from tests.e2e.cluster import holder, info, node_cluster, ok, start_holder
from tests.e2e.conftest import Server
from tests.e2e.helpers import poll
from tests.nodenet import NodeHost
from tests.s3server import ACCESS_KEY, REGION, SECRET_KEY, S3Server, s3_server

VOLUME_NODES = Path("/var/lib/sbx/volume/nodes")
BUCKET = "sbx-seals"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server(BUCKET) as srv:
        yield srv


@contextmanager
def seal_store_cluster(tmp: Path, s3: S3Server, node: str, bridge: str, subnet: str,
                       **env: str) -> Iterator[tuple[Server, list[NodeHost]]]:
    """:func:`node_cluster` of nodes 12 and 13 whose server's seal store is ``s3``'s bucket :data:`BUCKET`, a pass
    every second (``env``: more settings)."""
    with node_cluster(tmp, [12, 13], node, bridge, subnet, SBX_SEAL_STORE=f"s3://{BUCKET}/seals",
                      SBX_SEAL_STORE_SECONDS="1", SBX_S3_ENDPOINT=s3.endpoint, SBX_S3_REGION=REGION,
                      SBX_S3_ACCESS_KEY=ACCESS_KEY, SBX_S3_SECRET_KEY=SECRET_KEY, **env) as c:
        yield c


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, s3: S3Server) -> Iterator[tuple[Server, list[NodeHost]]]:
    with seal_store_cluster(tmp_path_factory.mktemp("sbx-sealstore"), s3, "sssrv", "sbxsssv", "10.150.0.0/16") as c:
        yield c


def _client(s3: S3Server) -> Any:
    return boto3.client("s3", endpoint_url=s3.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                        aws_secret_access_key=SECRET_KEY)


def _objects(s3: S3Server) -> dict[str, int]:
    """``{key: size}`` of every seal object in the bucket."""
    pages = _client(s3).get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="seals/")
    return {o["Key"]: o["Size"] for p in pages for o in p.get("Contents", [])}


def _new(srv: Server, nodes: list[NodeHost]) -> tuple[str, NodeHost, NodeHost]:
    """A new sandbox, its node and the other node."""
    sid = ok(srv, "new", "--type", "small").strip()
    home = next(n for n in nodes if n.node_name == info(srv, sid)["node"])
    return sid, home, next(n for n in nodes if n is not home)


def _written(srv: Server, sid: str, name: str, size: int) -> str:
    """Write ``size`` random bytes to ``~/name`` in sandbox ``sid``, synced; their SHA-256."""
    ok(srv, "exec", sid, f"head -c {size} /dev/urandom > ~/{name} && sha256sum ~/{name} > ~/{name}.sha && sync",
       timeout=300)
    return ok(srv, "exec", sid, f"cat ~/{name}.sha").split()[0]


def _lose(node: NodeHost, sid: str) -> None:
    """Kill -9 the node agent and delete the sandbox's data on that node."""
    node.kill()
    shutil.rmtree(VOLUME_NODES / node.node_name / "sandboxes" / sid)


def test_a_stopped_sandbox_resumes_from_the_bucket_when_its_node_is_gone(
        cluster: tuple[Server, list[NodeHost]], s3: S3Server) -> None:
    srv, nodes = cluster
    sid, home, other = _new(srv, nodes)
    start_holder(srv, sid)
    before = holder(srv, sid)
    kept = _written(srv, sid, "kept.bin", 3000000)
    ok(srv, "stop", sid, "--wait")

    poll(lambda: info(srv, sid)["sealStored"], "the seal to be in the bucket", 120)
    stored = _objects(s3)
    assert stored and all(k.startswith("seals/acct_") for k in stored), stored
    assert info(srv, sid)["replicaNode"] is None  # no replica: the bucket is the only copy elsewhere

    _lose(home, sid)
    try:
        poll(lambda: info(srv, sid)["nodeStatus"] == "unreachable", "the node to be unreachable", 60)
        ok(srv, "resume", sid, "--wait")
        after = info(srv, sid)
        assert (after["state"], after["node"], after["memoryRestored"]) == ("running", other.node_name, True), after
        assert holder(srv, sid) == before  # same PID, memory SHA-256, unlinked file's offset and link count
        assert ok(srv, "exec", sid, "sha256sum ~/kept.bin").split()[0] == kept
    finally:
        home.start()

    # deleted, its objects go from the bucket
    ok(srv, "delete", sid, "--wait")
    poll(lambda: not set(_objects(s3)) & set(stored), "the deleted sandbox's objects to go", 60)


def test_a_seal_cut_by_the_s3_server_dying_is_never_half_recorded(
        cluster: tuple[Server, list[NodeHost]], s3: S3Server) -> None:
    srv, nodes = cluster
    sid, home, other = _new(srv, nodes)
    want = _written(srv, sid, "big.bin", 300000000)
    ok(srv, "stop", sid, "--wait")

    # the S3 server dies while a part of the seal is on its way
    client = _client(s3)
    poll(lambda: client.list_multipart_uploads(Bucket=BUCKET).get("Uploads"), "a multipart upload to start", 120,
         0.02)
    s3.kill()
    time.sleep(4)  # four passes of the uploader, each failing
    assert info(srv, sid)["sealStored"] is False
    assert info(srv, sid)["state"] == "stopped"

    # back (empty: moto keeps objects in memory), the next pass uploads the seal whole
    s3.start()
    s3.make_bucket(BUCKET)
    poll(lambda: info(srv, sid)["sealStored"], "the seal to be in the bucket after the retry", 180)

    # and it is whole: with its node gone the sandbox comes back from it
    _lose(home, sid)
    try:
        poll(lambda: info(srv, sid)["nodeStatus"] == "unreachable", "the node to be unreachable", 60)
        ok(srv, "resume", sid, "--wait")
        after = info(srv, sid)
        assert (after["state"], after["node"]) == ("running", other.node_name), after
        assert ok(srv, "exec", sid, "sha256sum ~/big.bin", timeout=120).split()[0] == want
    finally:
        home.start()
    ok(srv, "delete", sid, "--wait")
