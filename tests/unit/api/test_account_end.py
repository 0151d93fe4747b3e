"""Issue 36, accounts that end, over the API with a FakeNode: suspend (keys 403 ``account_suspended``, running
sandboxes stopped with memory, starts refused, survives a restart), resume (keys again, sandboxes stay stopped),
delete (sandboxes in every state, forks, snapshots, secrets, routes and keys gone; usage kept; refused while a
drain or migration moves one; finished at the next start when cut short), the first account protected, errors
that change nothing, the OpenAPI document."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from sbx.api.app import create_app
from sbx.control.errors import ControlError
from sbx.control.sandboxes.routes import RouteRow
from sbx.control.store.database import Store
from tests.fakes import TOKEN, Api, FakeNode, auth, fake_settings, make_api


def _account(api: Api, name: str) -> tuple[str, dict[str, str]]:
    r = api.post("/v1/accounts", json={"name": name, "plan": "team"})
    assert r.status_code == 201, r.text
    return r.json()["account"]["id"], auth(r.json()["key"]["token"])


def _err(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


def _state(api: Api, sid: str) -> str:
    return str(api.sandbox(sid)["state"])


def _until(check: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    port = _free_port()
    gen = make_api(tmp_path, serve_proxy=True, settings={"proxy_port": port, "rate_limit": 0})
    a = next(gen)
    a.proxy_port = port  # type: ignore[attr-defined]
    yield a
    gen.close()


@pytest.fixture
def alice(api: Api) -> dict[str, Any]:
    """An account with a running sandbox (route on 8000, a secret bound), a stopped one, a fork of the running
    one, a named snapshot, and a second account (bob) with a running sandbox."""
    acct, h = _account(api, "alice")
    r = api.c.put("/v1/secrets/gh", json={"value": "v" * 12, "rules": [{"hosts": ["api.example.com"],
                                                                         "action": "replace"}]}, headers=h)
    assert r.status_code == 200, r.text
    run = api.c.post("/v1/sandboxes?wait=true", json={"type": "small"}, headers=h).json()["sandbox"]["id"]
    stop = api.c.post("/v1/sandboxes?wait=true", json={"type": "small"}, headers=h).json()["sandbox"]["id"]
    assert api.c.post(f"/v1/sandboxes/{stop}/stop?wait=true", headers=h).status_code == 200
    route = api.c.post(f"/v1/sandboxes/{run}/routes", json={"port": 8000}, headers=h).json()["route"]
    assert api.c.put(f"/v1/sandboxes/{run}/secrets/gh", headers=h).status_code == 200
    assert api.c.post(f"/v1/sandboxes/{run}/snapshot", json={"name": "snap"}, headers=h).status_code == 201
    fork = api.c.post(f"/v1/sandboxes/{run}/fork?wait=true", json={}, headers=h).json()["sandbox"]["id"]
    _bob_id, bob = _account(api, "bob")
    other = api.c.post("/v1/sandboxes?wait=true", json={"type": "small"}, headers=bob).json()["sandbox"]["id"]
    return {"id": acct, "h": h, "run": run, "stop": stop, "fork": fork, "route": route, "bob": bob, "other": other}


def _proxy(api: Api, route: dict[str, Any]) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{api.proxy_port}/", headers={"Host": route["host"],  # type: ignore
                                                                      "X-Sbx-Token": route["token"]}, timeout=10)


def test_suspend_refuses_keys_stops_with_memory_refuses_starts_and_resume_lifts_it(api: Api,
                                                                                   alice: dict[str, Any]) -> None:
    a, h = alice["id"], alice["h"]
    r = api.post(f"/v1/accounts/{a}/suspend")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["account"]["state"] == "suspended" and body["account"]["stateChangedAt"]
    assert sorted(body["sandboxes"]) == sorted([alice["run"], alice["fork"]])
    _until(lambda: _state(api, alice["run"]) == "stopped" and _state(api, alice["fork"]) == "stopped")
    info = api.sandbox(alice["run"])
    assert info["stopReason"] == "suspended" and info["memorySaved"] is True
    for method, path in (("GET", "/v1/sandboxes"), ("GET", "/v1/account"), ("POST", "/v1/sandboxes")):
        assert _err(api.c.request(method, path, json={"type": "small"}, headers=h)) == (403, "account_suspended")
    # the admin can't start them either; the proxy says why instead of resuming
    assert _err(api.post(f"/v1/sandboxes/{alice['stop']}/resume")) == (403, "account_suspended")
    assert _err(api.post(f"/v1/sandboxes/{alice['run']}/fork", json={})) == (403, "account_suspended")
    assert _state(api, alice["stop"]) == "stopped"
    assert api.c.get("/v1/sandboxes", headers=alice["bob"]).status_code == 200  # bob untouched
    assert _state(api, alice["other"]) == "running"
    again = api.post(f"/v1/accounts/{a}/suspend")
    assert again.status_code == 200 and again.json()["sandboxes"] == []
    r = api.post(f"/v1/accounts/{a}/resume")
    assert r.status_code == 200 and r.json()["account"]["state"] == "active"
    assert api.c.get("/v1/sandboxes", headers=h).status_code == 200
    assert _state(api, alice["run"]) == "stopped"  # the user resumes them
    r = api.c.post(f"/v1/sandboxes/{alice['run']}/resume?wait=true", headers=h)
    assert r.status_code == 200 and r.json()["sandbox"]["memoryRestored"] is True
    assert api.post(f"/v1/accounts/{a}/resume").status_code == 200  # active already: as it is


def test_suspended_port_answers_403_not_a_resume(api: Api, alice: dict[str, Any]) -> None:
    a, run = alice["id"], alice["run"]
    api.post(f"/v1/accounts/{a}/suspend")
    _until(lambda: _state(api, run) == "stopped")
    api.control.store.update_sandbox(run, auto_resume=True)
    assert _err(_proxy(api, alice["route"])) == (403, "account_suspended")
    assert _state(api, run) == "stopped"


def test_delete_removes_everything_keeps_usage_and_leaves_others_alone(api: Api, alice: dict[str, Any]) -> None:
    a, h = alice["id"], alice["h"]
    assert _proxy(api, alice["route"]).status_code != 401  # the port token works before (no upstream: 502)
    r = api.delete(f"/v1/accounts/{a}")
    assert r.status_code == 202, r.text
    assert r.json()["account"]["state"] in ("deleting", "deleted")
    assert sorted(r.json()["sandboxes"]) == sorted([alice["run"], alice["stop"], alice["fork"]])
    assert _err(api.c.get("/v1/sandboxes", headers=h)) == (401, "unauthorized")  # at once
    _until(lambda: api.get(f"/v1/account?account={a}").json()["account"]["state"] == "deleted")
    cp = api.control
    assert cp.store.list_sandboxes(account_id=a) == []
    assert {r.state for r in cp.store.list_sandboxes(include_deleted=True, account_id=a)} == {"deleted"}
    assert cp.store.list_snapshots(account_id=a) == [] and "snap" not in {s.name for s in api.node.snapshots()}
    assert cp.secrets.all(a) == [] and cp.accounts.list_keys(a) == []
    with cp.store.session() as s:
        assert s.scalars(select(RouteRow).where(RouteRow.sandbox_id == alice["run"])).all() == []
    assert _err(_proxy(api, alice["route"])) == (401, "unauthorized")
    usage = api.get(f"/v1/usage?account={a}&by=sandbox").json()
    assert {g["key"] for g in usage["groups"]} >= {alice["run"], alice["stop"], alice["fork"]}
    assert usage["total"]["runningSeconds"] > 0
    assert [x["state"] for x in api.get("/v1/accounts").json()["accounts"] if x["id"] == a] == ["deleted"]
    # bob untouched
    assert api.c.get(f"/v1/sandboxes/{alice['other']}", headers=alice["bob"]).json()["sandbox"]["state"] == "running"
    # again: as it is; a deleted account can't be suspended, resumed or get keys
    assert api.delete(f"/v1/accounts/{a}").status_code == 202
    assert _err(api.post(f"/v1/accounts/{a}/suspend")) == (409, "account_deleted")
    assert _err(api.post(f"/v1/accounts/{a}/resume")) == (409, "account_deleted")
    assert _err(api.post(f"/v1/accounts/{a}/keys", json={"name": "x"})) == (409, "account_deleted")


def test_first_account_unknown_ones_and_account_keys_are_refused(api: Api, alice: dict[str, Any]) -> None:
    for method, path in (("POST", "suspend"), ("POST", "resume"), ("DELETE", "")):
        url = f"/v1/accounts/acct_default/{path}".rstrip("/")
        assert _err(api.c.request(method, url, headers=api.h)) == (403, "protected_account")
        url = f"/v1/accounts/acct_nope/{path}".rstrip("/")
        assert _err(api.c.request(method, url, headers=api.h)) == (404, "not_found")
        url = f"/v1/accounts/{alice['id']}/{path}".rstrip("/")
        assert _err(api.c.request(method, url, headers=alice["bob"])) == (403, "admin_only")
    assert api.get("/v1/sandboxes").status_code == 200
    assert api.get(f"/v1/account?account={alice['id']}").json()["account"]["state"] == "active"


def test_delete_is_refused_while_a_drain_or_migration_moves_one_of_its_sandboxes(api: Api,
                                                                               alice: dict[str, Any]) -> None:
    a, cp = alice["id"], api.control
    cp.store.update_sandbox(alice["run"], state="migrating")
    r = api.delete(f"/v1/accounts/{a}")
    assert _err(r) == (409, "account_busy") and alice["run"] in r.json()["error"]["message"]
    cp.store.update_sandbox(alice["run"], state="running")
    cp.moving_to[alice["stop"]] = ("other", 1024)
    assert _err(api.delete(f"/v1/accounts/{a}")) == (409, "account_busy")
    cp.moving_to.clear()
    drains = cp.drains
    drains.running = lambda: ["n1"]  # type: ignore[method-assign]
    drains.get = lambda name: {"sandboxes": [{"id": alice["fork"], "status": "pending"}]}  # type: ignore
    r = api.delete(f"/v1/accounts/{a}")
    assert _err(r) == (409, "account_busy") and "drain of node n1" in r.json()["error"]["message"]
    # nothing changed
    assert api.c.get("/v1/sandboxes", headers=alice["h"]).status_code == 200
    assert api.get(f"/v1/account?account={a}").json()["account"]["state"] == "active"
    drains.get = lambda name: {"sandboxes": [{"id": alice["fork"], "status": "done"}]}  # type: ignore
    assert api.delete(f"/v1/accounts/{a}").status_code == 202


def test_openapi_describes_the_new_routes_and_their_errors(api: Api) -> None:
    doc = api.c.get("/openapi.json").json()
    paths = doc["paths"]
    for path, method, ok in (("/v1/accounts/{account_id}/suspend", "post", "200"),
                             ("/v1/accounts/{account_id}/resume", "post", "200"),
                             ("/v1/accounts/{account_id}", "delete", "202")):
        responses = paths[path][method]["responses"]
        assert {ok, "401", "403", "404", "409"} <= set(responses), (path, sorted(responses))
    assert "account_suspended" in str(paths["/v1/accounts/{account_id}/suspend"]["post"]["responses"]["403"])
    assert "state" in doc["components"]["schemas"]["Account"]["properties"]


def _app(tmp_path: Path, node: FakeNode) -> Iterator[Api]:
    app = create_app(fake_settings(tmp_path, rate_limit=0), node, token=TOKEN, reaper_tick=0.1, wait=5.0)
    with TestClient(app) as client:
        yield Api(client, node)


def test_suspension_and_a_deletion_cut_short_survive_a_restart(tmp_path: Path) -> None:
    node = FakeNode(tmp_path / "node")
    try:
        for api in _app(tmp_path, node):
            a, h = _account(api, "carol")
            run = api.c.post("/v1/sandboxes?wait=true", json={"type": "small"}, headers=h).json()["sandbox"]["id"]
            d, dh = _account(api, "dan")
            gone = api.c.post("/v1/sandboxes?wait=true", json={"type": "small"}, headers=dh).json()["sandbox"]["id"]
            assert api.c.post(f"/v1/sandboxes/{gone}/snapshot", json={"name": "s1"}, headers=dh).status_code == 201
            # as if killed: carol suspended with her sandbox still running, dan deleting with nothing done yet
            api.control.accounts.set_state(a, "suspended", ("active",))
            api.control.accounts.set_state(d, "deleting", ("active",))
        for api in _app(tmp_path, node):  # the next start finishes both
            assert _err(api.c.get("/v1/sandboxes", headers=h)) == (403, "account_suspended")
            _until(lambda: _state(api, run) == "stopped")  # noqa: B023
            _until(lambda: api.get(f"/v1/account?account={d}").json()["account"]["state"] == "deleted")  # noqa: B023
            assert api.control.store.list_snapshots(account_id=d) == [] and "s1" not in node.snaps
            assert _state(api, run) == "stopped" and api.control.store.get_sandbox(gone).state == "deleted"
            assert _err(api.c.get("/v1/sandboxes", headers=dh)) == (401, "unauthorized")
    finally:
        node.close()


def test_migration_adds_state_to_existing_accounts(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'db' / 'sbx.db'}")
    from sqlalchemy import text

    with store.engine.begin() as c:
        c.execute(text("insert into accounts (id, name, plan, created_at) values ('acct_x', 'x', 'trial', "
                       "'2026-01-01 00:00:00')"))
        assert c.execute(text("select state from accounts where id = 'acct_x'")).scalar() == "active"
    store.close()


def test_a_deletion_that_cannot_finish_stays_deleting_and_goes_on_when_asked_again(api: Api) -> None:
    a, h = _account(api, "frank")
    sid = api.c.post("/v1/sandboxes?wait=true", json={"type": "small"}, headers=h).json()["sandbox"]["id"]
    cp = api.control
    cp.account_ends.pause = 0.01
    calls = []  # every pass of the first delete fails on the node
    real = api.node.delete

    def failing(sandbox_id: str) -> None:
        calls.append(sandbox_id)
        if len(calls) <= 3:
            from sbx.node.types import NodeError

            raise NodeError("node_busy", "the disk is held")
        real(sandbox_id)

    api.node.delete = failing  # type: ignore[method-assign]
    assert api.delete(f"/v1/accounts/{a}").status_code == 202
    _until(lambda: len(calls) >= 3 and a not in cp.account_ends._deleting)
    assert api.get(f"/v1/account?account={a}").json()["account"]["state"] == "deleting"
    assert _err(api.c.get("/v1/sandboxes", headers=h)) == (401, "unauthorized")  # its keys are gone already
    r = api.delete(f"/v1/accounts/{a}")  # asked again: goes on, no busy check, no new error
    assert r.status_code == 202 and r.json()["account"]["state"] == "deleting"
    _until(lambda: api.get(f"/v1/account?account={a}").json()["account"]["state"] == "deleted")
    assert cp.store.get_sandbox(sid).state == "deleted"  # type: ignore[union-attr]


def test_a_deleted_accounts_name_stays_taken_and_says_why(api: Api) -> None:
    a, _h = _account(api, "gone")
    assert api.delete(f"/v1/accounts/{a}").status_code == 202
    _until(lambda: api.get(f"/v1/account?account={a}").json()["account"]["state"] == "deleted")
    r = api.post("/v1/accounts", json={"name": "gone"})
    assert _err(r) == (409, "account_exists") and "pick another" in r.json()["error"]["message"]


def test_console_sessions_follow_the_accounts_state(api: Api) -> None:
    from sbx.api.sessions import SESSION_COOKIE

    gate = api.c.app.state.gate  # type: ignore[attr-defined]
    row, key, token = api.control.accounts.create_account("ivy", "team")
    session = gate.sessions.open(token, key.id)
    jar = {SESSION_COOKIE: session.id}
    assert gate.authorize("GET", {}, jar, "10.0.0.9").account_id == row.id
    api.post(f"/v1/accounts/{row.id}/suspend")
    with pytest.raises(ControlError) as e:
        gate.authorize("GET", {}, jar, "10.0.0.9")
    assert (e.value.status, e.value.code) == (403, "account_suspended")
    assert gate.sessions.get(session.id) is session  # kept: a resume gives it back
    api.post(f"/v1/accounts/{row.id}/resume")
    assert gate.authorize("GET", {}, jar, "10.0.0.9").account_id == row.id
    api.delete(f"/v1/accounts/{row.id}")
    with pytest.raises(ControlError) as e:
        gate.authorize("GET", {}, jar, "10.0.0.9")
    assert (e.value.status, e.value.code) == (401, "unauthorized")
    assert gate.sessions.get(session.id) is None  # ended
