"""Issue 36, accounts that end, on a real server with real sandboxes: an account with running, stopped and forked
sandboxes, a snapshot, a secret and a hosted port is suspended (its key 403 ``account_suspended``, its running
sandboxes stopped with memory, starts refused, still so after the server is killed and started again), resumed
(its sandboxes come back with their memory when the user resumes them) and deleted (its key and its port token
answer 401, its sandboxes, snapshot and secret are gone, its usage stays in the admin's report); another account's
sandbox runs on untouched. A deletion whose server is killed with SIGKILL right after it began is finished by the
next start.

One kill-9-able server (tests/e2e/faultsrv.py)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import SBX
from tests.e2e.faultsrv import FaultServer
from tests.e2e.helpers import poll

pytestmark = pytest.mark.e2e

COUNTER = "nohup python3 -u -c 'import time\nwhile True: time.sleep(1)' >/dev/null 2>&1 & echo $!"


@pytest.fixture(scope="module")
def fs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultServer]:
    f = FaultServer(tmp_path_factory.mktemp("sbx-acctend"), prefix="SBX_ACCTEND", node="acctend",
                    bridge="sbxaend0", subnet="10.72.0.0/16")
    f.start()
    try:
        yield f
    finally:
        f.close()


def cli(fs: FaultServer, token: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    """``sbx ARGS`` as the holder of ``token`` (None: the admin's client config)."""
    assert fs.srv is not None
    env = dict(fs.srv.env)
    if token is not None:
        env["SBX_TOKEN"] = token
    return subprocess.run([SBX, *args], env=env, capture_output=True, text=True, timeout=900)


def ok(fs: FaultServer, token: str | None, *args: str) -> str:
    r = cli(fs, token, *args)
    assert r.returncode == 0, f"sbx {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def http(fs: FaultServer, token: str | None = None) -> httpx.Client:
    assert fs.srv is not None
    return httpx.Client(base_url=fs.srv.url, headers={"Authorization": f"Bearer {token or fs.srv.token}"},
                        timeout=900)


def account(fs: FaultServer, name: str) -> tuple[str, str]:
    made = json.loads(ok(fs, None, "admin", "account", "create", name, "--plan", "team", "--json"))
    return made["account"]["id"], made["key"]["token"]


def sandbox(fs: FaultServer, sid: str) -> dict[str, Any]:
    with http(fs) as c:
        return c.get(f"/v1/sandboxes/{sid}").json()  # type: ignore[no-any-return]


def state(fs: FaultServer, sid: str) -> str:
    body = sandbox(fs, sid)
    return str(body["sandbox"]["state"]) if "sandbox" in body else body["error"]["code"]


def proxied(fs: FaultServer, route: dict[str, Any]) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{fs.env['SBX_PROXY_PORT']}/", timeout=60,
                     headers={"Host": route["host"], "X-Sbx-Token": route["token"]})


