"""Issue 12 over the API with a FakeNode: accounts and keys, isolation (404 for another account's resources on
every route), the admin key, plans (403 plan_limit), rate limits (429 + Retry-After) and wrong-key throttling."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes import Api, auth, make_api


def _account(api: Api, name: str, plan: str | None = None) -> tuple[str, dict[str, str]]:
    body: dict[str, Any] = {"name": name}
    if plan:
        body["plan"] = plan
    r = api.post("/v1/accounts", json=body)
    assert r.status_code == 201, r.text
    data = r.json()
    assert data["key"]["token"].startswith("sbx_") and data["key"]["prefix"] == data["key"]["token"][:8]
    return data["account"]["id"], auth(data["key"]["token"])


@pytest.fixture
def two(api: Api) -> tuple[dict[str, str], dict[str, str], str]:
    """Two accounts' headers and a running sandbox of the first (with a job, a route and a snapshot)."""
    _, a = _account(api, "alice", "team")
    _, b = _account(api, "bob", "team")
    r = api.c.post("/v1/sandboxes?wait=true", json={"type": "small"}, headers=a)
    assert r.status_code == 200, r.text
    sid = r.json()["sandbox"]["id"]
    assert api.c.post(f"/v1/sandboxes/{sid}/routes", json={"port": 8000}, headers=a).status_code == 201
    assert api.c.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "alice-snap"}, headers=a).status_code == 201
    assert api.c.post(f"/v1/sandboxes/{sid}/jobs", json={"command": "true"}, headers=a).status_code == 201
    return a, b, sid


def test_keys_are_stored_hashed_and_shown_once(api: Api) -> None:
    acct, h = _account(api, "carol")
    token = h["Authorization"].split()[1]
    keys = api.get(f"/v1/accounts/{acct}/keys").json()["keys"]
    assert len(keys) == 1 and keys[0].get("token") is None
    from sqlalchemy import text

    with api.control.store.engine.connect() as c:
        stored = [row[0] for row in c.execute(text("select secret_sha256 from api_keys"))]
    assert token not in str(stored) and all(re.fullmatch(r"[0-9a-f]{64}", s) for s in stored)


def test_another_accounts_resources_are_404_on_every_route(api: Api, two: tuple[Any, Any, str]) -> None:
    a, b, sid = two
    job = api.c.get(f"/v1/sandboxes/{sid}/jobs", headers=a).json()["jobs"][0]["id"]
    calls = [
        ("GET", f"/v1/sandboxes/{sid}", None), ("DELETE", f"/v1/sandboxes/{sid}", None),
        ("POST", f"/v1/sandboxes/{sid}/stop", {}), ("POST", f"/v1/sandboxes/{sid}/resume", {}),
        ("POST", f"/v1/sandboxes/{sid}/fork", {}), ("POST", f"/v1/sandboxes/{sid}/snapshot", {"name": "x"}),
        ("GET", f"/v1/sandboxes/{sid}/snapshots", None), ("POST", f"/v1/sandboxes/{sid}/exec", {"command": "id"}),
        ("POST", f"/v1/sandboxes/{sid}/jobs", {"command": "id"}), ("GET", f"/v1/sandboxes/{sid}/jobs", None),
        ("GET", f"/v1/sandboxes/{sid}/jobs/{job}", None), ("POST", f"/v1/sandboxes/{sid}/jobs/{job}/kill", None),
        ("GET", f"/v1/sandboxes/{sid}/jobs/{job}/logs", None), ("GET", f"/v1/sandboxes/{sid}/jobs/{job}/wait", None),
        ("GET", f"/v1/sandboxes/{sid}/events", None), ("GET", f"/v1/sandboxes/{sid}/routes", None),
        ("POST", f"/v1/sandboxes/{sid}/routes", {"port": 9000}), ("DELETE", f"/v1/sandboxes/{sid}/routes/8000", None),
        ("GET", f"/v1/sandboxes/{sid}/files?path=.", None), ("PUT", f"/v1/sandboxes/{sid}/files?path=x", None),
        ("DELETE", f"/v1/sandboxes/{sid}/files?path=x", None), ("GET", f"/v1/sandboxes/{sid}/files/list?path=.", None),
        ("GET", f"/v1/sandboxes/{sid}/files/stat?path=.", None), ("GET", f"/v1/snapshots?sandbox={sid}", None),
        ("DELETE", "/v1/snapshots/alice-snap", None), ("GET", f"/v1/usage?sandbox={sid}", None),
    ]
    for method, path, body in calls:
        r = api.c.request(method, path, json=body, headers=b)
        assert r.status_code == 404, (method, path, r.status_code, r.text)
        assert r.json()["error"]["code"] == "not_found", (method, path)
        unknown = api.c.request(method, path.replace(sid, "sb_0000000000").replace("alice-snap", "nosnap"),
                                json=body, headers=b)
        assert unknown.json()["error"]["message"] == r.json()["error"]["message"].replace(
            sid, "sb_0000000000").replace("alice-snap", "nosnap"), path  # same answer as a missing one
    r = api.c.post("/v1/sandboxes", json={"type": "small", "fromSnapshot": "alice-snap"}, headers=b)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert api.c.get("/v1/sandboxes", headers=b).json()["sandboxes"] == []
    assert api.c.get("/v1/snapshots", headers=b).json()["snapshots"] == []
    # nothing changed: still running, route and snapshot still there, for the owner
    assert api.c.get(f"/v1/sandboxes/{sid}", headers=a).json()["sandbox"]["state"] == "running"
    assert [x["port"] for x in api.c.get(f"/v1/sandboxes/{sid}/routes", headers=a).json()["routes"]] == [8000]
    assert [s["name"] for s in api.c.get("/v1/snapshots", headers=a).json()["snapshots"]] == ["alice-snap"]


