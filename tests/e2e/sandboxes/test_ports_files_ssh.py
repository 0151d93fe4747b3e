"""Hosted ports, files and terminals end to end through `sbx` on real sandboxes.

Ports are reached on the server's proxy listener with the route's ``Host`` header (what a TLS terminator for
``*.<domain>`` would forward)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

WS_ECHO = r'''
import base64, hashlib, socket, struct, threading
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
def serve(c):
    data = b""
    while b"\r\n\r\n" not in data:
        data += c.recv(4096)
    key = [l.split(b":", 1)[1].strip() for l in data.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key")][0]
    acc = base64.b64encode(hashlib.sha1(key + GUID).digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Accept: " + acc + b"\r\n\r\n")
    f = c.makefile("rb")
    while True:
        b0, b1 = f.read(2)
        n = b1 & 127
        if n == 126: n = struct.unpack(">H", f.read(2))[0]
        elif n == 127: n = struct.unpack(">Q", f.read(8))[0]
        mask = f.read(4)
        payload = bytes(x ^ mask[i % 4] for i, x in enumerate(f.read(n)))
        op = b0 & 15
        if op == 8:
            c.sendall(b"\x88\x00"); c.close(); return
        reply = b"echo:" + payload
        size = bytes([len(reply)]) if len(reply) < 126 else b"\x7e" + struct.pack(">H", len(reply))
        head = bytes([0x80 | op]) + size
        c.sendall(head + reply)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 8001)); s.listen()
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
'''


def new_sandbox(server: Any, *args: str) -> str:
    sid = server.sbx("new", "--type", "small", *args, check=True).stdout.strip()
    assert re.fullmatch(r"sb_[a-z0-9]{10}", sid)
    return sid


def info(server: Any, sid: str) -> dict:  # type: ignore[type-arg]
    return json.loads(server.sbx("info", sid, "--json", check=True).stdout)["sandbox"]  # type: ignore[no-any-return]


def wait_listening(server: Any, sid: str, port: int) -> None:
    server.sbx("exec", sid, f"for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && exit 0; "
                            "sleep 0.2; done; exit 1", check=True)


def proxied(server: Any, host: str, path: str = "/", headers: dict[str, str] | None = None
            ) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.proxy_port}{path}", headers={"Host": host,
                                                                                         **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def host_port(server: Any, sid: str, port: int, *args: str) -> dict:  # type: ignore[type-arg]
    return json.loads(server.sbx("host", sid, str(port), *args, "--json", check=True).stdout)["route"]  # type: ignore


def test_hosted_port_token_websocket_stop_resume_and_fork(server: Any) -> None:
    from websockets.sync.client import connect

    sid = new_sandbox(server, "--name", "ports-e2e")
    sub = info(server, sid)["subdomain"]
    server.sbx("exec", sid, "mkdir -p ~/site && echo hello-from-sandbox > ~/site/index.html", check=True)
    server.sbx("exec", sid, "--detach", "cd ~/site && python3 -m http.server 8000", check=True)
    wait_listening(server, sid, 8000)

    human = server.sbx("host", sid, "8000", check=True).stdout.splitlines()
    route = host_port(server, sid, 8000)
    assert human == [f"https://8000-{sub}.sbx.localhost", f"token: {route['token']}"]
    assert (route["url"], route["host"], route["public"]) == (
        f"https://8000-{sub}.sbx.localhost", f"8000-{sub}.sbx.localhost", False)
    host = route["host"]

    status, _, body = proxied(server, host, headers={"X-Sbx-Token": route["token"]})
    assert (status, body) == (200, b"hello-from-sandbox\n")
    status, headers, body = proxied(server, host)
    assert status == 401 and "Location" not in headers
    assert json.loads(body)["error"]["code"] == "unauthorized"
    assert proxied(server, host, headers={"X-Sbx-Token": "wrong"})[0] == 401
    status, headers, body = proxied(server, host, f"/index.html?token={route['token']}")
    assert status == 200 and body == b"hello-from-sandbox\n"
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and route["token"] in cookie
    assert proxied(server, host, headers={"Cookie": cookie.split(";")[0]})[0] == 200

    # a WebSocket echo server upgrades through the route
    server.sbx("exec", sid, f"cat > ~/ws.py <<'EOF'\n{WS_ECHO}\nEOF", check=True)
    server.sbx("exec", sid, "--detach", "python3 ~/ws.py", check=True)
    wait_listening(server, sid, 8001)
    ws_route = host_port(server, sid, 8001)
    sock = socket.create_connection(("127.0.0.1", server.proxy_port))
    with connect(f"ws://{ws_route['host']}/", sock=sock, additional_headers={"X-Sbx-Token": ws_route["token"]},
                 open_timeout=60) as ws:
        ws.send("ping")
        assert ws.recv(timeout=60) == "echo:ping"
        ws.send(b"\x00\x01binary")
        assert ws.recv(timeout=60) == b"echo:\x00\x01binary"

    listed = json.loads(server.sbx("host", sid, "--json", check=True).stdout)["routes"]
    assert [r["port"] for r in listed] == [8000, 8001]

    # stopped without autoResume: 409 with the state; after a resume the same route serves again
    server.sbx("stop", sid, "--wait", check=True)
    status, _, body = proxied(server, host, headers={"X-Sbx-Token": route["token"]})
    assert status == 409 and json.loads(body)["error"] == {
        "code": "not_running", "message": f"sandbox {sid} is stopped", "state": "stopped"}
    server.sbx("resume", sid, "--wait", check=True)
    assert info(server, sid)["memoryRestored"] is True
    status, _, body = proxied(server, host, headers={"X-Sbx-Token": route["token"]})
    assert (status, body) == (200, b"hello-from-sandbox\n")
    assert host_port(server, sid, 8000)["token"] == route["token"]  # hosting again keeps the token

    # a fork gets no routes
    fork = json.loads(server.sbx("fork", sid, "--wait", "--json", check=True).stdout.splitlines()[-1])["id"]
    assert json.loads(server.sbx("host", fork, "--json", check=True).stdout)["routes"] == []
    fork_sub = info(server, fork)["subdomain"]
    server.sbx("exec", fork, "--detach", "cd ~/site && python3 -m http.server 8000", check=True)
    wait_listening(server, fork, 8000)
    assert proxied(server, f"8000-{fork_sub}.sbx.localhost", headers={"X-Sbx-Token": route["token"]})[0] == 404

    server.sbx("unhost", sid, "8001", check=True)
    assert [r["port"] for r in json.loads(server.sbx("host", sid, "--json", check=True).stdout)["routes"]] == [8000]
    server.sbx("delete", fork, "--wait", check=True)
    server.sbx("delete", sid, "--wait", check=True)
    assert proxied(server, host, headers={"X-Sbx-Token": route["token"]})[0] == 404


def test_a_request_resumes_a_stopped_auto_resume_sandbox(server: Any) -> None:
    sid = new_sandbox(server, "--auto-resume")
    assert info(server, sid)["autoResume"] is True
    server.sbx("exec", sid, "mkdir -p ~/site && echo awake > ~/site/index.html", check=True)
    server.sbx("exec", sid, "--detach", "cd ~/site && python3 -m http.server 8000", check=True)
    wait_listening(server, sid, 8000)
    route = host_port(server, sid, 8000, "--public")
    assert route["public"] is True
    server.sbx("stop", sid, "--wait", check=True)
    assert info(server, sid)["state"] == "stopped"
    status, _, body = proxied(server, route["host"])
    assert (status, body) == (200, b"awake\n")
    assert info(server, sid)["state"] == "running"
    server.sbx("delete", sid, "--wait", check=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def test_cp_round_trips_a_50_mib_binary_file_and_a_folder(server: Any, tmp_path: Path) -> None:
    sid = new_sandbox(server)
    big = tmp_path / "big.bin"
    with big.open("wb") as f:
        for _ in range(50):
            f.write(os.urandom(1 << 20))
    digest = _sha256(big)
    server.sbx("cp", str(big), f"{sid}:~/in/big.bin", check=True)
    r = server.sbx("exec", sid, "sha256sum ~/in/big.bin; stat -c '%U:%G %s' ~/in/big.bin", check=True)
    assert r.stdout.split() == [digest, "/home/user/in/big.bin", "user:user", str(50 << 20)]
    back = tmp_path / "back.bin"
    server.sbx("cp", f"{sid}:~/in/big.bin", str(back), check=True)
    assert _sha256(back) == digest

    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "blob").write_bytes(bytes(range(256)) * 10)
    (tree / "a.txt").write_text("a\n")
    server.sbx("cp", str(tree), f"{sid}:~/", check=True)  # onto a folder: lands inside it, like cp -r
    r = server.sbx("exec", sid, "cd ~/tree && find . -type f | sort && stat -c %U sub/blob", check=True)
    assert r.stdout.split() == ["./a.txt", "./sub/blob", "user"]
    out = tmp_path / "out"
    server.sbx("cp", f"{sid}:~/tree", str(out), check=True)
    assert (out / "sub" / "blob").read_bytes() == bytes(range(256)) * 10 and (out / "a.txt").read_text() == "a\n"

    r = server.sbx("cp", f"{sid}:~/missing", str(tmp_path / "x"))
    assert r.returncode == 1 and r.stderr.startswith("error: not_found: ")
    server.sbx("delete", sid, "--wait", check=True)


def test_an_upload_cut_short_leaves_the_old_file(server: Any) -> None:
    from collections.abc import Iterator

    from sbx.sdk import Client, Sandbox
    from tests.e2e.helpers import poll

    sid = new_sandbox(server)
    server.sbx("exec", sid, "mkdir ~/d && echo old > ~/d/f && chmod 640 ~/d/f", check=True)

    def gives_up() -> Iterator[bytes]:
        yield os.urandom(4 << 20)
        raise RuntimeError("the client gave up")

    with Client(server.url, server.token) as c:
        sb = Sandbox.get(sid, client=c)
        with pytest.raises(RuntimeError, match="gave up"):
            sb.files.write("d/f", gives_up())
        poll(lambda: [e["name"] for e in sb.files.list("d")] == ["f"], "the temporary upload file to go")
        assert sb.files.read("d/f") == b"old\n"
        sb.files.write("d/f", b"new\n")
    r = server.sbx("exec", sid, "cat ~/d/f; stat -c '%a %U' ~/d/f; ls -A ~/d", check=True)
    assert r.stdout.split() == ["new", "640", "user", "f"]
    server.sbx("delete", sid, "--wait", check=True)


def test_a_symlink_to_etc_shadow_never_leaks_a_host_file(server: Any, tmp_path: Path) -> None:
    host_shadow = Path("/etc/shadow").read_bytes()
    host_hostname = Path("/etc/hostname").read_bytes()
    sid = new_sandbox(server)
    server.sbx("exec", sid, "ln -s /etc/shadow ~/leak && ln -s / ~/root && mkdir ~/d && ln -s /etc/shadow ~/d/l",
               check=True)
    # as user: the sandbox's own /etc/shadow is unreadable
    r = server.sbx("cp", f"{sid}:~/leak", str(tmp_path / "leak"))
    assert r.returncode == 1 and r.stderr.startswith("error: permission_denied: ")
    assert not (tmp_path / "leak").exists()
    # as root: the sandbox's /etc/shadow, never the host's
    server.sbx("cp", "--user", "root", f"{sid}:/home/user/leak", str(tmp_path / "leak"), check=True)
    got = (tmp_path / "leak").read_bytes()
    assert got != host_shadow and b"\nuser:" in b"\n" + got
    # a path through a symlink to / resolves in the sandbox too
    server.sbx("cp", f"{sid}:~/root/etc/hostname", str(tmp_path / "hn"), check=True)
    assert (tmp_path / "hn").read_bytes() != host_hostname
    assert (tmp_path / "hn").read_text().strip() == info(server, sid)["subdomain"]
    # a folder copy keeps the symlink a symlink
    server.sbx("cp", f"{sid}:~/d", str(tmp_path / "d"), check=True)
    assert os.readlink(tmp_path / "d" / "l") == "/etc/shadow"
    # writing through a symlink writes inside the sandbox
    (tmp_path / "w").write_bytes(b"x")
    r = server.sbx("cp", str(tmp_path / "w"), f"{sid}:~/leak")
    assert r.returncode == 1 and "permission_denied" in r.stderr
    assert Path("/etc/shadow").read_bytes() == host_shadow
    server.sbx("delete", sid, "--wait", check=True)


def test_ssh_runs_in_a_terminal_in_the_sandbox(server: Any) -> None:
    sid = new_sandbox(server)
    sub = info(server, sid)["subdomain"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(Path(sys.executable).parent / "sbx"), *args], env=server.env,
                              capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)

    r = run("ssh", sid, "--", "hostname")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == sub
    r = run("ssh", sid, "--", "test -t 0 && tty && whoami; exit 7")
    assert r.returncode == 7
    lines = r.stdout.split()
    assert re.fullmatch(r"/dev/pts/\d+", lines[0]) and lines[1] == "user"
    r = run("exec", "-t", sid, "hostname")
    assert (r.returncode, r.stdout.strip()) == (0, sub)
    r = run("ssh", sid, "--user", "root", "--", "id -u")
    assert r.stdout.strip() == "0"
    server.sbx("delete", sid, "--wait", check=True)


def test_a_terminal_has_the_asked_size_from_its_first_command(server: Any) -> None:
    """The pty session's ``cols``/``rows`` are the sandbox terminal's size before its command runs: a command
    that reads it at once (``stty size``) sees them (the size was once set only after the command started, and a
    quick command read 0 0 now and then)."""
    from websockets.sync.client import connect

    sid = new_sandbox(server)
    url = "ws" + server.url[len("http"):] + f"/v1/sandboxes/{sid}/pty?command=stty+size&cols=100&rows=30"
    for _ in range(8):
        out = b""
        with connect(url, additional_headers={"Authorization": f"Bearer {server.token}"}) as ws:
            while True:
                msg = ws.recv(timeout=60)
                if isinstance(msg, bytes):
                    out += msg
                else:
                    assert json.loads(msg) == {"type": "exit", "exitCode": 0}, msg
                    break
        assert out.strip() == b"30 100", out
    server.sbx("delete", sid, "--wait", check=True)
