"""The disk guard's decisions (issue 36) on fake disk numbers: levels, which growers stop and whether with memory,
and what a node's pass publishes and stops (:mod:`sbx.control.cluster.diskguard`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from sbx.control.cluster.diskguard import (
    MEMORY_SLACK,
    DiskGuard,
    Grower,
    Stop,
    choose_stops,
    keep_memory,
    level,
)
from sbx.control.errors import ControlError
from sbx.node.types import NodeError, Stats

MiB = 1 << 20
GiB = 1 << 30


def test_level_thresholds() -> None:
    assert level(10 * GiB, 5 * GiB, 2 * GiB) == "ok"
    assert level(5 * GiB, 5 * GiB, 2 * GiB) == "ok"  # at the reserve is enough
    assert level(5 * GiB - 1, 5 * GiB, 2 * GiB) == "low"
    assert level(2 * GiB, 5 * GiB, 2 * GiB) == "low"
    assert level(2 * GiB - 1, 5 * GiB, 2 * GiB) == "full"
    assert level(0, 5 * GiB, 2 * GiB) == "full"


def test_no_stop_at_or_above_the_floor() -> None:
    growers = [Grower("a", 500 * MiB, 100 * MiB)]
    assert choose_stops(2 * GiB, 2 * GiB, growers, 15) == []


def test_below_the_floor_the_fastest_grower_stops_first_and_idle_ones_never() -> None:
    growers = [Grower("slow", 1 * MiB, 0), Grower("idle", 0, 0), Grower("fast", 40 * MiB, 0),
               Grower("shrinking", -5 * MiB, 0)]
    # the rest (1 MiB/s) would take 1000 s to use 1 GiB: only the fastest stops this pass
    stops = choose_stops(1 * GiB, 2 * GiB, growers, 15)
    assert [s.id for s in stops] == ["fast"]


def test_an_idle_systems_trickle_counts_only_below_half_the_floor() -> None:
    growers = [Grower("idle", 0.1 * MiB, 0), Grower("writer", 5 * MiB, 0)]
    assert [s.id for s in choose_stops(GiB, 2 * GiB, growers, 15)] == ["writer"]
    assert choose_stops(GiB, 2 * GiB, growers[:1], 15) == []  # logs and journal commits: not a grower yet
    assert [s.id for s in choose_stops(GiB - 1, 2 * GiB, growers[:1], 15)] == ["idle"]  # below half the floor


def test_growers_that_would_fill_the_room_within_the_horizon_all_stop_in_one_pass() -> None:
    growers = [Grower("a", 30 * MiB, 0), Grower("b", 20 * MiB, 0), Grower("c", 10 * MiB, 0),
               Grower("d", 1 * MiB, 0)]
    # 300 MiB left, horizon 5 s: after a, the rest (31 MiB/s) use 155 MiB in 5 s, less than what is left: only a
    assert [s.id for s in choose_stops(300 * MiB, 2 * GiB, growers, 5)] == ["a"]
    # 100 MiB left: after a the rest use 155 MiB in 5 s (b goes too); after b 55 MiB (c waits for the next pass)
    assert [s.id for s in choose_stops(100 * MiB, 2 * GiB, growers, 5)] == ["a", "b"]
    # nothing left: every grower stops
    assert [s.id for s in choose_stops(0, 2 * GiB, growers, 5)] == ["a", "b", "c", "d"]


def test_memory_is_kept_while_the_images_fit_in_half_the_room() -> None:
    assert keep_memory(100 * MiB, 100 * MiB + MEMORY_SLACK)
    assert not keep_memory(100 * MiB, 100 * MiB + MEMORY_SLACK - 1)
    growers = [Grower("a", 30 * MiB, 200 * MiB), Grower("b", 20 * MiB, 200 * MiB), Grower("c", 10 * MiB, 50 * MiB)]
    stops = choose_stops(800 * MiB, 2 * GiB, growers, 1000)  # budget 400 MiB: a fits (264), b not (136 left), c does
    assert stops == [Stop("a", True, 30 * MiB), Stop("b", False, 20 * MiB), Stop("c", True, 10 * MiB)]
    # almost no room: nobody gets a memory image
    assert all(not s.keep_memory for s in choose_stops(50 * MiB, 2 * GiB, growers, 1000))


# --- a node's pass, with a fake plane and node ----------------------------------------------------------------


@dataclass
class Row:
    id: str
    state: str = "running"
    node: str | None = None
    stop_reason: str | None = None


@dataclass
class FakeNode:
    free: int
    disks: dict[str, int]
    memory_mib: int = 100
    down: bool = False

    def info(self) -> Any:
        if self.down:
            raise NodeError("node_unreachable", "down")
        return SimpleNamespace(disk_free_bytes=self.free)

    def stats(self, id: str, space: bool = True) -> Stats:
        assert space is False  # the guard never asks for the FIEMAP scan of other images
        if id not in self.disks:
            raise NodeError("not_found", id)
        return Stats(256, self.memory_mib, 0.0, 0, 0, disk_allocated_bytes=self.disks[id])


@dataclass
class FakePlane:
    node: FakeNode
    rows: list[Row]
    reserve_gib: float = 5.0
    floor_gib: float = 2.0
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    stops: list[tuple[str, bool, str]] = field(default_factory=list)
    busy: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.settings = SimpleNamespace(disk_reserve_gib=self.reserve_gib, disk_floor_gib=self.floor_gib,
                                        disk_check_seconds=5.0)
        self.store = SimpleNamespace(engine=SimpleNamespace(dialect=SimpleNamespace(name="sqlite")),
                                     list_sandboxes=lambda: list(self.rows))
        self.router = SimpleNamespace(default_name="n1", agents=lambda: {"n1": ("local", self.node)})

    def stop(self, sandbox_id: str, keep_memory: bool = True, wait: float | None = None,
             reason: str = "requested") -> Any:
        if sandbox_id in self.busy:
            raise ControlError("busy", "an operation is running", 409)
        self.stops.append((sandbox_id, keep_memory, reason))
        for r in self.rows:
            if r.id == sandbox_id:
                r.state, r.stop_reason = "stopped", reason
        return None

    def add_event(self, sandbox_id: str, payload: dict[str, Any]) -> None:
        self.events.append((sandbox_id, payload))

    def kinds(self) -> list[tuple[str, str]]:
        return [(sid, str(p["event"])) for sid, p in self.events]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def guard_for(plane: FakePlane) -> tuple[DiskGuard, Clock]:
    clock = Clock()
    return DiskGuard(plane, period=5.0, clock=clock), clock  # type: ignore[arg-type]


def test_ok_node_publishes_nothing_and_stops_nothing() -> None:
    plane = FakePlane(FakeNode(50 * GiB, {"a": GiB, "b": GiB}), [Row("a"), Row("b")])
    guard, clock = guard_for(plane)
    assert guard.run_once() == {"n1": []}
    plane.node.disks["a"] += 5 * GiB
    plane.node.free -= 5 * GiB
    clock.t += 5
    assert guard.run_once() == {"n1": []}
    assert plane.events == [] and plane.stops == []
    assert not guard.low("n1") and not guard.low(None)
    assert guard.view() == {"n1": {"level": "ok", "freeBytes": 45 * GiB}}


def test_low_tells_each_running_sandbox_once_pauses_snapshots_and_ok_tells_them_again() -> None:
    plane = FakePlane(FakeNode(4 * GiB, {"a": GiB, "b": GiB}), [Row("a"), Row("b"), Row("s", state="stopped")])
    guard, clock = guard_for(plane)
    guard.run_once()
    assert sorted(plane.kinds()) == [("a", "disk_low"), ("b", "disk_low")]
    low = plane.events[0][1]
    assert low["freeBytes"] == 4 * GiB and low["reserveBytes"] == 5 * GiB and low["floorBytes"] == 2 * GiB
    assert guard.low("n1") and guard.low(None)
    clock.t += 5
    guard.run_once()
    assert len(plane.events) == 2  # once per descent
    plane.rows.append(Row("c"))  # a sandbox that started meanwhile is told too
    plane.node.disks["c"] = GiB
    clock.t += 5
    guard.run_once()
    assert plane.kinds()[-1] == ("c", "disk_low")
    plane.node.free = 6 * GiB
    clock.t += 5
    guard.run_once()
    assert sorted(plane.kinds()[3:]) == [("a", "disk_ok"), ("b", "disk_ok"), ("c", "disk_ok")]
    assert not guard.low("n1")
    assert plane.stops == []


def test_below_the_floor_the_fastest_writer_stops_with_disk_full_and_others_follow_while_it_stays_full() -> None:
    node = FakeNode(3 * GiB, {"fast": GiB, "slow": GiB, "idle": GiB})
    plane = FakePlane(node, [Row("fast"), Row("slow"), Row("idle"), Row("elsewhere", node="n2")])
    guard, clock = guard_for(plane)
    guard.run_once()  # first samples, low: told
    clock.t += 5
    node.disks["fast"] += 500 * MiB  # 100 MiB/s
    node.disks["slow"] += 25 * MiB  # 5 MiB/s
    node.free = 3 * GiB - 525 * MiB - 800 * MiB  # ~1.7 GiB: below the floor
    stops = guard.run_once()["n1"]
    assert [s.id for s in stops] == ["fast"]  # slow: 5 MiB/s x 15 s = 75 MiB, far from using 1.7 GiB
    assert plane.stops == [("fast", True, "disk_full")]
    full = [p for sid, p in plane.events if p["event"] == "disk_full"]
    assert full == [{"event": "disk_full", "id": "fast", "node": "n1", "freeBytes": node.free,
                     "floorBytes": 2 * GiB, "growthBytesPerSecond": 100 * MiB, "keepMemory": True}]
    clock.t += 5
    node.disks["slow"] += 25 * MiB
    node.free -= 25 * MiB
    assert [s.id for s in guard.run_once()["n1"]] == ["slow"]  # still below the floor and growing
    clock.t += 5
    assert guard.run_once()["n1"] == []  # idle never grows: it keeps running
    assert [r.state for r in plane.rows[:3]] == ["stopped", "stopped", "running"]
    node.free = 5 * GiB
    clock.t += 5
    guard.run_once()
    ok = sorted(sid for sid, p in plane.events if p["event"] == "disk_ok")
    assert ok == ["fast", "idle", "slow"]  # the running one and the two it stopped


def test_a_memory_image_that_would_not_fit_stops_without_memory() -> None:
    node = FakeNode(GiB, {"a": GiB}, memory_mib=600)
    plane = FakePlane(node, [Row("a")])
    guard, clock = guard_for(plane)
    guard.run_once()
    clock.t += 1
    node.disks["a"] += 100 * MiB
    node.free -= 100 * MiB  # 924 MiB left: half of it (462) can't hold 600 MiB
    guard.run_once()
    assert plane.stops == [("a", False, "disk_full")]


def test_a_busy_sandbox_or_an_unreachable_node_is_skipped_not_fatal() -> None:
    node = FakeNode(GiB, {"a": GiB})
    plane = FakePlane(node, [Row("a")], busy={"a"})
    guard, clock = guard_for(plane)
    guard.run_once()
    clock.t += 1
    node.disks["a"] += 100 * MiB
    assert [s.id for s in guard.run_once()["n1"]] == ["a"]  # asked; the plane said busy
    assert plane.stops == []
    node.down = True
    assert guard.run_once() == {}
    assert guard.low("n1")  # the last level stays


def test_the_floor_never_passes_the_reserve_and_a_reserve_of_zero_turns_the_guard_off() -> None:
    node = FakeNode(512 * MiB, {"a": GiB})
    plane = FakePlane(node, [Row("a")], reserve_gib=0.0, floor_gib=2.0)
    guard, clock = guard_for(plane)
    assert guard.floor_bytes == 0
    guard.run_once()
    clock.t += 1
    node.disks["a"] += 100 * MiB
    node.free -= 100 * MiB
    assert guard.run_once() == {"n1": []}
    assert plane.events == [] and not guard.low("n1")
    plane.settings.disk_reserve_gib = 1.0
    assert guard.floor_bytes == GiB  # capped at the reserve
