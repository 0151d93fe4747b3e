"""The envd side of the E2B layer (:mod:`sbx.api.e2b.envd`, :mod:`sbx.api.e2b.connect`, :mod:`sbx.api.e2b.fs`,
:mod:`sbx.api.e2b.procs`): Connect's JSON framing, routing by ``E2b-Sandbox-Id``, access tokens, the filesystem
calls (run for real by the fake node's local bash), /files, and how a process's follower output becomes events."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sbx.api.e2b import connect, fs, procs
from sbx.api.e2b.connect import ConnectError
from sbx.api.e2b.envd import basic_user
from sbx.api.e2b.files import FilesError, parse_multipart
from tests.fakes import TOKEN, Api, make_api
from tests.unit.api.test_files_ports import SpawnNode


@pytest.fixture
def spawn_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Api]:
    """The app on a fake node that also runs the file programs (``spawn``) on this host."""
    monkeypatch.setattr("tests.fakes.FakeNode", SpawnNode)
    yield from make_api(tmp_path)


def sandbox(api: Api) -> tuple[str, dict[str, str]]:
    made = api.c.post("/e2b/v2/sandboxes", json={"templateID": "base"}, headers={"X-API-KEY": TOKEN}).json()
    sid = made["sandboxID"]
    return sid, {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", "X-Access-Token": made["envdAccessToken"]}


def frames(body: bytes) -> list[tuple[int, dict[str, Any]]]:
    out, at = [], 0
    while at < len(body):
        flags, size = struct.unpack(">BI", body[at:at + 5])
        out.append((flags, json.loads(body[at + 5:at + 5 + size])))
        at += 5 + size
    return out


# framing ---------------------------------------------------------------------------------------------------------
def test_envelopes_round_trip_and_end_frames() -> None:
    data = connect.frame({"a": 1}) + connect.frame({"b": "x"})
    assert connect.parse_envelopes(data) == [{"a": 1}, {"b": "x"}]
    assert frames(connect.end_frame()) == [(connect.END_STREAM, {})]
    assert frames(connect.end_frame(ConnectError("not_found", "gone"))) == [
        (2, {"error": {"code": "not_found", "message": "gone"}})]
    assert connect.parse_envelopes(b"") == []


@pytest.mark.parametrize("body,code", [
    (b"\x00\x00\x00", "invalid_argument"),
    (b"\x00\x00\x00\x00\x09{}", "invalid_argument"),
    (b"\x01\x00\x00\x00\x02{}", "invalid_argument"),
    (b"\x00\x00\x00\x00\x02[]", "invalid_argument"),
    (b"\x00\x00\x00\x00\x01{", "invalid_argument"),
    (b"\x00\xff\xff\xff\xff", "resource_exhausted"),
])
def test_bad_envelopes_are_refused(body: bytes, code: str) -> None:
    with pytest.raises(ConnectError) as e:
        connect.parse_envelopes(body)
    assert e.value.code == code


def test_an_unknown_code_becomes_unknown_and_unary_errors_have_their_status() -> None:
    assert ConnectError("weird", "x").code == "unknown"
    r = connect.unary_error(ConnectError("already_exists", "there"))
    assert r.status_code == 409 and json.loads(bytes(r.body)) == {"code": "already_exists", "message": "there"}


# routing and tokens ----------------------------------------------------------------------------------------------
def test_requests_without_the_header_stay_sbxs_and_unknown_sandboxes_get_502(api: Api) -> None:
    assert api.c.get("/healthz").json()["ok"] is True
    r = api.c.get("/health", headers={"E2b-Sandbox-Id": "sb_nothere000"})
    assert r.status_code == 502 and r.json() == {"sandboxId": "sb_nothere000", "message": "The sandbox was not found",
                                                 "code": 502}


def test_health_token_and_paused_sandboxes(api: Api) -> None:
    sid, hdr = sandbox(api)
    assert api.c.get("/health", headers={"E2b-Sandbox-Id": sid}).status_code == 204
    no_token = {k: v for k, v in hdr.items() if k != "X-Access-Token"}
    r = api.c.post("/process.Process/List", json={}, headers=no_token)
    assert r.status_code == 401 and r.json()["code"] == 401
    r = api.c.post("/process.Process/List", json={}, headers={**hdr, "X-Access-Token": "0" * 64})
    assert r.status_code == 401
    r = api.c.get("/health", headers={**hdr, "E2b-Sandbox-Port": "99999"})
    assert (r.status_code, r.json()["code"]) == (400, 400)
    api.c.post(f"/e2b/sandboxes/{sid}/pause", json={}, headers={"X-API-KEY": TOKEN})
    assert api.c.get("/health", headers=hdr).status_code == 502


def test_unknown_methods_wrong_types_and_users(api: Api) -> None:
    _sid, hdr = sandbox(api)
    r = api.c.post("/filesystem.Filesystem/Nope", json={}, headers=hdr)
    assert r.status_code == 501 and r.json()["code"] == "unimplemented"
    r = api.c.post("/filesystem.Filesystem/Stat", content=b"{}", headers={**hdr, "Content-Type": "text/plain"})
    assert r.status_code == 415
    r = api.c.post("/filesystem.Filesystem/Stat", content=b"{nope", headers={**hdr, "Content-Type":
                                                                             "application/json"})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    basic = "Basic " + base64.b64encode(b"mallory:").decode()
    r = api.c.post("/filesystem.Filesystem/Stat", json={"path": "/"}, headers={**hdr, "Authorization": basic})
    assert r.status_code == 403 and r.json()["code"] == "permission_denied"
    r = api.c.post("/filesystem.Filesystem/Stat", json={"path": ""}, headers=hdr)
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    r = api.c.get("/files", params={"path": "/x", "username": "mallory"}, headers=hdr)
    assert r.status_code == 401 and r.json()["code"] == 401


def test_basic_user() -> None:
    assert basic_user(None) is None and basic_user("Bearer x") is None
    assert basic_user("Basic " + base64.b64encode(b"root:").decode()) == "root"
    assert basic_user("Basic %%%") == ""


# the filesystem calls, run by the fake node's bash on a scratch folder -------------------------------------------
def test_filesystem_calls(api: Api, tmp_path: Path) -> None:
    _sid, hdr = sandbox(api)
    base = tmp_path / "fs"
    base.mkdir()
    (base / "a.txt").write_text("hello")
    (base / "link").symlink_to("a.txt")

    def call(method: str, **body: Any) -> Any:
        return api.c.post(f"/filesystem.Filesystem/{method}", json=body, headers=hdr)

    st = call("Stat", path=str(base / "a.txt"))
    assert st.status_code == 200, st.text
    entry = st.json()["entry"]
    assert entry["name"] == "a.txt" and entry["type"] == "FILE_TYPE_FILE" and entry["size"] == "5"
    assert entry["path"] == str(base / "a.txt") and entry["permissions"].startswith("-rw")
    assert entry["modifiedTime"].endswith("Z") and entry["owner"]
    link = call("Stat", path=str(base / "link")).json()["entry"]
    assert link["symlinkTarget"] == str(base / "a.txt") and link["type"] == "FILE_TYPE_FILE"
    missing = call("Stat", path=str(base / "nope"))
    assert missing.status_code == 404 and missing.json()["code"] == "not_found"

    made = call("MakeDir", path=str(base / "d1" / "d2"))
    assert made.status_code == 200 and made.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
    assert call("MakeDir", path=str(base / "d1")).json()["code"] == "already_exists"
    listed = call("ListDir", path=str(base), depth=2).json()["entries"]
    assert {e["name"] for e in listed} == {"a.txt", "link", "d1", "d2"}
    assert {e["name"] for e in call("ListDir", path=str(base)).json()["entries"]} == {"a.txt", "link", "d1"}
    assert call("ListDir", path=str(base / "a.txt")).json()["code"] == "invalid_argument"
    assert call("ListDir", path=str(base), depth=0.5).json()["code"] == "invalid_argument"

    moved = call("Move", source=str(base / "a.txt"), destination=str(base / "x" / "b.txt"))
    assert moved.status_code == 200 and moved.json()["entry"]["path"] == str(base / "x" / "b.txt")
    assert (base / "x" / "b.txt").read_text() == "hello"
    assert call("Move", source=str(base / "a.txt"), destination=str(base / "c")).json()["code"] == "not_found"
    assert call("Remove", path=str(base / "d1")).status_code == 200 and not (base / "d1").exists()
    assert call("Remove", path=str(base / "d1")).json() == {}  # gone already: envd answers the same
    assert call("Remove", path="/").json()["code"] == "invalid_argument"


def test_absolute_paths_and_permissions() -> None:
    assert fs.absolute("notes/a", "user") == "/home/user/notes/a"
    assert fs.absolute("~", "root") == "/root" and fs.absolute("/a/../b/", "user") == "/b"
    for bad in ("", None, "a\0b", "x" * 5000):
        with pytest.raises(ConnectError):
            fs.absolute(bad, "user")
    assert fs.permissions("d", 0o755) == "drwxr-xr-x" and fs.permissions("f", 0o644) == "-rw-r--r--"


# /files ----------------------------------------------------------------------------------------------------------
def test_files_upload_and_download(spawn_api: Api, tmp_path: Path) -> None:
    api = spawn_api
    _sid, hdr = sandbox(api)
    target = tmp_path / "up" / "one.txt"
    r = api.c.post("/files", params={"path": str(target)}, files={"file": ("one.txt", b"first\n")}, headers=hdr)
    assert r.status_code == 200, r.text
    assert r.json() == [{"path": str(target), "name": "one.txt", "type": "file"}]
    assert target.read_bytes() == b"first\n"
    got = api.c.get("/files", params={"path": str(target)}, headers=hdr)
    assert got.status_code == 200 and got.content == b"first\n"
    import gzip

    r = api.c.post("/files", params={"path": str(target)}, content=gzip.compress(b"zipped"),
                   headers={**hdr, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
    assert r.status_code == 200 and target.read_bytes() == b"zipped"
    two = [("file", (str(tmp_path / "m1"), b"1")), ("file", (str(tmp_path / "m2"), b"22"))]
    r = api.c.post("/files", files=two, headers=hdr)
    assert [e["name"] for e in r.json()] == ["m1", "m2"] and (tmp_path / "m2").read_bytes() == b"22"
    r = api.c.get("/files", params={"path": str(tmp_path / "absent")}, headers=hdr)
    assert r.status_code == 404 and r.json()["code"] == 404
    r = api.c.post("/files", params={"path": str(target)}, content=b"x", headers={**hdr, "Content-Type":
                                                                                "text/plain"})
    assert r.status_code == 400 and r.json()["code"] == 400


def test_multipart_parsing() -> None:
    body = (b"--XX\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a/b.txt\"\r\n"
            b"Content-Type: application/octet-stream\r\n\r\nline1\r\nline2\r\n--XX--\r\n")
    assert parse_multipart(body, 'multipart/form-data; boundary="XX"') == [("a/b.txt", b"line1\r\nline2")]
    with pytest.raises(FilesError):
        parse_multipart(body, "multipart/form-data")
    with pytest.raises(FilesError):
        parse_multipart(b"garbage", "multipart/form-data; boundary=XX")


# processes -------------------------------------------------------------------------------------------------------
class StubPlane:
    """Answers each exec with the next scripted list of lines; records the commands."""

    def __init__(self, *answers: list[dict[str, Any]]):
        self.answers = list(answers)
        self.commands: list[tuple[str, str]] = []

    def exec(self, sid: str, command: str, timeout: Any, user: str, *rest: Any) -> Iterator[dict[str, Any]]:
        self.commands.append((user, command))
        return iter(self.answers.pop(0))


def out(stream: str, data: bytes) -> dict[str, Any]:
    return {"stream": stream, "data": base64.b64encode(data).decode(), "encoding": "base64"}


def test_follow_turns_the_followers_output_into_process_events() -> None:
    cp = StubPlane([out("stdout", b"4"), out("stdout", b"2\nhel"), out("stderr", b"oops"), out("stdout", b"lo"),
                    {"exitCode": 3, "timedOut": False}])
    events = list(procs.follow(cp, "sb_x", "job_abcdefgh", False, lambda: False))  # type: ignore[arg-type]
    assert events == [{"start": {"pid": 42}}, {"data": {"stdout": base64.b64encode(b"hel").decode()}},
                      {"data": {"stderr": base64.b64encode(b"oops").decode()}},
                      {"data": {"stdout": base64.b64encode(b"lo").decode()}},
                      {"end": {"exitCode": 3, "exited": True, "status": "exit status 3"}}]
    assert cp.commands[0][0] == "root" and "job_abcdefgh" in cp.commands[0][1]


def test_a_killed_follower_is_checked_against_the_jobs_exit_file() -> None:
    cp = StubPlane([out("stdout", b"7\n"), {"exitCode": 137, "timedOut": False}],
                   [out("stdout", b"137\n"), {"exitCode": 0, "timedOut": False}])
    assert list(procs.follow(cp, "sb_x", "job_abcdefgh", False, lambda: False))[-1]["end"]["exitCode"] == 137  # type: ignore[arg-type]
    cp = StubPlane([out("stdout", b"7\n"), {"exitCode": 143, "timedOut": False}], [{"exitCode": 1, "timedOut": False}])
    with pytest.raises(ConnectError) as e:
        list(procs.follow(cp, "sb_x", "job_abcdefgh", False, lambda: False))  # type: ignore[arg-type]
    assert e.value.code == "unavailable"
    cp = StubPlane([out("stdout", b"none\n"), {"exitCode": 0, "timedOut": False}])
    with pytest.raises(ConnectError) as e:
        list(procs.follow(cp, "sb_x", "job_abcdefgh", False, lambda: False))  # type: ignore[arg-type]
    assert e.value.code == "not_found"
    cp = StubPlane([out("stdout", b"7\n"), {"error": {"code": "not_running", "message": "stopped"}}])
    with pytest.raises(ConnectError) as e:
        list(procs.follow(cp, "sb_x", "job_abcdefgh", False, lambda: False))  # type: ignore[arg-type]
    assert e.value.code == "unavailable"


def test_a_pty_process_runs_under_script_with_its_size_and_a_stdin_pipe() -> None:
    cmd = procs.job_command("/bin/bash", ["-i", "-l"], None, None, pty=(100, 30))
    assert "mkfifo" in cmd and "exec script -qfec 'stty cols 100 rows 30 2>/dev/null; /bin/bash -i -l; c=$?; " in cmd
    assert cmd.split("\n")[2].endswith(' /dev/null < "$s/stdin"')
    meta = json.loads(base64.b64decode(cmd.rsplit(procs.MARK, 1)[1]))
    assert meta["pty"] is True
    cp = StubPlane([out("stdout", b"9\n\x1b[?2004h$ "), {"exitCode": 0, "timedOut": False}])
    events = list(procs.follow(cp, "sb_x", "job_abcdefgh", False, lambda: False, pty=True))  # type: ignore[arg-type]
    assert events[1] == {"data": {"pty": base64.b64encode(b"\x1b[?2004h$ ").decode()}}


def test_job_commands_keep_their_config_for_list() -> None:
    cmd = procs.job_command("/bin/bash", ["-l", "-c", "echo 'hi'\nnext"], "/tmp", "t1")
    assert cmd.startswith("printf '%s\\n' \"$$\" >&2\nexec /bin/bash -l -c ")
    meta = cmd.rsplit(procs.MARK, 1)[1]
    assert json.loads(base64.b64decode(meta)) == {"cmd": "/bin/bash", "args": ["-l", "-c", "echo 'hi'\nnext"],
                                                  "cwd": "/tmp", "tag": "t1"}
    line = f"job_abcdefgh 42 {meta}\n".encode()
    cp = StubPlane([out("stdout", line), {"exitCode": 0, "timedOut": False}])
    assert procs.listed(cp, "sb_x") == {"processes": [  # type: ignore[arg-type]
        {"config": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo 'hi'\nnext"], "envs": {}, "cwd": "/tmp"},
         "pid": 42, "tag": "t1"}]}


@pytest.mark.parametrize("request_,code", [
    ({}, "invalid_argument"),
    ({"process": {"cmd": ""}}, "invalid_argument"),
    ({"process": {"cmd": "ls", "args": "x"}}, "invalid_argument"),
    ({"process": {"cmd": "ls", "envs": {"A": 1}}}, "invalid_argument"),
    ({"process": {"cmd": "ls\0"}}, "invalid_argument"),
    ({"process": {"cmd": "ls"}, "pty": {"size": {"cols": 0, "rows": 24}}}, "invalid_argument"),
    ({"process": {"cmd": "ls"}, "stdin": "yes"}, "invalid_argument"),
])
def test_bad_start_requests(request_: dict[str, Any], code: str) -> None:
    with pytest.raises(ConnectError) as e:
        procs.start(StubPlane(), "sb_x", request_, "user")  # type: ignore[arg-type]
    assert e.value.code == code


def test_a_start_stream_ends_with_its_error_frame(api: Api) -> None:
    _sid, hdr = sandbox(api)
    body = connect.frame({"process": {"cmd": "true"}})
    r = api.c.post("/process.Process/Start", content=body,
                   headers={**hdr, "Content-Type": "application/connect+json"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/connect+json")
    flags, last = frames(r.content)[-1]
    assert flags == connect.END_STREAM and last["error"]["code"] == "not_found"  # the fake node keeps no job files
    r = api.c.post("/process.Process/Start", content=b"\x00\x00", headers={**hdr, "Content-Type":
                                                                           "application/connect+json"})
    assert r.status_code == 200 and frames(r.content) == [(2, {"error": {
        "code": "invalid_argument", "message": "truncated envelope: fewer than 5 header bytes"}})]
    r = api.c.post("/process.Process/Start", json={}, headers=hdr)
    assert r.status_code == 415


def test_signed_file_urls_need_no_header(spawn_api: Api, tmp_path: Path) -> None:
    import hashlib
    import time

    api = spawn_api
    sid, hdr = sandbox(api)
    target = str(tmp_path / "signed.txt")
    api.c.post("/files", params={"path": target}, files={"file": ("x", b"signed!")}, headers=hdr)

    def sign(path: str, op: str, exp: int | None = None) -> dict[str, str]:
        raw = f"{path}:{op}::{hdr['X-Access-Token']}" + (f":{exp}" if exp is not None else "")
        sig = "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()
        return {"path": path, "signature": sig, **({"signature_expiration": str(exp)} if exp else {})}

    r = api.c.get("/files", params=sign(target, "read"))
    assert r.status_code == 200 and r.content == b"signed!"
    r = api.c.get("/files", params=sign(target, "read", int(time.time()) + 60))
    assert r.status_code == 200
    r = api.c.get("/files", params=sign(target, "read", int(time.time()) - 60))
    assert r.status_code == 401 and r.json() == {"code": 401, "message": "signature is already expired"}
    r = api.c.get("/files", params=sign(target, "write"))  # a write signature does not read
    assert r.status_code == 401 and r.json()["code"] == 401
    r = api.c.post("/files", params=sign(target, "write"), files={"file": ("x", b"again")})
    assert r.status_code == 200 and (tmp_path / "signed.txt").read_bytes() == b"again"
    assert sid


def test_watchers_report_what_changed_between_polls(api: Api, tmp_path: Path) -> None:
    _sid, hdr = sandbox(api)
    d = tmp_path / "w"
    (d / "sub").mkdir(parents=True)
    (d / "keep.txt").write_text("a")
    (d / "gone.txt").write_text("b")

    def call(method: str, **body: Any) -> Any:
        r = api.c.post(f"/filesystem.Filesystem/{method}", json=body, headers=hdr)
        return r.json()

    wid = call("CreateWatcher", path=str(d), recursive=True, includeEntry=True)["watcherId"]
    assert call("GetWatcherEvents", watcherId=wid) == {"events": []}
    (d / "keep.txt").write_text("changed")
    (d / "gone.txt").unlink()
    (d / "sub" / "new.txt").write_text("new")
    events = call("GetWatcherEvents", watcherId=wid)["events"]
    assert [(e["name"], e["type"]) for e in events] == [
        ("gone.txt", "EVENT_TYPE_REMOVE"), ("keep.txt", "EVENT_TYPE_WRITE"), ("sub/new.txt", "EVENT_TYPE_CREATE"),
        ("sub/new.txt", "EVENT_TYPE_WRITE"), ("sub/new.txt", "EVENT_TYPE_CHMOD")]
    assert events[1]["entry"]["path"] == str(d / "keep.txt") and "entry" not in events[0]
    assert call("RemoveWatcher", watcherId=wid) == {}
    assert call("GetWatcherEvents", watcherId=wid)["code"] == "not_found"
    assert call("CreateWatcher", path=str(tmp_path / "absent"))["code"] == "not_found"
    assert call("CreateWatcher", path=str(d / "keep.txt"))["code"] == "invalid_argument"
    flat = call("CreateWatcher", path=str(d))["watcherId"]
    (d / "sub" / "deeper.txt").write_text("x")
    assert call("GetWatcherEvents", watcherId=flat) == {"events": []}  # not recursive: sub's files unseen


def test_a_watch_stream_starts_then_reports_changes(api: Api, tmp_path: Path) -> None:
    from sbx.api.e2b.watch import Watchers

    sid, _hdr = sandbox(api)
    d = tmp_path / "ws"
    d.mkdir()
    gone = False
    stream = Watchers().stream(api.control, sid, {"path": str(d)}, "user", lambda: gone, every=0.1)
    assert next(stream) == {"start": {}}
    (d / "n.txt").write_text("x")
    assert next(stream) == {"filesystem": {"name": "n.txt", "type": "EVENT_TYPE_CREATE"}}
    assert next(stream)["filesystem"]["type"] == "EVENT_TYPE_WRITE"
    gone = True
    assert next(stream, None) in (None, {"filesystem": {"name": "n.txt", "type": "EVENT_TYPE_CHMOD"}})


def test_a_stream_ends_with_deadline_exceeded_at_its_deadline(api: Api, tmp_path: Path) -> None:
    _sid, hdr = sandbox(api)
    r = api.c.post("/filesystem.Filesystem/WatchDir", content=connect.frame({"path": str(tmp_path)}),
                   headers={**hdr, "Content-Type": "application/connect+json", "Connect-Timeout-Ms": "400"})
    got = frames(r.content)
    assert got[0] == (0, {"start": {}})
    assert got[-1] == (2, {"error": {"code": "deadline_exceeded", "message": "the call's deadline passed"}})


def test_other_ports_forward_only_by_e2b_rules(api: Api) -> None:
    """Another port than envd's is forwarded only for a sandbox made through E2B's API, and a private one's only
    with its traffic token (forwarding on real sandboxes: tests/e2e/api/test_e2b_interpreter.py)."""
    native = api.new()["id"]
    r = api.c.get("/health", headers={"E2b-Sandbox-Id": native, "E2b-Sandbox-Port": "8080"})
    assert r.status_code == 502
    assert "only sandboxes created through E2B's API" in r.json()["message"]
    made = api.c.post("/e2b/v2/sandboxes", json={"templateID": "base", "network": {"allowPublicTraffic": False}},
                      headers={"X-API-KEY": TOKEN}).json()
    private = {"E2b-Sandbox-Id": made["sandboxID"], "E2b-Sandbox-Port": "49999"}
    r = api.c.get("/health", headers=private)
    assert (r.status_code, r.json()["code"]) == (401, 401)
    r = api.c.get("/health", headers={**private, "E2B-Traffic-Access-Token": "0" * 64})
    assert r.status_code == 401 and "a wrong" in r.json()["message"]
    r = api.c.get("/health", headers={"E2b-Sandbox-Id": "sb_nothere000", "E2b-Sandbox-Port": "49999"})
    assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found"


def test_another_port_is_forwarded_with_e2b_headers_removed(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forwarding itself, against an HTTP server on this host standing in for the sandbox's port: the request
    arrives without E2B's headers and tokens, the streamed answer comes back whole; a refused port gets E2B's 502."""
    import asyncio
    import http.server
    import threading

    seen: list[dict[str, str]] = []

    class Port(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append({**{k.lower(): v for k, v in self.headers.items()}, "path": self.path, "body": body.decode()})
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for line in (b'{"n": 1}\n', b'{"n": 2}\n'):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.write(b"0\r\n\r\n")

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Port)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    target = {"port": httpd.server_address[1]}

    async def fake_open(cp: Any, sandbox_id: str, port: int) -> Any:
        from sbx.api.upstream import Unreachable
        try:
            return await asyncio.open_connection("127.0.0.1", target["port"])
        except ConnectionRefusedError as e:  # as sbx.api.upstream.open_upstream says it
            raise Unreachable(502, "upstream_unreachable", f"nothing answers on port {port}", refused=True) from e

    monkeypatch.setattr("sbx.api.e2b.ports.open_upstream", fake_open)
    sid, hdr = sandbox(api)
    try:
        r = api.c.post("/execute?x=1", content=b'{"code": "1"}', headers={**hdr, "E2b-Sandbox-Port": "49999",
                                                                           "Content-Type": "application/json"})
        assert r.status_code == 200 and r.text == '{"n": 1}\n{"n": 2}\n'
        got = seen[-1]
        assert got["path"] == "/execute?x=1" and got["body"] == '{"code": "1"}' and got["host"] == "localhost:49999"
        assert not {"e2b-sandbox-id", "e2b-sandbox-port", "x-access-token"} & set(got)
    finally:
        httpd.shutdown()
        httpd.server_close()
    target["port"] = httpd.server_address[1]  # closed now: refused
    monkeypatch.setattr("sbx.api.e2b.ports.BOOT_WAIT", 0.5)
    r = api.c.post("/execute", content=b"{}", headers={**hdr, "E2b-Sandbox-Port": "49999"})
    assert r.status_code == 502 and r.json()["code"] == 502 and "nothing answers" in r.json()["message"]
