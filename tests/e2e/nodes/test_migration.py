"""Live migration at the node level (issue 11): two node agents (`sbx node serve`), each in a network namespace of
its own (tests/nodenet.py, nodes 4 and 5), driven from the test through their node API (RemoteNode clients).

- A sandbox running a Python process that holds 128 MiB of random bytes, an unlinked 8 MiB file (over CRIU's
  default ghost limit) open at a known offset
  and a file it keeps appending to is moved A→B while it runs: afterwards on B the same PID, the same SHA-256 of
  the memory, the same offset of the unlinked file, its files (also what it wrote during the pre-copy), exec
  works, a listener answers on B's address; an established TCP connection from A's network is reset at once
  (never a silent hang), and nothing is left of it on A.
- A move whose destination agent is killed with -9 halfway (everything sent, before the restore) fails with
  ``migration_failed``, the sandbox runs on A with its processes and memory, and B's restarted agent removes the
  half-made arrival.
"""

from __future__ import annotations

import secrets
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbx import tls
from sbx.config import TEST_SIZES
from sbx.node.migration.live import migrate
from sbx.node.remote.client import RemoteNode
from sbx.node.types import NodeError, SandboxSpec
from tests.e2e.helpers import poll
from tests.nodenet import NodeHost, exec_out, node_netns_many, run_ca

VOLUME_NODES = Path("/var/lib/sbx/volume/nodes")

HOLDER = r"""
import hashlib, os, signal, sys, time
data = bytearray(os.urandom(128 << 20))
f = open('/root/unlinked', 'w+b')
f.write(os.urandom(8 << 20))  # 8 MiB: over CRIU's default ghost limit (1 MiB)
f.seek(12345)
os.unlink('/root/unlinked')
ghost = hashlib.sha256(os.pread(f.fileno(), 8 << 20, 0)).hexdigest()
ticks = open('/root/ticks', 'a')
def report(*_a):
    st = os.fstat(f.fileno())
    with open('/root/holder.check.tmp', 'w') as out:
        out.write(f"{os.getpid()} {hashlib.sha256(data).hexdigest()} {f.tell()} {st.st_nlink} {ghost}\n")
    os.replace('/root/holder.check.tmp', '/root/holder.check')
signal.signal(signal.SIGUSR1, report)
open('/root/holder.pid', 'w').write(f"{os.getpid()}\n")
report()
i = 0
while True:
    ticks.write(f"{i}\n"); ticks.flush(); os.fsync(ticks.fileno())
    i += 1
    time.sleep(0.05)
"""

SERVER = r"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', 7070)); s.listen(8)
conns = []
while True:
    c, _ = s.accept(); c.sendall(b'hello\n'); conns.append(c)
"""

# A client in A's network namespace: connects, reads the greeting, then waits for the next byte and says how the
# wait ended (a migration must end it with a reset, not leave it hanging).
CLIENT = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], 7070), timeout=10)
assert c.recv(6) == b'hello\n'
print('connected', flush=True)
c.settimeout(900)  # far longer than any move: the test reads the outcome right after the move returns
t0 = time.monotonic()
try:
    got = c.recv(10)
    print('eof' if not got else 'data', flush=True)
except ConnectionResetError:
    print('reset', flush=True)
except TimeoutError:
    print('hang', flush=True)
"""


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeHost, NodeHost]]:
    tmp = tmp_path_factory.mktemp("sbx-migration")
    with node_netns_many([4, 5], tmp) as (a, b):
        a.start()
        b.start()
        yield a, b


def client(h: NodeHost) -> RemoteNode:
    return RemoteNode(h.url, h.token, identity=tls.identity(run_ca()))


def sh(node: RemoteNode, sid: str, command: str) -> str:
    code, out = exec_out(node, sid, command)
    assert code == 0, f"{command!r} exited {code}: {out!r}"
    return out


def holder_check(node: RemoteNode, sid: str) -> list[str]:
    """PID, SHA-256 of the 128 MiB, offset and link count of the unlinked 8 MiB file and the SHA-256 of its content
    (read when it started), as the holder reports them now."""
    sh(node, sid, "rm -f /root/holder.check; kill -USR1 $(cat /root/holder.pid)")
    poll(lambda: sh(node, sid, "cat /root/holder.check 2>/dev/null || true").strip(), "the holder's report")
    return sh(node, sid, "cat /root/holder.check").split()


def new_sandbox(a: NodeHost) -> SandboxSpec:
    spec = SandboxSpec(id="sb_" + secrets.token_hex(5), hostname="mig-" + secrets.token_hex(3),
                       size=TEST_SIZES["default"])
    node = client(a)
    node.create(spec)
    node.exec_detached(spec.id, f"cat > /root/holder.py <<'EOF'\n{HOLDER}\nEOF\nexec python3 /root/holder.py",
                       user="root")
    poll(lambda: sh(node, spec.id, "cat /root/holder.check 2>/dev/null || true").strip(), "the holder to start",
         timeout=120)
    return spec


