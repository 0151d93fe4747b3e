"""Several nodes, placement and resume on another node (issue 10, items 4 and 5): one `sbx server` driving three
node agents, each in a network namespace of its own (tests/nodenet.py): node 1 is the server's configured node
(SBX_NODE_URL), nodes 2 and 3 are added with `sbx node add URL --token T`; node 3 fakes another CPU
(SBX_TEST_FAKE_FINGERPRINT), so memory images of nodes 1 and 2 don't match it.

- new sandboxes spread over the nodes; exec and a hosted port (through the node's port relay) work on each; a
  fork stays on its source's node;
- node 1 cordoned: a sandbox stopped there with a Python process holding 128 MiB of random bytes resumes on node 2
  with the same PID, the same SHA-256 of that memory and its files (disk delta and memory image streamed
  node -> server -> node);
- only the faked-mismatch node free: `cpu_mismatch` and a cold boot with the files kept;
- `--require-memory` with only the mismatching node free waits, and succeeds on node 2 once it is uncordoned.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.e2e.conftest import SBX, Server, start_server
from tests.e2e.helpers import poll
from tests.nodenet import NodeHost, node_netns_many

HOG = r"""
import hashlib, os, signal, time
blob = os.urandom(128 << 20)
def report(*_):
    with open('/home/user/memsha.tmp', 'w') as f:
        f.write(hashlib.sha256(blob).hexdigest())
    os.replace('/home/user/memsha.tmp', '/home/user/memsha')
signal.signal(signal.SIGUSR1, report)
report()
while True:
    time.sleep(1)
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, list[NodeHost]]]:
    tmp = tmp_path_factory.mktemp("sbx-placement")
    with ExitStack() as stack:
        nodes = stack.enter_context(node_netns_many([1, 2, 3], tmp))
        nodes[2].extra_env["SBX_TEST_FAKE_FINGERPRINT"] = "other-cpu"
        for n in nodes:
            n.start()
        (tmp / "server").mkdir()
        srv = stack.enter_context(start_server(
            tmp / "server", node="plsrv", bridge="sbxplsv", subnet="10.95.0.0/16", SBX_NODE_URL=nodes[0].url,
            SBX_NODE_TOKEN=nodes[0].token, SBX_NODE_HEARTBEAT_SECONDS="1", SBX_NODE_UNREACHABLE_SECONDS="5"))
        for n in nodes[1:]:
            added = json.loads(ok(srv, "node", "add", n.url, "--token", n.token, "--json"))["node"]
            assert (added["name"], added["status"]) == (n.node_name, "ready")
        yield srv, nodes
        for n in nodes:
            ok(srv, "node", "uncordon", n.node_name)


def ok(srv: Server, *args: str, timeout: float = 300) -> str:
    return srv.sbx(*args, timeout=timeout, check=True).stdout


def _info(srv: Server, sid: str) -> dict:  # type: ignore[type-arg]
    return json.loads(ok(srv, "info", sid, "--json"))["sandbox"]  # type: ignore[no-any-return]


def _cordon(srv: Server, nodes: list[NodeHost], *ks: int) -> None:
    """Cordon exactly nodes ``ks`` (1-based), uncordon the others."""
    for n in nodes:
        ok(srv, "node", "cordon" if n.k in ks else "uncordon", n.node_name)


def _proxied(srv: Server, host: str, token: str) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{srv.proxy_port}/", headers={"Host": host, "X-Sbx-Token": token})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _pid(srv: Server, sid: str, pattern: str) -> str:
    return ok(srv, "exec", sid, f"pgrep -f -o '{pattern}'", timeout=60).strip()


def _memsha(srv: Server, sid: str, pid: str) -> str:
    ok(srv, "exec", sid, f"rm -f ~/memsha; kill -USR1 {pid}; for i in $(seq 100); do [ -s ~/memsha ] && exit 0; "
                         "sleep 0.1; done; exit 1", timeout=60)
    return ok(srv, "exec", sid, "cat ~/memsha", timeout=60).strip()


