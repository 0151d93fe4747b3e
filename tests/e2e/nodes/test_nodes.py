"""Several nodes, step 1 (issue 10): `sbx server` driving a node agent (`sbx node serve`) that runs in a network
namespace of its own, reached over a veth pair, so every node call crosses a network (tests/nodenet.py).

- the server creates, execs (exit codes, stdout and stderr apart), copies a file both ways, opens a terminal,
  stops with memory and resumes with the same PID, all through the remote node;
- kill -9 of the node agent: the server stays up and reports ``node_unreachable``; after the agent restarts the
  sandbox is running with its processes;
- the registry: `sbx node list` shows the node's capacity, load and fingerprint; a cordoned node takes no new
  sandbox; a node whose agent is killed is `unreachable` and its sandboxes show it (state kept) until it is back;
- the node API answers only with the node token, and never to a sandbox (from inside a real one).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Server, start_server
from tests.e2e.helpers import poll
from tests.nodenet import NodeHost, node_netns


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, NodeHost]]:
    tmp = tmp_path_factory.mktemp("sbx-nodes")
    with node_netns(1, tmp) as node:
        node.start()
        (tmp / "server").mkdir()
        with start_server(tmp / "server", node="ndsrv", bridge="sbxndsv", subnet="10.94.0.0/16",
                          SBX_NODE_URL=node.url, SBX_NODE_TOKEN=node.token, SBX_NODE_HEARTBEAT_SECONDS="1",
                          SBX_NODE_UNREACHABLE_SECONDS="3") as srv:
            yield srv, node
        assert node.stop() == 0, node.logs()


def ok(srv: Server, *args: str, timeout: float = 300) -> str:
    return srv.sbx(*args, timeout=timeout, check=True).stdout


def _pid(srv: Server, sid: str, pattern: str) -> str:
    return ok(srv, "exec", sid, f"pgrep -f -o '{pattern}'", timeout=60).strip()


def test_a_server_drives_a_node_in_another_namespace(remote: tuple[Server, NodeHost], tmp_path: Path) -> None:
    srv, node = remote
    sid = ok(srv, "new", "--type", "small").strip()
    # the sandbox runs on the node: its veth is in the node's namespace, not on this host
    veth = "v" + sid[3:]
    assert veth in os.popen(f"ip -n {node.netns} -br link").read()
    assert veth not in os.popen("ip -br link").read()

    r = srv.sbx("exec", sid, "echo out; echo err >&2; exit 7", timeout=60)
    assert (r.returncode, r.stdout, r.stderr.strip().splitlines()[-1]) == (7, "out\n", "err")
    assert srv.sbx("exec", sid, "no-such-command", timeout=60).returncode == 127
    r = srv.sbx("exec", sid, "sleep 30", "--timeout", "1", timeout=60)
    assert r.returncode == 124

    # files both ways, 5 MiB of random bytes
    src = tmp_path / "blob"
    src.write_bytes(os.urandom(5 << 20))
    ok(srv, "cp", str(src), f"{sid}:blob")
    assert ok(srv, "exec", sid, "sha256sum blob", timeout=60).split()[0] == hashlib.sha256(src.read_bytes()).hexdigest()
    back = tmp_path / "back"
    ok(srv, "cp", f"{sid}:blob", str(back))
    assert back.read_bytes() == src.read_bytes()
    # a terminal (pty over the node's WebSocket)
    hostname = ok(srv, "exec", sid, "hostname", timeout=60).strip()
    assert ok(srv, "ssh", sid, "--", "hostname", timeout=60).strip() == hostname

    # stop with memory, resume: the same process
    ok(srv, "exec", sid, "--detach", "sleep 424242", timeout=60)
    pid = _pid(srv, sid, "sleep 424242")
    ok(srv, "stop", sid, "--wait")
    info = json.loads(ok(srv, "info", sid, "--json"))["sandbox"]
    assert info["state"] == "stopped" and info["memorySaved"] is True
    ok(srv, "resume", sid, "--wait")
    info = json.loads(ok(srv, "info", sid, "--json"))["sandbox"]
    assert info["memoryRestored"] is True, info
    assert _pid(srv, sid, "sleep 424242") == pid
    assert ok(srv, "exec", sid, "sha256sum blob", timeout=60).split()[0] == hashlib.sha256(src.read_bytes()).hexdigest()
    ok(srv, "delete", sid, "--wait")
    assert not (Path("/var/lib/sbx/volume/nodes") / node.node_name / "sandboxes" / sid).exists()


def test_kill9_of_the_node_agent_keeps_the_server_and_the_sandbox(remote: tuple[Server, NodeHost]) -> None:
    srv, node = remote
    sid = ok(srv, "new", "--type", "small").strip()
    ok(srv, "exec", sid, "--detach", "sleep 434343", timeout=60)
    pid = _pid(srv, sid, "sleep 434343")

    node.kill()
    with urllib.request.urlopen(srv.url + "/healthz", timeout=10) as resp:
        assert resp.status == 200
    r = srv.sbx("exec", sid, "true", timeout=60)
    assert r.returncode != 0 and "node_unreachable" in r.stderr, r.stderr
    assert json.loads(ok(srv, "info", sid, "--json"))["sandbox"]["state"] == "running"

    node.start()
    assert _pid(srv, sid, "sleep 434343") == pid
    assert ok(srv, "exec", sid, "echo back", timeout=60).strip() == "back"
    ok(srv, "stop", sid, "--wait")
    ok(srv, "resume", sid, "--wait")
    assert _pid(srv, sid, "sleep 434343") == pid
    ok(srv, "delete", sid, "--wait")


def _nodes(srv: Server) -> list[dict]:  # type: ignore[type-arg]
    return json.loads(ok(srv, "node", "list", "--json"))["nodes"]  # type: ignore[no-any-return]


def _sandbox(srv: Server, sid: str) -> dict:  # type: ignore[type-arg]
    return json.loads(ok(srv, "info", sid, "--json"))["sandbox"]  # type: ignore[no-any-return]


def test_node_list_cordon_and_unreachable(remote: tuple[Server, NodeHost]) -> None:
    srv, node = remote
    nodes = _nodes(srv)
    assert [n["name"] for n in nodes] == [node.node_name]
    n = nodes[0]
    assert (n["status"], n["url"], n["cordoned"]) == ("ready", node.url, False)
    assert n["capacity"]["memoryMiB"] > 1024 and n["capacity"]["vcpus"] == os.cpu_count()
    assert n["capacity"]["diskFreeBytes"] > 0 and n["lastSeen"]
    assert n["fingerprint"]["kernel"] == platform.release() and n["fingerprint"]["criu"]
    table = ok(srv, "node", "list")
    assert table.splitlines()[0].split()[:3] == ["NAME", "STATUS", "SANDBOXES"]
    assert table.splitlines()[1].split()[:2] == [node.node_name, "ready"]

    sid = ok(srv, "new", "--type", "small").strip()
    sb = _sandbox(srv, sid)
    assert (sb["node"], sb["nodeStatus"]) == (node.node_name, "ready")

    # cordoned: no new sandbox, the old one runs on
    assert ok(srv, "node", "cordon", node.node_name).strip() == f"cordoned {node.node_name}"
    assert _nodes(srv)[0]["status"] == "cordoned"
    r = srv.sbx("new", "--type", "small", timeout=60)
    assert r.returncode == 1 and "insufficient_capacity" in r.stderr and "cordoned" in r.stderr, r.stderr
    assert [s["id"] for s in srv.api("GET", "/v1/sandboxes")["sandboxes"]] == [sid]
    assert ok(srv, "exec", sid, "echo still", timeout=60).strip() == "still"
    assert _sandbox(srv, sid)["nodeStatus"] == "cordoned"
    ok(srv, "node", "uncordon", node.node_name)
    other = ok(srv, "new", "--type", "small").strip()
    ok(srv, "delete", other, "--wait")
    r = srv.sbx("node", "cordon", "no-such-node", timeout=60)
    assert r.returncode == 1 and "not_found" in r.stderr

    # unreachable: the agent is killed; the sandbox keeps its state and shows its node's status
    node.kill()
    poll(lambda: _nodes(srv)[0]["status"] == "unreachable", "the node to be unreachable", timeout=30)
    sb = _sandbox(srv, sid)
    assert (sb["state"], sb["nodeStatus"]) == ("running", "unreachable")
    assert "unreachable" in ok(srv, "node", "list")
    node.start()
    poll(lambda: _sandbox(srv, sid)["nodeStatus"] == "ready", "the node to be back", timeout=30)
    assert _nodes(srv)[0]["status"] == "ready"
    assert ok(srv, "exec", sid, "echo back", timeout=60).strip() == "back"
    ok(srv, "delete", sid, "--wait")


def _node_get(node: NodeHost, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    req = urllib.request.Request(node.url + "/v1/node/health", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10, context=node.client_context()) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_the_node_api_needs_the_node_token(remote: tuple[Server, NodeHost]) -> None:
    _srv, node = remote
    assert _node_get(node, node.token) == 200
    assert _node_get(node, None) == 401
    assert _node_get(node, "sbxn_wrong") == 401
    assert _node_get(node, node.token + "x") == 401
    body = json.dumps({"args": ["sb_aaaaaaaaaa"], "kwargs": {}}).encode()
    req = urllib.request.Request(node.url + "/v1/node/call/delete", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10, context=node.client_context())
    assert e.value.code == 401


def test_a_sandbox_cannot_reach_the_node_api(remote: tuple[Server, NodeHost]) -> None:
    srv, node = remote
    sid = ok(srv, "new", "--type", "small").strip()
    # from this host the node answers (so a refusal below is the policy, not a dead port)
    assert _node_get(node, node.token) == 200
    probe = "timeout 3 bash -c 'exec 3<>/dev/tcp/{ip}/{port}' && echo open || echo closed"
    out = ok(srv, "exec", sid, probe.format(ip=node.node_ip, port=7700), timeout=60).strip()
    assert out == "closed", "the node API is reachable from a sandbox"
    # nor its port relay (node port + 1), which from this host answers only with the node token
    assert _relay_hello(node, "wrong-token", sid, 22) == b"ERR unauthorized missing or wrong node token\n"
    assert _relay_hello(node, node.token, sid, 22) == b"OK\n"
    out = ok(srv, "exec", sid, probe.format(ip=node.node_ip, port=7701), timeout=60).strip()
    assert out == "closed", "the node's port relay is reachable from a sandbox"
    ok(srv, "delete", sid, "--wait")


def _relay_hello(node: NodeHost, token: str, sid: str, port: int) -> bytes:
    import socket

    with socket.create_connection((node.node_ip, 7701), timeout=10) as raw:
        ctx = node.client_context()
        s = ctx.wrap_socket(raw, server_hostname=node.node_ip) if ctx is not None else raw
        s.sendall(f"SBXRELAY {token} {sid} {port}\n".encode())
        return s.makefile("rb").readline()
