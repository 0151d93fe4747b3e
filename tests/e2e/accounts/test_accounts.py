"""Issue 12 end to end, on a real server with real sandboxes: two accounts that neither see nor touch each other's
sandboxes, snapshots, routes or terminals (404 on every route, CLI and API); a revoked key is 401; a trial
account's xlarge create and a start past its limit are 403 plan_limit; running and stopped time of real sandboxes
is metered within a second; a server killed with SIGKILL during a stop neither loses nor double-counts a second.

One kill-9-able server (tests/e2e/faultsrv.py) with a server config that gives the trial plan 3 starts an hour."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import SBX
from tests.e2e.faultsrv import FaultServer
from tests.e2e.helpers import poll

pytestmark = pytest.mark.e2e

TRIAL_STARTS = 3


@pytest.fixture(scope="module")
def fs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultServer]:
    tmp = tmp_path_factory.mktemp("sbx-acct")
    config = tmp / "server.toml"
    config.write_text(f"[plans.trial]\nstarts_per_hour = {TRIAL_STARTS}\n"
                      '[plans.hardened]\nprice_usd_month = 50\nsizes = ["small"]\nruntimes = ["gvisor"]\n')
    f = FaultServer(tmp, prefix="SBX_ACCT", node="acct", bridge="sbxacct0", subnet="10.84.0.0/16",
                    SBX_CONFIG=str(config))
    f.start()
    try:
        yield f
    finally:
        f.close()


def cli(fs: FaultServer, token: str | None, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``sbx ARGS`` as the holder of ``token`` (None: the admin's client config)."""
    assert fs.srv is not None
    env = dict(fs.srv.env)
    if token is not None:
        env["SBX_TOKEN"] = token
    return subprocess.run([SBX, *args], env=env, capture_output=True, text=True, timeout=timeout)


def ok(fs: FaultServer, token: str | None, *args: str) -> str:
    r = cli(fs, token, *args)
    assert r.returncode == 0, f"sbx {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def account(fs: FaultServer, name: str, plan: str) -> tuple[str, str]:
    made = json.loads(ok(fs, None, "admin", "account", "create", name, "--plan", plan, "--json"))
    return made["account"]["id"], made["key"]["token"]


def http(fs: FaultServer, token: str) -> httpx.Client:
    assert fs.srv is not None
    return httpx.Client(base_url=fs.srv.url, headers={"Authorization": f"Bearer {token}"}, timeout=900)


@pytest.fixture(scope="module")
def people(fs: FaultServer) -> dict[str, tuple[str, str]]:
    return {"alice": account(fs, "alice", "team"), "bob": account(fs, "bob", "team"),
            "tina": account(fs, "tina", "trial")}