def _with_hog_and_files(srv: Server, sid: str, tmp: Path) -> tuple[str, str, str]:
    """Start the 128 MiB process and write a 5 MiB file; (pid, memory sha, file sha)."""
    ok(srv, "exec", sid, f"cat > ~/hog.py <<'EOF'\n{HOG}\nEOF")
    ok(srv, "exec", sid, "--detach", "python3 ~/hog.py")
    poll(lambda: srv.sbx("exec", sid, "test -s ~/memsha", timeout=60).returncode == 0, "the hog's first hash", 120)
    pid = _pid(srv, sid, "python3 /home/user/hog.py")
    blob = tmp / f"blob-{sid}"
    blob.write_bytes(os.urandom(5 << 20))
    ok(srv, "cp", str(blob), f"{sid}:blob")
    return pid, _memsha(srv, sid, pid), hashlib.sha256(blob.read_bytes()).hexdigest()


def _file_sha(srv: Server, sid: str) -> str:
    return ok(srv, "exec", sid, "sha256sum blob", timeout=60).split()[0]


def test_sandboxes_spread_exec_ports_and_forks_on_every_node(cluster: tuple[Server, list[NodeHost]]) -> None:
    srv, nodes = cluster
    _cordon(srv, nodes)
    sids = [ok(srv, "new", "--type", "small").strip() for _ in range(3)]
    placed = {sid: _info(srv, sid)["node"] for sid in sids}
    assert sorted(placed.values()) == sorted(n.node_name for n in nodes), placed
    listed = {s["id"]: s["node"] for s in json.loads(ok(srv, "list", "--json"))["sandboxes"]}
    assert all(listed[sid] == placed[sid] for sid in sids)
    by_name = {n.node_name: n for n in nodes}
    for sid in sids:
        node = by_name[placed[sid]]
        # it runs on that node: its veth is in that node's namespace
        assert ("v" + sid[3:]) in os.popen(f"ip -n {node.netns} -br link").read()
        r = srv.sbx("exec", sid, "echo out; echo err >&2; exit 3", timeout=60)
        assert (r.returncode, r.stdout) == (3, "out\n")
        ok(srv, "exec", sid, f"mkdir -p ~/site && echo hello-from-{sid} > ~/site/index.html")
        ok(srv, "exec", sid, "--detach", "cd ~/site && python3 -m http.server 8000")
        ok(srv, "exec", sid, "for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/8000) 2>/dev/null && exit 0; "
                             "sleep 0.2; done; exit 1")
        route = json.loads(ok(srv, "host", sid, "8000", "--json"))["route"]
        assert _proxied(srv, route["host"], route["token"]) == (200, f"hello-from-{sid}\n".encode())
        assert _proxied(srv, route["host"], "wrong")[0] == 401
    # a fork stays on its source's node
    src = next(sid for sid in sids if placed[sid] == nodes[1].node_name)
    fork = ok(srv, "fork", src, "--wait").strip().splitlines()[-1].split()[0]
    assert _info(srv, fork)["node"] == nodes[1].node_name
    assert ok(srv, "exec", fork, "cat ~/site/index.html", timeout=60).strip() == f"hello-from-{src}"
    for sid in [*sids, fork]:
        ok(srv, "delete", sid, "--wait")


