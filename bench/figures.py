"""The benchmark's core figures (``create`` to ``grow``, the default run's first eight): one function per figure,
each registered with :func:`bench.registry.figure` and returning :class:`bench.report.Row` objects. The other
figures live in modules of their own (:mod:`bench.egress`, :mod:`bench.density`, :mod:`bench.memfigs`,
:mod:`bench.migrate`, :mod:`bench.migclient`, :mod:`bench.remote`, :mod:`bench.xresume`) and register themselves
the same way.

Every figure here runs against a real ``sbx server`` (:mod:`bench.server`) with the test size profile, except
``disk``, which calls :func:`bench.storage.run` on the benchmark node's folder of the real reflink volume. Steps
the seed guides timed with the ``sbx`` command (stop, resume --type, fork --wait, the grow loop) are timed here
with the real ``sbx`` command too, so CLI start-up (see the ``exec`` rows) is in both figures; the rest uses the
Python SDK. Each figure deletes the sandboxes it made, also when it fails.

Anchors (``ANCHORS``) are the single runs the seed guides report (on their production machines, 4-8 GB sizes):
``sbx stop --wait`` 2.2 s, ``sbx resume --type default`` until it answers 3.4 s, a fork 1.9 s (small to small,
createdAt to updatedAt) to 3.4 s (``sbx fork --type default --wait``, wall time), the grow loop 18.6 s.
"""

from __future__ import annotations

import json
import subprocess
import time
from datetime import datetime
from pathlib import Path

from bench import e2bsdk, storage
from bench.context import (
    TTL,
    Ctx,
    check,
    cli_info,
    cli_new,
    cli_wait_exec,
    delete,
    du,
    new,
    since,
    start_holder,
    tracked,
    wait_exec,
)
from bench.memfigs import wait_template, wait_warm
from bench.registry import figure
from bench.report import Anchor, Row

SEED_DIR = Path(__file__).resolve().parent.parent / "tests" / "e2e" / "seed"

ANCHORS = {
    "stop": Anchor(2.2, "2.2 s", "resize guide: sbx stop --wait"),
    "resume": Anchor(3.4, "3.4 s", "resize guide: sbx resume --type default until it answers (a cold boot)"),
    "resize": Anchor(5.6, "5.6 s", "resize guide: stop 2.2 s + resume 3.4 s (\"about 6 seconds\")"),
    "fork_same": Anchor(1.9, "1.9 s", "fork guide: small to small, createdAt to updatedAt"),
    "fork_cli": Anchor(3.4, "3.4 s", "fork guide: time sbx fork --type default --wait --json (running source)"),
    "grow": Anchor(18.6, "18.6 s", "resize guide: time ./grow.sh, incl. ~10 s of the task's own work"),
}

GOALS = {
    "exec": Anchor(0.010, "10 ms", "issue 13 goal: exec round trip (an in-sandbox agent, as E2B's envd)"),
    "cli": Anchor(0.120, "120 ms", "issue 13 goal: sbx exec ID true as a whole process"),
    "resume128": Anchor(0.35, "0.35 s", "issue 13 goal: resume → exec answered at 128 MiB"),
}
"""Rows whose reference is a target set in an issue rather than a seed guide's run (same table columns)."""


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.0f} MiB"


@figure("create", order=10)
def fig_create(ctx: Ctx) -> list[Row]:
    """``create``: SDK ``Sandbox.create(type="small")`` (waits until it runs) until a first ``exec("true")``
    answers, one after another; the sandbox is deleted after each run (not timed). Then the same through E2B's
    SDK (:func:`bench.e2bsdk.create_rows`). Timed once the node is as a
    running installation has it: an untimed first create made the small memory template (a size's first create
    on a new image boots: the ``template`` figure's cold row) and the node's warm sandboxes are ready."""
    samples = []
    with tracked(ctx) as ids:
        first = new(ctx, ids, "small", "bench-create-first")
        delete(ctx, first.id)
        ids.discard(first.id)
        wait_template(ctx.srv.settings.node_dir)
        if ctx.srv.settings.warm_pool > 0:
            wait_warm(ctx.srv.settings.node_dir, count=ctx.srv.settings.warm_pool)
        for i in range(ctx.repeats):
            t0 = time.perf_counter()
            sb = new(ctx, ids, "small", f"bench-create-{i}")
            r = sb.exec("true")
            samples.append(since(t0))
            check(r.exit_code == 0, f"first exec in {sb.id} exited {r.exit_code}")
            delete(ctx, sb.id)
            ids.discard(sb.id)
        e2b = e2bsdk.create_rows(ctx, ids)  # E2B's SDK on the same server, same node state
    return [Row("create", "create small → first exec answered (SDK)", "s", samples), *e2b]


