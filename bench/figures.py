"""The benchmark's figures: one function per figure, each returning :class:`bench.report.Row` objects.

Every figure runs against a real ``sbx server`` (:mod:`bench.server`) with the test size profile, except
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
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from bench import storage
from bench.density import fig_density
from bench.egress import fig_egress
from bench.memfigs import fig_forkmem, fig_template
from bench.migclient import fig_migclient
from bench.migrate import fig_migrate
from bench.remote import fig_remote
from bench.report import Anchor, Row
from bench.server import BenchServer
from bench.xresume import fig_xresume
from sbx.sdk import Client, Sandbox, SbxError

SEED_DIR = Path(__file__).resolve().parent.parent / "tests" / "e2e" / "seed"
TTL = 1800  # seconds: long enough for any figure, short enough that a crashed run's sandboxes stop by themselves
EXEC_READY_TIMEOUT = 120.0  # seconds to wait for a resumed or new sandbox to answer a command

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


@dataclass
class Ctx:
    """What a figure needs: the ``server``, an SDK ``client`` on it, ``repeats`` (``--repeats``), the share of
    each disk ``disk_fill`` filled with data in the ``disk`` figure, ``say`` for progress lines, and the density
    figure's ``density_max`` sandboxes and ``density_idle`` seconds (``--density-max``, ``--density-idle``)."""

    server: BenchServer | None
    client: Client | None
    repeats: int
    disk_fill: float = 0.25
    say: Callable[[str], None] = lambda _m: None
    density_max: int = 300
    density_idle: float = 60.0
    made: set[str] = field(default_factory=set)

    @property
    def srv(self) -> BenchServer:
        if self.server is None:
            raise RuntimeError("this figure needs the benchmark server")
        return self.server

    @property
    def sdk(self) -> Client:
        if self.client is None:
            raise RuntimeError("this figure needs the benchmark server")
        return self.client


def _since(t0: float) -> float:
    return time.perf_counter() - t0


def _delete(ctx: Ctx, sid: str) -> None:
    try:
        Sandbox({"id": sid, "state": "?"}, ctx.sdk).delete(wait=True)
    except SbxError as e:
        if e.code != "not_found":
            ctx.say(f"  could not delete {sid}: {e}")
    ctx.made.discard(sid)


@contextmanager
def _tracked(ctx: Ctx) -> Iterator[set[str]]:
    """A set the figure adds sandbox ids to; every id still in it at the end is deleted (also on Ctrl-C)."""
    ids: set[str] = set()
    try:
        yield ids
    finally:
        for sid in sorted(ids):
            _delete(ctx, sid)


def _new(ctx: Ctx, ids: set[str], type: str, name: str) -> Sandbox:
    sb = Sandbox.create(type=type, name=name, ttl=TTL, client=ctx.sdk)
    ids.add(sb.id)
    ctx.made.add(sb.id)
    return sb


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(what)