def test_a_sandbox_stopped_on_a_cordoned_node_resumes_on_another_with_its_memory(
        cluster: tuple[Server, list[NodeHost]], tmp_path: Path) -> None:
    srv, nodes = cluster
    _cordon(srv, nodes, 2, 3)
    sid = ok(srv, "new", "--type", "small").strip()
    assert _info(srv, sid)["node"] == nodes[0].node_name
    pid, mem_sha, file_sha = _with_hog_and_files(srv, sid, tmp_path)
    before = _info(srv, sid)
    ok(srv, "stop", sid, "--wait")
    assert _info(srv, sid)["memorySaved"] is True
    _cordon(srv, nodes, 1, 3)
    ok(srv, "resume", sid, "--wait")
    after = _info(srv, sid)
    assert (after["state"], after["node"], after["memoryRestored"]) == ("running", nodes[1].node_name, True), after
    assert (after["id"], after["name"], after["url"], after["subdomain"]) == (
        before["id"], before["name"], before["url"], before["subdomain"])
    assert _pid(srv, sid, "python3 /home/user/hog.py") == pid
    assert _memsha(srv, sid, pid) == mem_sha
    assert _file_sha(srv, sid) == file_sha
    # it left node 1: nothing of it stays there; it now lives on node 2's bridge
    assert ("v" + sid[3:]) in os.popen(f"ip -n {nodes[1].netns} -br link").read()
    assert ("v" + sid[3:]) not in os.popen(f"ip -n {nodes[0].netns} -br link").read()
    assert not (Path("/var/lib/sbx/volume/nodes") / nodes[0].node_name / "sandboxes" / sid).exists()
    addr = ok(srv, "exec", sid, "ip -4 -br addr show eth0", timeout=60).split()[2]
    assert ipaddress.ip_interface(addr).ip in ipaddress.ip_network(nodes[1].subnet), addr
    ok(srv, "delete", sid, "--wait")


def test_a_mismatching_node_boots_from_disk_with_cpu_mismatch(
        cluster: tuple[Server, list[NodeHost]], tmp_path: Path) -> None:
    srv, nodes = cluster
    _cordon(srv, nodes, 2, 3)
    sid = ok(srv, "new", "--type", "small").strip()
    pid, _mem, file_sha = _with_hog_and_files(srv, sid, tmp_path)
    ok(srv, "stop", sid, "--wait")
    _cordon(srv, nodes, 1, 2)
    ok(srv, "resume", sid, "--wait")
    after = _info(srv, sid)
    assert (after["node"], after["memoryRestored"], after["resumeReason"]) == (
        nodes[2].node_name, False, "cpu_mismatch"), after
    assert _file_sha(srv, sid) == file_sha
    assert srv.sbx("exec", sid, "pgrep -f 'python3 /home/user/hog.py'", timeout=60).returncode == 1  # cold boot
    ok(srv, "delete", sid, "--wait")


def test_require_memory_waits_for_a_matching_node(cluster: tuple[Server, list[NodeHost]], tmp_path: Path) -> None:
    srv, nodes = cluster
    _cordon(srv, nodes, 2, 3)
    sid = ok(srv, "new", "--type", "small").strip()
    pid, mem_sha, file_sha = _with_hog_and_files(srv, sid, tmp_path)
    ok(srv, "stop", sid, "--wait")
    _cordon(srv, nodes, 1, 2)  # only node 3 (another CPU) may take it
    waiting = subprocess.Popen([SBX, "resume", sid, "--require-memory", "--wait"], env=srv.env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        poll(lambda: _info(srv, sid)["state"] == "resuming", "the resume to start", 60)
        time.sleep(6)  # several placement rounds with no matching node: it keeps waiting
        assert waiting.poll() is None and _info(srv, sid)["state"] == "resuming"
        ok(srv, "node", "uncordon", nodes[1].node_name)
        _out, err = waiting.communicate(timeout=300)
        assert waiting.returncode == 0, err
    finally:
        if waiting.poll() is None:
            waiting.kill()
    after = _info(srv, sid)
    assert (after["node"], after["memoryRestored"]) == (nodes[1].node_name, True), after
    assert _pid(srv, sid, "python3 /home/user/hog.py") == pid
    assert _memsha(srv, sid, pid) == mem_sha
    assert _file_sha(srv, sid) == file_sha
    ok(srv, "delete", sid, "--wait")
