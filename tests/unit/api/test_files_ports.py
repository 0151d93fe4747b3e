"""Hosted ports (routes API and the proxy), files and PTY sessions through the real app with a FakeNode.

The fake's ``spawn`` runs the in-sandbox programs on this host inside the sandbox's folder, so paths in these tests
are relative (the real node runs them in the sandbox's own mount namespace: see
tests/e2e/sandboxes/test_ports_files_ssh.py).
Its ``address`` is 127.0.0.1, so a route's port is a server the test starts on this host.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import tarfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from sbx.node.exec.terminal import set_winsize
from tests.fakes import Api, FakeNode, make_api, wait_until


class SpawnNode(FakeNode):
    """FakeNode plus ``spawn`` (host processes in the sandbox's folder) and ``address`` (127.0.0.1)."""

    def spawn(self, id: str, argv: list[str], *, user: str = "user", stdin: bool = False, tty: bool = False,
              env: dict[str, str] | None = None, size: tuple[int, int] | None = None) -> subprocess.Popen[bytes]:
        box = self._running(id)
        self.calls.append(("spawn", id, {"argv": argv, "user": user, "tty": tty}))
        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(box.dir), **(env or {})}
        if tty:
            import pty

            master, slave = pty.openpty()
            set_winsize(slave, *(size or (80, 24)))
            proc = subprocess.Popen(argv, cwd=box.dir, env=full_env, stdin=slave, stdout=slave, stderr=slave,
                                    start_new_session=True)
            os.close(slave)
            proc.pty_master = master  # type: ignore[attr-defined]
            return proc
        return subprocess.Popen(argv, cwd=box.dir, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)

    def address(self, id: str) -> str:
        self._box(id)
        return "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Api]:
    monkeypatch.setattr("tests.fakes.FakeNode", SpawnNode)
    proxy_port = _free_port()
    gen = make_api(tmp_path, serve_proxy=True, settings={"proxy_port": proxy_port})
    a = next(gen)
    a.proxy_port = proxy_port  # type: ignore[attr-defined]
    yield a
    with pytest.raises(StopIteration):
        next(gen)


