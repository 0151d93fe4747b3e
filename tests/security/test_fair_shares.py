"""Issue 36, fair shares: a sandbox's task count and CPU weight follow its size (:attr:`sbx.config.Size.pids_limit`,
:attr:`~sbx.config.Size.cpu_shares`), and a fork bomb in a small sandbox is held at its size's tasks while a
neighbour's commands and the server go on answering. Timing targets live in the benchmark; this test prints the
neighbour's exec round trips, idle and under the bomb."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest

from sbx.config import TEST_SIZES
from tests.e2e.conftest import Server
from tests.security.conftest import new_sandbox
from tests.security.test_escape import _host_cgroup

pytestmark = pytest.mark.e2e

BOMB = "setsid sh -c 'while :; do sleep 1000 & done' </dev/null >/dev/null 2>&1 & echo started"
"""A fork bomb, as ``user``, in a session of its own (it outlives the exec that starts it): it forks sleepers as
fast as it can and keeps them, so its task count climbs to its limit and stays there while its loop spins on
the failing forks. (A recursive ``b | b &`` bomb's tasks are short-lived: under load its count went anywhere from 6
to 1024, and a thousand bash processes outgrew the test profile's 256 MiB small size.) A bomb that ends its own
sandbox (its OOM killer) harms no one else: the test accepts that too."""


def _read(path: Path) -> str:
    return path.read_text().strip()


def _round_trips(server: Server, sid: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.monotonic()
        r = server.sbx("exec", sid, "--", "echo ok", timeout=120)
        times.append(time.monotonic() - t0)
        assert (r.returncode, r.stdout.strip()) == (0, "ok"), r.stderr
    return times


def test_limits_follow_the_size_and_a_fork_bomb_is_held(sec_server: Server) -> None:
    small, neighbour = new_sandbox(sec_server), new_sandbox(sec_server, "--type", "default")
    try:
        for sid, size in ((small, TEST_SIZES["small"]), (neighbour, TEST_SIZES["default"])):
            assert int(_read(_host_cgroup("pids", sid) / "pids.max")) == size.pids_limit == 512 * size.vcpus
            assert int(_read(_host_cgroup("cpu", sid) / "cpu.shares")) == size.cpu_shares == 256 * size.vcpus
        idle = _round_trips(sec_server, neighbour, 10)

        r = sec_server.sbx("exec", small, "--", BOMB, timeout=60)
        assert r.stdout.strip() == "started", r.stderr
        current = _host_cgroup("pids", small) / "pids.current"
        peak, busy = 0, []
        limit = TEST_SIZES["small"].pids_limit
        # until the bomb holds its limit and the neighbour answered a few times (at most 30 s: the bomb takes the
        # CPUs of whatever else runs on the host)
        deadline = time.monotonic() + 30
        ended = False  # the bomb's sandbox ended by its own OOM (its cgroup is gone)
        while time.monotonic() < deadline and not (len(busy) >= 5 and (peak >= limit * 0.9 or ended)):
            try:
                peak = max(peak, int(_read(current)))
            except FileNotFoundError:
                ended = True
            busy += _round_trips(sec_server, neighbour, 1)
        assert peak <= limit, f"the bomb reached {peak} tasks (limit {limit})"
        state = json.loads(sec_server.sbx("info", small, "--json", check=True).stdout)["sandbox"]["state"]
        assert limit * 0.9 <= peak or (ended and state != "running"), (peak, ended, state)
        t0 = time.monotonic()
        listed = sec_server.sbx("list", "--json", timeout=60)
        took = time.monotonic() - t0
        assert listed.returncode == 0 and small in listed.stdout
        print(f"\nneighbour exec round trip, idle: p50 {statistics.median(idle) * 1e3:.0f} ms, "
              f"max {max(idle) * 1e3:.0f} ms; under a fork bomb of {peak} tasks: p50 "
              f"{statistics.median(busy) * 1e3:.0f} ms, max {max(busy) * 1e3:.0f} ms ({len(busy)} runs); "
              f"sbx list {took * 1e3:.0f} ms; the bomb's sandbox {state}")
    finally:
        for sid in (small, neighbour):
            sec_server.sbx("delete", sid, "--wait", timeout=300)
    assert not _host_cgroup("pids", small).exists()  # the bomb went with its sandbox
