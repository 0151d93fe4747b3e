"""Figures of issue 13: a new sandbox from a memory template, and a fork with memory.

- ``template``: ``Sandbox.create(type="small")`` until a first ``exec("true")`` answers, from the small memory
  template (built in the background after the first cold boot of the size; the figure waits for it), and the same
  with ``cold=True`` (the cold boot it replaces), ``repeats`` times each.
- ``forkmem``: ``fork(memory=True)`` of a running ``default`` sandbox whose detached python3 holds 128 MiB of
  touched random memory, until the fork answers an exec; checks the holder runs in the fork with the same PID.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.report import Anchor, Row
from sbx.sdk import Sandbox

if TYPE_CHECKING:
    from bench.figures import Ctx

ANCHORS = {
    "template": Anchor(0.15, "0.15 s", "E2B: a sandbox starts in ~150 ms (every sandbox is a resumed snapshot)"),
    "forkmem": Anchor(0.25, "0.25 s", "Morph: snapshot and branch a running VM with memory in < 250 ms"),
}
TEMPLATE_WAIT = 300.0  # seconds to wait for the small template's background build


def wait_template(node_dir: Path, type: str = "small", timeout: float = TEMPLATE_WAIT) -> None:
    """Return once the memory template of ``type`` is built in ``node_dir/templates`` (in the background, after
    the first cold boot of that size); raises ``RuntimeError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not list((node_dir / "templates").glob(f"*-{type}/template.json")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {type} memory template was not built in {node_dir} within {timeout:.0f} s")
        time.sleep(0.5)


def fig_template(ctx: Ctx) -> list[Row]:
    """``template``: create small → first exec answered, from the template and cold (see the module docstring)."""
    from bench import figures as F

    warm: list[float] = []
    cold: list[float] = []
    with F._tracked(ctx) as ids:
        first = F._new(ctx, ids, "small", "bench-template-first")  # a cold boot that asks for the template
        F._delete(ctx, first.id)
        ids.discard(first.id)
        wait_template(ctx.srv.settings.node_dir)
        for i in range(ctx.repeats):
            for is_cold, samples in ((False, warm), (True, cold)):
                t0 = time.perf_counter()
                sb = Sandbox.create(type="small", name=f"bench-template-{i}", ttl=F.TTL, client=ctx.sdk, cold=is_cold)
                ids.add(sb.id)
                ctx.made.add(sb.id)
                r = sb.exec("true")
                samples.append(F._since(t0))
                F._check(r.exit_code == 0, f"first exec in {sb.id} exited {r.exit_code}")
                F._delete(ctx, sb.id)
                ids.discard(sb.id)
    return [
        Row("template", "create small from its memory template → first exec (SDK)", "s", warm, ANCHORS["template"]),
        Row("template", "create small --cold → first exec (SDK; the cold boot it replaces)", "s", cold,
            ANCHORS["template"]),
    ]


def fig_forkmem(ctx: Ctx) -> list[Row]:
    """``forkmem``: fork with memory → exec answered at 128 MiB (see the module docstring)."""
    from bench import figures as F

    samples: list[float] = []
    with F._tracked(ctx) as ids:
        src = F._new(ctx, ids, "default", "bench-forkmem-src")
        r = src.exec(f"cat > ~/bench-ws.py <<'PYEOF'\n{F.HOLDER}PYEOF")
        F._check(r.exit_code == 0, f"writing the holder script: {r.stderr}")
        src.exec_detached("python3 ~/bench-ws.py 128")
        deadline = time.monotonic() + 300
        pid = ""
        while not pid:
            F._check(time.monotonic() < deadline, "the 128 MiB holder did not get ready")
            pid = src.exec("cat ~/bench-ws.ready 2>/dev/null").stdout.strip()
            if not pid:
                time.sleep(0.2)
        for i in range(ctx.repeats):
            t0 = time.perf_counter()
            fork = src.fork(ttl=F.TTL, name=f"bench-forkmem-{i}", memory=True)
            ids.add(fork.id)
            ctx.made.add(fork.id)
            r = fork.exec(f"kill -0 {pid}")
            samples.append(F._since(t0))
            F._check(r.exit_code == 0, f"the holder {pid} is not in fork {fork.id}")
            F._check(fork.data.get("memoryRestored") is True, f"fork {fork.id} has memoryRestored "
                     f"{fork.data.get('memoryRestored')}")
            F._delete(ctx, fork.id)
            ids.discard(fork.id)
        F._check(src.exec(f"kill -0 {pid}").exit_code == 0, "the source's holder did not survive the forks")
    return [Row("forkmem", "fork --memory running default (128 MiB held) → exec answered (SDK)", "s", samples,
                ANCHORS["forkmem"], "same pid in the fork")]