def test_two_accounts_neither_see_nor_touch_each_others_things(fs: FaultServer, people: Any) -> None:
    alice, bob = people["alice"][1], people["bob"][1]
    sid = ok(fs, alice, "new", "--type", "small").strip()
    ok(fs, alice, "host", sid, "8000")
    ok(fs, alice, "snapshot", sid, "alice-e2e")
    ok(fs, alice, "exec", sid, "echo secret > ~/notes")
    job = json.loads(ok(fs, alice, "exec", sid, "--detach", "sleep 300", "--json"))["job"]["id"]

    for args in (["info", sid], ["exec", sid, "id"], ["stop", sid], ["resume", sid], ["fork", sid],
                 ["delete", sid], ["snapshot", sid, "bobs"], ["snapshots", sid], ["host", sid, "9000"],
                 ["unhost", sid, "8000"], ["jobs", sid], ["logs", sid, job], ["kill", sid, job],
                 ["wait", sid, job], ["cp", f"{sid}:notes", "/tmp/sbx-acct-bob-notes"],
                 ["ssh", sid, "--", "cat notes"], ["snapshot-delete", "alice-e2e"],
                 ["new", "--from", "alice-e2e"]):
        r = cli(fs, bob, *args)
        assert r.returncode != 0 and "not_found" in r.stderr, (args, r.returncode, r.stdout, r.stderr)
    assert not Path("/tmp/sbx-acct-bob-notes").exists()
    with http(fs, bob) as b:
        for method, path in (("GET", f"/v1/sandboxes/{sid}/events"), ("GET", f"/v1/sandboxes/{sid}/routes"),
                             ("GET", f"/v1/sandboxes/{sid}/files?path=notes"),
                             ("GET", f"/v1/sandboxes/{sid}/files/list?path=."),
                             ("PUT", f"/v1/sandboxes/{sid}/files?path=notes"),
                             ("DELETE", f"/v1/sandboxes/{sid}/files?path=notes"),
                             ("GET", f"/v1/usage?sandbox={sid}")):
            r = b.request(method, path, content=b"bob was here" if method == "PUT" else None)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (method, path, r.text)
        assert b.get("/v1/sandboxes").json()["sandboxes"] == []
        assert b.get("/v1/snapshots").json()["snapshots"] == []
    assert json.loads(ok(fs, bob, "list", "--json"))["sandboxes"] == []
    # alice's things are untouched; the admin sees them
    assert ok(fs, alice, "exec", sid, "cat ~/notes").strip() == "secret"
    sb = json.loads(ok(fs, alice, "info", sid, "--json"))["sandbox"]
    assert sb["state"] == "running"
    assert [r["port"] for r in json.loads(ok(fs, alice, "host", sid, "--json"))["routes"]] == [8000]
    assert "alice-e2e" in ok(fs, alice, "snapshots")
    assert sid in ok(fs, None, "list")
    # snapshot names are the account's own: bob takes the name alice holds (before: 409 snapshot_exists, which
    # told bob that it existed), and `new --from` gives each account its own snapshot's disk
    bsid = ok(fs, bob, "new", "--type", "small").strip()
    ok(fs, bob, "exec", bsid, "echo bobs > ~/notes")
    ok(fs, bob, "snapshot", bsid, "alice-e2e")
    r = cli(fs, bob, "snapshot", bsid, "alice-e2e")
    assert r.returncode != 0 and "snapshot_exists" in r.stderr
    made = {who: ok(fs, tok, "new", "--type", "small", "--from", "alice-e2e").strip()
            for who, tok in (("alice", alice), ("bob", bob))}
    # alice's snapshot was sealed before her notes were written; bob's after his
    assert ok(fs, alice, "exec", made["alice"], "cat ~/notes 2>/dev/null || echo none").strip() == "none"
    assert ok(fs, bob, "exec", made["bob"], "cat ~/notes 2>/dev/null || echo none").strip() == "bobs"
    ok(fs, bob, "snapshot-delete", "alice-e2e")
    assert "alice-e2e" not in ok(fs, bob, "snapshots") and "alice-e2e" in ok(fs, alice, "snapshots")
    for tok, ids in ((alice, [sid, made["alice"]]), (bob, [bsid, made["bob"]])):
        for i in ids:
            ok(fs, tok, "delete", i, "--wait")
    ok(fs, alice, "snapshot-delete", "alice-e2e")


def test_a_revoked_key_is_401(fs: FaultServer, people: Any) -> None:
    bob_id = people["bob"][0]
    key = json.loads(ok(fs, None, "admin", "key", "create", bob_id, "--name", "laptop", "--json"))["key"]
    assert json.loads(ok(fs, key["token"], "list", "--json"))["sandboxes"] == []
    ok(fs, None, "admin", "key", "revoke", key["id"])
    r = cli(fs, key["token"], "list")
    assert r.returncode == 1 and r.stderr.startswith("error: unauthorized"), r.stderr
    with http(fs, key["token"]) as c:
        resp = c.get("/v1/sandboxes")
    assert resp.status_code == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
    assert json.loads(ok(fs, people["bob"][1], "list", "--json"))["sandboxes"] == []  # bob's other key still works