def test_pty_of_another_account_is_refused_as_not_found(api: Api, two: tuple[Any, Any, str]) -> None:
    _, b, sid = two
    with api.c.websocket_connect(f"/v1/sandboxes/{sid}/pty", headers=b) as ws:
        msg = ws.receive_json()
    assert msg["type"] == "error" and msg["code"] == "not_found"


def test_admin_sees_every_account(api: Api, two: tuple[Any, Any, str]) -> None:
    _, _, sid = two
    assert [s["id"] for s in api.get("/v1/sandboxes").json()["sandboxes"]] == [sid]
    assert api.get(f"/v1/sandboxes/{sid}").status_code == 200
    names = [a["name"] for a in api.get("/v1/accounts").json()["accounts"]]
    assert names == ["default", "alice", "bob"]


def test_account_keys_cannot_manage_accounts_or_others_keys(api: Api, two: tuple[Any, Any, str]) -> None:
    a, b, _ = two
    assert api.c.get("/v1/accounts", headers=a).json()["error"]["code"] == "admin_only"
    assert api.c.post("/v1/accounts", json={"name": "x"}, headers=a).status_code == 403
    alice = api.c.get("/v1/account", headers=a).json()["account"]["id"]
    assert api.c.post(f"/v1/accounts/{alice}/keys", json={"name": "ci"}, headers=b).status_code == 404
    own = api.c.post(f"/v1/accounts/{alice}/keys", json={"name": "ci"}, headers=a)
    assert own.status_code == 201
    assert api.c.delete(f"/v1/keys/{own.json()['key']['id']}", headers=b).status_code == 404


def test_revoked_and_expired_keys_answer_401(api: Api) -> None:
    acct, h = _account(api, "dave")
    assert api.c.get("/v1/sandboxes", headers=h).status_code == 200
    key = api.get(f"/v1/accounts/{acct}/keys").json()["keys"][0]["id"]
    r = api.delete(f"/v1/keys/{key}")
    assert r.status_code == 200 and r.json()["key"]["revokedAt"]
    r = api.c.get("/v1/sandboxes", headers=h)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    made = api.post(f"/v1/accounts/{acct}/keys", json={"name": "short", "expiresIn": 1}).json()["key"]
    import datetime as dt

    from sqlalchemy import text

    with api.control.store.engine.begin() as c:  # let it expire without sleeping
        c.execute(text("update api_keys set expires_at = :t where id = :k"),
                  {"t": dt.datetime(2020, 1, 1, tzinfo=dt.UTC), "k": made["id"]})
    assert api.c.get("/v1/sandboxes", headers=auth(made["token"])).status_code == 401


def test_the_admin_key_cannot_be_revoked(api: Api) -> None:
    admin_key = api.get("/v1/accounts/acct_default/keys").json()["keys"][0]
    assert admin_key["admin"] is True
    r = api.delete(f"/v1/keys/{admin_key['id']}")
    assert r.status_code == 403 and r.json()["error"]["code"] == "protected_key"
    assert api.get("/v1/sandboxes").status_code == 200