@figure("exec", order=20)
def fig_exec(ctx: Ctx) -> list[Row]:
    """``exec``: round trip of ``exec("true")`` through the SDK (``max(20, 4 × repeats)`` runs) and of the
    ``sbx exec ID true`` command as a process (``max(5, repeats)`` runs) on one running small sandbox; then E2B's
    ``commands.run("true")`` there, each after an SDK exec, and the difference (:func:`bench.e2bsdk.command_rows`)."""
    with tracked(ctx) as ids:
        sb = new(ctx, ids, "small", "bench-exec")
        wait_exec(sb)
        sdk = []
        for _ in range(max(20, 4 * ctx.repeats)):
            t0 = time.perf_counter()
            r = sb.exec("true")
            sdk.append(since(t0))
            check(r.exit_code == 0, f"exec exited {r.exit_code}")
        cli = []
        for _ in range(max(5, ctx.repeats)):
            t0 = time.perf_counter()
            ctx.srv.sbx("exec", sb.id, "true")
            cli.append(since(t0))
        e2b = e2bsdk.command_rows(ctx, sb, max(20, 4 * ctx.repeats))
    return [
        Row("exec", "exec `true` round trip (SDK)", "s", sdk, GOALS["exec"]),
        Row("exec", "sbx exec ID true (whole CLI process)", "s", cli, GOALS["cli"]),
        *e2b,
    ]


def _working_set(ctx: Ctx, figure: str, mib: int, type: str, runs: int,
                 resume_anchor: Anchor = ANCHORS["resume"]) -> list[Row]:
    """Stop --wait, then resume --wait until an exec answers, ``runs`` times on one sandbox of ``type`` whose
    detached python3 holds ``mib`` MiB of touched random memory (it must survive every memory resume). The
    resume row is compared with ``resume_anchor``."""
    label = f"{mib} MiB" if mib < 1024 else f"{mib // 1024} GiB"
    stops, resumes, images = [], [], []
    with tracked(ctx) as ids:
        sb = new(ctx, ids, type, f"bench-{figure}")
        pid = start_holder(sb, mib, label)
        rss = sb.exec(f"awk '/VmRSS/ {{print $2}}' /proc/{pid}/status").stdout.strip()
        ctx.say(f"  {label} held by pid {pid} (VmRSS {int(rss or 0) // 1024} MiB) in a {type} sandbox")
        mem_dir = ctx.srv.settings.node_dir / "sandboxes" / sb.id / "memory"
        for _ in range(runs):
            t0 = time.perf_counter()
            sb.stop(wait=True)
            stops.append(since(t0))
            size = du(mem_dir)
            if size is not None:
                images.append(size)
            t0 = time.perf_counter()
            sb.resume(wait=True)
            wait_exec(sb)
            resumes.append(since(t0))
            check(sb.data.get("memoryRestored") is True,
                  f"resume of {sb.id} did not restore memory (resumeReason {sb.data.get('resumeReason')})")
        r = sb.exec(f"kill -0 {pid}")
        check(r.exit_code == 0, f"the holder process {pid} did not survive the resumes")
    img = f"memory image {_mib(int(sorted(images)[len(images) // 2]))}" if images else ""
    requested = ctx.repeats if runs < ctx.repeats else None
    return [
        Row(figure, f"stop --wait, {label} working set ({type}, SDK)", "s", stops, ANCHORS["stop"], img,
            requested),
        Row(figure, f"resume --wait → exec answered, {label} (memory restored)", "s", resumes,
            resume_anchor, "same pid after every resume", requested),
    ]