def sandbox_dir(h: NodeHost, sid: str) -> Path:
    return VOLUME_NODES / h.node_name / "sandboxes" / sid


def test_a_running_sandbox_moves_to_another_node_with_its_processes(nodes: tuple[NodeHost, NodeHost]) -> None:
    a, b = nodes
    src, dst = client(a), client(b)
    spec = new_sandbox(a)
    sid = spec.id
    before = holder_check(src, sid)
    assert before[2:4] == ["12345", "0"]
    sh(src, sid, "head -c 3000000 /dev/urandom > /root/blob; sha256sum /root/blob > /root/blob.sum")
    blob_sum = sh(src, sid, "cat /root/blob.sum")
    hostname = sh(src, sid, "hostname").strip()
    src.exec_detached(sid, f"cat > /root/server.py <<'EOF'\n{SERVER}\nEOF\nexec python3 /root/server.py",
                      user="root")
    addr_a = src.address(sid)
    poll(lambda: sh(src, sid, "ss -Hltn 'sport = :7070'").strip(), "the server to listen")
    peer = subprocess.Popen(["nsenter", f"--net=/run/netns/{a.netns}", "--", sys.executable, "-c", CLIENT, addr_a],
                            stdout=subprocess.PIPE, text=True)
    assert peer.stdout is not None and peer.stdout.readline().strip() == "connected"

    figures = migrate(src, dst, b.url, spec)

    # the peer's connection was reset during the move, not left hanging: its outcome is there once the move
    # returned (a move's first run hashes the base image, which can take a minute on a loaded host, so the client's
    # own wait is not the measure)
    ready, _, _ = select.select([peer.stdout], [], [], 60)
    peer_saw = peer.stdout.readline().strip() if ready else "nothing"
    peer.kill()
    peer.wait(timeout=30)
    assert figures["memoryBytes"] > 128 << 20 and not figures["fullDisk"]
    assert figures["pageServer"], "the pages did not go through the destination's page server"
    assert figures["pageTLS"], "the pages crossed between the nodes outside TLS"
    # same process, same memory, same unlinked file at the same offset
    assert holder_check(dst, sid) == before
    assert sh(dst, sid, "sha256sum /root/blob") == blob_sum
    assert sh(dst, sid, "hostname").strip() == hostname
    # the file the holder appended to during the pre-copy and up to the freeze: every line, none lost, no hole
    ticks = sh(dst, sid, "cat /root/ticks").split("\n")
    assert ticks[-1] == "" and [int(t) for t in ticks[:-1]] == list(range(len(ticks) - 1))
    # it keeps running there
    n = len(ticks)
    poll(lambda: len(sh(dst, sid, "cat /root/ticks").split("\n")) > n + 5, "the holder to go on writing")
    # the listener answers on the address of B's subnet, from B's network
    addr_b = dst.address(sid)
    assert addr_b != addr_a
    hello = subprocess.run(["nsenter", f"--net=/run/netns/{b.netns}", "--", sys.executable, "-c",
                            f"import socket; print(socket.create_connection(('{addr_b}', 7070), 10).recv(6))"],
                           capture_output=True, text=True, timeout=60)
    assert hello.stdout.strip() == "b'hello\\n'", hello.stderr
    # gone from A (its copy there is deleted in the background once B confirmed)
    poll(lambda: not sandbox_dir(a, sid).exists(), "the copy on A to be deleted", timeout=30)
    try:
        gone = str(src.status(sid))
    except NodeError as e:
        gone = e.code
    assert gone in ("absent", "not_found")
    assert dst.status(sid) == "running"
    left_on_b = sh(dst, sid, "ss -t -n -H state established")  # a connection the reset missed, restored closed
    table = "sbx_" + "".join(c if c.isalnum() else "_" for c in a.node_name)
    untracked = subprocess.run(["nsenter", f"--net=/run/netns/{a.netns}", "--", "nft", "list", "counter", "inet",
                                table, "rst_untracked"], capture_output=True, text=True).stdout  # resets let in
    untracked = " ".join(w for w in untracked.split() if w.isdigit()) or untracked.strip()
    dst.delete(sid)
    # The peer got its reset at once (before the bridge kept one MAC, in about half of the full-suite runs it got
    # none: the reset went to the bridge's previous MAC, see sbx.node.network.bridge.bridge_mac).
    assert (peer_saw, figures["resetConnections"] >= 1) == ("reset", True), (
        f"the peer's TCP connection saw {peer_saw!r} after the move, not a reset (sockets destroyed at the freeze: "
        f"{figures['resetSockets']}; established on B after the move: {left_on_b!r}; packets, bytes of resets "
        f"conntrack did not call established on A: {untracked})")


