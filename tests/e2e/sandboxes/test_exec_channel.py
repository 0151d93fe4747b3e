"""The exec channel (issue 13 item 3) on real sandboxes through the API: commands run by the sandbox's exec agent
(``sbx-agent``), the channel comes back with a stop/resume with memory, a sandbox whose root stops the agent gets
``runc exec`` instead, and a hostile program on the agent's socket can neither hang nor break the node.

Which way a command went is read from inside: under the agent its parent is ``sbx-agent``; under ``runc exec``
its parent is outside the sandbox's pid namespace, so ``$PPID`` is 0.
"""

from __future__ import annotations

import base64
import threading
import time
from typing import Any

import pytest

from sbx.sdk import Client, Sandbox, SbxError

pytestmark = pytest.mark.e2e

WHO = 'if [ "$PPID" = 0 ]; then echo runc; else cat /proc/$PPID/comm; fi'


@pytest.fixture
def sdk(server: Any) -> Any:
    with Client(url=server.url, token=server.token) as c:
        yield c


def _new(sdk: Client, name: str, type: str = "small") -> Sandbox:
    return Sandbox.create(type=type, name=name, ttl=1800, client=sdk)


def _way(sb: Sandbox) -> str:
    r = sb.exec(WHO)
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


def _detached_root(sb: Sandbox, script: str, marker: str, timeout: float = 60) -> None:
    """Run ``script`` as root in a detached job (started with runc exec, not through the agent) and wait until
    it made ``marker`` (looked for with the files API, which does not use the agent either)."""
    sb.exec_detached(script, user="root")
    deadline = time.monotonic() + timeout
    while not sb.files.exists(marker, user="root"):
        assert time.monotonic() < deadline, f"{marker} never appeared"
        time.sleep(0.2)


def _root(sb: Sandbox, script: str, timeout: float = 60) -> str:
    r = sb.exec(script, user="root", timeout=timeout)
    assert r.exit_code == 0, f"{script}: {r.exit_code} {r.stderr}"
    return r.stdout