@figure("ws128", order=30)
def fig_ws128(ctx: Ctx) -> list[Row]:
    """``ws128``: stop/resume with 128 MiB held in a ``default`` (512 MiB) sandbox, ``repeats`` times; the resume
    row's anchor is issue 13's goal (0.35 s), the seed's cold resume (3.4 s) stays on ``ws1g``."""
    return _working_set(ctx, "ws128", 128, "default", ctx.repeats, GOALS["resume128"])


@figure("ws1g", order=40)
def fig_ws1g(ctx: Ctx) -> list[Row]:
    """``ws1g``: stop/resume with 1 GiB held in an ``xlarge`` (2 GiB in the test profile) sandbox,
    ``min(repeats, 3)`` times."""
    return _working_set(ctx, "ws1g", 1024, "xlarge", min(ctx.repeats, 3))


@figure("resize", order=50)
def fig_resize(ctx: Ctx) -> list[Row]:
    """``resize``: with the ``sbx`` command as the guide did, on a fresh small sandbox each run: ``sbx stop ID
    --wait``, then ``sbx resume ID --type default --wait`` until ``sbx exec ID true`` answers. Checks the
    resize kept a file and reports memoryRestored false / resumeReason resized."""
    stops, resumes, totals = [], [], []
    with tracked(ctx) as ids:
        for i in range(ctx.repeats):
            sid = cli_new(ctx, ids, "small", f"bench-resize-{i}")
            ctx.srv.sbx("exec", sid, "echo kept > ~/kept")
            t0 = time.perf_counter()
            ctx.srv.sbx("stop", sid, "--wait")
            t1 = time.perf_counter()
            ctx.srv.sbx("resume", sid, "--type", "default", "--wait")
            cli_wait_exec(ctx, sid)
            t2 = time.perf_counter()
            stops.append(t1 - t0)
            resumes.append(t2 - t1)
            totals.append(t2 - t0)
            sb = cli_info(ctx, sid)
            check((sb["type"], sb["memoryRestored"], sb["resumeReason"]) == ("default", False, "resized"),
                  f"resize of {sid} gave {sb['type']}/{sb['memoryRestored']}/{sb['resumeReason']}")
            check(ctx.srv.sbx("exec", sid, "cat ~/kept").stdout.strip() == "kept", f"{sid} lost ~/kept")
            delete(ctx, sid)
            ids.discard(sid)
    return [
        Row("resize", "sbx stop --wait (small, idle)", "s", stops, ANCHORS["stop"]),
        Row("resize", "sbx resume --type default → exec answers", "s", resumes, ANCHORS["resume"], "cold boot"),
        Row("resize", "resize: stop + resume --type → exec", "s", totals, ANCHORS["resize"]),
    ]


