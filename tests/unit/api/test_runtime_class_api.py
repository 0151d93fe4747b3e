"""The runtime class through the API (issue 33) on the fake node: ``runtime`` in POST /v1/sandboxes and in the
sandbox view, carried to the node in the spec, kept by forks and by sandboxes made from a snapshot; an unknown class
is a 400 ``invalid_runtime`` (not a string: 422 ``invalid_request``); fork with memory and live migration of a gvisor
sandbox are 409 ``not_supported``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sbx.node.types import SandboxSpec
from tests.fakes import Api, make_api, wait_until


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    yield from make_api(tmp_path)


def _err(r) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    return r.status_code, r.json()["error"]["code"]


def _spy_specs(api: Api) -> list[SandboxSpec]:
    """Record the specs the node's create and fork get."""
    seen: list[SandboxSpec] = []
    create, fork = api.node.create, api.node.fork

    def spy_create(spec: SandboxSpec, *a, **kw):  # type: ignore[no-untyped-def]
        seen.append(spec)
        return create(spec, *a, **kw)

    def spy_fork(source_id: str, spec: SandboxSpec, *a, **kw):  # type: ignore[no-untyped-def]
        seen.append(spec)
        return fork(source_id, spec, *a, **kw)

    api.node.create = spy_create  # type: ignore[method-assign]
    api.node.fork = spy_fork  # type: ignore[method-assign]
    return seen


def test_the_runtime_class_goes_to_the_node_and_shows_in_the_view(api: Api) -> None:
    specs = _spy_specs(api)
    default = api.new()
    assert default["runtime"] == "container"
    sb = api.new(runtime="gvisor")
    assert sb["runtime"] == "gvisor" and api.sandbox(sb["id"])["runtime"] == "gvisor"
    assert [s.runtime for s in specs] == ["container", "gvisor"]
    assert api.new(runtime="container")["runtime"] == "container"


def test_forks_and_snapshot_copies_keep_the_class(api: Api) -> None:
    specs = _spy_specs(api)
    sid = api.new(runtime="gvisor")["id"]
    r = api.post(f"/v1/sandboxes/{sid}/fork?wait=true", json={})
    assert r.status_code in (200, 202), r.text
    fid = r.json()["sandbox"]["id"]
    wait_until(lambda: api.sandbox(fid)["state"] == "running")
    assert api.sandbox(fid)["runtime"] == "gvisor" and specs[-1].runtime == "gvisor"
    assert api.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "gv-snap"}).status_code == 201
    assert api.new(fromSnapshot="gv-snap")["runtime"] == "gvisor"
    assert api.new(fromSnapshot="gv-snap", runtime="container")["runtime"] == "container"


@pytest.mark.parametrize("runtime", ["kvm", "", "GVISOR", "runc"])
def test_a_bad_runtime_is_400_invalid_runtime(api: Api, runtime: object) -> None:
    r = api.post("/v1/sandboxes", json={"runtime": runtime})
    assert _err(r) == (400, "invalid_runtime") and r.json()["error"]["field"] == "runtime"
    assert api.get("/v1/sandboxes").json()["sandboxes"] == []


def test_a_runtime_that_is_not_a_string_is_422(api: Api) -> None:
    assert _err(api.post("/v1/sandboxes", json={"runtime": 1})) == (422, "invalid_request")


def test_fork_with_memory_and_migration_of_a_gvisor_sandbox_are_409(api: Api) -> None:
    sid = api.new(runtime="gvisor")["id"]
    r = api.post(f"/v1/sandboxes/{sid}/fork", json={"memory": True})
    assert _err(r) == (409, "not_supported") and "gvisor" in r.json()["error"]["message"]
    r = api.post(f"/v1/sandboxes/{sid}/migrate", json={})
    assert _err(r) == (409, "not_supported") and "gvisor" in r.json()["error"]["message"]
    assert api.sandbox(sid)["state"] == "running"


def _plan_account(api: Api, plan: str) -> dict[str, str]:
    r = api.post("/v1/accounts", json={"name": f"on-{plan}", "plan": plan})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['key']['token']}"}


def _ids(api: Api, h: dict[str, str]) -> list[str]:
    return [s["id"] for s in api.c.get("/v1/sandboxes", headers=h).json()["sandboxes"]]


HARDENED = {"hardened": {"price_usd_month": 50, "sizes": ["small", "default"], "runtimes": ["gvisor"]}}


def test_a_plan_can_require_the_hardened_class(tmp_path: Path) -> None:
    for api in make_api(tmp_path, settings={"plans": HARDENED}):
        h = _plan_account(api, "hardened")
        r = api.c.post("/v1/sandboxes", json={"type": "small"}, headers=h)
        assert r.status_code in (200, 201, 202), r.text
        assert r.json()["sandbox"]["runtime"] == "gvisor"  # the plan's class when none is named
        before = _ids(api, h)
        r = api.c.post("/v1/sandboxes", json={"type": "small", "runtime": "container"}, headers=h)
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert (err["code"], err["limit"], err["plan"], err["upgrade"]) == ("plan_limit", "runtime", "hardened",
                                                                            "trial")
        assert "container runtime class is not included" in err["message"]
        assert _ids(api, h) == before  # nothing was made
        plan = api.c.get("/v1/account", headers=h).json()["plan"]
        assert plan["runtimes"] == ["gvisor"]
        # an account of another plan keeps the server's default
        assert api.new()["runtime"] == "container"


def test_the_server_default_class(tmp_path: Path) -> None:
    for api in make_api(tmp_path, settings={"default_runtime": "gvisor"}):
        assert api.new()["runtime"] == "gvisor"
        assert api.new(runtime="container")["runtime"] == "container"


def test_bad_class_settings_stop_the_server_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sbx.config import load_settings
    from sbx.control.accounts.plans import load_plans

    monkeypatch.setenv("SBX_DEFAULT_RUNTIME", "kvm")
    with pytest.raises(ValueError, match="default_runtime"):
        load_settings(state_dir=tmp_path)
    with pytest.raises(ValueError, match="runtimes"):
        load_plans({"odd": {"runtimes": ["kvm"]}})
    with pytest.raises(ValueError, match="runtimes"):
        load_plans({"none": {"runtimes": []}})