def test_trial_plan_refuses_xlarge_naming_the_limit_and_the_plan(api: Api) -> None:
    _, h = _account(api, "trialist")
    r = api.c.post("/v1/sandboxes", json={"type": "xlarge"}, headers=h)
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert (err["code"], err["limit"], err["plan"], err["upgrade"]) == ("plan_limit", "size", "trial", "team")
    assert "team plan allows it" in err["message"]
    assert api.c.get("/v1/sandboxes", headers=h).json()["sandboxes"] == []


@pytest.fixture
def strict(tmp_path: Path) -> Iterator[Api]:
    yield from make_api(tmp_path, settings={
        "plans": {"trial": {"starts_per_hour": 3, "running": 2}}, "rate_limit": 0})


def test_starts_and_running_limits(strict: Api) -> None:
    api = strict
    _, h = _account(api, "t")
    one = api.c.post("/v1/sandboxes?wait=true", json={"type": "small"}, headers=h).json()["sandbox"]["id"]
    api.c.post("/v1/sandboxes?wait=true", json={"type": "small"}, headers=h)
    r = api.c.post(f"/v1/sandboxes/{one}/fork", json={}, headers=h)  # a third would run: over `running`
    assert r.status_code == 403 and r.json()["error"]["limit"] == "running", r.text
    assert api.c.post(f"/v1/sandboxes/{one}/stop?wait=true", headers=h).status_code == 200
    r = api.c.post(f"/v1/sandboxes/{one}/resume?wait=true", headers=h)  # start 3 of 3
    assert r.status_code == 200, r.text
    api.c.post(f"/v1/sandboxes/{one}/stop?wait=true", headers=h)
    r = api.c.post(f"/v1/sandboxes/{one}/resume", headers=h)
    err = r.json()["error"]
    assert r.status_code == 403 and err["limit"] == "starts_per_hour" and err["upgrade"] == "pro", r.text
    assert api.c.get(f"/v1/sandboxes/{one}", headers=h).json()["sandbox"]["state"] == "stopped"
    plan = api.c.get("/v1/account", headers=h).json()
    assert plan["plan"]["name"] == "trial" and plan["used"]["startsLastHour"] == 3 and plan["used"]["running"] == 1


@pytest.fixture
def limited(tmp_path: Path) -> Iterator[Api]:
    yield from make_api(tmp_path, settings={"rate_limit": 0.5, "rate_burst": 3, "auth_fail_limit": 3,
                                            "auth_fail_window": 60.0})


