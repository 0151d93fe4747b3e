"""E2B's REST API on sbx (:mod:`sbx.api.e2b.rest`) with a fake node: E2B's shapes and exact statuses, sbx's
operations behind them, account isolation, and E2B's error body for every bad input."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

import pytest

from sbx.api.e2b.tokens import access_token
from tests.fakes import TOKEN, Api


def h(key: str = TOKEN) -> dict[str, str]:
    return {"X-API-KEY": key}


def create(api: Api, key: str = TOKEN, **body: Any) -> dict[str, Any]:
    r = api.c.post("/e2b/v2/sandboxes", json={"templateID": "base", **body}, headers=h(key))
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def test_create_answers_201_with_a_running_sandbox_and_its_access_token(api: Api) -> None:
    made = create(api, timeout=120, metadata={"team": "ml"}, envVars={"FOO": "bar"},
                  autoResume={"enabled": True})
    sid = made["sandboxID"]
    assert made["templateID"] == "small" and made["clientID"] and made["envdVersion"] == "0.6.4"
    secret = (api.control.settings.state_dir / "e2b-secret").read_bytes().strip()
    assert made["envdAccessToken"] == access_token(secret, sid)
    row = api.control.get(sid)
    assert (row.state, row.ttl, row.labels, row.env, row.auto_resume) == ("running", 120, {"team": "ml",
                                                                                          "e2b.ports": "public"},
                                                                          {"FOO": "bar"}, True)
    got = api.c.get(f"/e2b/sandboxes/{sid}", headers=h()).json()
    assert got["state"] == "running" and got["metadata"] == {"team": "ml"} and got["cpuCount"] > 0
    assert got["envdAccessToken"] == made["envdAccessToken"] and got["startedAt"] <= got["endAt"]


def test_v1_create_and_a_size_as_template(api: Api) -> None:
    r = api.c.post("/e2b/sandboxes", json={"templateID": "default", "secure": True}, headers=h())
    assert r.status_code == 201 and api.control.get(r.json()["sandboxID"]).type == "default"


def test_list_filters_on_state_and_metadata_and_pages(api: Api) -> None:
    a = create(api, metadata={"k.y": "v&w=1 x"})["sandboxID"]
    b = create(api, metadata={"other": "1"})["sandboxID"]
    c = create(api)["sandboxID"]
    assert api.c.post(f"/e2b/sandboxes/{c}/pause", json={"memory": True}, headers=h()).status_code == 204
    every = api.c.get("/e2b/v2/sandboxes", headers=h()).json()
    assert {s["sandboxID"] for s in every} == {a, b, c}
    paused = api.c.get("/e2b/v2/sandboxes?state=paused", headers=h()).json()
    assert [(s["sandboxID"], s["state"]) for s in paused] == [(c, "paused")]
    running = api.c.get("/e2b/v2/sandboxes", params={"state": "running"}, headers=h()).json()
    assert {s["sandboxID"] for s in running} == {a, b}
    # the SDK quotes keys and values, urlencodes the dict, and the query is encoded once more
    meta = urlencode({quote("k.y"): quote("v&w=1 x")})
    found = api.c.get("/e2b/v2/sandboxes", params={"metadata": meta}, headers=h()).json()
    assert [s["sandboxID"] for s in found] == [a]
    first = api.c.get("/e2b/v2/sandboxes?limit=2", headers=h())
    assert len(first.json()) == 2 and first.headers["x-next-token"]
    second = api.c.get("/e2b/v2/sandboxes", params={"limit": 2, "nextToken": first.headers["x-next-token"]},
                       headers=h())
    assert len(second.json()) == 1 and "x-next-token" not in second.headers
    assert {s["sandboxID"] for s in first.json() + second.json()} == {a, b, c}
    assert [s["sandboxID"] for s in api.c.get("/e2b/sandboxes", headers=h()).json()] != []  # v1: running only
    assert c not in [s["sandboxID"] for s in api.c.get("/e2b/sandboxes", headers=h()).json()]


def test_pause_connect_timeout_and_kill(api: Api) -> None:
    sid = create(api, timeout=60)["sandboxID"]
    assert api.c.post(f"/e2b/sandboxes/{sid}/pause", json={"memory": True}, headers=h()).status_code == 204
    assert api.control.get(sid).state == "stopped"
    again = api.c.post(f"/e2b/sandboxes/{sid}/pause", json={}, headers=h())
    assert again.status_code == 409 and again.json()["code"] == 409
    r = api.c.post(f"/e2b/sandboxes/{sid}/connect", json={"timeout": 30}, headers=h())
    assert r.status_code == 201 and r.json()["sandboxID"] == sid and api.control.get(sid).state == "running"
    assert api.control.get(sid).ttl == 60  # connect only ever extends
    r = api.c.post(f"/e2b/v2/sandboxes/{sid}/connect", json={"timeout": 900}, headers=h())
    assert r.status_code == 200 and api.control.get(sid).ttl == 900
    assert api.c.post(f"/e2b/sandboxes/{sid}/resume", json={}, headers=h()).status_code == 409
    assert api.c.post(f"/e2b/sandboxes/{sid}/timeout", json={"timeout": 15}, headers=h()).status_code == 204
    assert api.control.get(sid).ttl == 15
    assert api.c.post(f"/e2b/sandboxes/{sid}/timeout", json={"timeout": 0}, headers=h()).status_code == 204
    assert api.control.wait_settled(sid).state == "stopped" and api.control.get(sid).ttl == 15  # E2B: time out now
    assert api.c.post(f"/e2b/sandboxes/{sid}/connect", json={}, headers=h()).status_code == 201
    assert api.c.delete(f"/e2b/sandboxes/{sid}", headers=h()).status_code == 204
    gone = api.c.get(f"/e2b/sandboxes/{sid}", headers=h())
    assert gone.status_code == 404 and gone.json()["code"] == 404
    assert api.c.delete(f"/e2b/sandboxes/{sid}", headers=h()).status_code == 404


def test_another_accounts_key_sees_and_touches_nothing(api: Api) -> None:
    _acct, _key, other = api.control.accounts.create_account("other")
    sid = create(api)["sandboxID"]
    theirs = create(api, key=other)["sandboxID"]
    assert [s["sandboxID"] for s in api.c.get("/e2b/v2/sandboxes", headers=h(other)).json()] == [theirs]
    for method, path in [("GET", f"/sandboxes/{sid}"), ("DELETE", f"/sandboxes/{sid}"),
                         ("POST", f"/sandboxes/{sid}/pause"), ("POST", f"/sandboxes/{sid}/connect"),
                         ("POST", f"/sandboxes/{sid}/timeout"), ("GET", f"/sandboxes/{sid}/metrics")]:
        r = api.c.request(method, "/e2b" + path, json={"timeout": 10}, headers=h(other))
        assert r.status_code == 404 and r.json()["code"] == 404 and sid in r.json()["message"], path
    assert api.control.get(sid).state == "running"


@pytest.mark.parametrize("method,path,body,status", [
    ("POST", "/v2/sandboxes", {"templateID": 7}, 400),
    ("POST", "/v2/sandboxes", {"templateID": "nope"}, 400),
    ("POST", "/v2/sandboxes", {"templateID": "base", "timeout": True}, 400),
    ("POST", "/v2/sandboxes", {"templateID": "base", "metadata": "x"}, 400),
    ("POST", "/v2/sandboxes", {"templateID": "base", "envVars": {"A": 1}}, 400),
    ("POST", "/v2/sandboxes", {"templateID": "base", "network": {"allowOut": ["1.1.1.1"]}}, 400),
    ("POST", "/v2/sandboxes", {"templateID": "base", "network": {"allowPublicTraffic": "no"}}, 400),
    ("POST", "/v2/sandboxes", {"templateID": "base", "network": []}, 400),
    ("POST", "/v2/sandboxes", {"templateID": "base", "metadata": {"e2b.ports": "public"}}, 400),
    ("POST", "/v2/sandboxes", {"templateID": "base", "allow_internet_access": False}, 400),
    ("POST", "/v2/sandboxes", {"templateID": "base", "autoResume": True}, 400),
    ("POST", "/v2/sandboxes", "{", 400),
    ("POST", "/v2/sandboxes", "[]", 400),
    ("GET", "/v2/sandboxes?state=running,dead", None, 400),
    ("GET", "/v2/sandboxes?limit=101", None, 400),
    ("GET", "/v2/sandboxes?limit=x", None, 400),
    ("GET", "/v2/sandboxes?order=up", None, 400),
    ("GET", "/v2/sandboxes?nextToken=!!", None, 400),
    ("GET", "/v2/sandboxes?startedAfter=yesterday", None, 400),
    ("GET", "/sandboxes/sb_missing000", None, 404),
    ("GET", "/sandboxes/sb_missing000/metrics", None, 404),
    ("POST", "/sandboxes/sb_missing000/timeout", {"timeout": -5}, 400),
    ("POST", "/sandboxes/sb_missing000/pause", {"memory": "yes"}, 400),
    ("PUT", "/sandboxes", None, 405),
    ("GET", "/templates", None, 404),
])
def test_bad_input_gets_e2b_errors(api: Api, method: str, path: str, body: Any, status: int) -> None:
    import json

    content = body if isinstance(body, str) else (json.dumps(body) if body is not None else None)
    before = len(api.control.list_sandboxes())
    r = api.c.request(method, "/e2b" + path, content=content, headers={**h(), "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    got = r.json()
    assert set(got) == {"code", "message"} and got["code"] == status and isinstance(got["message"], str)
    assert len(api.control.list_sandboxes()) == before


def test_keys(api: Api) -> None:
    r = api.c.get("/e2b/v2/sandboxes")
    assert r.status_code == 401 and r.json()["code"] == 401
    r = api.c.get("/e2b/v2/sandboxes", headers=h("key_notakey"))
    assert r.status_code == 401 and r.json()["code"] == 401
    r = api.c.get("/e2b/v2/sandboxes", headers={"Authorization": f"Bearer {TOKEN}"})  # E2B sends X-API-KEY
    assert r.status_code == 401


def test_started_after(api: Api) -> None:
    import datetime as dt

    sid = create(api)["sandboxID"]
    started = api.c.get(f"/e2b/sandboxes/{sid}", headers=h()).json()["startedAt"]
    at = dt.datetime.fromisoformat(started.replace("Z", "+00:00"))
    found = api.c.get("/e2b/v2/sandboxes", params={"startedAfter": at.isoformat()}, headers=h()).json()
    assert [s["sandboxID"] for s in found] == [sid]
    later = (at + dt.timedelta(seconds=1)).isoformat()
    assert api.c.get("/e2b/v2/sandboxes", params={"startedAfter": later}, headers=h()).json() == []


def test_a_sandbox_without_public_traffic_gets_a_traffic_token(api: Api) -> None:
    public = create(api)
    assert "trafficAccessToken" not in public
    private = create(api, network={"allowPublicTraffic": False})
    token = private["trafficAccessToken"]
    assert len(token) == 64 and token != private["envdAccessToken"]
    assert api.control.get(private["sandboxID"]).labels == {"e2b.ports": "traffic-token"}
    r = api.c.post(f"/e2b/sandboxes/{private['sandboxID']}/connect", json={"timeout": 60}, headers=h(TOKEN))
    assert r.status_code == 200 and r.json()["trafficAccessToken"] == token
    got = api.c.get(f"/e2b/sandboxes/{private['sandboxID']}", headers=h(TOKEN)).json()
    assert got["metadata"] == {}
