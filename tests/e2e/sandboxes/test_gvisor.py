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
    _ok(server.sbx("exec", gsid, "sha256sum -c ~/big.sum"))
    # the network came back: the sandbox reaches its gateway's resolver port or at least has its address
    assert _ok(server.sbx("exec", gsid, "ip -4 addr show eth0")).count("inet ") == 1


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