def _iso(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


@figure("fork", order=60)
def fig_fork(ctx: Ctx) -> list[Row]:
    """``fork``: fork a running small sandbox (a detached process running, a file just written), ``repeats``
    times each way: SDK ``fork(wait=True)`` at the same size (wall time, and the fork's createdAt → updatedAt
    as the guide read it from ``sbx info``), and ``sbx fork ID --type default --wait --json`` (wall time, as
    the guide timed it). Checks each fork has the file and answers a command; deletes each fork."""
    sdk_wall, server_side, cli = [], [], []
    with tracked(ctx) as ids:
        src = new(ctx, ids, "small", "bench-fork-src")
        src.exec_detached("sleep 100000")
        for i in range(ctx.repeats):
            check(src.exec(f"echo {i} > ~/marker && sync ~/marker").exit_code == 0, "writing the marker")
            t0 = time.perf_counter()
            fork = src.fork(ttl=TTL, name=f"bench-fork-{i}")
            sdk_wall.append(since(t0))
            ids.add(fork.id)
            ctx.made.add(fork.id)
            server_side.append((_iso(fork.data["updatedAt"]) - _iso(fork.data["createdAt"])).total_seconds())
            check(fork.data["state"] == "running", f"fork {fork.id} is {fork.data['state']}")
            check(fork.exec("cat ~/marker").stdout.strip() == str(i), f"fork {fork.id} lacks the marker")
            delete(ctx, fork.id)
            ids.discard(fork.id)
        for i in range(ctx.repeats):
            t0 = time.perf_counter()
            r = ctx.srv.sbx("fork", src.id, "--type", "default", "--ttl", str(TTL), "--name", f"bench-forkcli-{i}",
                            "--wait", "--json")
            cli.append(since(t0))
            events = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
            fid = events[-1]["id"]
            ids.add(fid)
            ctx.made.add(fid)
            check(events[-1]["event"] == "ready", f"sbx fork ended with {events[-1]}")
            delete(ctx, fid)
            ids.discard(fid)
        check(src.exec("pgrep -f 'sleep 100000'").exit_code == 0, "the source's process did not survive")
    return [
        Row("fork", "fork running small → ready: createdAt→updatedAt", "s", server_side, ANCHORS["fork_same"]),
        Row("fork", "fork running small → ready (SDK fork(wait=True), wall)", "s", sdk_wall, None,
            "includes the HTTP round trips"),
        Row("fork", "sbx fork --type default --wait --json (running source)", "s", cli, ANCHORS["fork_cli"]),
    ]


@figure("disk", order=70, needs_server=False)
def fig_disk(ctx: Ctx) -> list[Row]:
    """``disk``: :func:`bench.storage.run` (reflink clone, clone with new UUID, fork of a mounted disk, seal
    after 1 MiB written) at 1 GiB and 20 GiB, on the benchmark node's folder of the volume. Each 20 GiB row's
    anchor is the same op at 1 GiB: the fork guide says a reflink fork takes about the same time for a large
    disk as for a small one, so the ratio should stay near 1."""
    from bench.server import node_settings

    settings = ctx.server.settings if ctx.server else node_settings()
    data = storage.run(settings, sizes_gib=(1, 20), repeats=ctx.repeats, fill_fraction=ctx.disk_fill)
    small = {r["op"]: r for r in data if r["size_gib"] == 1}
    rows = []
    for op in storage.OPS:
        for r in sorted((r for r in data if r["op"] == op), key=lambda r: r["size_gib"]):
            anchor = None
            if r["size_gib"] != 1 and op in small:
                base = small[op]["median_ms"]
                anchor = Anchor(base, f"{base:.1f} ms", "fork guide: a large disk forks in about the same time "
                                "as a small one (anchor = the 1 GiB row)")
            rows.append(Row("disk", f"disk {op} at {r['size_gib']} GiB", "ms", [], anchor,
                            f"{r['data_mib']} MiB data",
                            stats=(r["median_ms"], r["min_ms"], r["max_ms"], r["n"])))
    return rows


@figure("grow", order=80)
def fig_grow(ctx: Ctx) -> list[Row]:
    """``grow``: the seed ``grow.sh`` end to end with the real ``sbx`` on PATH, exactly as
    ``tests/e2e/sandboxes/test_resize_guide.py`` runs it: a fresh small sandbox with the seed ``task.py`` copied in,
    OOM-killed at the heavy step, resized to default, continued to "all steps done". ``min(repeats, 3)`` runs;
    the task sleeps 8 s in total (2 s for each light step)."""
    runs = min(ctx.repeats, 3)
    script = (SEED_DIR / "task.py").read_text()
    samples = []
    with tracked(ctx) as ids:
        for i in range(runs):
            sid = cli_new(ctx, ids, "small", f"bench-grow-{i}")
            ctx.srv.sbx("exec", sid, f"mkdir -p ~/task && cat > ~/task/task.py <<'PYEOF'\n{script}PYEOF")
            t0 = time.perf_counter()
            r = subprocess.run(["bash", str(SEED_DIR / "grow.sh"), sid], env=ctx.srv.env, capture_output=True,
                               text=True, timeout=900)
            samples.append(since(t0))
            check(r.returncode == 0 and "OOM-killed on small; moving to default" in r.stdout
                  and r.stdout.rstrip().endswith("all steps done"),
                  f"grow.sh {sid} -> {r.returncode}:\n{r.stdout}\n{r.stderr}")
            delete(ctx, sid)
            ids.discard(sid)
    return [Row("grow", "grow loop end to end (grow.sh: small → default)", "s", samples, ANCHORS["grow"],
                "task sleeps 8 s of it", ctx.repeats if runs < ctx.repeats else None)]
