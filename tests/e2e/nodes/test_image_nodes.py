"""Images on several nodes (issue 32): one `sbx server` whose configured node is another process (node 6, in a
network namespace of its own, tests/nodenet.py) and a second node (14). The image is built on node 6 through the
node's API (sbx/node/remote/imagelink.py), a sandbox of it is placed there, and `sbx migrate` moves it live to node
14 (its whole disk: node 14 never had the image file) with its processes and memory: the same PID and the same
SHA-256 of 128 MiB held by a process, the image's files and environment. A stop with memory and a resume follow on
node 14."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import cordon, holder, info, node_cluster, ok, start_holder
from tests.e2e.conftest import Server
from tests.nodenet import NodeHost

# sbx's own image as the base: it has every package the sbx layer needs, so the build needs no network (a node in a
# test namespace reaches nothing outside the host)
DOCKERFILE = """\
FROM sbx-debian
COPY hello.txt /opt/app/hello.txt
ENV GREETING=moved
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, list[NodeHost]]]:
    with node_cluster(tmp_path_factory.mktemp("sbx-imgnodes"), [6, 14], "imsrv", "sbximsv", "10.74.0.0/16",
                      SBX_CONSOLIDATE_SECONDS="0") as c:
        yield c


def test_an_image_sandbox_moves_live_to_a_node_without_the_image(cluster: tuple[Server, list[NodeHost]],
                                                                  tmp_path: Path) -> None:
    srv, nodes = cluster
    a, b = nodes
    (tmp_path / "Dockerfile").write_text(DOCKERFILE)
    nonce = secrets.token_hex(4)  # inputs of their own: a cached build from an earlier run would stream no step
    (tmp_path / "hello.txt").write_text(f"hello from node 6 {nonce}\n")
    build = srv.sbx("image", "build", str(tmp_path), "--name", "app", timeout=900)
    assert build.returncode == 0, build.stderr
    assert "STEP 2/3: COPY" in build.stderr  # the remote node's build streamed through the server
    cordon(srv, nodes)
    sid = ok(srv, "new", "--image", "app").strip()
    try:
        assert (info(srv, sid)["node"], info(srv, sid)["image"]) == (a.node_name, "app")
        start_holder(srv, sid)
        before = holder(srv, sid)
        ok(srv, "migrate", sid, "--to", b.node_name, "--wait")
        assert info(srv, sid)["node"] == b.node_name
        assert holder(srv, sid) == before  # same PID, same memory, same open file
        assert ok(srv, "exec", sid, 'cat /opt/app/hello.txt; echo "$GREETING"').split("\n")[:2] == [
            f"hello from node 6 {nonce}", "moved"]
        ok(srv, "stop", sid, "--wait")
        ok(srv, "resume", sid, "--wait")
        assert info(srv, sid)["memoryRestored"] is True and holder(srv, sid) == before
        r = srv.sbx("image", "delete", "app")
        assert r.returncode != 0 and "image_in_use" in r.stderr
    finally:
        ok(srv, "delete", sid, "--wait")
        srv.sbx("image", "delete", "app")
    assert "app" not in ok(srv, "image", "list")
