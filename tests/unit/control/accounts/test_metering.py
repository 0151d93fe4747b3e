"""Issue 12: per-second metering and the two price models, with a fake clock, against the resize guide's worked
examples ("What the bigger size costs") and Sandbox0's memory-time figure (1 GiB running 730 hours, $10.95)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbx.control.accounts.pricing import Interval, Pricing, report
from sbx.control.service import ControlPlane
from tests.fakes import FakeNode, make_control

T0 = dt.datetime(2026, 12, 1, 8, 0, tzinfo=dt.UTC)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, **kw: float) -> None:
        self.now += dt.timedelta(**kw)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _plane(tmp_path: Path, node: FakeNode, clock: Clock, **settings: object) -> ControlPlane:
    cp: ControlPlane = make_control(tmp_path, node, **settings)
    cp.store.clock = clock
    return cp


@pytest.fixture
def cp(tmp_path: Path, node: FakeNode, clock: Clock) -> Iterator[ControlPlane]:
    plane = _plane(tmp_path, node, clock)
    yield plane
    plane.close()


def _cost(cp: ControlPlane, **kw: object) -> float:
    return float(cp.meter.usage(None, **kw)["total"]["cost"])  # type: ignore[arg-type]


def _run(cp: ControlPlane, sid: str) -> None:
    cp.wait_settled(sid, 10)


def test_two_hours_on_default_cost_0_072(cp: ControlPlane, clock: Clock) -> None:
    sid = cp.create("default", ttl=0).id
    _run(cp, sid)
    clock.advance(hours=2)
    cp.stop(sid)
    _run(cp, sid)
    clock.advance(hours=5)  # stopped: the size model charges nothing for it
    assert round(_cost(cp), 6) == 0.072
    assert cp.meter.usage(None)["total"]["runningSeconds"] == 7200


def test_small_for_an_hour_then_resized_to_default_costs_0_054(cp: ControlPlane, clock: Clock) -> None:
    sid = cp.create("small", ttl=0).id
    _run(cp, sid)
    clock.advance(hours=1)
    cp.stop(sid)
    _run(cp, sid)
    cp.resume(sid, type="default")
    _run(cp, sid)
    clock.advance(hours=1)
    by_size = cp.meter.usage(None, by="size")
    assert round(by_size["total"]["cost"], 6) == 0.054
    assert {g["key"]: round(g["cost"], 6) for g in by_size["groups"] if g["key"] != "storage"} == {
        "small": 0.018, "default": 0.036}


def test_small_two_hours_with_a_ten_minute_default_fork_costs_0_039(cp: ControlPlane, clock: Clock) -> None:
    src = cp.create("small", ttl=0).id
    _run(cp, src)
    clock.advance(minutes=60)
    cp.stop(src)  # the heavy step runs in the fork; the source waits stopped
    _run(cp, src)
    fork = cp.fork(src, type="default").id
    _run(cp, fork)
    clock.advance(minutes=10)
    cp.delete(fork)
    _run(cp, fork)
    cp.resume(src)
    _run(cp, src)
    clock.advance(minutes=50)
    rep = cp.meter.usage(None, by="sandbox")
    groups = {g["key"]: round(g["cost"], 6) for g in rep["groups"]}
    assert groups == {src: 0.033, fork: 0.006}
    assert round(rep["total"]["cost"], 6) == 0.039


def test_memory_time_model_1_gib_for_730_hours_costs_10_95(tmp_path: Path, node: FakeNode, clock: Clock) -> None:
    cp = _plane(tmp_path, node, clock, pricing={"model": "memory"})
    try:
        sid = cp.create("large", ttl=0).id  # the test profile's large has 1 GiB of memory
        _run(cp, sid)
        clock.advance(hours=730)
        rep = cp.meter.usage(None, start=T0)  # by default a report starts this month; this one spans two
        assert rep["priceModel"] == "memory"
        assert rep["total"]["runningGiBHours"] == 730
        assert round(rep["total"]["cost"], 6) == 10.95
    finally:
        cp.close()


def test_memory_model_charges_stored_gib_months() -> None:
    p = Pricing.from_settings({"model": "memory"})
    iv = Interval("store", None, 10.0, T0, T0 + dt.timedelta(hours=730))
    assert round(report([iv], T0, T0 + dt.timedelta(days=60), None, p)["total"]["cost"], 6) == 0.2
    assert report([iv], T0, T0 + dt.timedelta(days=60), None, Pricing())["total"]["cost"] == 0  # size model


def test_stopped_time_is_stored_not_running_and_by_day_splits_at_midnight(cp: ControlPlane, clock: Clock) -> None:
    clock.now = dt.datetime(2026, 12, 1, 23, 0, tzinfo=dt.UTC)
    sid = cp.create("small", ttl=0).id
    _run(cp, sid)
    clock.advance(hours=2)  # 23:00 -> 01:00 next day
    cp.stop(sid)
    _run(cp, sid)
    clock.advance(hours=3)
    rep = cp.meter.usage(None, by="day")
    days = {g["key"]: g["runningSeconds"] for g in rep["groups"]}
    assert days == {"2026-12-01": 3600, "2026-12-02": 3600}
    rows = cp.meter.intervals(None, T0 - dt.timedelta(days=1), clock.now + dt.timedelta(days=1))
    assert [(r.kind, r.end is None) for r in rows] == [("run", False), ("store", True)]
    window = cp.meter.usage(None, start=dt.datetime(2026, 12, 2, 0, 30, tzinfo=dt.UTC),
                            end=dt.datetime(2026, 12, 2, 0, 45, tzinfo=dt.UTC))
    assert window["total"]["runningSeconds"] == 900


def test_reconcile_after_a_crash_closes_what_stopped_and_counts_each_second_once(
        tmp_path: Path, node: FakeNode, clock: Clock) -> None:
    cp = _plane(tmp_path, node, clock)
    sid = cp.create("small", ttl=0).id
    _run(cp, sid)
    clock.advance(minutes=30)
    # the server "dies" with the sandbox in stopping: the running interval was closed with that state change
    cp.store.update_sandbox(sid, state="stopping")
    cp.close()
    node.boxes[sid].status = "checkpointed"
    clock.advance(minutes=30)  # the server is down
    cp2 = _plane(tmp_path, node, clock)
    try:
        assert cp2.get(sid).state == "stopped"
        rep = cp2.meter.usage(None)
        assert rep["total"]["runningSeconds"] == 1800
        runs = [r for r in cp2.meter.intervals(None, T0, clock.now) if r.kind == "run"]
        assert len(runs) == 1 and runs[0].end == T0 + dt.timedelta(minutes=30)
        assert cp2.meter.reconcile() == 0  # nothing left to repair: a second start changes nothing
    finally:
        cp2.close()


def test_a_running_interval_stays_open_across_a_crash(tmp_path: Path, node: FakeNode, clock: Clock) -> None:
    cp = _plane(tmp_path, node, clock)
    sid = cp.create("small", ttl=0).id
    _run(cp, sid)
    cp.close()  # killed; the sandbox keeps running
    clock.advance(hours=1)
    cp2 = _plane(tmp_path, node, clock)
    try:
        clock.advance(hours=1)
        assert cp2.meter.usage(None)["total"]["runningSeconds"] == 7200
        assert cp2.meter.usage(None, end=T0 + dt.timedelta(minutes=90))["total"]["runningSeconds"] == 5400
    finally:
        cp2.close()


def test_snapshots_hold_stored_gib_until_deleted(cp: ControlPlane, clock: Clock) -> None:
    sid = cp.create("small", ttl=0).id
    _run(cp, sid)
    cp.snapshot(sid, "s1")
    assert any(r.snapshot == "s1" and r.end is None for r in cp.meter.intervals(None, T0, clock.now + dt.timedelta(1)))
    clock.advance(hours=1)
    cp.delete_snapshot("s1")
    snap = [r for r in cp.meter.intervals(None, T0, clock.now) if r.snapshot == "s1"]
    assert len(snap) == 1 and snap[0].end == T0 + dt.timedelta(hours=1)


def test_a_to_in_the_future_counts_a_running_sandbox_only_until_now(cp: ControlPlane, clock: Clock) -> None:
    """The console asks for whole days (``to`` = tomorrow): the running interval must stop at now, not at ``to``."""
    sid = cp.create("default", ttl=0).id
    _run(cp, sid)
    clock.advance(hours=2)
    report = cp.meter.usage(None, T0 - dt.timedelta(days=1), T0 + dt.timedelta(days=2), by="day")
    assert report["total"]["runningSeconds"] == 7200
    assert round(report["total"]["cost"], 6) == 0.072
    assert report["to"] == "2026-12-01T10:00:00Z"
    later = cp.meter.usage(None, T0 + dt.timedelta(days=1), T0 + dt.timedelta(days=2))
    assert later["total"]["runningSeconds"] == 0  # a window wholly in the future is empty