def code(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


def test_suspend_resume_and_delete_an_account(fs: FaultServer) -> None:
    carol_id, carol = account(fs, "carol")
    _dave_id, dave = account(fs, "dave")
    run = ok(fs, carol, "new", "--type", "small").strip()
    pid = ok(fs, carol, "exec", run, COUNTER).strip()
    ok(fs, carol, "exec", run, "echo kept > ~/notes; sync")
    ok(fs, carol, "exec", run, "--detach", "python3 -m http.server 8000 --bind 0.0.0.0")
    route = json.loads(ok(fs, carol, "host", run, "8000", "--json"))["route"]
    stopped = ok(fs, carol, "new", "--type", "small").strip()
    ok(fs, carol, "stop", stopped, "--wait")
    fork = json.loads(ok(fs, carol, "fork", run, "--wait", "--json").splitlines()[-1])["id"]
    ok(fs, carol, "snapshot", run, "carol-snap")
    with http(fs, carol) as c:
        r = c.put("/v1/secrets/tok", json={"value": "s3cret-value", "rules": [
            {"hosts": ["api.example.com"], "action": "replace"}]})
        assert r.status_code == 200, r.text
    other = ok(fs, dave, "new", "--type", "small").strip()
    assert poll(lambda: proxied(fs, route).status_code == 200, "the hosted port to answer", timeout=60)

    # suspend: key refused, running sandboxes stopped with memory, starts refused, port refused
    out = cli(fs, None, "admin", "account", "suspend", carol_id)
    assert out.returncode == 0 and "suspended" in out.stderr, out.stderr
    poll(lambda: state(fs, run) == "stopped" and state(fs, fork) == "stopped", "carol's sandboxes to stop",
         timeout=180)
    info = sandbox(fs, run)["sandbox"]
    assert (info["stopReason"], info["memorySaved"]) == ("suspended", True), info
    r = cli(fs, carol, "list")
    assert r.returncode == 1 and r.stderr.startswith("error: account_suspended"), r.stderr
    with http(fs) as admin:
        assert code(admin.post(f"/v1/sandboxes/{stopped}/resume")) == (403, "account_suspended")
        assert code(admin.post(f"/v1/sandboxes/{run}/fork", json={})) == (403, "account_suspended")
    assert proxied(fs, route).status_code in (403, 409)
    assert ok(fs, dave, "exec", other, "echo fine").strip() == "fine"

    # it survives a server killed and started again
    fs.restart()
    r = cli(fs, carol, "list")
    assert r.returncode == 1 and r.stderr.startswith("error: account_suspended"), r.stderr
    assert state(fs, run) == "stopped"

    # resume: the key works again; the sandboxes stay stopped until the user resumes them, with their memory
    out = cli(fs, None, "admin", "account", "resume", carol_id)
    assert out.returncode == 0 and "active" in out.stderr, out.stderr
    assert state(fs, run) == "stopped" and state(fs, fork) == "stopped"
    ok(fs, carol, "resume", run, "--wait")
    assert json.loads(ok(fs, carol, "info", run, "--json"))["sandbox"]["memoryRestored"] is True
    assert ok(fs, carol, "exec", run, f"kill -0 {pid} && cat ~/notes").strip() == "kept"

    # delete: everything of carol's goes, her key and port token answer 401, her usage stays
    with http(fs) as admin:
        before = admin.get("/v1/usage", params={"account": carol_id, "by": "sandbox"}).json()
    out = cli(fs, None, "admin", "account", "delete", carol_id, "--yes")
    assert out.returncode == 0 and "deleted" in out.stderr, out.stderr
    r = cli(fs, carol, "list")
    assert r.returncode == 1 and r.stderr.startswith("error: unauthorized"), r.stderr
    assert code(proxied(fs, route)) == (401, "unauthorized")
    with http(fs) as admin:
        acct = admin.get("/v1/account", params={"account": carol_id}).json()["account"]
        assert acct["state"] == "deleted"
        ids = {s["id"] for s in admin.get("/v1/sandboxes").json()["sandboxes"]}
        assert not ids & {run, stopped, fork} and other in ids
        for sid in (run, stopped, fork):
            assert admin.get(f"/v1/sandboxes/{sid}").status_code == 404
        assert "carol-snap" not in {s["name"] for s in admin.get("/v1/snapshots").json()["snapshots"]}
        usage = admin.get("/v1/usage", params={"account": carol_id, "by": "sandbox"}).json()
        groups = {g["key"]: g for g in usage["groups"]}
        assert {run, stopped, fork} <= set(groups), usage
        assert usage["total"]["runningSeconds"] >= before["total"]["runningSeconds"] > 0
        everyone = admin.get("/v1/usage", params={"by": "sandbox"}).json()
        assert run in {g["key"] for g in everyone["groups"]}
        r = admin.post(f"/v1/accounts/{carol_id}/suspend")
        assert code(r) == (409, "account_deleted")
    from sqlalchemy import create_engine, text

    engine = create_engine(f"sqlite:///{fs.tmp / 'state' / 'sbx.db'}")
    with engine.connect() as c:
        assert c.execute(text("select count(*) from secrets where account_id = :a"), {"a": carol_id}).scalar() == 0
        assert c.execute(text("select count(*) from api_keys where account_id = :a"), {"a": carol_id}).scalar() == 0
    engine.dispose()
    # dave is untouched
    assert state(fs, other) == "running"
    assert ok(fs, dave, "exec", other, "echo still").strip() == "still"
    ok(fs, dave, "delete", other, "--wait")


def test_a_deletion_cut_short_by_sigkill_is_finished_at_start(fs: FaultServer) -> None:
    erin_id, erin = account(fs, "erin")
    running = ok(fs, erin, "new", "--type", "small").strip()
    stopped = ok(fs, erin, "new", "--type", "small").strip()
    ok(fs, erin, "stop", stopped, "--wait")
    with http(fs) as admin:
        r = admin.delete(f"/v1/accounts/{erin_id}")
        assert r.status_code == 202 and r.json()["account"]["state"] == "deleting", r.text
    fs.kill9()  # right after the deletion began
    fs.start()
    with http(fs) as admin:
        poll(lambda: admin.get("/v1/account", params={"account": erin_id}).json()["account"]["state"] == "deleted",
             "erin's deletion to be finished by the new server", timeout=300)
        for sid in (running, stopped):
            assert admin.get(f"/v1/sandboxes/{sid}").status_code == 404
    r = cli(fs, erin, "list")
    assert r.returncode == 1 and r.stderr.startswith("error: unauthorized"), r.stderr