def test_per_key_rate_limit_answers_429_with_retry_after(limited: Api) -> None:
    api = limited
    _, h = _account(api, "busy")
    codes = [api.c.get("/v1/sandboxes", headers=h).status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    r = api.c.get("/v1/sandboxes", headers=h)
    assert r.json()["error"]["code"] == "rate_limited" and int(r.headers["Retry-After"]) >= 1
    assert all(api.get("/v1/sandboxes").status_code == 200 for _ in range(10))  # the admin key is not limited


def test_wrong_keys_are_throttled_per_address_even_a_right_one_then(limited: Api) -> None:
    api = limited
    _, fresh = _account(api, "fresh")  # made with the admin key, which has now worked from this address
    codes = [api.c.get("/v1/sandboxes", headers=auth(f"sbx_wrong{i}")).status_code for i in range(4)]
    assert codes == [401, 401, 401, 401]
    r = api.c.get("/v1/sandboxes", headers=auth("sbx_wrong9"))
    assert r.json()["error"]["code"] == "auth_throttled" and int(r.headers["Retry-After"]) >= 1
    r = api.c.get("/v1/sandboxes", headers=fresh)  # a right key new to this address is not even looked up now
    assert r.status_code == 401 and r.json()["error"]["code"] == "auth_throttled"
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    assert api.get("/v1/sandboxes").status_code == 200  # a key that already worked from here goes on working
    assert api.c.get("/v1/sandboxes").status_code == 401  # no key at all is not a guess: still a plain 401


def test_plans_and_usage_routes(api: Api) -> None:
    plans = {p["name"]: p for p in api.get("/v1/plans").json()["plans"]}
    assert plans["trial"]["sizes"] == ["small", "default"] and "xlarge" in plans["team"]["sizes"]
    _, h = _account(api, "u", "pro")
    sid = api.c.post("/v1/sandboxes?wait=true", json={"type": "small"}, headers=h).json()["sandbox"]["id"]
    rep = api.c.get("/v1/usage?by=size", headers=h).json()
    assert rep["priceModel"] == "size" and rep["currency"] == "USD" and rep["groups"][0]["key"] == "small"
    assert api.c.get(f"/v1/usage?sandbox={sid}", headers=h).status_code == 200
    assert api.get("/v1/usage?from=yesterday").json()["error"]["code"] == "invalid_from"
    assert api.get("/v1/usage?from=2026-02-31&to=2026-03-01T00:00:00Z").status_code == 200  # read as Feb 28
    r = api.c.patch("/v1/accounts/acct_default", json={"plan": "gold"}, headers=api.h)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_plan"
    assert api.post("/v1/accounts", json={"name": "-bad"}).json()["error"]["code"] == "invalid_name"
    assert api.get("/v1/usage?by=week").status_code == 400
    empty = api.get("/v1/usage?from=2026-12-01&to=2000-01-01").json()  # to before from: an empty window
    assert empty["total"]["runningSeconds"] == 0 and empty["groups"] == []


def test_only_the_admin_key_sees_and_cordons_nodes(api: Api) -> None:
    """A node is shared by every account: an account's key cordoning it would refuse every other account's new
    sandboxes. Node routes answer 403 ``admin_only`` to an account's key and change nothing."""
    _, a = _account(api, "alice", "team")
    node = api.get("/v1/nodes").json()["nodes"][0]["name"]
    for method, path in (("GET", "/v1/nodes"), ("POST", f"/v1/nodes/{node}/cordon"),
                         ("POST", f"/v1/nodes/{node}/uncordon"), ("POST", f"/v1/nodes/{node}/drain"),
                         ("GET", f"/v1/nodes/{node}/drain"), ("GET", "/v1/consolidation")):
        r = api.c.request(method, path, headers=a)
        assert (r.status_code, r.json()["error"]["code"]) == (403, "admin_only"), (method, path, r.text)
    assert api.get("/v1/nodes").json()["nodes"][0]["cordoned"] is False
    assert api.post(f"/v1/nodes/{node}/cordon").json()["node"]["cordoned"] is True
    k = api.get("/v1/consolidation").json()["consolidation"]  # the admin's: the loop's state, no pass yet
    assert (k["enabled"], k["plan"], k["drain"], k["removable"]) == (True, None, None, [])
    assert k["rules"] == {"lightFraction": 0.25, "headroom": 0.2, "maxMoves": 20}


def test_draining_a_node(api: Api) -> None:
    """``POST /v1/nodes/{name}/drain`` (admin key) cordons the node; with no other node, a running sandbox stays
    and says why (``insufficient_capacity``); an unknown node is 404, and so is the progress of a node never
    drained."""
    node = api.get("/v1/nodes").json()["nodes"][0]["name"]
    assert api.get(f"/v1/nodes/{node}/drain").json()["error"]["code"] == "not_found"
    assert api.post("/v1/nodes/no-such-node/drain").status_code == 404
    sid = api.post("/v1/sandboxes?wait=true", json={"type": "small"}).json()["sandbox"]["id"]
    r = api.post(f"/v1/nodes/{node}/drain?wait=true")
    assert r.status_code == 200, r.text
    d = r.json()["drain"]
    assert (d["node"], d["state"], d["empty"]) == (node, "done", False)
    [item] = d["sandboxes"]
    assert (item["id"], item["action"], item["status"], item["from"]) == (sid, "migrate", "failed", node)
    assert item["error"]["code"] == "insufficient_capacity"
    assert api.get(f"/v1/nodes/{node}/drain").json()["drain"]["sandboxes"][0]["status"] == "failed"
    assert api.get("/v1/nodes").json()["nodes"][0]["cordoned"] is True
    assert api.sandbox(sid)["state"] == "running"
    # one sandbox's live migration: the admin's, and no other node here to take it (nothing changes)
    _, a = _account(api, "carol", "team")
    api.post(f"/v1/nodes/{node}/uncordon")
    own = api.c.post("/v1/sandboxes?wait=true", json={"type": "small"}, headers=a).json()["sandbox"]["id"]
    r = api.c.post(f"/v1/sandboxes/{own}/migrate", headers=a)
    assert (r.status_code, r.json()["error"]["code"]) == (403, "admin_only")
    assert api.c.post(f"/v1/sandboxes/{sid}/migrate", headers=a).status_code == 404  # not carol's
    r = api.post(f"/v1/sandboxes/{sid}/migrate")
    assert (r.status_code, r.json()["error"]["code"]) == (507, "insufficient_capacity"), r.text
    assert api.post("/v1/sandboxes/sb_0000000000/migrate").status_code == 404
    assert api.sandbox(sid)["state"] == "running"


def test_adding_and_removing_nodes(api: Api) -> None:
    """``POST /v1/nodes`` asks the node first: nothing answering is 502 ``node_unreachable`` and nothing is stored;
    the server's own node can't be removed; an account's key is refused; a bad url is 400."""
    _, a = _account(api, "bob", "team")
    body = {"url": "http://127.0.0.1:9", "token": "sbxn_" + "x" * 20}
    r = api.c.post("/v1/nodes", json=body, headers=a)
    assert (r.status_code, r.json()["error"]["code"]) == (403, "admin_only")
    r = api.post("/v1/nodes", json=body)
    assert (r.status_code, r.json()["error"]["code"]) == (502, "node_unreachable"), r.text
    assert len(api.get("/v1/nodes").json()["nodes"]) == 1
    r = api.post("/v1/nodes", json={"url": "not a url", "token": "sbxn_xxxxxxxxxx"})
    assert r.status_code == 400 and r.json()["error"]["code"].startswith("invalid_"), r.text
    r = api.post("/v1/nodes", json={"url": "http://\u00e9\u0301\ud7ff:7700", "token": "sbxn_xxxxxxxxxx"})
    assert r.status_code in (400, 502) and r.json()["error"]["code"] in ("invalid_url", "node_unreachable"), r.text
    own = api.get("/v1/nodes").json()["nodes"][0]["name"]
    r = api.c.delete(f"/v1/nodes/{own}", headers=api.h)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "node_configured")
    r = api.c.delete("/v1/nodes/nope", headers=api.h)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")


