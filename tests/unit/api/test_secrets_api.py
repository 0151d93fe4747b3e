"""Secrets through the real app with a FakeNode: storage at rest, rules, bindings, what the proxy is told, errors."""

from __future__ import annotations

import base64
import sqlite3
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidTag

from sbx.control.secrets import rules as R
from sbx.control.secrets import vault as S
from tests.fakes import Api

VALUE = "ghp_unit-test-value-0123456789"
RULE = {"hosts": ["api.example.com", "*.uploads.example.com"], "action": "replace"}


def err(r) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    body = r.json()
    assert set(body) == {"error"}, body
    return r.status_code, body["error"]["code"]


def put(api: Api, name: str, value: str = VALUE, rules: list[dict] | None = None):  # type: ignore[no-untyped-def,type-arg]
    body: dict = {"value": value}  # type: ignore[type-arg]
    if rules is not None:
        body["rules"] = rules
    return api.c.put(f"/v1/secrets/{name}", json=body, headers=api.h)


def test_values_are_encrypted_at_rest_with_a_key_outside_the_database(api: Api, tmp_path: Path) -> None:
    r = put(api, "gh", rules=[RULE])
    assert r.status_code == 200, r.text
    sec = r.json()["secret"]
    assert sec["placeholder"] == "sbx-secret:gh" and sec["version"] == 1 and VALUE not in r.text
    settings = api.control.settings
    key = settings.state_dir / "secrets.key"
    assert key.stat().st_mode & 0o777 == 0o600 and len(key.read_bytes()) == 32
    db = Path(settings.db_url.removeprefix("sqlite:///"))
    raw = db.read_bytes() + b"".join(p.read_bytes() for p in db.parent.glob(db.name + "-wal"))
    assert VALUE.encode() not in raw and base64.b64encode(VALUE.encode()) not in raw
    (blob,) = sqlite3.connect(db).execute("SELECT ciphertext FROM secrets").fetchone()
    assert S.unseal(key.read_bytes(), blob, b"acct_default/gh/1") == VALUE
    with pytest.raises(InvalidTag):  # bound to account, name and version
        S.unseal(key.read_bytes(), blob, b"acct_default/other/1")
    for path in ("/v1/secrets", "/v1/secrets/gh"):
        got = api.get(path)
        assert got.status_code == 200 and VALUE not in got.text


def test_rotation_bumps_the_version_keeps_rules_and_changes_what_the_proxy_gets(api: Api) -> None:
    put(api, "gh", rules=[RULE])
    sid = api.new()["id"]
    assert api.c.put(f"/v1/sandboxes/{sid}/secrets/gh", headers=api.h).json() == {"sandbox": sid, "secrets": ["gh"]}
    assert api.node.egress[sid] is True
    handle = api.node.egress_handler
    ask = {"op": "resolve", "host": "api.example.com", "method": "GET", "path": "/x"}
    assert handle(sid, ask)["actions"] == [{"secret": "gh", "action": "replace", "placeholder": "sbx-secret:gh",
                                           "value": VALUE}]
    r = put(api, "gh", "new-value")
    assert r.json()["secret"]["version"] == 2 and r.json()["secret"]["rules"][0]["hosts"] == RULE["hosts"]
    assert handle(sid, ask)["actions"][0]["value"] == "new-value"
    # hosts the rules don't name get nothing; *.domain is below the domain only
    for host in ("example.com", "evil-api.example.com", "uploads.example.com", "api.example.com.evil.net"):
        assert handle(sid, {**ask, "host": host})["actions"] == [], host
    assert handle(sid, {**ask, "host": "a.b.uploads.example.com"})["actions"]
    # another sandbox, not bound, gets nothing
    other = api.new()["id"]
    assert handle(other, ask)["actions"] == []
    assert api.node.egress.get(other) is None


def test_header_basic_path_and_method_rules(api: Api) -> None:
    put(api, "tok", rules=[{"hosts": ["api.example.com"], "pathPrefix": "/v1", "methods": ["post"],
                            "action": "header", "header": "Authorization", "value": "Bearer {secret}"},
                           {"hosts": ["basic.example.com"], "action": "basic", "username": "bot"}])
    sid = api.new(secrets=["tok"])["id"]
    handle = api.node.egress_handler
    q = {"op": "resolve", "host": "api.example.com", "method": "POST", "path": "/v1/chat"}
    assert handle(sid, q)["actions"] == [{"secret": "tok", "action": "header", "header": "Authorization",
                                         "value": f"Bearer {VALUE}"}]
    assert handle(sid, {**q, "method": "GET"})["actions"] == []
    assert handle(sid, {**q, "path": "/v2/chat"})["actions"] == []
    basic = handle(sid, {**q, "host": "basic.example.com"})["actions"][0]
    assert basic["value"] == "Basic " + base64.b64encode(f"bot:{VALUE}".encode()).decode()
    # audit
    assert handle(sid, {"op": "used", "secrets": ["tok"], "host": "api.example.com", "method": "POST",
                        "path": "/v1/chat", "status": 201}) == {}
    uses = api.get("/v1/secrets/tok/log").json()["uses"]
    assert [(u["sandbox"], u["host"], u["method"], u["path"], u["status"]) for u in uses] == [
        (sid, "api.example.com", "POST", "/v1/chat", 201)]


