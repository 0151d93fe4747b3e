"""The console's sign-in and sessions (sbx.api.auth, sbx.api.console) and the stats sampler
(sbx.control.sandboxes.sampler)
on the real app with a FakeNode. The browser side is tests/e2e/api/test_console.py."""

from __future__ import annotations

from typing import Any

import pytest

from sbx.api.auth import Gate
from sbx.api.sessions import CSRF_HEADER, SESSION_COOKIE, Sessions
from sbx.control.errors import ControlError
from sbx.control.sandboxes.sampler import WINDOW_SECONDS, Sampler
from sbx.node.types import NodeError, Stats
from tests.fakes import TOKEN, Api


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def code(call: Any) -> tuple[int, str]:
    with pytest.raises(ControlError) as e:
        call()
    return e.value.status, e.value.code


def test_a_session_expires_and_closes() -> None:
    clock = Clock()
    sessions = Sessions(seconds=60, clock=clock)
    s = sessions.open("k", "key_1")
    assert sessions.get(s.id) is s and s.id != s.csrf and len(s.id) >= 40
    clock.now += 59
    assert sessions.get(s.id) is s
    clock.now += 2
    assert sessions.get(s.id) is None
    s2 = sessions.open("k", "key_1")
    sessions.close(s2.id)
    assert sessions.get(s2.id) is None and sessions.get(None) is None and sessions.get("") is None


def test_the_gate_takes_a_bearer_key_or_a_session_with_its_csrf_token(api: Api) -> None:
    gate: Gate = api.c.app.state.gate  # type: ignore[attr-defined]
    account, _, token = api.control.accounts.create_account("alice")
    ip = "10.0.0.1"

    def check(method: str, headers: dict[str, str], cookies: dict[str, str], query: dict[str, str] | None = None,
              websocket: bool = False) -> Any:
        return gate.authorize(method, headers, cookies, ip, query, websocket)

    who = check("POST", {"authorization": f"Bearer {token}"}, {})
    assert who.account_id == account.id and not who.admin
    assert code(lambda: check("GET", {"authorization": "Bearer nope"}, {})) == (401, "unauthorized")
    assert code(lambda: check("GET", {"authorization": f"Basic {token}"}, {})) == (401, "unauthorized")
    assert code(lambda: check("GET", {}, {})) == (401, "unauthorized")
    assert code(lambda: check("GET", {}, {SESSION_COOKIE: "made-up"})) == (401, "unauthorized")
    s = gate.sessions.open(token, who.key_id)
    jar = {SESSION_COOKIE: s.id}
    assert check("GET", {}, jar) == who  # the same Principal a bearer request gets
    assert code(lambda: check("POST", {}, jar)) == (403, "csrf_failed")
    assert code(lambda: check("DELETE", {CSRF_HEADER: "wrong"}, jar)) == (403, "csrf_failed")
    assert check("POST", {CSRF_HEADER: s.csrf}, jar).key_id == who.key_id
    # a wrong bearer header is never rescued by a good cookie
    assert code(lambda: check("GET", {"authorization": "Bearer nope"}, jar)) == (401, "unauthorized")
    # a WebSocket needs the page's own origin and the token in the query
    ws = {"host": "127.0.0.1:7070", "origin": "http://127.0.0.1:7070"}
    assert check("GET", ws, jar, {"csrf": s.csrf}, websocket=True) == who
    assert code(lambda: check("GET", ws, jar, {}, websocket=True)) == (403, "csrf_failed")
    assert code(lambda: check("GET", {**ws, "origin": "http://8000-x.sbx.localhost"}, jar, {"csrf": s.csrf},
                              websocket=True)) == (403, "csrf_failed")
    assert code(lambda: check("GET", {"host": ws["host"]}, jar, {"csrf": s.csrf}, websocket=True)
                ) == (403, "csrf_failed")


def test_a_session_dies_with_its_key(api: Api) -> None:
    """A revoked key ends the sessions it opened: the next cookie request is 401 and the session is gone."""
    _, key, token = api.control.accounts.create_account("bob")
    r = api.c.post("/v1/console/session", json={"key": token})
    assert r.status_code == 200 and r.json()["session"]["keyId"] == key.id
    sid = api.c.cookies[SESSION_COOKIE]
    assert api.c.get("/v1/sandboxes").status_code == 200
    assert api.delete(f"/v1/keys/{key.id}").status_code == 200
    r = api.c.get("/v1/sandboxes")
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    gate: Gate = api.c.app.state.gate  # type: ignore[attr-defined]
    assert gate.sessions.get(sid) is None


def test_a_session_sees_only_its_account(api: Api) -> None:
    """Cookie requests get the same ownership rules as bearer ones: another account's sandbox is 404."""
    theirs = api.new()  # the admin key's account
    _, _, token = api.control.accounts.create_account("carol")
    csrf = api.c.post("/v1/console/session", json={"key": token}).json()["session"]["csrf"]
    assert api.c.get("/v1/sandboxes").json()["sandboxes"] == []
    for path in (f"/v1/sandboxes/{theirs['id']}", f"/v1/sandboxes/{theirs['id']}/stats"):
        r = api.c.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
    r = api.c.post(f"/v1/sandboxes/{theirs['id']}/stop", headers={CSRF_HEADER: csrf})
    assert r.status_code == 404
    assert api.sandbox(theirs["id"])["state"] == "running"


