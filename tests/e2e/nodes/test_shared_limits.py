"""Limits shared by every replica (issue 35): two `sbx server` replicas on one PostgreSQL database, driving one node
agent, enforce one account's plan and its key's request rate once in total, not once per replica.

- An account whose plan allows ``STARTS`` starts an hour fires creates at both replicas at once: exactly ``STARTS``
  are accepted in total, every other one is 403 ``plan_limit`` (limit ``starts_per_hour``); both replicas then
  report the same ``startsLastHour``.
- A key's requests fired at both replicas at once: ``BURST`` (plus what ``RATE`` refills meanwhile) pass in total,
  the rest are 429 ``rate_limited`` with ``Retry-After`` from either replica (per-replica buckets would pass twice
  ``BURST``).
- Wrong keys from one address at both replicas: ``FAILS`` are looked up in total, then 401 ``auth_throttled``.

The node agent runs in a network namespace of its own (tests/nodenet.py, node 3). The replicas share the
installation's admin key and secrets key (copied from the first one's state folder, as an operator would) and one
server config (``SBX_CONFIG``) with the plan's limit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from tests.e2e.faultsrv import FaultServer, start_replicas
from tests.e2e.helpers import poll
from tests.nodenet import NodeHost, node_netns
from tests.pgcluster import PgCluster, pg_cluster

pytestmark = pytest.mark.e2e

STARTS = 3  # starts per hour of the plan "capped"
PER_REPLICA = 4  # creates fired at each replica at once
BURST, RATE = 20, 0.2  # each account key's bucket (the admin key is not limited)
FAILS = 5  # wrong keys an address may present in the window


@dataclass
class Replicas:
    pg: PgCluster
    node: NodeHost
    a: FaultServer
    b: FaultServer


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    tmp = tmp_path_factory.mktemp("sbx-shared-limits")
    config = tmp / "server.toml"
    config.write_text(f'[plans.capped]\nprice_usd_month = 5\nsizes = ["small"]\nstarts_per_hour = {STARTS}\n'
                      "running = 0\nstorage_gib = 0\n")
    with pg_cluster() as pg, node_netns(3, tmp) as node:
        node.start()
        common = {"SBX_DATABASE_URL": pg.create_db("sbx_shared_limits"), "SBX_NODE_URL": node.url,
                  "SBX_NODE_TOKEN": node.token, "SBX_NODE_HEARTBEAT_SECONDS": "1", "SBX_CONFIG": str(config),
                  "SBX_RATE_LIMIT": str(RATE), "SBX_RATE_BURST": str(BURST), "SBX_AUTH_FAIL_LIMIT": str(FAILS),
                  "SBX_AUTH_FAIL_WINDOW": "300"}
        (tmp / "a").mkdir()
        (tmp / "b").mkdir()
        a = FaultServer(tmp / "a", prefix="SBX_SHLA", node="shla", bridge="sbxsla0", subnet="10.79.0.0/16",
                        **common)
        b = FaultServer(tmp / "b", prefix="SBX_SHLB", node="shlb", bridge="sbxslb0", subnet="10.78.0.0/16",
                        **common)
        try:
            start_replicas(a, b)
            yield Replicas(pg, node, a, b)
        finally:
            b.close()
            a.close()
            assert node.stop() == 0, node.logs()


def admin(fs: FaultServer) -> httpx.Client:
    assert fs.srv is not None
    return httpx.Client(base_url=fs.srv.url, headers={"Authorization": f"Bearer {fs.srv.token}"}, timeout=600)


def keyed(fs: FaultServer, token: str) -> httpx.Client:
    assert fs.srv is not None
    return httpx.Client(base_url=fs.srv.url, headers={"Authorization": f"Bearer {token}"}, timeout=600)


def account(fs: FaultServer, name: str, plan: str) -> tuple[str, str]:
    """A new account on ``plan`` (through ``fs``): ``(account id, its key's token)``."""
    with admin(fs) as c:
        r = c.post("/v1/accounts", json={"name": name, "plan": plan})
        assert r.status_code == 201, r.text
        return r.json()["account"]["id"], r.json()["key"]["token"]


def test_two_replicas_allow_an_accounts_starts_once_in_total(replicas: Replicas) -> None:
    a, b = replicas.a, replicas.b
    acct, token = account(a, "capped", "capped")
    results: list[tuple[str, int, str]] = []  # (replica, status, error code or sandbox id)
    barrier = threading.Barrier(2 * PER_REPLICA)

    def create(fs: FaultServer, name: str) -> None:
        with keyed(fs, token) as c:
            barrier.wait()
            r = c.post("/v1/sandboxes", json={"type": "small"})
        body = r.json()
        results.append((name, r.status_code, body["error"]["code"] if r.status_code >= 400 else body["sandbox"]["id"]))
        if r.status_code == 403:
            assert body["error"]["limit"] == "starts_per_hour" and body["error"]["plan"] == "capped", body

    threads = [threading.Thread(target=create, args=(fs, name)) for fs, name in ((a, "a"), (b, "b"))
               for _ in range(PER_REPLICA)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    made = [r for r in results if r[1] < 300]
    refused = [r for r in results if r[1] == 403 and r[2] == "plan_limit"]
    assert len(results) == 2 * PER_REPLICA and len(made) == STARTS, results
    assert len(refused) == 2 * PER_REPLICA - STARTS, results
    for fs in (a, b):  # both replicas count the same starts, and refuse the next one
        with keyed(fs, token) as c:
            assert c.get("/v1/account").json()["used"]["startsLastHour"] == STARTS
            r = c.post("/v1/sandboxes", json={"type": "small"})
            assert (r.status_code, r.json()["error"]["code"]) == (403, "plan_limit"), r.text
    with admin(a) as c:  # the accepted ones are real sandboxes that boot
        for _, _, sid in made:
            poll(lambda sid=sid: c.get(f"/v1/sandboxes/{sid}").json()["sandbox"]["state"] == "running",  # type: ignore[misc]
                 f"{sid} to run", timeout=300)
        for _, _, sid in made:
            assert c.delete(f"/v1/sandboxes/{sid}").status_code < 300


def test_two_replicas_hold_a_keys_request_rate_to_one_bucket(replicas: Replicas) -> None:
    a, b = replicas.a, replicas.b
    _acct, token = account(b, "ratey", "capped")
    clients = {"a": keyed(a, token), "b": keyed(b, token)}
    try:
        for c in clients.values():  # connections up before the clock starts
            c.get("/healthz")

        def get(name: str) -> tuple[str, int, str | None]:
            r = clients[name].get("/v1/account")
            return name, r.status_code, r.headers.get("retry-after")

        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(get, ["a", "b"] * BURST))  # 2 * BURST requests, half at each replica
        elapsed = time.monotonic() - t0
    finally:
        for c in clients.values():
            c.close()
    passed = [g for g in got if g[1] == 200]
    limited = [g for g in got if g[1] == 429]
    assert len(passed) + len(limited) == len(got), got
    # one bucket: BURST, and what refilled while they ran (per-replica buckets: all 2 * BURST)
    assert BURST <= len(passed) <= BURST + int(RATE * elapsed) + 1, (len(passed), elapsed, got)
    assert {g[0] for g in limited} == {"a", "b"}, got  # refused by either replica once the shared bucket is empty
    assert all(g[2] is not None and int(g[2]) >= 1 for g in limited), got


def test_two_replicas_throttle_an_addresss_wrong_keys_once_in_total(replicas: Replicas) -> None:
    """(Last in the module: afterwards 127.0.0.1 gets auth_throttled for every key not yet used from it at that
    replica; the admin key used first at both keeps working for the fixture's clean-up.)"""
    a, b = replicas.a, replicas.b
    for fs in (a, b):
        with admin(fs) as c:
            assert c.get("/v1/accounts").status_code == 200
    codes = []
    for i in range(FAILS + 3):
        with keyed((a, b)[i % 2], f"sbx_wrong_key_{i:02d}_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx") as c:
            r = c.get("/v1/sandboxes")
        codes.append((r.status_code, r.json()["error"]["code"]))
    assert codes == [(401, "unauthorized")] * FAILS + [(401, "auth_throttled")] * 3, codes
    _acct, fresh = account(a, "late", "capped")  # a good key never used from here: throttled too, at both
    for fs in (a, b):
        with keyed(fs, fresh) as c:
            assert c.get("/v1/account").json()["error"]["code"] == "auth_throttled"
        with admin(fs) as c:  # the admin key, known good from here, goes on
            assert c.get("/v1/accounts").status_code == 200
