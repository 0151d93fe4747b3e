"""Abuse limits shared by every replica (issue 35), against a real PostgreSQL: token buckets and wrong-key counts
in the database (:mod:`sbx.control.accounts.limits`), exact when many threads of two "replicas" (two stores, two
connection pools) hit one key or one address at once, refilled by the database's clock, cleaned up; and the
:class:`sbx.api.auth.Gate` on top of them answering 429 ``rate_limited`` / 401 ``auth_throttled`` from either
replica once the shared budget is spent."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from sbx.api.auth import Gate
from sbx.control.accounts.keys import Accounts
from sbx.control.accounts.limits import SharedLimits, shared_limits
from sbx.control.errors import ControlError
from sbx.control.store.database import Store
from tests.fakes import fake_settings

THREADS = 12
TRIES = 10  # per thread


@pytest.fixture
def stores(pg_url: str) -> Iterator[list[Store]]:
    out = [Store(pg_url), Store(pg_url)]
    yield out
    for s in out:
        s.close()


def _hammer(fns: list[Callable[[], bool]], tries: int = TRIES) -> int:
    """Run each of ``fns`` in THREADS/len(fns) threads at once, ``tries`` times per thread; how many True."""
    got: list[bool] = []
    lock = threading.Lock()
    barrier = threading.Barrier(THREADS)

    def go(fn: Callable[[], bool]) -> None:
        barrier.wait()
        mine = [fn() for _ in range(tries)]
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=go, args=(fns[i % len(fns)],)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(got) == THREADS * tries
    return sum(got)


def test_many_threads_of_two_replicas_get_exactly_burst_tokens(stores: list[Store]) -> None:
    limits = [SharedLimits(s.engine) for s in stores]
    burst = 25  # far less than THREADS * TRIES; at 0.001/s nothing refills during the test
    n = _hammer([lambda lim=lim: lim.take("key_hot", 0.001, burst) is None for lim in limits])  # type: ignore[misc]
    assert n == burst
    wait = limits[1].take("key_hot", 0.001, burst)
    assert wait is not None and 900 < wait <= 1000  # (1 - tokens) / rate: about one token's time
    assert limits[0].take("key_cold", 0.001, burst) is None  # another key has its own bucket


def test_a_bucket_refills_at_the_rate_by_the_databases_clock(stores: list[Store]) -> None:
    lim = SharedLimits(stores[0].engine)
    assert [lim.take("key_r", 10.0, 3) is None for _ in range(4)] == [True, True, True, False]
    time.sleep(0.25)  # 2.5 tokens back
    assert [lim.take("key_r", 10.0, 3) is None for _ in range(3)] == [True, True, False]
    time.sleep(1.0)  # full again, never more than burst
    assert sum(lim.take("key_r", 10.0, 3) is None for _ in range(6)) == 3


def test_many_threads_of_two_replicas_pass_exactly_limit_wrong_keys(stores: list[Store]) -> None:
    limits = [SharedLimits(s.engine) for s in stores]

    def wrong(lim: SharedLimits) -> bool:
        return lim.attempt("203.0.113.9", 7, 60.0).wait is None  # each one that passes stays counted (wrong)

    assert _hammer([lambda lim=lim: wrong(lim) for lim in limits]) == 7  # type: ignore[misc]
    refused = limits[0].attempt("203.0.113.9", 7, 60.0)
    assert refused.ticket is None and refused.wait is not None and 55 < refused.wait <= 60
    assert limits[1].attempt("198.51.100.1", 7, 60.0).wait is None  # another address has its own count


def test_good_keys_give_their_attempt_back(stores: list[Store]) -> None:
    lim = SharedLimits(stores[0].engine)
    for _ in range(20):  # many good keys from one address never throttle it
        got = lim.attempt("192.0.2.1", 3, 60.0)
        assert got.wait is None and got.ticket is not None
        lim.attempt_ok(got.ticket)
    for _ in range(3):
        assert lim.attempt("192.0.2.1", 3, 60.0).wait is None
    assert lim.attempt("192.0.2.1", 3, 60.0).wait is not None


def test_attempts_leave_the_window_and_cleanup_removes_what_no_longer_counts(stores: list[Store]) -> None:
    lim = SharedLimits(stores[0].engine)
    assert [lim.attempt("192.0.2.7", 2, 0.5).wait is None for _ in range(3)] == [True, True, False]
    time.sleep(0.6)
    assert lim.attempt("192.0.2.7", 2, 0.5).wait is None  # the old two left the window
    assert lim.take("key_c", 100.0, 5) is None  # full again after 0.05 s
    time.sleep(0.6)
    assert lim.cleanup() == 4  # the bucket, and the three attempts counted (the refused one left none)
    with stores[0].engine.connect() as c:
        assert c.execute(text("SELECT count(*) FROM rate_buckets")).scalar_one() == 0
        assert c.execute(text("SELECT count(*) FROM auth_attempts")).scalar_one() == 0


def test_sqlite_keeps_limits_in_memory(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'sbx.db'}")
    try:
        assert shared_limits(store) is None
    finally:
        store.close()


def test_two_gates_on_one_database_hold_a_key_and_an_address_to_one_budget(tmp_path: Path,
                                                                          stores: list[Store]) -> None:
    settings = fake_settings(tmp_path, rate_limit=0.001, rate_burst=6, auth_fail_limit=4, auth_fail_window=60.0)
    gates = []
    for s in stores:
        accounts = Accounts(s, ["trial", "unlimited"])
        gates.append(Gate(accounts, settings, limits=shared_limits(s)))
    accounts = gates[0].accounts
    accounts.bootstrap("sbx_admin_token_for_shared_limits")
    _row, _key, token = accounts.create_account("ratey", "trial")

    def call(gate: Gate, tok: str, client: str) -> str:
        try:
            gate.check(tok, client)
            return "ok"
        except ControlError as e:
            return e.code

    got = [call(gates[i % 2], token, "10.0.0.1") for i in range(10)]
    assert got == ["ok"] * 6 + ["rate_limited"] * 4, got  # 6 in total across both, not 6 each
    # the admin key is not rate limited
    assert all(call(gates[i % 2], "sbx_admin_token_for_shared_limits", "10.0.0.1") == "ok" for i in range(10))

    wrong = [call(gates[i % 2], f"sbx_wrong_{i}", "10.0.0.66") for i in range(6)]
    assert wrong == ["unauthorized"] * 4 + ["auth_throttled"] * 2, wrong
    assert call(gates[1], token, "10.0.0.66") == "auth_throttled"  # a key never used from there: not even looked up
    # a good key from a fresh address gives its attempt back: its 4 wrong keys still get through after it
    assert call(gates[0], token, "10.0.0.77") == "rate_limited"  # (still known good: the bucket is what refuses)
    assert [call(gates[i % 2], f"sbx_wrong_{i}", "10.0.0.77") for i in range(5)] == \
        ["unauthorized"] * 4 + ["auth_throttled"]