@pytest.mark.parametrize("body, code", [
    ({"value": VALUE, "rules": []}, "invalid_rules"),  # a new secret needs rules
    ({"value": VALUE, "rules": [{"hosts": ["*"]}]}, "invalid_rules"),
    ({"value": VALUE, "rules": [{"hosts": ["10.0.0.1"]}]}, "invalid_rules"),
    ({"value": VALUE, "rules": [{"hosts": ["localhost"]}]}, "invalid_rules"),
    ({"value": VALUE, "rules": [{"hosts": ["a.example.com"], "action": "header", "header": "X-Key",
                                 "value": "no placeholder"}]}, "invalid_rules"),
    ({"value": VALUE, "rules": [{"hosts": ["a.example.com"], "action": "header", "header": "X Key",
                                 "value": "{secret}"}]}, "invalid_rules"),
    ({"value": VALUE, "rules": [{"hosts": ["a.example.com"], "action": "basic"}]}, "invalid_rules"),
    ({"value": VALUE, "rules": [{"hosts": ["a.example.com"], "pathPrefix": "v1"}]}, "invalid_rules"),
])
def test_bad_rules_are_400_and_nothing_is_stored(api: Api, body: dict, code: str) -> None:  # type: ignore[type-arg]
    r = api.c.put("/v1/secrets/gh", json=body, headers=api.h)
    assert err(r) == (400, code), r.text
    assert api.get("/v1/secrets").json() == {"secrets": []}


def test_errors(api: Api) -> None:
    assert err(put(api, "9bad", rules=[RULE])) == (400, "invalid_name")
    assert err(api.c.put("/v1/secrets/gh", json={"value": ""}, headers=api.h)) == (400, "invalid_value")
    assert err(api.get("/v1/secrets/nope")) == (404, "not_found")
    assert err(put(api, "nope")) == (404, "not_found")  # a rotation of nothing
    assert err(api.delete("/v1/secrets/nope")) == (404, "not_found")
    assert err(api.get("/v1/secrets/nope/log")) == (404, "not_found")
    sid = api.new()["id"]
    assert err(api.c.put(f"/v1/sandboxes/{sid}/secrets/nope", headers=api.h)) == (404, "not_found")
    before = len(api.get("/v1/sandboxes").json()["sandboxes"])
    assert err(api.post("/v1/sandboxes", json={"secrets": ["nope"]})) == (404, "not_found")
    assert len(api.get("/v1/sandboxes").json()["sandboxes"]) == before  # nothing was made
    put(api, "gh", rules=[RULE])
    assert err(api.delete(f"/v1/sandboxes/{sid}/secrets/gh")) == (404, "not_found")  # not bound
    assert err(api.c.put("/v1/sandboxes/sb_nothere00/secrets/gh", headers=api.h)) == (404, "not_found")


def test_delete_unbinds_and_sandbox_delete_forgets(api: Api) -> None:
    put(api, "gh", rules=[RULE])
    a = api.new(secrets=["gh"])["id"]
    b = api.post(f"/v1/sandboxes/{a}/fork?wait=true", json={"secrets": ["gh"]}).json()["sandbox"]["id"]
    assert api.get("/v1/secrets/gh").json()["secret"]["sandboxes"] == [a, b]
    assert api.get(f"/v1/sandboxes/{b}/secrets").json() == {"sandbox": b, "secrets": ["gh"]}
    assert api.delete(f"/v1/sandboxes/{b}?wait=true").status_code == 200
    assert api.get("/v1/secrets/gh").json()["secret"]["sandboxes"] == [a]
    assert api.delete("/v1/secrets/gh").json() == {"deleted": "gh"}
    assert api.node.egress[a] is False
    assert api.node.egress_handler(a, {"op": "resolve", "host": "api.example.com", "method": "GET",
                                       "path": "/"})["actions"] == []


def test_binding_needs_the_nodes_egress_proxy(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    put(api, "gh", rules=[RULE])
    sid = api.new()["id"]
    monkeypatch.setattr(api.node, "egress_ready", lambda: False)
    assert err(api.c.put(f"/v1/sandboxes/{sid}/secrets/gh", headers=api.h)) == (409, "egress_proxy_unavailable")
    assert err(api.post("/v1/sandboxes", json={"secrets": ["gh"]})) == (409, "egress_proxy_unavailable")
    assert api.get(f"/v1/sandboxes/{sid}/secrets").json()["secrets"] == []


def test_host_patterns() -> None:
    assert R.host_matches("api.example.com", "API.example.com.")
    assert R.host_matches("*.example.com", "a.example.com")
    assert not R.host_matches("*.example.com", "example.com")
    assert not R.host_matches("*.example.com", "aexample.com")
    assert not R.host_matches("api.example.com", "api.example.com.evil")


def test_lone_surrogates_are_400_not_500(api: Api) -> None:
    bad = '{"value": "x\\ud800", "rules": [{"hosts": ["a.example.com"]}]}'
    r = api.c.put("/v1/secrets/gh", content=bad, headers={**api.h, "Content-Type": "application/json"})
    assert err(r) == (400, "invalid_value"), r.text
    bad = '{"value": "x", "rules": [{"hosts": ["a.example.com"], "action": "basic", "username": "u\\udc00"}]}'
    r = api.c.put("/v1/secrets/gh", content=bad, headers={**api.h, "Content-Type": "application/json"})
    assert err(r) == (400, "invalid_rules"), r.text