def err(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


# --- routes API --------------------------------------------------------------------------------------------------
def test_host_list_rehost_and_unhost(api: Api) -> None:
    sb = api.new()
    sid, sub = sb["id"], sb["subdomain"]
    r = api.post(f"/v1/sandboxes/{sid}/routes", json={"port": 8000})
    assert r.status_code == 201
    route = r.json()["route"]
    assert set(route) == {"port", "public", "url", "host", "token", "createdAt"}
    assert (route["url"], route["host"], route["public"]) == (
        f"https://8000-{sub}.sbx.localhost", f"8000-{sub}.sbx.localhost", False)
    assert route["token"].startswith("sbxr_") and len(route["token"]) > 30
    again = api.post(f"/v1/sandboxes/{sid}/routes", json={"port": 8000, "public": True}).json()["route"]
    assert (again["token"], again["public"]) == (route["token"], True)
    api.post(f"/v1/sandboxes/{sid}/routes", json={"port": 3000})
    assert [r["port"] for r in api.get(f"/v1/sandboxes/{sid}/routes").json()["routes"]] == [3000, 8000]
    assert api.delete(f"/v1/sandboxes/{sid}/routes/3000").json() == {"deleted": 3000}
    assert err(api.delete(f"/v1/sandboxes/{sid}/routes/3000")) == (404, "not_found")
    assert [r["port"] for r in api.get(f"/v1/sandboxes/{sid}/routes").json()["routes"]] == [8000]


def test_route_errors(api: Api) -> None:
    sid = api.new()["id"]
    assert err(api.post(f"/v1/sandboxes/{sid}/routes", json={"port": 0})) == (400, "invalid_port")
    assert err(api.post(f"/v1/sandboxes/{sid}/routes", json={"port": 70000})) == (400, "invalid_port")
    assert err(api.post(f"/v1/sandboxes/{sid}/routes", json={"port": "x"})) == (422, "invalid_request")
    assert err(api.post("/v1/sandboxes/sb_0000000000/routes", json={"port": 80})) == (404, "not_found")
    assert err(api.get("/v1/sandboxes/sb_0000000000/routes")) == (404, "not_found")
    assert err(api.c.get(f"/v1/sandboxes/{sid}/routes")) == (401, "unauthorized")


def test_routes_survive_stop_resume_but_not_fork_or_delete(api: Api) -> None:
    sid = api.new()["id"]
    token = api.post(f"/v1/sandboxes/{sid}/routes", json={"port": 8000}).json()["route"]["token"]
    api.post(f"/v1/sandboxes/{sid}/stop?wait=true")
    api.post(f"/v1/sandboxes/{sid}/resume?wait=true")
    assert [r["token"] for r in api.get(f"/v1/sandboxes/{sid}/routes").json()["routes"]] == [token]
    fork = api.post(f"/v1/sandboxes/{sid}/fork?wait=true").json()["sandbox"]
    assert api.get(f"/v1/sandboxes/{fork['id']}/routes").json()["routes"] == []
    api.delete(f"/v1/sandboxes/{sid}?wait=true")
    assert api.control.routes.resolve(f"8000-{api.sandbox(fork['id'])['subdomain']}.sbx.localhost") is None
    from sbx.control.sandboxes.routes import RouteRow

    with api.control.store.session() as s:
        assert s.query(RouteRow).filter_by(sandbox_id=sid).count() == 0


def test_create_with_auto_resume(api: Api) -> None:
    assert api.new()["autoResume"] is False
    assert api.new(autoResume=True)["autoResume"] is True


# --- proxy ---------------------------------------------------------------------------------------------------------
class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[dict[str, Any]] = []

    def do_GET(self) -> None:  # noqa: N802
        _Upstream.seen.append({"path": self.path, "headers": dict(self.headers)})
        if self.path.startswith("/stream"):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(3):
                piece = f"part{i}\n".encode()
                self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            return
        body = f"hello {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        data = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[::-1])

    def log_message(self, *_a: Any) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[int]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    _Upstream.seen = []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield int(srv.server_address[1])
    srv.shutdown()
    srv.server_close()


def _proxy(api: Api, host: str, path: str = "/", **kw: Any) -> httpx.Response:
    headers = {"Host": host, **kw.pop("headers", {})}
    return httpx.request(kw.pop("method", "GET"), f"http://127.0.0.1:{api.proxy_port}{path}",  # type: ignore
                         headers=headers, timeout=30, **kw)


def _hosted(api: Api, port: int, public: bool = False, **create: Any) -> tuple[str, dict[str, Any]]:
    sb = api.new(**create)
    route = api.post(f"/v1/sandboxes/{sb['id']}/routes", json={"port": port, "public": public}).json()["route"]
    return sb["id"], route


def test_proxy_needs_the_token_for_a_private_route(api: Api, upstream: int) -> None:
    _, route = _hosted(api, upstream)
    r = _proxy(api, route["host"], "/x", headers={"X-Sbx-Token": route["token"]})
    assert (r.status_code, r.text) == (200, "hello /x")
    assert "x-sbx-token" not in {k.lower() for k in _Upstream.seen[-1]["headers"]}
    assert _Upstream.seen[-1]["headers"]["X-Forwarded-Host"] == route["host"]
    r = _proxy(api, route["host"], "/x")
    assert err(r) == (401, "unauthorized") and "location" not in r.headers
    assert err(_proxy(api, route["host"], "/x", headers={"X-Sbx-Token": "sbxr_wrong"})) == (401, "unauthorized")
    assert len(_Upstream.seen) == 1


def test_query_token_becomes_an_http_only_cookie_and_is_not_forwarded(api: Api, upstream: int) -> None:
    _, route = _hosted(api, upstream)
    r = _proxy(api, route["host"], f"/page?a=1&token={route['token']}")
    assert (r.status_code, r.text) == (200, "hello /page?a=1")
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"sbx_token={route['token']}") and "HttpOnly" in cookie
    r = _proxy(api, route["host"], "/next", headers={"Cookie": f"theme=dark; sbx_token={route['token']}"})
    assert (r.status_code, r.text) == (200, "hello /next") and "set-cookie" not in r.headers
    assert _Upstream.seen[-1]["headers"]["Cookie"] == "theme=dark"


def test_public_routes_bodies_and_streaming(api: Api, upstream: int) -> None:
    _, route = _hosted(api, upstream, public=True)
    assert _proxy(api, route["host"], "/").status_code == 200
    body = os.urandom(300_000)
    r = _proxy(api, route["host"], "/echo", method="POST", content=body)
    assert r.content == body[::-1]
    r = _proxy(api, route["host"], "/stream")
    assert r.text == "part0\npart1\npart2\n"


def test_proxy_errors(api: Api, upstream: int) -> None:
    sid, route = _hosted(api, upstream, public=True)
    assert err(_proxy(api, "nothing.example.com")) == (404, "not_found")
    assert err(_proxy(api, route["host"].replace(str(upstream), "1"))) == (404, "not_found")
    dead = _free_port()
    api.post(f"/v1/sandboxes/{sid}/routes", json={"port": dead, "public": True})
    host = route["host"].replace(str(upstream), str(dead))
    assert err(_proxy(api, host)) == (502, "upstream_unreachable")
    with socket.create_connection(("127.0.0.1", api.proxy_port)) as s:  # type: ignore[attr-defined]
        s.sendall(b"NOT HTTP\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400")