def test_sign_in_sets_an_httponly_strict_cookie_and_a_wrong_key_is_refused(api: Api) -> None:
    c = api.c
    r = c.post("/v1/console/session", json={"key": "sbx_wrong"})
    assert r.status_code == 401 and r.json()["error"] == {"code": "unauthorized", "message": "wrong, revoked or "
                                                          "expired API key"}
    assert SESSION_COOKIE not in r.headers.get("set-cookie", "")
    assert c.post("/v1/console/session", json={}).status_code == 422
    r = c.post("/v1/console/session", json={"key": TOKEN}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
    r = c.post("/v1/console/session", json={"key": TOKEN})
    assert r.status_code == 200
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{SESSION_COOKIE}=") and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert TOKEN not in cookie
    csrf = r.json()["session"]["csrf"]
    assert c.get("/v1/console/session").json()["session"]["csrf"] == csrf
    assert c.get("/v1/sandboxes").status_code == 200  # the cookie alone reads
    r = c.post("/v1/sandboxes", json={"type": "small"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
    assert c.get("/v1/sandboxes").json()["sandboxes"] == []  # nothing was made
    r = c.post("/v1/sandboxes", json={"type": "small"}, headers={CSRF_HEADER: csrf})
    assert r.status_code == 202
    r = c.delete("/v1/console/session")
    assert r.status_code == 200 and r.json() == {"signedOut": True}
    assert c.get("/v1/sandboxes").status_code == 401
    assert c.get("/v1/console/session").status_code == 401


def test_the_page_is_served_with_a_strict_content_security_policy(api: Api) -> None:
    r = api.c.get("/")
    assert r.status_code == 200, "console assets missing: run scripts/build-console.sh"
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
    assert '<script type="module" src="/console/app.js">' in r.text
    assert api.c.get("/console/app.js").headers["content-type"].startswith("text/javascript")
    assert api.c.get("/console/vendor/xterm.js").status_code == 200
    paths = api.c.get("/openapi.json").json()["paths"]
    assert "/" not in paths and "/v1/console/session" in paths and "/v1/sandboxes/{sandbox_id}/stats" in paths


class StubNode:
    def __init__(self) -> None:
        self.used = 10
        self.fail: set[str] = set()

    def stats(self, id: str, space: bool = True) -> Stats:
        if id in self.fail:
            raise NodeError("not_found", id)
        self.used += 1
        return Stats(memory_total_mb=256, memory_used_mb=self.used, cpu_percent=12.34, disk_used_mb=0, oom_kills=0)


def test_the_sampler_keeps_one_hour_per_running_sandbox() -> None:
    clock = Clock()
    node = StubNode()
    running = ["a", "b"]
    s = Sampler(node, lambda: list(running), every=10, clock=clock)  # type: ignore[arg-type]
    for _ in range(400):  # 4000 s of samples
        s.run_once()
        clock.now += 10
    a = s.series("a")
    assert WINDOW_SECONDS // 10 - 1 <= len(a) <= WINDOW_SECONDS // 10 + 1
    assert a[0].at >= clock.now - WINDOW_SECONDS and a == sorted(a, key=lambda x: x.at)
    assert a[-1].cpu_percent == 12.3 and a[-1].memory_total_mb == 256
    assert len(s.series("a", seconds=60)) == 6
    node.fail.add("b")  # a failing sample is skipped, not fatal
    running.remove("a")
    s.run_once()
    assert len(s.series("b")) == len(a)
    clock.now += WINDOW_SECONDS + 1
    s.run_once()
    assert s.series("a") == [] and s.series("b") == []
    s.forget("a")


def test_the_stats_route_answers_the_sampled_series(api: Api) -> None:
    sb = api.new()
    cp = api.control
    for _ in range(3):
        cp.sampler.run_once()
    r = api.get(f"/v1/sandboxes/{sb['id']}/stats")
    assert r.status_code == 200
    body = r.json()
    assert body["sandboxId"] == sb["id"] and body["intervalSeconds"] == cp.settings.stats_sample_seconds
    assert len(body["samples"]) == 3
    assert set(body["samples"][0]) == {"at", "memoryUsedMb", "memoryTotalMb", "cpuPercent"}
    assert body["samples"][0]["memoryUsedMb"] == 42
    assert api.get("/v1/sandboxes/sb_nope/stats").status_code == 404
    assert api.get(f"/v1/sandboxes/{sb['id']}/stats?seconds=0").status_code == 400
    api.delete(f"/v1/sandboxes/{sb['id']}?wait=true")
    assert cp.sampler.series(sb["id"]) == []


