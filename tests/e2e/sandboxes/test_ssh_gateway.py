"""The SSH gateway end to end (issue 35): OpenSSH's own ``ssh``, ``scp`` and ``sftp`` against a real server's gateway
(``SBX_SSH_GATEWAY_PORT``) and real sandboxes: a command's output and exit status, files up and down byte for byte,
``ssh -L`` to a program listening inside the sandbox, sftp, a wrong key and another account's key refused like an
unknown sandbox, a stopped ``--auto-resume`` sandbox resumed by a login and a stopped one without it refused with a
message."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import termios
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

DENIED = "Permission denied (publickey)"


def _keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)], check=True)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Gateway:
    """OpenSSH clients pointed at the test server's gateway, with ``key``."""

    def __init__(self, port: int, key: Path):
        self.port = port
        self.key = key

    def opts(self, key: Path | None = None) -> list[str]:
        return ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "IdentitiesOnly=yes",
                "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=30",
                "-i", str(key or self.key)]

    def ssh(self, login: str, *cmd: str, key: Path | None = None, timeout: float = 300,
            input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["ssh", "-p", str(self.port), *self.opts(key), f"{login}@127.0.0.1", *cmd],
                              capture_output=True, timeout=timeout, input=input)

    def scp(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["scp", "-P", str(self.port), *self.opts(), *args], capture_output=True, timeout=300)


def _new(server: Any, *args: str) -> str:
    sid = server.sbx("new", "--type", "small", *args, check=True).stdout.strip()
    assert re.fullmatch(r"sb_[a-z0-9]{10}", sid), sid
    return sid