def test_kill9_of_the_destination_halfway_leaves_the_sandbox_running_on_its_source(
        nodes: tuple[NodeHost, NodeHost], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = nodes
    src = client(a)
    spec = new_sandbox(a)
    sid = spec.id
    before = holder_check(src, sid)

    b.stop()
    monkeypatch.setenv("SBX_TEST_HOLD_MIGRATION", "120")
    b.start()
    monkeypatch.delenv("SBX_TEST_HOLD_MIGRATION")
    result: dict[str, object] = {}

    def move() -> None:
        try:
            result["figures"] = migrate(src, client(b), b.url, spec)
        except NodeError as e:
            result["error"] = e

    mover = threading.Thread(target=move)
    mover.start()
    hold = sandbox_dir(b, sid) / "migrate-hold"
    poll(hold.exists, "the destination to hold before its restore", timeout=300, interval=0.1)
    # halfway: everything was sent, the source is frozen, the destination has not restored
    assert src.status(sid) == "running"
    b.kill()
    mover.join(timeout=120)
    assert not mover.is_alive()
    err = result.get("error")
    assert isinstance(err, NodeError) and err.code == "migration_failed", result
    assert "restore" in err.message, err.message

    # the sandbox runs on A with the same process and memory, and goes on
    assert holder_check(src, sid) == before
    n = len(sh(src, sid, "cat /root/ticks").split("\n"))
    time.sleep(1)
    assert len(sh(src, sid, "cat /root/ticks").split("\n")) > n
    assert sh(src, sid, "echo fine").strip() == "fine"

    # B's restarted agent drops the arrival it never confirmed
    b.start()
    assert not sandbox_dir(b, sid).exists()
    assert client(b).status(sid) == "absent"
    src.delete(sid)


def test_a_sandbox_moved_back_at_once_waits_for_its_old_copy_to_go(nodes: tuple[NodeHost, NodeHost]) -> None:
    """A move answers once the destination confirmed, and the source deletes its paused copy afterwards; a move
    straight back to that node waits for that delete instead of answering ``exists``, and the sandbox keeps its
    process and memory through both moves."""
    a, b = nodes
    src, dst = client(a), client(b)
    spec = new_sandbox(a)
    sid = spec.id
    before = holder_check(src, sid)
    there = migrate(src, dst, b.url, spec)
    back = migrate(dst, src, a.url, spec)
    assert there["pauseS"] > 0 and back["pauseS"] > 0
    assert holder_check(src, sid) == before
    poll(lambda: not sandbox_dir(b, sid).exists(), "the copy on B to be deleted", timeout=30)
    assert src.status(sid) == "running"
    src.delete(sid)


def test_a_sandbox_resumed_from_its_memory_image_moves_too(nodes: tuple[NodeHost, NodeHost]) -> None:
    """Stopped with its memory and resumed on its node (a restore of its own dump, not of the template), a
    sandbox still live-migrates with its process and memory (it failed on the destination's restore with CRIU's
    'cgroupd: recv req error: File exists')."""
    a, b = nodes
    src, dst = client(a), client(b)
    spec = new_sandbox(a)
    sid = spec.id
    before = holder_check(src, sid)
    assert src.stop(sid).memory_saved
    assert src.resume(sid, spec).memory_restored
    assert holder_check(src, sid) == before
    migrate(src, dst, b.url, spec)
    assert holder_check(dst, sid) == before
    assert dst.status(sid) == "running"
    dst.delete(sid)


def test_a_sandbox_resumed_from_its_memory_image_forks_with_its_memory(nodes: tuple[NodeHost, NodeHost]) -> None:
    """``fork --memory`` of a sandbox resumed from its own memory image (so in the time namespace CRIU made for
    that restore) restores the fork with the source's process and memory."""
    a, _b = nodes
    src = client(a)
    spec = new_sandbox(a)
    sid = spec.id
    before = holder_check(src, sid)
    assert src.stop(sid).memory_saved
    assert src.resume(sid, spec).memory_restored
    fork = SandboxSpec(id="sb_" + secrets.token_hex(5), hostname="frk-" + secrets.token_hex(3),
                       size=TEST_SIZES["default"])
    src.fork(sid, fork, memory=True)
    assert src.status(fork.id) == "running"
    assert holder_check(src, fork.id) == before  # same PID, memory, unlinked file's offset
    assert holder_check(src, sid) == before
    src.delete(fork.id)
    src.delete(sid)


def test_an_arrival_left_by_an_abandoned_move_is_replaced_by_the_next_move(nodes: tuple[NodeHost, NodeHost]) -> None:
    """A server replica that died between the destination's prepare and the source's migrate_out left an arrival
    on B that nobody feeds; the next move of that sandbox to B replaces it instead of failing with ``exists``
    (seen in CI: a drain taken over by another replica)."""
    a, b = nodes
    src, dst = client(a), client(b)
    spec = new_sandbox(a)
    sid = spec.id
    before = holder_check(src, sid)
    dst.migrate_prepare(spec, src.info().fingerprint)  # the abandoned move's first step
    assert dst.status(sid) == "absent" and sandbox_dir(b, sid).exists()
    there = migrate(src, dst, b.url, spec)
    assert there["pauseS"] > 0 and dst.status(sid) == "running"
    assert holder_check(dst, sid) == before
    dst.delete(sid)