def test_a_stopped_sandbox_answers_409_unless_auto_resume(api: Api, upstream: int) -> None:
    sid, route = _hosted(api, upstream, public=True)
    api.post(f"/v1/sandboxes/{sid}/stop?wait=true")
    r = _proxy(api, route["host"])
    assert r.status_code == 409 and r.json()["error"] == {
        "code": "not_running", "message": f"sandbox {sid} is stopped", "state": "stopped"}
    api.delete(f"/v1/sandboxes/{sid}/routes/{upstream}")

    sid2, route2 = _hosted(api, upstream, public=True, autoResume=True)
    api.post(f"/v1/sandboxes/{sid2}/stop?wait=true")
    r = _proxy(api, route2["host"], "/woke")
    assert (r.status_code, r.text) == (200, "hello /woke")
    assert api.sandbox(sid2)["state"] == "running"
    assert [c[0] for c in api.node.calls if c[1] == sid2].count("resume") == 1


def test_websocket_upgrade_passes_through(api: Api) -> None:
    from websockets.sync.client import connect
    from websockets.sync.server import serve

    def echo(ws: Any) -> None:
        for msg in ws:
            ws.send(msg)

    with serve(echo, "127.0.0.1", 0) as srv:
        port = srv.socket.getsockname()[1]
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        _, route = _hosted(api, port)
        sock = socket.create_connection(("127.0.0.1", api.proxy_port))  # type: ignore[attr-defined]
        with connect(f"ws://{route['host']}/", sock=sock, additional_headers={"X-Sbx-Token": route["token"]}) as ws:
            ws.send("hi")
            assert ws.recv(timeout=10) == "hi"
            ws.send(b"\x00\xff")
            assert ws.recv(timeout=10) == b"\x00\xff"
        srv.shutdown()


def test_proxy_traffic_counts_as_activity(api: Api, upstream: int) -> None:
    sid, route = _hosted(api, upstream, public=True)
    act = api.control.activity
    with act._lock:
        act._last[sid] -= 1000
    assert act.idle_for(sid) >= 1000
    _proxy(api, route["host"])
    assert act.idle_for(sid) < 1000


# --- files ---------------------------------------------------------------------------------------------------------
def _files(api: Api, sid: str, method: str, path: str, **kw: Any) -> httpx.Response:
    params = {"path": path, **kw.pop("params", {})}
    return api.c.request(method, f"/v1/sandboxes/{sid}/files", params=params, headers=api.h, **kw)


def test_write_read_stat_list_remove(api: Api) -> None:
    sid = api.new()["id"]
    data = os.urandom(3 << 20)
    r = _files(api, sid, "PUT", "dir/sub/blob.bin", content=data)
    assert r.status_code == 200 and r.json() == {"path": "dir/sub/blob.bin", "size": len(data)}
    r = _files(api, sid, "GET", "dir/sub/blob.bin")
    assert r.status_code == 200 and r.content == data
    assert r.headers["content-type"] == "application/octet-stream"
    assert _files(api, sid, "PUT", "empty", content=b"").json()["size"] == 0
    assert _files(api, sid, "GET", "empty").content == b""
    st = api.get(f"/v1/sandboxes/{sid}/files/stat", params={"path": "dir/sub/blob.bin"}).json()["entry"]
    assert (st["type"], st["size"], st["name"]) == ("file", len(data), "blob.bin")
    entries = api.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "dir"}).json()["entries"]
    assert [(e["name"], e["type"], e["path"]) for e in entries] == [("sub", "directory", "dir/sub")]
    assert set(entries[0]) == {"name", "path", "type", "size", "mode", "mtime"}
    assert _files(api, sid, "DELETE", "dir").json() == {"deleted": "dir"}
    assert err(_files(api, sid, "GET", "dir/sub/blob.bin")) == (404, "not_found")
    assert err(_files(api, sid, "DELETE", "dir")) == (404, "not_found")


def test_odd_names_list_exactly(api: Api) -> None:
    sid = api.new()["id"]
    for name in ("a b", "tab\tname", "new\nline", "-dash", "ünï"):
        assert _files(api, sid, "PUT", f"odd/{name}", content=name.encode()).status_code == 200
    names = [e["name"] for e in api.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "odd"}).json()["entries"]]
    assert sorted(names) == sorted(["a b", "tab\tname", "new\nline", "-dash", "ünï"])
    assert _files(api, sid, "GET", "odd/-dash").content == b"-dash"