@pytest.fixture(scope="module")
def gw(server: Any, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    """The admin account's key registered with ``sbx ssh-key add``."""
    folder = tmp_path_factory.mktemp("sshgw")
    key = _keygen(folder / "id_admin")
    r = server.sbx("ssh-key", "add", str(key) + ".pub", "--name", "e2e", "--json", check=True)
    added = json.loads(r.stdout)["sshKey"]
    assert added["name"] == "e2e" and added["fingerprint"].startswith("SHA256:")
    assert server.sbx("ssh-key", "add", str(key) + ".pub").returncode != 0  # 409: the same key twice
    listed = server.sbx("ssh-key", "list", check=True).stdout
    assert added["id"] in listed and added["fingerprint"] in listed
    assert server.ssh_port
    return Gateway(server.ssh_port, key)


@pytest.fixture(scope="module")
def box(server: Any) -> str:
    return _new(server, "--name", "gw-box")


def test_a_command_gives_its_output_and_exit_status(server: Any, gw: Gateway, box: str) -> None:
    hostname = server.sbx("exec", box, "hostname", check=True).stdout.strip()
    assert hostname and hostname != socket.gethostname()
    r = gw.ssh(box, "hostname; id -un; echo err >&2; exit 3")
    assert r.returncode == 3, r.stderr
    assert r.stdout.decode().split() == [hostname, "user"] and r.stderr.decode().strip() == "err"
    # by name too, and as root with +root
    r = gw.ssh("gw-box+root", "id -un; hostname")
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().split() == ["root", hostname]
    # stdin goes through, and its end too
    r = gw.ssh(box, "wc -c", input=b"x" * 100000)
    assert r.returncode == 0 and r.stdout.decode().strip() == "100000", r.stderr
    # what the gateway put into the sandbox is a public key and nothing else
    keys = server.sbx("exec", box, "cat ~/.ssh/authorized_keys", check=True).stdout
    assert re.fullmatch(r"(ssh-ed25519 [A-Za-z0-9+/=]+ sbx-gateway\n)+", keys), keys
    assert gw.key.with_suffix(".pub").read_text().split()[1] not in keys


def _set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def test_a_terminal_has_the_clients_size_and_follows_its_changes(gw: Gateway, box: str) -> None:
    """``ssh -t`` in a terminal of 33x111: the sandbox's terminal has that size; after the client's terminal
    becomes 44x122 (and ssh gets its SIGWINCH) the sandbox's does too."""
    main, side = pty.openpty()
    _set_size(side, 33, 111)
    proc = subprocess.Popen(["ssh", "-p", str(gw.port), *gw.opts(), "-tt", f"{box}@127.0.0.1",
                             "stty size; echo TERM=$TERM; read _; stty size; exit 4"],
                            stdin=side, stdout=side, stderr=side, env={**os.environ, "TERM": "xterm-256color"})
    os.close(side)
    seen = b""

    def read_until(what: bytes) -> None:
        nonlocal seen
        deadline = time.monotonic() + 60
        while what not in seen and time.monotonic() < deadline:
            if select.select([main], [], [], 1)[0]:
                try:
                    seen += os.read(main, 4096)
                except OSError:
                    break
        assert what in seen, seen

    try:
        read_until(b"TERM=xterm-256color")
        assert b"33 111" in seen
        _set_size(main, 44, 122)
        proc.send_signal(signal.SIGWINCH)
        time.sleep(1)
        os.write(main, b"go\r")
        read_until(b"44 122")
        assert proc.wait(timeout=60) == 4
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(main)


def test_scp_up_and_down_keeps_the_bytes(gw: Gateway, box: str, tmp_path: Path) -> None:
    blob = os.urandom(3 * 1024 * 1024 + 17)
    up = tmp_path / "up.bin"
    up.write_bytes(blob)
    r = gw.scp(str(up), f"{box}@127.0.0.1:blob.bin")
    assert r.returncode == 0, r.stderr
    down = tmp_path / "down.bin"
    r = gw.scp(f"{box}@127.0.0.1:blob.bin", str(down))
    assert r.returncode == 0, r.stderr
    assert down.read_bytes() == blob
    # the old scp protocol: an exec of scp -f in the sandbox
    r = gw.scp("-O", f"{box}@127.0.0.1:blob.bin", str(tmp_path / "legacy.bin"))
    assert r.returncode == 0 and (tmp_path / "legacy.bin").read_bytes() == blob, r.stderr


def test_sftp_lists_the_home_folder(gw: Gateway, box: str) -> None:
    gw.ssh(box, "mkdir -p sftp-here && touch sftp-here/marker-file")
    r = subprocess.run(["sftp", "-P", str(gw.port), *gw.opts(), "-b", "-", f"{box}@127.0.0.1"],
                       input=b"cd sftp-here\nls -1\n", capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "marker-file" in r.stdout.decode()


def test_local_port_forwarding_reaches_a_port_inside_the_sandbox(server: Any, gw: Gateway, box: str) -> None:
    server.sbx("exec", box, "--detach", "mkdir -p www && echo forwarded-ok > www/index.html && "
               "cd www && exec python3 -m http.server 8123 --bind 127.0.0.1", check=True)
    local = _free_port()
    proc = subprocess.Popen(["ssh", "-p", str(gw.port), *gw.opts(), "-N", "-o", "ExitOnForwardFailure=yes",
                             "-L", f"127.0.0.1:{local}:127.0.0.1:8123", f"{box}@127.0.0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        body = b""
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else b""
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{local}/index.html", timeout=10) as resp:
                    body = resp.read()
                    break
            except OSError:
                time.sleep(0.5)
        assert body == b"forwarded-ok\n"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_wrong_key_and_another_accounts_key_are_refused_like_an_unknown_sandbox(
        server: Any, gw: Gateway, box: str, tmp_path: Path) -> None:
    stranger = _keygen(tmp_path / "id_stranger")
    r = gw.ssh(box, "true", key=stranger)
    assert r.returncode == 255 and DENIED in r.stderr.decode(), r.stderr
    # another account with its own registered key: its own sandbox would open, the admin's does not
    req = urllib.request.Request(server.url + "/v1/accounts", data=json.dumps({"name": "gw-other"}).encode(),
                                 method="POST", headers={"Authorization": f"Bearer {server.token}",
                                                         "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        token = json.loads(resp.read())["key"]["token"]
    other = _keygen(tmp_path / "id_other")
    req = urllib.request.Request(server.url + "/v1/ssh-keys", method="POST",
                                 data=json.dumps({"publicKey": (tmp_path / "id_other.pub").read_text()}).encode(),
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 201
    theirs = gw.ssh(box, "true", key=other)
    unknown = gw.ssh("sb_nosuchbox0", "true")
    assert theirs.returncode == unknown.returncode == 255
    assert DENIED in theirs.stderr.decode() and DENIED in unknown.stderr.decode()
    assert theirs.stderr.decode().replace(box, "X") == unknown.stderr.decode().replace("sb_nosuchbox0", "X")
    assert gw.ssh(box, "true").returncode == 0  # the right key still opens it


def test_a_login_resumes_a_stopped_auto_resume_sandbox_and_not_another(server: Any, gw: Gateway, box: str) -> None:
    sleepy = _new(server, "--auto-resume")
    assert gw.ssh(sleepy, "echo $((6*7)) > answer").returncode == 0
    server.sbx("stop", sleepy, "--wait", check=True)
    assert server.api("GET", f"/v1/sandboxes/{sleepy}")["sandbox"]["state"] == "stopped"
    r = gw.ssh(sleepy, "cat answer")
    assert r.returncode == 0 and r.stdout.decode().strip() == "42", r.stderr
    assert server.api("GET", f"/v1/sandboxes/{sleepy}")["sandbox"]["state"] == "running"
    # without autoResume: a message on stderr and a failing exit status, the sandbox left stopped
    server.sbx("stop", box, "--wait", check=True)
    r = gw.ssh(box, "true")
    assert r.returncode != 0
    assert "stopped" in r.stderr.decode() and "sbx resume" in r.stderr.decode(), r.stderr
    assert server.api("GET", f"/v1/sandboxes/{box}")["sandbox"]["state"] == "stopped"


def test_a_sandbox_on_a_node_agent_is_reached_through_its_port_relay(tmp_path_factory: pytest.TempPathFactory
                                                                      ) -> None:
    """A server whose node is a node agent in a network namespace of its own (tests/nodenet.py): the sandbox's
    bridge is not on the server's host, so the gateway goes through the node's port relay."""
    from tests.e2e.cluster import node_cluster

    tmp = tmp_path_factory.mktemp("sshgw-node")
    key = _keygen(tmp / "id_node")
    with node_cluster(tmp / "c", [3], "gwsrv", "sbxgwsv", "10.70.0.0/16") as (srv, nodes):
        srv.sbx("ssh-key", "add", str(key) + ".pub", check=True)
        gw = Gateway(srv.ssh_port, key)
        sid = _new(srv)
        assert srv.api("GET", f"/v1/sandboxes/{sid}")["sandbox"]["node"] == nodes[0].node_name
        hostname = srv.sbx("exec", sid, "hostname", check=True).stdout.strip()
        r = gw.ssh(sid, "hostname; exit 7")
        assert r.returncode == 7 and r.stdout.decode().strip() == hostname, r.stderr
        blob = os.urandom(1024 * 1024)
        (tmp / "up.bin").write_bytes(blob)
        assert gw.scp(str(tmp / "up.bin"), f"{sid}@127.0.0.1:up.bin").returncode == 0
        r = gw.ssh(sid, "sha256sum < up.bin")
        assert r.stdout.decode().split()[0] == hashlib.sha256(blob).hexdigest(), r.stderr
