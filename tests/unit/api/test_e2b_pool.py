"""The E2B layer's ready jobs (:mod:`sbx.api.e2b.pool`) around a pause: :meth:`Pool.hold` waits for a ready job's
start in flight and starts none while it holds."""

from __future__ import annotations

import threading
import time
from typing import Any

from sbx.api.e2b.pool import TARGET, Pool


class SlowStarts:
    """A control plane whose ``exec_detached`` (a ready job's start) takes until ``go`` is set."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.started: list[str] = []
        self.lock = threading.Lock()

    def exec_detached(self, sandbox_id: str, command: str, user: str) -> Any:
        assert self.go.wait(10)
        with self.lock:
            self.started.append(sandbox_id)


def test_hold_waits_for_a_start_in_flight_and_starts_none_while_held() -> None:
    cp = SlowStarts()
    pool = Pool(cp)  # type: ignore[arg-type]
    pool.empty("sb_a")  # a refill starts: its first exec_detached blocks
    time.sleep(0.1)
    entered = threading.Event()

    def pause() -> None:
        with pool.hold("sb_a"):
            entered.set()
            time.sleep(0.3)
            pool.claimed("sb_a")  # a start asked for while held is not made
            assert len(cp.started) == 1

    t = threading.Thread(target=pause)
    t.start()
    assert not entered.wait(0.3)  # the start in flight holds the pause back
    cp.go.set()
    assert entered.wait(5)
    t.join(5)
    assert cp.started == ["sb_a"]  # the refill stopped at the hold, after the start in flight
    pool.claimed("sb_a")  # after the hold, starts go on: both ready jobs were claimed, two more start
    deadline = time.monotonic() + 5
    while len(cp.started) < 1 + TARGET and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)
    assert len(cp.started) == 1 + TARGET


def test_hold_gives_up_waiting_after_its_limit() -> None:
    cp = SlowStarts()
    pool = Pool(cp)  # type: ignore[arg-type]
    pool.empty("sb_b")
    time.sleep(0.1)
    t0 = time.monotonic()
    with pool.hold("sb_b", wait=0.2):
        assert time.monotonic() - t0 < 2
    cp.go.set()
