"""The idle-density figure (``python -m bench --only density``; opt-in, never part of the default run).

Small sandboxes are created one after another on the benchmark's node until ``--density-max`` (300 by default,
issue 16's goal on a 24 GiB, 2-core host) or the first refusal. A refusal must be a clear capacity error (an error
code in :data:`CAPACITY_CODES`); any other failure (``boot_failed``, a timeout, ...) fails the figure, because it
means the node broke before it said it was full. Then every sandbox stays idle for ``--density-idle`` seconds (60
by default) and must answer ``exec("true")`` afterwards. Memory per sandbox is what the node's memory cgroup
(``/sbx/<node>``, all its sandboxes) holds after the idle time, inactive page cache excluded (as ``sbx info``'s
``memoryUsed``), divided by the count: unlike the host's ``MemTotal - MemAvailable`` (read before and after too, and
shown in the note) it is not moved by other work on a shared host. Load is the 1-minute load average
(:func:`os.getloadavg`) after the idle time.
"""

from __future__ import annotations

import os
import time

from bench.context import Ctx, new, tracked, wait_exec
from bench.registry import figure
from bench.report import Row
from sbx.node.container import cgroup
from sbx.sdk import SbxError

CAPACITY_CODES = frozenset({"insufficient_capacity", "no_space"})
"""Error codes that count as a clean refusal (the node is full: the API's 507 ``insufficient_capacity`` admission
refusal, or a full volume) rather than a failure."""


def host_memory_used_mib() -> float:
    """``MemTotal - MemAvailable`` from ``/proc/meminfo``, in MiB (what the host's processes and kernel hold,
    reclaimable cache excluded)."""
    fields: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0])  # kB
    return (fields["MemTotal"] - fields["MemAvailable"]) / 1024


@figure("density", order=100, opt_in=True)
def fig_density(ctx: Ctx) -> list[Row]:
    """``density``: see the module docstring. Rows: sandboxes running and answering after the idle time (count),
    host memory per sandbox (MiB), the 1-minute load average, and the time each create took (s). Raises
    ``RuntimeError`` for a non-capacity create failure or a sandbox that stopped answering."""
    limit, idle = ctx.density_max, ctx.density_idle
    before = host_memory_used_mib()
    creates: list[float] = []
    refusal = ""
    with tracked(ctx) as ids:
        boxes = []
        for i in range(limit):
            t0 = time.perf_counter()
            try:
                sb = new(ctx, ids, "small", f"bench-density-{i}")
            except SbxError as e:
                if e.code in CAPACITY_CODES:
                    refusal = f"refused at #{i + 1}: {e.code}"
                    ctx.say(f"  {refusal} ({e.message})")
                    break
                raise RuntimeError(f"sandbox #{i + 1} failed, not a capacity refusal: {e.code}: {e.message}") from e
            wait_exec(sb)
            creates.append(time.perf_counter() - t0)
            boxes.append(sb)
            if (i + 1) % 10 == 0 or i + 1 == limit:
                ctx.say(f"  {i + 1} running, host memory used {host_memory_used_mib() - before:+.0f} MiB")
        if not boxes:
            raise RuntimeError(f"no sandbox could be created ({refusal})")
        ctx.say(f"  {len(boxes)} sandboxes; idle for {idle:.0f} s")
        time.sleep(idle)
        host_used = host_memory_used_mib() - before
        used = cgroup.sample(f"/sbx/{ctx.srv.settings.node_name}").memory_used / (1 << 20)
        load1 = os.getloadavg()[0]
        silent = []
        for sb in boxes:
            try:
                wait_exec(sb, timeout=60)
            except RuntimeError as e:
                silent.append(str(e))
        if silent:
            raise RuntimeError(f"{len(silent)} of {len(boxes)} idle sandboxes did not answer: {silent[0]}")
    n = len(boxes)
    stop = refusal or f"stopped at --density-max {limit}"
    return [
        Row("density", f"idle small sandboxes answering exec after {idle:.0f} s idle", "count", [float(n)],
            note=stop),
        Row("density", "host memory per idle sandbox (node cgroup)", "MiB", [used / n],
            note=f"{used:.0f} MiB for {n}; host MemTotal-MemAvailable moved {host_used:+.0f} MiB"),
        Row("density", "load average (1 min) after the idle time", "load", [load1], note=f"{os.cpu_count()} cores"),
        Row("density", "create small → first exec answered, one after another", "s", creates,
            note=f"from empty to {n} sandboxes"),
    ]
