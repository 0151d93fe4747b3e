"""The lifecycle through the real server and CLI on real sandboxes: error codes over HTTP, stop then an immediate
resume, ten stop/resume cycles keeping files and id, and the TTL stop that activity pushes back."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

pytestmark = pytest.mark.e2e


def _new(server: Any, *args: str) -> str:
    r = server.sbx("new", "--type", "small", "--json", *args, check=True)
    return str(json.loads(r.stdout)["sandbox"]["id"])


def _http(server: Any, method: str, path: str, body: bytes | None = None, token: str | None = "ok") -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {server.token if token == 'ok' else token}"
    req = urllib.request.Request(server.url + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_error_codes_over_http(server: Any) -> None:
    sid = _new(server)
    assert _http(server, "GET", "/v1/sandboxes", token=None)[0] == 401
    code, body = _http(server, "GET", "/v1/sandboxes", token="wrong")
    assert (code, body["error"]["code"]) == (401, "unauthorized")
    code, body = _http(server, "GET", "/v1/sandboxes/sb_doesnotexi")
    assert (code, body["error"]["code"]) == (404, "not_found")
    code, body = _http(server, "POST", "/v1/sandboxes", b'{"type": "huge"}')
    assert (code, body["error"]["code"]) == (400, "invalid_type")
    code, body = _http(server, "POST", "/v1/sandboxes", b'{"type": ')
    assert (code, body["error"]["code"]) == (422, "invalid_request")
    code, body = _http(server, "POST", f"/v1/sandboxes/{sid}/stop?wait=true")
    assert code == 200 and body["sandbox"]["state"] == "stopped"
    code, body = _http(server, "POST", f"/v1/sandboxes/{sid}/resume", b'{"type": "default", "requireMemory": true}')
    assert (code, body["error"]["code"]) == (400, "invalid_require_memory")
    server.sbx("resume", sid, "--type", "default", "--wait", check=True)
    code, body = _http(server, "POST", f"/v1/sandboxes/{sid}/stop?wait=true")
    code, body = _http(server, "POST", f"/v1/sandboxes/{sid}/resume", b'{"type": "small"}')
    assert (code, body["error"]["code"]) == (400, "invalid_resize")
    r = server.sbx("info", "sb_doesnotexi")
    assert r.returncode == 1 and r.stderr.startswith("error: not_found:")


def test_stop_then_immediate_resume_and_ten_cycles_keep_files_and_id(server: Any) -> None:
    sid = _new(server)
    server.sbx("exec", sid, "echo start > ~/cycle-0", check=True)
    # A stop that is still in flight when the resume arrives: the resume waits for it, never a 404.
    assert server.sbx("stop", sid).returncode == 0
    r = server.sbx("resume", sid, "--wait")
    assert r.returncode == 0, r.stderr
    for i in range(1, 11):
        server.sbx("exec", sid, f"echo {i} > ~/cycle-{i}", check=True)
        server.sbx("stop", sid, "--wait", check=True)
        server.sbx("resume", sid, "--wait", check=True)
    info = json.loads(server.sbx("info", sid, "--json", check=True).stdout)["sandbox"]
    assert (info["id"], info["state"], info["memoryRestored"]) == (sid, "running", True)
    out = server.sbx("exec", sid, "cat ~/cycle-*", check=True).stdout.split()
    assert sorted(out) == sorted(["start", *[str(i) for i in range(1, 11)]])


def _state(server: Any, sid: str) -> str:
    return str(json.loads(server.sbx("info", sid, "--json", check=True).stdout)["sandbox"]["state"])


def test_ttl_stops_an_idle_sandbox_and_activity_pushes_it_back(server: Any) -> None:
    sid = _new(server, "--ttl", "4")
    server.sbx("exec", sid, "echo kept > ~/f; sleep 1000 >/dev/null 2>&1 &", check=True)
    # A foreground exec that runs longer than the ttl is activity the whole time.
    r = server.sbx("exec", sid, "--timeout", "30", "sleep 9; echo still-here")
    assert (r.returncode, r.stdout.strip()) == (0, "still-here")
    assert _state(server, sid) == "running"
    deadline = time.monotonic() + 60
    while _state(server, sid) != "stopped":
        assert time.monotonic() < deadline, "the ttl never stopped the idle sandbox"
        time.sleep(1)
    server.sbx("resume", sid, "--wait", check=True)
    info = json.loads(server.sbx("info", sid, "--json", check=True).stdout)["sandbox"]
    assert info["memoryRestored"] is True and info["ttl"] == 4  # the ttl stop kept memory; resume kept the ttl
    assert server.sbx("exec", sid, "cat ~/f", check=True).stdout.strip() == "kept"