def test_snapshot_names_belong_to_their_account(api: Api, two: tuple[Any, Any, str]) -> None:
    """Another account's snapshot name neither blocks nor shows: bob takes the name alice already holds (201, not
    409 ``snapshot_exists``, which told bob that alice had it), and each account's name means its own snapshot for
    a list, a ``fromSnapshot`` and a delete."""
    a, b, alice_sb = two
    r = api.c.post("/v1/sandboxes?wait=true", json={"type": "small"}, headers=b)
    bob_sb = r.json()["sandbox"]["id"]
    r = api.c.post(f"/v1/sandboxes/{bob_sb}/snapshot", json={"name": "alice-snap"}, headers=b)
    assert r.status_code == 201, r.text
    assert r.json()["snapshot"]["name"] == "alice-snap" and r.json()["snapshot"]["sandboxId"] == bob_sb
    again = api.c.post(f"/v1/sandboxes/{bob_sb}/snapshot", json={"name": "alice-snap"}, headers=b)
    assert (again.status_code, again.json()["error"]["code"]) == (409, "snapshot_exists")  # within one account
    for h, sid in ((a, alice_sb), (b, bob_sb)):
        snaps = api.c.get("/v1/snapshots", headers=h).json()["snapshots"]
        assert [(s["name"], s["sandboxId"]) for s in snaps] == [("alice-snap", sid)]
    keys = {s.name: s.label for s in api.control.store.list_snapshots()}
    assert len(keys) == 2 and set(keys.values()) == {"alice-snap"}  # two keys, one name
    r = api.c.post("/v1/sandboxes?wait=true", json={"type": "small", "fromSnapshot": "alice-snap"}, headers=b)
    assert r.status_code == 200, r.text
    made = api.control.store.get_sandbox(r.json()["sandbox"]["id"])
    assert made is not None and api.control.store.get_snapshot(made.from_snapshot or "").sandbox_id == bob_sb
    assert api.c.delete("/v1/snapshots/alice-snap", headers=b).status_code == 200
    assert api.c.get("/v1/snapshots", headers=b).json()["snapshots"] == []
    assert [s["name"] for s in api.c.get("/v1/snapshots", headers=a).json()["snapshots"]] == ["alice-snap"]
    r = api.c.delete("/v1/snapshots/alice-snap", headers=b)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")