def _wait_exec(sb: Sandbox, timeout: float = EXEC_READY_TIMEOUT) -> None:
    """Return once ``true`` runs in ``sb`` with exit 0; raises ``RuntimeError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            r = sb.exec("true", timeout=20)
            if r.exit_code == 0:
                return
            last = f"exit {r.exit_code}: {r.stderr.strip()}"
        except SbxError as e:
            last = str(e)
        time.sleep(0.05)
    raise RuntimeError(f"{sb.id} did not answer a command within {timeout:.0f} s ({last})")


def _cli_new(ctx: Ctx, ids: set[str], type: str, name: str) -> str:
    sid = ctx.srv.sbx("new", "--type", type, "--name", name, "--ttl", str(TTL)).stdout.strip()
    ids.add(sid)
    ctx.made.add(sid)
    return sid


def _cli_info(ctx: Ctx, sid: str) -> dict:  # type: ignore[type-arg]
    return json.loads(ctx.srv.sbx("info", sid, "--json").stdout)["sandbox"]  # type: ignore[no-any-return]


def _cli_wait_exec(ctx: Ctx, sid: str, timeout: float = EXEC_READY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while True:
        r = ctx.srv.sbx("exec", sid, "true", check=False)
        if r.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"sbx exec {sid} true -> {r.returncode}: {r.stderr.strip()}")
        time.sleep(0.05)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.0f} MiB"


def _du(path: Path) -> int | None:
    """Bytes allocated under ``path`` (None when it is missing)."""
    if not path.exists():
        return None
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


# ---------------------------------------------------------------------------------------------------- figures

def fig_create(ctx: Ctx) -> list[Row]:
    """``create``: SDK ``Sandbox.create(type="small")`` (waits until it runs) until a first ``exec("true")``
    answers, one after another; the sandbox is deleted after each run (not timed). Timed once the node is as a
    running installation has it: an untimed first create made the small memory template (a size's first create
    on a new image boots: the ``template`` figure's cold row) and the node's warm sandboxes are ready."""
    from bench.memfigs import wait_template, wait_warm

    samples = []
    with _tracked(ctx) as ids:
        first = _new(ctx, ids, "small", "bench-create-first")
        _delete(ctx, first.id)
        ids.discard(first.id)
        wait_template(ctx.srv.settings.node_dir)
        if ctx.srv.settings.warm_pool > 0:
            wait_warm(ctx.srv.settings.node_dir, count=ctx.srv.settings.warm_pool)
        for i in range(ctx.repeats):
            t0 = time.perf_counter()
            sb = _new(ctx, ids, "small", f"bench-create-{i}")
            r = sb.exec("true")
            samples.append(_since(t0))
            _check(r.exit_code == 0, f"first exec in {sb.id} exited {r.exit_code}")
            _delete(ctx, sb.id)
            ids.discard(sb.id)
    return [Row("create", "create small → first exec answered (SDK)", "s", samples)]


def fig_exec(ctx: Ctx) -> list[Row]:
    """``exec``: round trip of ``exec("true")`` through the SDK (``max(20, 4 × repeats)`` runs) and of the
    ``sbx exec ID true`` command as a process (``max(5, repeats)`` runs) on one running small sandbox."""
    with _tracked(ctx) as ids:
        sb = _new(ctx, ids, "small", "bench-exec")
        _wait_exec(sb)
        sdk = []
        for _ in range(max(20, 4 * ctx.repeats)):
            t0 = time.perf_counter()
            r = sb.exec("true")
            sdk.append(_since(t0))
            _check(r.exit_code == 0, f"exec exited {r.exit_code}")
        cli = []
        for _ in range(max(5, ctx.repeats)):
            t0 = time.perf_counter()
            ctx.srv.sbx("exec", sb.id, "true")
            cli.append(_since(t0))
    return [
        Row("exec", "exec `true` round trip (SDK)", "s", sdk, GOALS["exec"]),
        Row("exec", "sbx exec ID true (whole CLI process)", "s", cli, GOALS["cli"]),
    ]


HOLDER = """import os, sys, time
n = int(sys.argv[1]) << 20
buf = bytearray(n)
for i in range(0, n, 1 << 20):
    buf[i:i + (1 << 20)] = os.urandom(1 << 20)
with open(os.path.expanduser("~/bench-ws.ready"), "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(3600)
"""


def start_holder(sb: Sandbox, mib: int, label: str) -> str:
    """Start :data:`HOLDER` detached in ``sb`` holding ``mib`` MiB and wait until it is ready; its PID. Raises
    ``RuntimeError`` when it does not get ready within 300 s."""
    r = sb.exec(f"cat > ~/bench-ws.py <<'PYEOF'\n{HOLDER}PYEOF")
    _check(r.exit_code == 0, f"writing the holder script: {r.stderr}")
    sb.exec_detached(f"python3 ~/bench-ws.py {mib}")
    deadline = time.monotonic() + 300
    pid = ""
    while not pid:
        _check(time.monotonic() < deadline, f"the {label} holder did not get ready")
        pid = sb.exec("cat ~/bench-ws.ready 2>/dev/null").stdout.strip()
        if not pid:
            time.sleep(0.2)
    return pid


def _working_set(ctx: Ctx, figure: str, mib: int, type: str, runs: int,
                 resume_anchor: Anchor = ANCHORS["resume"]) -> list[Row]:
    """Stop --wait, then resume --wait until an exec answers, ``runs`` times on one sandbox of ``type`` whose
    detached python3 holds ``mib`` MiB of touched random memory (it must survive every memory resume). The
    resume row is compared with ``resume_anchor``."""
    label = f"{mib} MiB" if mib < 1024 else f"{mib // 1024} GiB"
    stops, resumes, images = [], [], []
    with _tracked(ctx) as ids:
        sb = _new(ctx, ids, type, f"bench-{figure}")
        pid = start_holder(sb, mib, label)
        rss = sb.exec(f"awk '/VmRSS/ {{print $2}}' /proc/{pid}/status").stdout.strip()
        ctx.say(f"  {label} held by pid {pid} (VmRSS {int(rss or 0) // 1024} MiB) in a {type} sandbox")
        mem_dir = ctx.srv.settings.node_dir / "sandboxes" / sb.id / "memory"
        for _ in range(runs):
            t0 = time.perf_counter()
            sb.stop(wait=True)
            stops.append(_since(t0))
            size = _du(mem_dir)
            if size is not None:
                images.append(size)
            t0 = time.perf_counter()
            sb.resume(wait=True)
            _wait_exec(sb)
            resumes.append(_since(t0))
            _check(sb.data.get("memoryRestored") is True,
                   f"resume of {sb.id} did not restore memory (resumeReason {sb.data.get('resumeReason')})")
        r = sb.exec(f"kill -0 {pid}")
        _check(r.exit_code == 0, f"the holder process {pid} did not survive the resumes")
    img = f"memory image {_mib(int(sorted(images)[len(images) // 2]))}" if images else ""
    requested = ctx.repeats if runs < ctx.repeats else None
    return [
        Row(figure, f"stop --wait, {label} working set ({type}, SDK)", "s", stops, ANCHORS["stop"], img,
            requested),
        Row(figure, f"resume --wait → exec answered, {label} (memory restored)", "s", resumes,
            resume_anchor, "same pid after every resume", requested),
    ]


def fig_ws128(ctx: Ctx) -> list[Row]:
    """``ws128``: stop/resume with 128 MiB held in a ``default`` (512 MiB) sandbox, ``repeats`` times; the resume
    row's anchor is issue 13's goal (0.35 s), the seed's cold resume (3.4 s) stays on ``ws1g``."""
    return _working_set(ctx, "ws128", 128, "default", ctx.repeats, GOALS["resume128"])


def fig_ws1g(ctx: Ctx) -> list[Row]:
    """``ws1g``: stop/resume with 1 GiB held in an ``xlarge`` (2 GiB in the test profile) sandbox,
    ``min(repeats, 3)`` times."""
    return _working_set(ctx, "ws1g", 1024, "xlarge", min(ctx.repeats, 3))


def fig_resize(ctx: Ctx) -> list[Row]:
    """``resize``: with the ``sbx`` command as the guide did, on a fresh small sandbox each run: ``sbx stop ID
    --wait``, then ``sbx resume ID --type default --wait`` until ``sbx exec ID true`` answers. Checks the
    resize kept a file and reports memoryRestored false / resumeReason resized."""
    stops, resumes, totals = [], [], []
    with _tracked(ctx) as ids:
        for i in range(ctx.repeats):
            sid = _cli_new(ctx, ids, "small", f"bench-resize-{i}")
            ctx.srv.sbx("exec", sid, "echo kept > ~/kept")
            t0 = time.perf_counter()
            ctx.srv.sbx("stop", sid, "--wait")
            t1 = time.perf_counter()
            ctx.srv.sbx("resume", sid, "--type", "default", "--wait")
            _cli_wait_exec(ctx, sid)
            t2 = time.perf_counter()
            stops.append(t1 - t0)
            resumes.append(t2 - t1)
            totals.append(t2 - t0)
            sb = _cli_info(ctx, sid)
            _check((sb["type"], sb["memoryRestored"], sb["resumeReason"]) == ("default", False, "resized"),
                   f"resize of {sid} gave {sb['type']}/{sb['memoryRestored']}/{sb['resumeReason']}")
            _check(ctx.srv.sbx("exec", sid, "cat ~/kept").stdout.strip() == "kept", f"{sid} lost ~/kept")
            _delete(ctx, sid)
            ids.discard(sid)
    return [
        Row("resize", "sbx stop --wait (small, idle)", "s", stops, ANCHORS["stop"]),
        Row("resize", "sbx resume --type default → exec answers", "s", resumes, ANCHORS["resume"], "cold boot"),
        Row("resize", "resize: stop + resume --type → exec", "s", totals, ANCHORS["resize"]),
    ]


def _iso(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def fig_fork(ctx: Ctx) -> list[Row]:
    """``fork``: fork a running small sandbox (a detached process running, a file just written), ``repeats``
    times each way: SDK ``fork(wait=True)`` at the same size (wall time, and the fork's createdAt → updatedAt
    as the guide read it from ``sbx info``), and ``sbx fork ID --type default --wait --json`` (wall time, as
    the guide timed it). Checks each fork has the file and answers a command; deletes each fork."""
    sdk_wall, server_side, cli = [], [], []
    with _tracked(ctx) as ids:
        src = _new(ctx, ids, "small", "bench-fork-src")
        src.exec_detached("sleep 100000")
        for i in range(ctx.repeats):
            _check(src.exec(f"echo {i} > ~/marker && sync ~/marker").exit_code == 0, "writing the marker")
            t0 = time.perf_counter()
            fork = src.fork(ttl=TTL, name=f"bench-fork-{i}")
            sdk_wall.append(_since(t0))
            ids.add(fork.id)
            ctx.made.add(fork.id)
            server_side.append((_iso(fork.data["updatedAt"]) - _iso(fork.data["createdAt"])).total_seconds())
            _check(fork.data["state"] == "running", f"fork {fork.id} is {fork.data['state']}")
            _check(fork.exec("cat ~/marker").stdout.strip() == str(i), f"fork {fork.id} lacks the marker")
            _delete(ctx, fork.id)
            ids.discard(fork.id)
        for i in range(ctx.repeats):
            t0 = time.perf_counter()
            r = ctx.srv.sbx("fork", src.id, "--type", "default", "--ttl", str(TTL), "--name", f"bench-forkcli-{i}",
                            "--wait", "--json")
            cli.append(_since(t0))
            events = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
            fid = events[-1]["id"]
            ids.add(fid)
            ctx.made.add(fid)
            _check(events[-1]["event"] == "ready", f"sbx fork ended with {events[-1]}")
            _delete(ctx, fid)
            ids.discard(fid)
        _check(src.exec("pgrep -f 'sleep 100000'").exit_code == 0, "the source's process did not survive")
    return [
        Row("fork", "fork running small → ready: createdAt→updatedAt", "s", server_side, ANCHORS["fork_same"]),
        Row("fork", "fork running small → ready (SDK fork(wait=True), wall)", "s", sdk_wall, None,
            "includes the HTTP round trips"),
        Row("fork", "sbx fork --type default --wait --json (running source)", "s", cli, ANCHORS["fork_cli"]),
    ]


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


def fig_grow(ctx: Ctx) -> list[Row]:
    """``grow``: the seed ``grow.sh`` end to end with the real ``sbx`` on PATH, exactly as
    ``tests/e2e/test_resize_guide.py`` runs it: a fresh small sandbox with the seed ``task.py`` copied in,
    OOM-killed at the heavy step, resized to default, continued to "all steps done". ``min(repeats, 3)`` runs;
    the task sleeps 8 s in total (2 s for each light step)."""
    runs = min(ctx.repeats, 3)
    script = (SEED_DIR / "task.py").read_text()
    samples = []
    with _tracked(ctx) as ids:
        for i in range(runs):
            sid = _cli_new(ctx, ids, "small", f"bench-grow-{i}")
            ctx.srv.sbx("exec", sid, f"mkdir -p ~/task && cat > ~/task/task.py <<'PYEOF'\n{script}PYEOF")
            t0 = time.perf_counter()
            r = subprocess.run(["bash", str(SEED_DIR / "grow.sh"), sid], env=ctx.srv.env, capture_output=True,
                               text=True, timeout=900)
            samples.append(_since(t0))
            _check(r.returncode == 0 and "OOM-killed on small; moving to default" in r.stdout
                   and r.stdout.rstrip().endswith("all steps done"),
                   f"grow.sh {sid} -> {r.returncode}:\n{r.stdout}\n{r.stderr}")
            _delete(ctx, sid)
            ids.discard(sid)
    return [Row("grow", "grow loop end to end (grow.sh: small → default)", "s", samples, ANCHORS["grow"],
                "task sleeps 8 s of it", ctx.repeats if runs < ctx.repeats else None)]


FIGURES: dict[str, Callable[[Ctx], list[Row]]] = {
    "create": fig_create,
    "exec": fig_exec,
    "ws128": fig_ws128,
    "ws1g": fig_ws1g,
    "resize": fig_resize,
    "fork": fig_fork,
    "disk": fig_disk,
    "grow": fig_grow,
    "egress": fig_egress,
    "density": fig_density,
    "template": fig_template,
    "forkmem": fig_forkmem,
    "migrate": fig_migrate,
    "migclient": fig_migclient,
    "remote": fig_remote,
    "xresume": fig_xresume,
}
"""Figure name (what ``--only`` takes) -> function, in the order they run."""

OPT_IN = {"density", "migrate", "migclient", "remote", "xresume"}
"""Figures that run only when ``--only`` names them: density takes a quarter of an hour or more; migrate,
migclient, remote and xresume make network namespaces with node agents in them (:mod:`bench.migrate`,
:mod:`bench.migclient`, :mod:`bench.remote`, :mod:`bench.xresume`)."""

NEEDS_SERVER = set(FIGURES) - {"disk", "migrate", "migclient", "xresume"}