def test_exec_goes_through_the_agent_and_behaves_as_runc_exec(sdk: Client) -> None:
    sb = _new(sdk, "chan-basic")
    try:
        assert _way(sb) == "sbx-agent"
        r = sb.exec("echo out; echo err >&2; exit 7")
        assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 7)
        r = sb.exec('id -un; id -Gn; echo "$PWD $HOME $FOO"; ulimit -n', env={"FOO": "bar baz"})
        assert r.stdout.split("\n")[:3] == ["user", "user", "/home/user /home/user bar baz"]
        r = sb.exec("id -u; pwd", user="root", cwd="/tmp")
        assert r.stdout.split() == ["0", "/tmp"]
        # the command lives in the sandbox's own cgroup as under runc exec (memory, OOM kills, CPU count there)
        assert sb.exec("cat /proc/self/cgroup | grep -c ':/$'").stdout.strip() == sb.exec(
            "cat /proc/self/cgroup | wc -l").stdout.strip()
        # ...while the agent, which moves there only for the moment of each spawn, is back in its service's
        agent = _root(sb, "systemctl show -p MainPID --value sbx-agent").strip()
        assert "name=systemd:/system.slice/sbx-agent.service\n" in _root(sb, f"cat /proc/{agent}/cgroup")
        assert sb.exec("cat /proc/self/cgroup | grep -c ':/$'", user="root").stdout.strip() == sb.exec(
            "cat /proc/self/cgroup | wc -l", user="root").stdout.strip()
        # the login shell's PATH as Debian's /etc/profile makes it for each (the image lets bash skip its `id -u`)
        assert sb.exec("echo $PATH").stdout.strip() == "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
        assert sb.exec("echo $PATH", user="root").stdout.strip() == (
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        blob = bytes(range(256)) * 64
        r = sb.exec(f"echo {base64.b64encode(blob).decode()} | base64 -d", binary=True)
        assert r.stdout_bytes == blob
        t0 = time.monotonic()
        r = sb.exec("sleep 300 & sleep 301; echo never", timeout=1)
        assert (r.exit_code, r.timed_out) == (124, True) and "never" not in r.stdout
        assert time.monotonic() - t0 < 10
        assert sb.exec("pgrep -a sleep || echo no-sleep").stdout.strip() == "no-sleep"
    finally:
        sb.delete()


def test_the_channel_survives_stop_and_resume_with_memory(sdk: Client) -> None:
    sb = _new(sdk, "chan-resume")
    try:
        agent = _root(sb, "systemctl show -p MainPID --value sbx-agent").strip()
        assert agent != "0" and _way(sb) == "sbx-agent"
        # a command still running when the stop comes: its connection is closed first (CRIU can't dump a
        # connection to the host), so the memory is kept
        errors: list[str] = []

        def long_exec() -> None:
            try:
                sb.exec("sleep 120", timeout=200)
            except SbxError as e:
                errors.append(e.code)

        t = threading.Thread(target=long_exec)
        t.start()
        time.sleep(1.0)
        sb.stop(wait=True)
        t.join(30)
        assert not t.is_alive()
        sb.resume(wait=True)
        assert sb.data["memoryRestored"] is True
        assert _root(sb, "systemctl show -p MainPID --value sbx-agent").strip() == agent  # the same process
        assert _way(sb) == "sbx-agent"
        assert sb.exec("pgrep -x sleep || echo none").stdout.strip() == "none"
    finally:
        sb.delete()


def test_a_sandbox_whose_root_stops_the_agent_gets_runc_exec(sdk: Client) -> None:
    sb = _new(sdk, "chan-killed")
    try:
        assert _way(sb) == "sbx-agent"
        # masked so systemd does not start it again; the socket file stays, nobody listens on it. Done from a
        # detached job (a command run by the agent would lose its own stream when the agent dies).
        _detached_root(sb, "systemctl mask --runtime sbx-agent; "
                           "kill -9 $(systemctl show -p MainPID --value sbx-agent); touch /run/agent-killed",
                       "/run/agent-killed")
        r = sb.exec(f"{WHO}; echo err >&2; exit 3")
        assert (r.stdout.strip(), r.stderr, r.exit_code) == ("runc", "err\n", 3)
        _root(sb, "rm -f /run/sbx-agent/agent.sock")
        assert _way(sb) == "runc"
        r = sb.exec("id -un; pwd", env={"A": "1"})
        assert r.stdout.split() == ["user", "/home/user"]
        r = sb.exec("sleep 30", timeout=1)
        assert (r.exit_code, r.timed_out) == (124, True)
    finally:
        sb.delete()


HOSTILE = r"""
import os, socket, struct, sys, time
mode = sys.argv[1]
path = "/run/sbx-agent/agent.sock"
os.makedirs("/run/sbx-agent", exist_ok=True)
if mode == "symlink":  # the socket's path leads out of the sandbox: the node must not follow it
    try: os.unlink(path)
    except FileNotFoundError: pass
    os.symlink("/run/sbx/hostile-target.sock", path)
    open("/run/hostile-ready", "w").close()
    time.sleep(1e6)
try: os.unlink(path)
except FileNotFoundError: pass
s = socket.socket(socket.AF_UNIX); s.bind(path); s.listen(8)
open("/run/hostile-ready", "w").close()
hello = b"H" + struct.pack(">I", 11) + b"sbx-agent 1"
conns = []
while True:
    c, _ = s.accept(); conns.append(c)
    if mode == "silent":
        continue  # never greets
    c.sendall(hello)
    c.recv(1 << 20)
    if mode == "huge":  # starts, then announces a 4 GiB frame and sends garbage
        c.sendall(b"S" + struct.pack(">I", 0))
        time.sleep(0.5)  # the node has taken the start; what comes now arrives mid-command
        c.sendall(b"o" + struct.pack(">I", 0xFFFFFFFF) + os.urandom(4096))
    elif mode == "deaf":  # starts, prints, then ignores the kill and never reports an end
        c.sendall(b"S" + struct.pack(">I", 0) + b"o" + struct.pack(">I", 3) + b"hi\n")
"""


def _hostile(sb: Sandbox, mode: str) -> None:
    sb.files.write("/root/hostile.py", HOSTILE.encode(), user="root")
    _detached_root(sb, "systemctl mask --runtime --now sbx-agent; "
                       f"systemd-run --quiet --unit=hostile-{mode} python3 /root/hostile.py {mode}",
                   "/run/hostile-ready")


@pytest.mark.parametrize("mode", ["silent", "huge", "deaf", "symlink"])
def test_a_hostile_agent_cannot_hang_or_break_the_node(server: Any, sdk: Client, mode: str) -> None:
    sb = _new(sdk, f"chan-hostile-{mode}")
    other = _new(sdk, f"chan-bystander-{mode}")
    try:
        _hostile(sb, mode)
        t0 = time.monotonic()
        if mode == "huge":  # the answer is refused mid-command: a clear error, quickly
            with pytest.raises(SbxError) as e:
                sb.exec("echo hi", timeout=30)
            assert e.value.code == "exec_failed" and "misbehaved" in e.value.message
        elif mode == "deaf":  # the timeout still ends it: exit 124 after the kill grace
            r = sb.exec("sleep 100", timeout=2)
            assert (r.exit_code, r.timed_out, r.stdout) == (124, True, "hi\n")
        else:  # no greeting / a path out of the sandbox: runc exec runs it
            r = sb.exec(f"{WHO}; exit 4")
            assert (r.stdout.strip(), r.exit_code) == ("runc", 4)
        assert time.monotonic() - t0 < 15
        # the node is fine: this sandbox gets runc exec from now on, the bystander keeps its agent
        r = sb.exec(f"{WHO}; echo ok")
        assert r.stdout.split() == ["runc", "ok"]
        assert _way(other) == "sbx-agent"
        assert server.api("GET", "/healthz") is not None
    finally:
        sb.delete()
        other.delete()
