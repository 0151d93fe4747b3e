"""The node on real sandboxes (runc, CRIU, reflink disks), below the API: boot, exec, stop with memory, resume,
resize, cpu_mismatch fallback, and a node killed with SIGKILL in the middle of a stop.

Every test here boots real containers as root with the test sizes (small 256 MiB, default 512 MiB).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time

import pytest

from sbx.config import load_settings
from sbx.node.agent import LocalNode
from sbx.node.network.bridge import remove_bridge
from sbx.node.types import NodeError, SandboxSpec
from tests.slots import slotted

pytestmark = pytest.mark.e2e

COUNTER = (
    "python3 -u -c 'import os,time,hashlib;b=bytearray(os.urandom(1<<20))*128;"
    "print(os.getpid(),hashlib.sha256(b).hexdigest(),flush=True);[time.sleep(1) for _ in iter(int,1)]'"
)


def _settings():
    node, bridge, subnet = slotted("e2enode", "sbxn0", "10.91.0.0/16")
    # no warm sandboxes: one still being made when the module's node is dropped would be left running
    return load_settings(profile="test", node_name=node, bridge=bridge, subnet=subnet,
                         require_memory_wait=REQUIRE_MEMORY_WAIT, warm_pool=0)


REQUIRE_MEMORY_WAIT = 4.0


@pytest.fixture(scope="module")
def node():
    n = LocalNode(_settings())
    n.prepare()
    n.reconcile({})
    yield n
    n.reconcile({})
    remove_bridge(n.settings.bridge, n.settings.node_name)


_counter = iter(range(1, 10_000))


@pytest.fixture
def sandbox(node):
    sid = f"sb_node{os.getpid() % 1000:03d}{next(_counter):03d}"
    spec = SandboxSpec(id=sid, hostname=f"node-{sid[3:]}", size=node.settings.size("small"))
    node.create(spec)
    yield spec
    node.delete(sid)


def run(node, sid, cmd, **kw):
    out = {"stdout": b"", "stderr": b""}
    code = None
    for ev in node.exec(sid, cmd, **kw):
        if ev.kind == "exit":
            code = ev.exit_code
        else:
            out[ev.kind] += ev.data
    return out["stdout"].decode(), out["stderr"].decode(), code


def test_boot_exec_identity_and_limits(node, sandbox):
    out, err, code = run(node, sandbox.id, "id -un; pwd; hostname; nproc; free -m | awk '/Mem/{print $2}'; "
                                           "systemctl is-system-running; sudo -n true && echo sudo-ok")
    lines = out.split()
    assert code == 0, err
    assert lines[0] == "user" and lines[1] == "/home/user" and lines[2] == sandbox.hostname
    assert int(lines[3]) == min(2, os.cpu_count() or 1)
    assert int(lines[4]) == 256  # free shows the memory limit (LXCFS), not the host's memory
    assert lines[5] in ("running", "degraded")
    assert lines[6] == "sudo-ok"
    out, _, code = run(node, sandbox.id, "id -u", user="root")
    assert (out.strip(), code) == ("0", 0)


def test_exit_codes_streams_and_oom(node, sandbox):
    assert run(node, sandbox.id, "echo out; echo err >&2; exit 7") == ("out\n", "err\n", 7)
    _, err, code = run(node, sandbox.id, "no-such-command")
    assert code == 127 and "not found" in err
    # The heavy allocation is OOM-killed by the memory cgroup; the shell that ran it lives on.
    out, _, code = run(node, sandbox.id, "python3 -c 'b=bytearray(400<<20); b[::4096]=b\"x\"*(len(b)//4096)'; "
                                         "echo rc=$?")
    assert out.strip() == "rc=137" and code == 0
    out, _, code = run(node, sandbox.id, "python3 -c 'b=bytearray(400<<20); b[::4096]=b\"x\"*(len(b)//4096)'")
    assert code == 137
    assert node.stats(sandbox.id).oom_kills >= 2
    assert node.status(sandbox.id) == "running"


def test_timeout_kills_the_process_group(node, sandbox):
    out, _, code = run(node, sandbox.id, "sleep 300 & sleep 301; echo never", timeout=1.0)
    assert code == 124 and "never" not in out
    out, _, _ = run(node, sandbox.id, "pgrep -a sleep || echo no-sleep")
    assert out.strip() == "no-sleep"


def test_stop_resume_keeps_pid_and_memory(node, sandbox):
    job = node.exec_detached(sandbox.id, COUNTER)
    deadline = time.monotonic() + 20
    while not node.job_output(sandbox.id, job.id, "stdout") and time.monotonic() < deadline:
        time.sleep(0.2)
    pid, digest = node.job_output(sandbox.id, job.id, "stdout").decode().split()
    run(node, sandbox.id, "echo kept > ~/home-file; echo tmp > /tmp/tmp-file")
    assert node.stop(sandbox.id).memory_saved is True
    assert node.status(sandbox.id) == "checkpointed"
    result = node.resume(sandbox.id, sandbox)
    assert result.memory_restored is True and result.reason is None
    out, _, _ = run(node, sandbox.id, f"cat /proc/{pid}/cmdline | tr '\\0' ' '; echo; cat ~/home-file /tmp/tmp-file")
    assert "python3" in out and out.split("\n")[1:3] == ["kept", "tmp"]
    # The same process, with the same buffer: ask it nothing, just check its output and that it is the job.
    jobs = node.jobs(sandbox.id)
    assert [j.id for j in jobs] == [job.id] and jobs[0].running
    assert node.job_output(sandbox.id, job.id, "stdout").decode().split() == [pid, digest]


ECHO_SERVER = (
    "python3 -c 'import socket,threading\ns=socket.create_server((\"\",8001))\n"
    "def h(c):\n  while (d:=c.recv(100)):\n    c.sendall(d)\n"
    "while True:\n  c,_=s.accept(); threading.Thread(target=h,args=(c,)).start()'"
)


def test_stop_with_an_open_tcp_connection_keeps_memory(node, sandbox):
    import socket

    node.exec_detached(sandbox.id, ECHO_SERVER)
    ip = node.address(sandbox.id)
    deadline = time.monotonic() + 20
    while True:
        try:
            conn = socket.create_connection((ip, 8001), timeout=2)
            break
        except OSError:
            assert time.monotonic() < deadline, "echo server did not come up"
            time.sleep(0.2)
    conn.sendall(b"ping")
    assert conn.recv(10) == b"ping"
    assert node.stop(sandbox.id).memory_saved is True  # the established connection does not block the checkpoint
    assert node.resume(sandbox.id, sandbox).memory_restored is True
    conn.settimeout(5)
    with pytest.raises(OSError):  # the old connection comes back closed (CRIU tcp-close) ...
        conn.sendall(b"again")
        if not conn.recv(10):
            raise ConnectionResetError("closed")
    with socket.create_connection((ip, 8001), timeout=5) as again:  # ... and the listener answers again
        again.sendall(b"new")
        assert again.recv(10) == b"new"


def test_resize_cold_boots_keeps_home_and_grows_disk(node, sandbox):
    unit = "[Service]\\nExecStart=/bin/sleep infinity\\n[Install]\\nWantedBy=multi-user.target\\n"
    run(node, sandbox.id, f"echo kept > ~/home-file; echo gone > /tmp/tmp-file; printf '{unit}'"
                          " | sudo tee /etc/systemd/system/napper.service >/dev/null;"
                          " sudo systemctl enable --now napper")
    before, _, _ = run(node, sandbox.id, "df -m --output=size / | tail -1")
    node.exec_detached(sandbox.id, "sleep 1000")
    node.stop(sandbox.id)
    bigger = SandboxSpec(id=sandbox.id, hostname=sandbox.hostname, size=node.settings.size("default"))
    result = node.resume(sandbox.id, bigger, cold=True)
    assert (result.memory_restored, result.reason) == (False, "resized")
    out, _, _ = run(node, sandbox.id, "cat ~/home-file; ls /tmp | grep -c tmp-file; pgrep -c -x sleep; "
                                      "systemctl is-active napper; df -m --output=size / | tail -1; "
                                      "free -m | awk '/Mem/{print $2}'")
    lines = out.split()
    assert lines[0] == "kept"
    assert lines[1] == "0"  # /tmp is empty of our file
    assert lines[2] == "1"  # only the enabled unit's sleep: the detached one is gone
    assert lines[3] == "active"
    assert int(lines[4]) > int(before.strip())
    assert int(lines[5]) == 512
    with pytest.raises(NodeError) as e:
        node.stop(sandbox.id)
        node.resume(sandbox.id, sandbox)  # back to small: the disk can't shrink
    assert e.value.code == "invalid_resize"


def _fake_other_host(node, sid):
    """Make the memory image say it was made on another CPU; returns a function that undoes it."""
    host_json = node.settings.node_dir / "sandboxes" / sid / "memory" / "host.json"
    original = host_json.read_text()
    recorded = json.loads(original)
    recorded["cpuModel"] = "A CPU from another host"
    host_json.write_text(json.dumps(recorded))
    return lambda: host_json.write_text(original)


def test_cpu_mismatch_falls_back_to_cold_boot(node, sandbox):
    run(node, sandbox.id, "echo kept > ~/home-file")
    node.exec_detached(sandbox.id, "sleep 1000")
    assert node.stop(sandbox.id).memory_saved is True
    _fake_other_host(node, sandbox.id)
    started = time.monotonic()
    with pytest.raises(NodeError) as e:
        node.resume(sandbox.id, sandbox, require_memory=True)
    assert e.value.code == "cpu_mismatch"
    assert "cpuModel" in e.value.message
    assert time.monotonic() - started >= REQUIRE_MEMORY_WAIT, "require_memory gives up before its wait"
    result = node.resume(sandbox.id, sandbox)
    assert (result.memory_restored, result.reason) == (False, "cpu_mismatch")
    out, _, _ = run(node, sandbox.id, "cat ~/home-file; pgrep -c -x sleep || true")
    assert out.split() == ["kept", "0"]


def _started(node, sid: str, name: str) -> str:
    """The in-sandbox PID of process ``name`` started by a detached job, once it runs: ``exec_detached`` answers
    when systemd started the job's unit, before its login shell has exec'd the command (CI saw it empty)."""
    deadline = time.monotonic() + 30
    while not (pid := run(node, sid, f"pgrep -x {name} || true")[0].strip()):
        assert time.monotonic() < deadline, f"{name} never started"
        time.sleep(0.05)
    return pid


def test_require_memory_waits_for_a_matching_host_and_restores(node, sandbox):
    node.exec_detached(sandbox.id, "sleep 1000")
    before = _started(node, sandbox.id, "sleep")
    assert node.stop(sandbox.id).memory_saved is True
    undo = _fake_other_host(node, sandbox.id)
    timer = threading.Timer(1.5, undo)  # a matching host "comes up" while the resume waits
    timer.start()
    try:
        result = node.resume(sandbox.id, sandbox, require_memory=True)
    finally:
        timer.cancel()
    assert result.memory_restored is True
    after, _, _ = run(node, sandbox.id, "pgrep -x sleep")
    assert after.split() == [before]


def _stop_in_child(sid: str) -> None:
    os.setsid()
    LocalNode(_settings()).stop(sid)


@pytest.mark.parametrize("delay", [0.05, 0.25, 0.6])
def test_node_killed_mid_stop_restarts_consistent(node, sandbox, delay):
    run(node, sandbox.id, "echo kept > ~/home-file")
    node.exec_detached(sandbox.id, COUNTER)
    time.sleep(1.0)
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_stop_in_child, args=(sandbox.id,))
    child.start()
    time.sleep(delay)
    os.killpg(child.pid, signal.SIGKILL)  # the node process and its runc/criu children die at once
    child.join()
    fresh = LocalNode(_settings())
    fresh.prepare()
    status = fresh.reconcile({sandbox.id: "stopping"})[sandbox.id]
    print(f"killed after {delay} s: reconciled to {status}")
    assert status in ("running", "checkpointed", "stopped")
    if status != "running":
        result = fresh.resume(sandbox.id, sandbox)
        assert result.memory_restored is (status == "checkpointed")
    out, _, code = run(fresh, sandbox.id, "cat ~/home-file")
    assert (out.strip(), code) == ("kept", 0)


def test_sandboxes_reach_neither_each_other_nor_the_host(node, sandbox):
    import http.server
    import threading

    other = SandboxSpec(id=sandbox.id[:-1] + "z", hostname="node-other", size=node.settings.size("small"))
    node.create(other)
    # A server on the host, on every address (as an API bound to 0.0.0.0 would be).
    host_server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), http.server.SimpleHTTPRequestHandler)
    port = host_server.server_address[1]
    threading.Thread(target=host_server.serve_forever, daemon=True).start()
    try:
        node.exec_detached(other.id, "python3 -m http.server 8000")
        gateway = str(node._lease(sandbox.id).gateway)
        probe = "curl -s -m 3 -o /dev/null -w '%{http_code}' http://{}/ || echo -n blocked"
        deadline = time.monotonic() + 20
        own, _, _ = run(node, other.id, probe.replace("{}", "127.0.0.1:8000"))
        while own != "200" and time.monotonic() < deadline:  # the server in `other` answers at home
            time.sleep(0.3)
            own, _, _ = run(node, other.id, probe.replace("{}", "127.0.0.1:8000"))
        assert own == "200"
        across, _, _ = run(node, sandbox.id, probe.replace("{}", f"{node.address(other.id)}:8000"))
        to_host, _, _ = run(node, sandbox.id, probe.replace("{}", f"{gateway}:{port}"))
        assert across.endswith("blocked") and to_host.endswith("blocked")
    finally:
        host_server.shutdown()
        node.delete(other.id)


def test_a_failed_restore_cold_boots_and_keeps_the_error(node, sandbox):
    run(node, sandbox.id, "echo kept > ~/home-file")
    node.exec_detached(sandbox.id, "sleep 1000")
    assert node.stop(sandbox.id).memory_saved is True
    memory = node.settings.node_dir / "sandboxes" / sandbox.id / "memory"
    for pages in memory.glob("pages-*.img"):  # a damaged memory image (host.json still says it is complete)
        pages.write_bytes(b"\0" * 16)
    result = node.resume(sandbox.id, sandbox)
    assert (result.memory_restored, result.reason) == (False, "restore_failed")
    assert result.error
    out, _, _ = run(node, sandbox.id, "cat ~/home-file; pgrep -c -x sleep || true")
    assert out.split() == ["kept", "0"]
    assert not memory.exists()  # a memory image is used once


UNREAD_PIDFD = r"""
import os, socket, time
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
b.setsockopt(socket.SOL_SOCKET, 76, 1)  # SO_PASSPIDFD: a message carries a pidfd (SCM_PIDFD), as systemd's do
while True:
    a.send(b'ready')
    open('/tmp/unread', 'w').close()  # a message with control data CRIU can't save sits in b's queue
    time.sleep(1.5)
    os.unlink('/tmp/unread')
    b.recv(16)
    time.sleep(30)