def test_trial_xlarge_and_a_start_past_the_limit_are_403_plan_limit(fs: FaultServer, people: Any) -> None:
    tina = people["tina"][1]
    r = cli(fs, tina, "new", "--type", "xlarge")
    assert r.returncode == 1 and "plan_limit" in r.stderr and "team plan allows it" in r.stderr, r.stderr
    with http(fs, tina) as c:
        resp = c.post("/v1/sandboxes", json={"type": "xlarge"})
        err = resp.json()["error"]
        assert (resp.status_code, err["code"], err["limit"], err["plan"], err["upgrade"]) == (
            403, "plan_limit", "size", "trial", "team")
        assert c.get("/v1/sandboxes").json()["sandboxes"] == []
    sid = ok(fs, tina, "new", "--type", "small").strip()  # start 1
    for _ in range(TRIAL_STARTS - 1):  # starts 2..3
        ok(fs, tina, "stop", sid, "--wait")
        ok(fs, tina, "resume", sid, "--wait")
    ok(fs, tina, "stop", sid, "--wait")
    r = cli(fs, tina, "resume", sid)
    assert r.returncode == 1 and "plan_limit" in r.stderr and "starts per hour" in r.stderr, r.stderr
    assert json.loads(ok(fs, tina, "info", sid, "--json"))["sandbox"]["state"] == "stopped"
    plan = json.loads(ok(fs, tina, "plan", "--json"))
    assert plan["plan"]["name"] == "trial" and plan["used"]["startsLastHour"] == TRIAL_STARTS
    ok(fs, tina, "delete", sid, "--wait")


def _sandbox_usage(fs: FaultServer, token: str, sid: str, to: str | None = None) -> dict[str, Any]:
    with http(fs, token) as c:
        r = c.get("/v1/usage", params={"sandbox": sid, **({"to": to} if to else {})})
        assert r.status_code == 200, r.text
        return r.json()["total"]  # type: ignore[no-any-return]


def test_running_and_stopped_time_of_a_real_sandbox_is_metered_within_a_second(fs: FaultServer,
                                                                                people: Any) -> None:
    alice = people["alice"][1]
    with http(fs, alice) as c:
        sid = c.post("/v1/sandboxes?wait=true", json={"type": "small"}).json()["sandbox"]["id"]
        ran_from = time.monotonic()  # answered once running: the meter started just before
        time.sleep(3)
        assert c.post(f"/v1/sandboxes/{sid}/stop").status_code == 202  # the meter stops at the request
        ran_to = time.monotonic()
        poll(lambda: c.get(f"/v1/sandboxes/{sid}").json()["sandbox"]["state"] == "stopped", f"{sid} to stop")
    stopped_from = time.monotonic()
    first = _sandbox_usage(fs, alice, sid)
    assert abs(first["runningSeconds"] - (ran_to - ran_from)) < 1.0, first
    assert first["cost"] == pytest.approx(first["runningSeconds"] * 0.018 / 3600, abs=1e-6)  # small: $0.018/h
    unique = json.loads(ok(fs, alice, "info", sid, "--json"))["sandbox"]["stats"]["diskUniqueBytes"]
    gib = poll(lambda: json.loads(ok(fs, alice, "plan", "--json"))["used"]["storedGiB"], "the stored size")
    assert gib > unique / 2**30  # its disk's unique bytes and its memory image (kept by the stop)
    time.sleep(3)
    later = _sandbox_usage(fs, alice, sid)
    stopped_for = time.monotonic() - stopped_from
    assert later["runningSeconds"] == first["runningSeconds"]  # stopped: no running time
    assert abs(later["storedGiBHours"] / gib * 3600 - stopped_for) < 1.0, (later, gib, stopped_for)
    ok(fs, alice, "resume", sid, "--wait")
    again = time.monotonic()
    time.sleep(2)
    resumed = _sandbox_usage(fs, alice, sid)
    assert abs(resumed["runningSeconds"] - first["runningSeconds"] - (time.monotonic() - again)) < 1.0, resumed
    by_day = json.loads(ok(fs, alice, "usage", "--by", "day", "--json"))
    assert by_day["groups"][-1]["bySize"]["small"]["runningSeconds"] >= resumed["runningSeconds"]
    assert "cost so far" in ok(fs, alice, "info", sid)
    ok(fs, alice, "delete", sid, "--wait")


