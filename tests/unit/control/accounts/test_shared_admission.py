"""Plan admission exact across replicas (issue 35): two control planes on one PostgreSQL database (two stores, two
connection pools, as two ``sbx server`` replicas) race many starts of one account; the account's per-account
advisory lock (:class:`sbx.control.store.locks.AccountLocks`) lets exactly the plan's starts (or running places)
through in total, not that many per replica."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbx.control.cluster.capacity import GiB, HostResources
from sbx.control.errors import ControlError
from sbx.control.service import ControlPlane
from sbx.control.store.database import Store
from tests.fakes import FakeNode, fake_settings

PER_REPLICA = 8  # concurrent starts fired at each replica


@pytest.fixture
def planes(tmp_path: Path, pg_url: str, request: pytest.FixtureRequest) -> Iterator[list[ControlPlane]]:
    limits: dict[str, int] = request.param
    settings = fake_settings(tmp_path, plans={"trial": {"starts_per_hour": 0, "running": 0, **limits}})
    out: list[ControlPlane] = []
    nodes: list[FakeNode] = []
    try:
        for k in range(2):
            nodes.append(FakeNode(tmp_path / f"node{k}"))
            out.append(ControlPlane(settings, nodes[-1], store=Store(pg_url),
                                    host=lambda: HostResources(1 << 20, 1000 * GiB, "/v"), trim=lambda _m: None))
            out[-1].start()
        yield out
    finally:
        for cp in out:
            cp.close()
        for n in nodes:
            n.close()


def _race(planes: list[ControlPlane], start) -> list[str]:  # type: ignore[no-untyped-def]
    """Run ``start(cp)`` PER_REPLICA times on each plane at once; each result: "ok" or the error's code."""
    results: list[str] = []
    barrier = threading.Barrier(PER_REPLICA * len(planes))

    def go(cp: ControlPlane) -> None:
        barrier.wait()
        try:
            start(cp)
            results.append("ok")
        except ControlError as e:
            results.append(e.code if e.code != "plan_limit" else f"plan_limit:{(e.extra or {}).get('limit')}")

    threads = [threading.Thread(target=go, args=(cp,)) for cp in planes for _ in range(PER_REPLICA)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


@pytest.mark.parametrize("planes", [{"starts_per_hour": 5}], indirect=True)
def test_two_replicas_allow_an_accounts_start_limit_once_in_total(planes: list[ControlPlane]) -> None:
    acct, _key, _token = planes[0].accounts.create_account("racer", "trial")
    results = _race(planes, lambda cp: cp.create("small", account_id=acct.id))
    assert results.count("ok") == 5, results
    assert results.count("plan_limit:starts_per_hour") == 2 * PER_REPLICA - 5, results
    assert planes[1].meter.starts_since(acct.id) == 5
    assert len(planes[1].store.list_sandboxes(account_id=acct.id)) == 5


@pytest.mark.parametrize("planes", [{"running": 3}], indirect=True)
def test_two_replicas_allow_an_accounts_running_places_once_in_total(planes: list[ControlPlane]) -> None:
    acct, _key, _token = planes[0].accounts.create_account("runner", "trial")
    results = _race(planes, lambda cp: cp.create("small", account_id=acct.id))
    assert results.count("ok") == 3, results
    assert results.count("plan_limit:running") == 2 * PER_REPLICA - 3, results