"""


UNACCEPTED_CONNECTION = r"""
import os, socket, time
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind('/tmp/listen.sock')
server.listen(1)
client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
client.connect('/tmp/listen.sock')
client.send(b'hello')  # a connection not accepted yet that already wrote: CRIU can't take its bytes
open('/tmp/unread', 'w').close()
time.sleep(1.5)
os.unlink('/tmp/unread')
conn, _ = server.accept()
conn.recv(16)
time.sleep(1000)
"""


def _start_unread(node, sid: str, program: str) -> str:
    """Run ``program`` (one of the above) as a detached job in ``sid`` until its message is in place (it made
    ``/tmp/unread``); returns its in-sandbox PID."""
    run(node, sid, f"cat > ~/unread.py <<'EOF'\n{program}\nEOF")
    node.exec_detached(sid, "exec python3 ~/unread.py")
    deadline = time.monotonic() + 60
    while run(node, sid, "test -e /tmp/unread && echo yes || true")[0].strip() != "yes":
        assert time.monotonic() < deadline, "the guest never sent its message"
        time.sleep(0.05)
    return run(node, sid, "pgrep -f '[u]nread.py'")[0].strip()


@pytest.mark.parametrize("program", [UNREAD_PIDFD, UNACCEPTED_CONNECTION],
                         ids=["control-message", "unaccepted-connection"])
def test_a_stop_that_meets_an_unread_control_message_lets_it_be_read_and_saves_memory(node, sandbox, program):
    """A unix message not yet read when the freezer stops the sandbox can fail CRIU's dump: one with a pidfd
    attached ("Control messages in queue, not supported"; seen in CI right after a boot, from systemd), or a
    connection to a listening socket, not accepted yet, that already wrote ("Non-empty write queue on an in-flight
    socket"; seen in CI right after a detached job started). The stop lets the sandbox run a moment and dumps
    again, so the memory is kept instead of lost."""
    pid = _start_unread(node, sandbox.id, program)
    result = node.stop(sandbox.id)
    assert result.memory_saved is True, result.error
    assert node.resume(sandbox.id, sandbox).memory_restored is True
    assert run(node, sandbox.id, "pgrep -f '[u]nread.py'")[0].strip() == pid


def test_a_fork_with_memory_that_meets_an_unaccepted_connection_dumps_again(node, sandbox):
    """The same passing dump error in a fork with memory: the source runs a moment, its disk is copied and it is
    dumped again, and the fork has the source's process."""
    pid = _start_unread(node, sandbox.id, UNACCEPTED_CONNECTION)
    fork = SandboxSpec(id=sandbox.id[:-1] + "f", hostname="node-fork", size=node.settings.size("small"))
    try:
        node.fork_memory(sandbox.id, fork)
        assert run(node, fork.id, "pgrep -f '[u]nread.py'")[0].strip() == pid
        assert run(node, sandbox.id, "pgrep -f '[u]nread.py'")[0].strip() == pid
    finally:
        node.delete(fork.id)


def test_a_running_node_holds_its_base_image(node):
    """A build of another recipe on this host prunes only images no running node holds (sbx.node.host.image)."""
    import fcntl

    from sbx.node.host.image import IN_USE_SUFFIX

    fd = os.open(node.image.with_suffix(IN_USE_SUFFIX), os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_a_deleted_sandbox_leaves_no_exec_channel_state(node):
    """A migration quiesces the source's exec channel and then deletes that copy: the id must not stay marked
    quiet, or the same sandbox moved back to this node would run every command through `runc exec`."""
    sid = f"sb_node{os.getpid() % 1000:03d}{next(_counter):03d}"
    spec = SandboxSpec(id=sid, hostname=f"node-{sid[3:]}", size=node.settings.size("small"))
    node.create(spec)
    node._quiesce_channel(sid, wait=0.1, why=("moved", "test"))
    node.delete(sid)
    assert sid not in node._channel_quiet and sid not in node._channel_why