def _intervals(fs: FaultServer, sid: str) -> list[tuple[str, str, str | None]]:
    with sqlite3.connect(fs.tmp / "state" / "sbx.db") as db:
        return [(k, s, e) for k, s, e in db.execute(
            "select kind, started_at, ended_at from usage where sandbox_id = ? and snapshot is null order by id",
            (sid,))]


@pytest.mark.parametrize("delay", [0.0, 0.4, 1.5])
def test_sigkill_during_a_stop_loses_and_double_counts_nothing(fs: FaultServer, people: Any, delay: float) -> None:
    alice = people["alice"][1]
    with http(fs, alice) as c:
        sid = c.post("/v1/sandboxes?wait=true", json={"type": "small"}).json()["sandbox"]["id"]
        ran_from = time.monotonic()
        time.sleep(2)
        assert c.post(f"/v1/sandboxes/{sid}/stop").status_code == 202  # stopping; the node checkpoints
        ran_to = time.monotonic()
    time.sleep(delay)
    fs.kill9()
    killed_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 1))
    time.sleep(2)  # the server is down
    fs.start()
    poll(lambda: json.loads(ok(fs, alice, "info", sid, "--json"))["sandbox"]["state"] in ("stopped", "running"),
         f"{sid} to settle after the restart", timeout=120)
    state = json.loads(ok(fs, alice, "info", sid, "--json"))["sandbox"]["state"]
    rows = _intervals(fs, sid)
    runs = [r for r in rows if r[0] == "run"]
    # the stop request closed the run in the same transaction as `stopping`: it is closed and counted once
    assert runs and runs[0][2] is not None, rows
    edges = [(s, e or "9999") for _, s, e in rows]
    assert all(a[1] <= b[0] for a, b in zip(edges, edges[1:], strict=False)), rows  # no second counted twice
    if state == "stopped":
        assert len(runs) == 1 and [r for r in rows if r[0] == "store" and r[2] is None], rows
    else:  # the checkpoint failed: the node kept it running and the reconcile opened a new run at the restart
        assert len(runs) == 2 and runs[1][2] is None, rows
    metered = _sandbox_usage(fs, alice, sid, to=killed_at)["runningSeconds"]
    assert abs(metered - (ran_to - ran_from)) < 1.0, (metered, rows)  # not lost, and the downtime not billed
    if state == "stopped":
        time.sleep(1.5)
        assert _sandbox_usage(fs, alice, sid)["runningSeconds"] == metered
    ok(fs, alice, "delete", sid, "--wait")


def test_a_plan_that_requires_the_hardened_class_runs_gvisor_sandboxes(fs: FaultServer) -> None:
    """Issue 33: a plan with ``runtimes = ["gvisor"]`` gives its accounts gVisor sandboxes without asking, and
    refuses the container class by name (403 plan_limit, nothing made)."""
    _, key = account(fs, "hannah", "hardened")
    sid = ok(fs, key, "new", "--type", "small").strip()
    try:
        assert json.loads(ok(fs, key, "info", sid, "--json"))["sandbox"]["runtime"] == "gvisor"
        assert "gVisor" in ok(fs, key, "exec", sid, "-u", "root", "dmesg | head -n 3")  # its own kernel
        r = cli(fs, key, "new", "--type", "small", "--runtime", "container")
        assert r.returncode != 0 and "plan_limit" in r.stderr and "container runtime class" in r.stderr, r.stderr
        assert [s["id"] for s in json.loads(ok(fs, key, "list", "--json"))["sandboxes"]] == [sid]
        assert json.loads(ok(fs, key, "plan", "--json"))["plan"]["runtimes"] == ["gvisor"]
    finally:
        ok(fs, key, "delete", sid, "--wait")
