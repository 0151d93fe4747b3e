"""The ``classes`` figure (issue 33): the container and gvisor runtime classes side by side in one run: create →
first exec, exec round trip, stop and resume with 128 MiB held, fork (the disk: a gvisor sandbox forks no memory)
and the host memory an idle sandbox of each class takes. Live migration is the container class's only (a gvisor
sandbox answers 409 ``not_supported``), so it has no gvisor row here; ``migrate`` times the container class's.

Both classes run the same default image at the same size. A container sandbox is created as a user's is, from the
size's warm sandboxes or memory template when they are ready; a gvisor sandbox always boots (runsc has no memory
template here), which is most of the difference in the first row. The 128 MiB holder is started with ``setsid``
from an attached exec in both classes (a gvisor sandbox's minimal init has no detached jobs).
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.context import TTL, Ctx, check, delete, since, tracked, wait_exec
from bench.registry import figure
from bench.report import Row
from sbx.sdk.client import Sandbox

CLASSES = ("container", "gvisor")
TYPE = "default"
"""The size of every sandbox of the figure (512 MiB in the test profile: room for the 128 MiB holder)."""
HOLD_MIB = 128
EXEC_RUNS = 20


def _cgroup_memory(ctx: Ctx, sid: str) -> int | None:
    """Host bytes the sandbox's memory cgroup charges, less inactive page cache (what ``docker stats`` shows), or
    None when the cgroup is not there."""
    base = Path("/sys/fs/cgroup/memory/sbx") / ctx.srv.settings.node_name / sid
    try:
        usage = int((base / "memory.usage_in_bytes").read_text())
        stat = dict(line.split() for line in (base / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return None
    return usage - int(stat.get("total_inactive_file", 0))


def _hold(sb: Sandbox) -> str:
    """Start a process holding :data:`HOLD_MIB` MiB of touched random memory; its pid once it holds them."""
    script = (f"import os, time\nb = bytearray({HOLD_MIB} << 20)\n"
              "for i in range(0, len(b), 1 << 20):\n    b[i:i + (1 << 20)] = os.urandom(1 << 20)\n"
              "open(os.path.expanduser('~/bench-hold.pid'), 'w').write(str(os.getpid()))\ntime.sleep(86400)\n")
    r = sb.exec(f"cat > ~/bench-hold.py <<'PYEOF'\n{script}PYEOF\n"
                "setsid nohup python3 ~/bench-hold.py </dev/null >/dev/null 2>&1 &")
    check(r.exit_code == 0, f"starting the holder in {sb.id}: {r.stderr}")
    deadline = time.monotonic() + 300
    while True:
        pid = sb.exec("cat ~/bench-hold.pid 2>/dev/null").stdout.strip()
        if pid:
            return pid
        check(time.monotonic() < deadline, f"the holder in {sb.id} did not get ready")
        time.sleep(0.2)


def _one_class(ctx: Ctx, runtime: str, ids: set[str]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in ("create", "exec", "stop", "resume", "fork", "idle")}
    for i in range(ctx.repeats):
        t0 = time.perf_counter()
        sb = Sandbox.create(type=TYPE, name=f"bench-{runtime}-{i}", ttl=TTL, runtime=runtime, client=ctx.sdk)
        ids.add(sb.id)
        r = sb.exec("true")
        out["create"].append(since(t0))
        check(r.exit_code == 0 and sb.data.get("runtime", runtime) == runtime, f"{sb.id}: first exec {r.exit_code}")
        if i < ctx.repeats - 1:
            delete(ctx, sb.id)
            ids.discard(sb.id)
    ctx.say(f"  {runtime}: {sb.id} for the rest")
    time.sleep(5)  # idle: its boot's work done
    idle = _cgroup_memory(ctx, sb.id)
    if idle is not None:
        out["idle"].append(idle / 2**20)
    for _ in range(EXEC_RUNS):
        t0 = time.perf_counter()
        r = sb.exec("true")
        out["exec"].append(since(t0) * 1000)
        check(r.exit_code == 0, f"exec in {sb.id} exited {r.exit_code}")
    pid = _hold(sb)
    for _ in range(ctx.repeats):
        t0 = time.perf_counter()
        sb.stop(wait=True)
        out["stop"].append(since(t0))
        t0 = time.perf_counter()
        sb.resume(wait=True)
        wait_exec(sb)
        out["resume"].append(since(t0))
        check(sb.data.get("memoryRestored") is True, f"resume of {sb.id} ({runtime}) did not restore memory "
              f"(resumeReason {sb.data.get('resumeReason')})")
    check(sb.exec(f"kill -0 {pid}").exit_code == 0, f"the holder {pid} in {sb.id} did not survive the resumes")
    for i in range(ctx.repeats):
        t0 = time.perf_counter()
        fork = sb.fork(name=f"bench-{runtime}-fork-{i}")
        ids.add(fork.id)
        r = fork.exec("true")
        out["fork"].append(since(t0))
        check(r.exit_code == 0, f"first exec in fork {fork.id} exited {r.exit_code}")
        delete(ctx, fork.id)
        ids.discard(fork.id)
    return out


@figure("classes", order=180)
def fig_classes(ctx: Ctx) -> list[Row]:
    """``classes``: for each runtime class, ``repeats`` creates → first exec, :data:`EXEC_RUNS` exec round trips,
    ``repeats`` stop/resume cycles with :data:`HOLD_MIB` MiB held, ``repeats`` forks → first exec, and an idle
    sandbox's host memory (in the create row's note)."""
    got: dict[str, dict[str, list[float]]] = {}
    with tracked(ctx) as ids:
        for runtime in CLASSES:
            got[runtime] = _one_class(ctx, runtime, ids)
    rows: list[Row] = []

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2] if xs else 0.0

    def ratio(key: str) -> str:
        base = med(got["container"][key])
        return f"{med(got['gvisor'][key]) / base:.1f}× the container class's median" if base else ""

    for runtime in CLASSES:
        g = got[runtime]
        idle = f"idle host memory {med(g['idle']):.0f} MiB (cgroup, less inactive cache)" if g["idle"] else ""
        if runtime == "gvisor" and got["container"]["idle"] and g["idle"]:
            idle += f", {med(g['idle']) / med(got['container']['idle']):.1f}× the container's"
        rows += [
            Row("classes", f"{runtime}: create {TYPE} → first exec", "s", g["create"],
                note="; ".join(x for x in (idle, ratio("create") if runtime == "gvisor" else "") if x)),
            Row("classes", f"{runtime}: exec round trip (true, SDK)", "ms", g["exec"],
                note=ratio("exec") if runtime == "gvisor" else ""),
            Row("classes", f"{runtime}: stop --wait, {HOLD_MIB} MiB held", "s", g["stop"],
                note=ratio("stop") if runtime == "gvisor" else ""),
            Row("classes", f"{runtime}: resume --wait → exec answered, {HOLD_MIB} MiB (memory restored)", "s",
                g["resume"], note=ratio("resume") if runtime == "gvisor" else "same pid after every resume"),
            Row("classes", f"{runtime}: fork (disk) → first exec", "s", g["fork"],
                note=ratio("fork") if runtime == "gvisor" else "live migration: container class only (`migrate`)"),
        ]
    return rows
