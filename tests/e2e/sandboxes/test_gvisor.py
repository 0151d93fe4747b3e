"""The gvisor runtime class (issue 33) on real sandboxes through the CLI: ``sbx new --runtime gvisor`` boots the
default image under runsc with sbx's minimal init; inside, the kernel is gVisor's (``/proc/version``, ``dmesg``) and
the host's kernel facts are out of sight; exec passes exit codes and timeouts; files go in and out; a stop keeps the
memory (a process of the init's tree keeps its PID, a tmpfs file its content) and a resume restores it; what runsc
can't do answers 409 ``not_supported`` naming the class.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from sbx.runtime.runsc import RUNSC_PATH

pytestmark = pytest.mark.e2e


def _ok(r: Any) -> str:
    assert r.returncode == 0, f"{r.returncode}\n{r.stdout}\n{r.stderr}"
    return str(r.stdout)


def _info(server: Any, sid: str) -> dict[str, Any]:
    return dict(json.loads(_ok(server.sbx("info", sid, "--json")))["sandbox"])


@pytest.fixture(scope="module")
def gsid(server: Any) -> Any:
    """One running gvisor sandbox for the module (the runsc binary must be installed: ``sbx setup``)."""
    assert RUNSC_PATH.is_file(), f"{RUNSC_PATH} is missing: run `sbx setup`"
    t0 = time.monotonic()
    sb = json.loads(_ok(server.sbx("new", "--runtime", "gvisor", "--name", "gv", "--ttl", "0", "--json")))
    sid = sb["sandbox"]["id"]
    _ok(server.sbx("exec", sid, "true"))
    print(f"gvisor create -> first exec: {time.monotonic() - t0:.2f} s")
    yield sid
    server.sbx("delete", sid, "--wait")


def test_the_sandbox_runs_on_gvisors_kernel(server: Any, gsid: str) -> None:
    info = _info(server, gsid)
    assert info["runtime"] == "gvisor" and info["state"] == "running"
    version = _ok(server.sbx("exec", gsid, "cat /proc/version"))
    host = Path("/proc/version").read_text()
    assert "gVisor" in version or version.strip() != host.strip(), version
    dmesg = _ok(server.sbx("exec", gsid, "-u", "root", "dmesg"))
    assert "gVisor" in dmesg, dmesg
    # the host's kernel command line and block devices are not what the sandbox sees
    cmdline = server.sbx("exec", gsid, "cat /proc/cmdline").stdout
    assert cmdline.strip() != Path("/proc/cmdline").read_text().strip()
    assert "loop" not in server.sbx("exec", gsid, "cat /proc/partitions 2>/dev/null; ls /sys/block 2>/dev/null").stdout
    # root can mount a fresh procfs and sysfs: still gVisor's, no host path or kernel fact in them or in mountinfo
    probe = _ok(server.sbx("exec", gsid, "-u", "root",
                           "mkdir -p /tmp/p /tmp/s && mount -t proc proc /tmp/p && mount -t sysfs sysfs /tmp/s && "
                           "cat /tmp/p/cmdline /tmp/p/self/mountinfo; ls /tmp/s/block /tmp/s/fs 2>&1; "
                           "umount /tmp/p /tmp/s"))
    assert "gvisor" in probe and Path("/proc/cmdline").read_text().strip() not in probe
    assert "/var/lib/sbx" not in probe and "/run/sbx" not in probe and "loop" not in probe, probe
    # PID 1 is sbx's minimal init, not systemd
    assert "tini" in _ok(server.sbx("exec", gsid, "cat /proc/1/cmdline | tr '\\0' ' '"))


def test_exec_codes_users_and_timeout(server: Any, gsid: str) -> None:
    assert server.sbx("exec", gsid, "exit 7").returncode == 7
    assert server.sbx("exec", gsid, "kill -9 $$").returncode == 137
    assert server.sbx("exec", gsid, "no-such-program").returncode == 127
    assert _ok(server.sbx("exec", gsid, "id -un")).strip() == "user"
    assert _ok(server.sbx("exec", gsid, "-u", "root", "id -u")).strip() == "0"
    assert _ok(server.sbx("exec", gsid, "-e", "FOO=bar", "echo $FOO")).strip() == "bar"
    t0 = time.monotonic()
    r = server.sbx("exec", gsid, "--timeout", "2", "sleep 30; echo never")
    assert r.returncode == 124 and "never" not in r.stdout
    assert time.monotonic() - t0 < 20
    # the timed-out command is gone inside too
    assert "sleep 30" not in server.sbx("exec", gsid, "ps -eo args").stdout
    times = []
    for _ in range(5):
        t = time.monotonic()
        _ok(server.sbx("exec", gsid, "true"))
        times.append(time.monotonic() - t)
    print(f"gvisor exec round trip through the CLI: median {sorted(times)[2] * 1000:.0f} ms")


def test_files_in_and_out(server: Any, gsid: str, tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("hello gvisor\n")
    _ok(server.sbx("cp", str(src), f"{gsid}:~/in.txt"))
    assert _ok(server.sbx("exec", gsid, "cat ~/in.txt")) == "hello gvisor\n"
    _ok(server.sbx("exec", gsid, "seq 1 1000 > ~/out.txt"))
    dst = tmp_path / "out.txt"
    _ok(server.sbx("cp", f"{gsid}:~/out.txt", str(dst)))
    assert dst.read_text().splitlines()[-1] == "1000"


def test_stop_keeps_memory_and_resume_restores_it(server: Any, gsid: str) -> None:
    # a process of the init's tree (the exec agent or sshd) and a file on the tmpfs /tmp (memory only)
    pid = _ok(server.sbx("exec", gsid, "pgrep -o sshd || pgrep -o -f sbx-agent")).strip()
    assert pid
    # commands go through the exec agent (by its relay): what they leave running is of the init's tree
    assert "sbx-agent" in _ok(server.sbx("exec", gsid, "tr '\\0' ' ' < /proc/$PPID/cmdline"))
    bg = _ok(server.sbx("exec", gsid, "sleep 100000 >/dev/null 2>&1 & echo $!")).strip()
    _ok(server.sbx("exec", gsid, "head -c 64M /dev/urandom > /tmp/big; sha256sum /tmp/big > ~/big.sum"))
    t0 = time.monotonic()
    _ok(server.sbx("stop", gsid, "--wait"))
    stopped = time.monotonic() - t0
    info = _info(server, gsid)
    assert info["state"] == "stopped" and info["memorySaved"] is True, info
    t0 = time.monotonic()
    _ok(server.sbx("resume", gsid, "--wait"))
    resumed = time.monotonic() - t0
    print(f"gvisor stop {stopped:.2f} s, resume {resumed:.2f} s (64 MiB on tmpfs)")
    info = _info(server, gsid)
    assert info["memoryRestored"] is True, info
    assert _ok(server.sbx("exec", gsid, f"cat /proc/{pid}/cmdline | tr '\\0' ' '")).strip()
    assert "sleep 100000" in _ok(server.sbx("exec", gsid, f"tr '\\0' ' ' < /proc/{bg}/cmdline"))
    _ok(server.sbx("exec", gsid, "sha256sum -c ~/big.sum"))
    # the network came back: the sandbox reaches its gateway's resolver port or at least has its address
    assert _ok(server.sbx("exec", gsid, "ip -4 addr show eth0")).count("inet ") == 1


def test_network_a_hosted_port_and_a_terminal(server: Any, gsid: str) -> None:
    """The sandbox's veth, pins and egress rules are the container class's: the node's proxy reaches a server in it
    on its address; its resolver is the node's; ``sbx ssh`` gives a terminal."""
    import urllib.request

    assert "nameserver" in _ok(server.sbx("exec", gsid, "cat /etc/resolv.conf"))
    # out through the node's resolver and NAT to the host's Debian mirror (the egress policy allows it)
    from urllib.parse import urlsplit

    from sbx.node.host import aptsources

    mirror = aptsources.debian_mirror()
    host = urlsplit(mirror).hostname
    assert _ok(server.sbx("exec", gsid, f"getent hosts {host}")).strip()
    r = server.sbx("exec", gsid, f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 20 {mirror}/dists/", timeout=60)
    assert r.returncode == 0 and r.stdout.strip() in ("200", "301", "302", "403", "404"), r
    _ok(server.sbx("exec", gsid, "mkdir -p ~/site && echo hello-gvisor > ~/site/index.html && cd ~/site && "
                                 "(nohup python3 -m http.server 8000 >/dev/null 2>&1 &) && "
                                 "for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/8000) 2>/dev/null && exit 0; "
                                 "sleep 0.2; done; exit 1"))
    route = json.loads(_ok(server.sbx("host", gsid, "8000", "--json")))["route"]
    req = urllib.request.Request(f"http://127.0.0.1:{server.proxy_port}/index.html",
                                 headers={"Host": route["host"], "X-Sbx-Token": route["token"]})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.read() == b"hello-gvisor\n"
    # a terminal (runsc exec with a process file: the command sees a tty on its stdin, no controlling terminal)
    r = server.sbx("ssh", gsid, "--", "test -t 0 && echo on-a-tty; whoami; exit 7")
    assert r.returncode == 7 and r.stdout.split() == ["on-a-tty", "user"], r
    r = server.sbx("ssh", gsid, "--user", "root", "--", "grep CapEff /proc/self/status")
    assert r.returncode == 0 and "0000000000000000" not in r.stdout, r


def test_what_gvisor_cannot_do_answers_409(server: Any, gsid: str) -> None:
    r = server.sbx("fork", gsid, "--memory", "--json")
    assert r.returncode != 0 and "not_supported" in r.stdout + r.stderr and "gvisor" in r.stdout + r.stderr
    r = server.sbx("exec", gsid, "--detach", "sleep 1")
    assert r.returncode != 0 and "not_supported" in r.stdout + r.stderr and "gvisor" in r.stdout + r.stderr
    r = server.sbx("migrate", gsid, "--json")
    assert r.returncode != 0 and "not_supported" in r.stdout + r.stderr, r.stdout + r.stderr
    # 409 on the wire
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{server.url}/v1/sandboxes/{gsid}/fork", method="POST",
                                 data=json.dumps({"memory": True}).encode(),
                                 headers={"Authorization": f"Bearer {server.token}",
                                          "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 409
    assert json.loads(e.value.read())["error"]["code"] == "not_supported"


def test_a_fork_without_memory_is_of_the_same_class(server: Any, gsid: str) -> None:
    _ok(server.sbx("exec", gsid, "echo from-source > ~/mark"))
    fork = json.loads(_ok(server.sbx("fork", gsid, "--wait", "--json")).splitlines()[-1])
    fid = fork.get("id") or fork["sandbox"]["id"]
    try:
        assert _info(server, fid)["runtime"] == "gvisor"
        assert _ok(server.sbx("exec", fid, "cat ~/mark")).strip() == "from-source"
        assert "gVisor" in _ok(server.sbx("exec", fid, "-u", "root", "dmesg"))
    finally:
        server.sbx("delete", fid, "--wait")


def test_a_bad_runtime_is_refused(server: Any) -> None:
    r = server.sbx("new", "--runtime", "kvm", "--json")
    assert r.returncode != 0
    assert "runtime" in r.stdout + r.stderr


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _measure(sdk: Any, runtime: str) -> dict[str, float]:
    """One class's figures through the SDK: create -> first exec, exec round trip (median of 10), stop and resume
    with 128 MiB touched on /tmp, memory charged to the sandbox's cgroup when idle."""
    from sbx.sdk import Sandbox

    t0 = time.monotonic()
    sb = Sandbox.create(type="small", name=f"measure-{runtime}", ttl=0, client=sdk, runtime=runtime)
    try:
        assert sb.exec("true").exit_code == 0
        create = time.monotonic() - t0
        rtts = []
        for _ in range(10):
            t = time.monotonic()
            assert sb.exec("true").exit_code == 0
            rtts.append(time.monotonic() - t)
        time.sleep(3)
        idle = float(sb.info()["stats"]["memoryUsedMb"])
        r = sb.exec("head -c 128M /dev/zero | tr '\\0' x > /tmp/w; md5sum /tmp/w > ~/w.md5", timeout=120)
        assert r.exit_code == 0, r.stderr
        t = time.monotonic()
        sb.stop()
        stop = time.monotonic() - t
        t = time.monotonic()
        sb.resume()
        resume = time.monotonic() - t
        assert sb.info()["memoryRestored"] is True
        assert sb.exec("md5sum -c ~/w.md5").exit_code == 0
        return {"create_s": create, "exec_ms": _median(rtts) * 1000, "idle_mb": idle, "stop_s": stop,
                "resume_s": resume}
    finally:
        sb.delete()


def test_both_classes_side_by_side(server: Any) -> None:
    from sbx.sdk import Client

    with Client(url=server.url, token=server.token) as sdk:
        figures = {rt: _measure(sdk, rt) for rt in ("container", "gvisor")}
    for rt, f in figures.items():
        print(f"{rt:9} create->first exec {f['create_s']:.2f} s, exec {f['exec_ms']:.0f} ms, idle "
              f"{f['idle_mb']:.0f} MB, stop {f['stop_s']:.2f} s / resume {f['resume_s']:.2f} s at 128 MiB")
    assert figures["gvisor"]["exec_ms"] < 2000 and figures["gvisor"]["resume_s"] < 30


def test_the_sandbox_is_held_to_its_sizes_memory(server: Any) -> None:
    """gVisor's kernel runs in the sandbox's cgroup with the size's memory limit (small: 256 MiB in the test
    profile). A program that wants more does not get it (137), but unlike the container class (where the sandbox
    lives on) the kernel's memory cgroup kills the whole Sentry: the sandbox ends, is marked stopped (``crashed``)
    and resumes from its disk."""
    sid = json.loads(_ok(server.sbx("new", "--runtime", "gvisor", "--ttl", "0", "--json")))["sandbox"]["id"]
    try:
        memcg = Path("/sys/fs/cgroup/memory/sbx") / server.env["SBX_NODE_NAME"] / sid
        assert int((memcg / "memory.limit_in_bytes").read_text()) == 256 << 20
        procs = [int(p) for p in (memcg / "cgroup.procs").read_text().split()]
        assert procs, "nothing in the sandbox's memory cgroup"
        _ok(server.sbx("exec", sid, "echo kept > ~/on-disk"))
        r = server.sbx("exec", sid, "python3 -c 'x = bytearray(600 << 20); print(len(x))'", timeout=300)
        print(f"gvisor: 600 MiB in a 256 MiB sandbox: exit {r.returncode}")
        assert r.returncode == 137 and "629145600" not in r.stdout
        deadline = time.monotonic() + 30
        while (info := _info(server, sid))["state"] == "running" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert info["state"] == "stopped" and info["stopReason"] == "crashed", info
        _ok(server.sbx("resume", sid, "--wait"))
        assert _ok(server.sbx("exec", sid, "cat ~/on-disk")).strip() == "kept"
    finally:
        server.sbx("delete", sid, "--wait")


def test_resize_on_resume_boots_at_the_new_size(server: Any) -> None:
    sid = json.loads(_ok(server.sbx("new", "--runtime", "gvisor", "--ttl", "0", "--json")))["sandbox"]["id"]
    try:
        _ok(server.sbx("exec", sid, "echo kept > ~/f"))
        _ok(server.sbx("stop", sid, "--wait"))
        _ok(server.sbx("resume", sid, "--type", "default", "--wait"))
        info = _info(server, sid)
        assert (info["type"], info["runtime"], info["resumeReason"]) == ("default", "gvisor", "resized"), info
        memcg = Path("/sys/fs/cgroup/memory/sbx") / server.env["SBX_NODE_NAME"] / sid
        assert int((memcg / "memory.limit_in_bytes").read_text()) == int(info["memoryGB"] * 1024) << 20
        assert _ok(server.sbx("exec", sid, "cat ~/f")).strip() == "kept"
    finally:
        server.sbx("delete", sid, "--wait")