def test_file_errors(api: Api) -> None:
    sid = api.new()["id"]
    _files(api, sid, "PUT", "d/f", content=b"x")
    assert err(_files(api, sid, "GET", "d")) == (400, "is_a_directory")
    assert err(_files(api, sid, "PUT", "d", content=b"x")) == (400, "is_a_directory")
    assert err(_files(api, sid, "PUT", "d/f/g", content=b"x")) == (400, "not_a_directory")
    assert err(api.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "d/f"})) == (400, "not_a_directory")
    assert err(_files(api, sid, "GET", "nope")) == (404, "not_found")
    assert err(api.get(f"/v1/sandboxes/{sid}/files/stat", params={"path": "nope"})) == (404, "not_found")
    assert err(_files(api, sid, "GET", "")) == (400, "invalid_path")
    assert err(_files(api, sid, "GET", "d/f", params={"user": "mallory"})) == (400, "invalid_user")
    assert err(_files(api, sid, "GET", "d/f", params={"archive": "zip"})) == (400, "invalid_archive")
    assert err(api.c.get(f"/v1/sandboxes/{sid}/files", params={"path": "d/f"})) == (401, "unauthorized")
    assert err(_files(api, "sb_0000000000", "GET", "d/f")) == (404, "not_found")
    os.chmod(api.node.root / sid / "d" / "f", 0)
    if os.geteuid() != 0:
        assert err(_files(api, sid, "GET", "d/f")) == (403, "permission_denied")
    api.post(f"/v1/sandboxes/{sid}/stop?wait=true")
    r = _files(api, sid, "GET", "d/f")
    assert err(r) == (409, "not_running") and r.json()["error"]["state"] == "stopped"


def test_tar_round_trip(api: Api) -> None:
    sid = api.new()["id"]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in (("./a.txt", b"a"), ("./sub/b.bin", bytes(range(256)))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    r = _files(api, sid, "PUT", "tree", params={"archive": "tar"}, content=buf.getvalue())
    assert r.status_code == 200, r.text
    assert _files(api, sid, "GET", "tree/sub/b.bin").content == bytes(range(256))
    r = _files(api, sid, "GET", "tree", params={"archive": "tar"})
    assert r.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tf:
        assert sorted(m.name for m in tf.getmembers() if m.isfile()) == ["./a.txt", "./sub/b.bin"]
    assert err(_files(api, sid, "GET", "tree/a.txt", params={"archive": "tar"})) == (400, "not_a_directory")


def test_file_transfer_counts_as_activity_and_runs_as_the_user(api: Api) -> None:
    sid = api.new()["id"]
    _files(api, sid, "PUT", "f", content=b"x", params={"user": "root"})
    spawns = [c for c in api.node.calls if c[0] == "spawn"]
    assert spawns[-1][2]["user"] == "root" and spawns[-1][2]["argv"][:2] == ["/bin/sh", "-c"]
    assert api.control.activity._active.get(sid) is None  # ended


# --- PTY -----------------------------------------------------------------------------------------------------------
def _pty(api: Api, sid: str, **params: str) -> tuple[bytes, dict[str, Any]]:
    out = b""
    with api.c.websocket_connect(f"/v1/sandboxes/{sid}/pty?{httpx.QueryParams(params)}", headers=api.h) as ws:
        while True:
            msg = ws.receive()
            if msg.get("bytes"):
                out += msg["bytes"]
            elif msg.get("text"):
                return out, json.loads(msg["text"])
            else:
                raise AssertionError(f"closed without exit: {msg}")


def test_pty_runs_a_command_in_a_terminal(api: Api) -> None:
    sid = api.new()["id"]
    out, end = _pty(api, sid, command="test -t 1 && echo tty-yes; stty size; exit 3", cols="100", rows="30")
    assert end == {"type": "exit", "exitCode": 3}
    assert out.replace(b"\r\n", b"\n").split(b"\n")[:2] == [b"tty-yes", b"30 100"]


def test_pty_takes_input_and_refuses_bad_requests(api: Api) -> None:
    sid = api.new()["id"]
    with api.c.websocket_connect(f"/v1/sandboxes/{sid}/pty?command=read+x%3B+echo+got-%24x", headers=api.h) as ws:
        ws.send_bytes(b"abc\n")
        out = b""
        while True:
            msg = ws.receive()
            if msg.get("text"):
                assert json.loads(msg["text"]) == {"type": "exit", "exitCode": 0}
                break
            out += msg.get("bytes") or b""
        assert b"got-abc" in out
    with api.c.websocket_connect(f"/v1/sandboxes/{sid}/pty") as ws:
        assert json.loads(ws.receive_text())["code"] == "unauthorized"
    with api.c.websocket_connect("/v1/sandboxes/sb_0000000000/pty", headers=api.h) as ws:
        assert json.loads(ws.receive_text())["code"] == "not_found"
    api.post(f"/v1/sandboxes/{sid}/stop?wait=true")
    with api.c.websocket_connect(f"/v1/sandboxes/{sid}/pty", headers=api.h) as ws:
        assert json.loads(ws.receive_text())["code"] == "not_running"
    wait_until(lambda: api.control.activity._active.get(sid) is None)
