"""Figures of issue 13: a new sandbox from a memory template, and a fork with memory.

- ``template``: ``Sandbox.create(type="small")`` until a first ``exec("true")`` answers, ``repeats`` times each
  way: from a warm sandbox (one already restored from the template, :mod:`sbx.node.memory.warmpool`; the figure waits
  until the node's pool is full), from the small memory template itself (after untimed creates took every warm
  one left, before the node made the next: so while it makes them), and with ``cold=True`` (the cold boot both
  replace; timed once the node's pool is full again). The template is built in the background after the first
  cold boot of the size; the figure waits for it. Each create is checked to have started the way its row says
  (the node's record, ``startedFrom``).
- ``forkmem``: ``fork(memory=True)`` of a running ``default`` sandbox whose detached python3 holds 128 MiB of
  touched random memory, until the fork answers an exec; checks the holder runs in the fork with the same PID.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.context import TTL, Ctx, check, delete, new, since, start_holder, tracked
from bench.registry import figure
from bench.report import Anchor, Row
from sbx.sdk import Sandbox

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


def warm_count(node_dir: Path, type: str = "small") -> int:
    """How many warm sandboxes of ``type`` are ready on the node whose folder is ``node_dir`` (records in phase
    ``pooled``)."""
    n = 0
    for rec_file in (node_dir / "sandboxes").glob("*/node.json"):
        try:
            rec = json.loads(rec_file.read_text())
        except (OSError, ValueError):
            continue
        n += rec.get("phase") == "pooled" and rec.get("pooled") == type
    return n


def wait_warm(node_dir: Path, type: str = "small", count: int = 1, timeout: float = TEMPLATE_WAIT) -> None:
    """Return once ``count`` warm sandboxes of ``type`` are ready on the node whose folder is ``node_dir``; raises
    ``RuntimeError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while warm_count(node_dir, type) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {count} warm {type} sandboxes were made in {node_dir} within {timeout:.0f} s")
        time.sleep(0.1)


def _started_from(node_dir: Path, sid: str) -> str:
    try:
        return str(json.loads((node_dir / "sandboxes" / sid / "node.json").read_text()).get("startedFrom"))
    except (OSError, ValueError):
        return "?"


@figure("template", order=110)
def fig_template(ctx: Ctx) -> list[Row]:
    """``template``: create small → first exec answered, from a warm sandbox, from the template and cold (see the
    module docstring)."""
    node_dir = ctx.srv.settings.node_dir
    samples: dict[str, list[float]] = {"pool": [], "template": [], "boot": []}
    with tracked(ctx) as ids:
        first = new(ctx, ids, "small", "bench-template-first")  # a cold boot that asks for the template
        delete(ctx, first.id)
        ids.discard(first.id)
        wait_template(node_dir)
        pool = max(1, ctx.srv.settings.warm_pool)

        def make(name: str, kind: str | None) -> None:
            """Create ``name``; with ``kind``, time it to its first exec and check it started that way."""
            t0 = time.perf_counter()
            sb = Sandbox.create(type="small", name=name, ttl=TTL, client=ctx.sdk, cold=kind == "boot")
            ids.add(sb.id)
            ctx.made.add(sb.id)
            if kind is None:
                return
            r = sb.exec("true")
            samples[kind].append(since(t0))
            check(r.exit_code == 0, f"first exec in {sb.id} exited {r.exit_code}")
            got = _started_from(node_dir, sb.id)
            check(got == kind, f"{sb.id} started from {got!r}, not {kind!r}")

        for i in range(ctx.repeats):
            wait_warm(node_dir, count=pool)
            make(f"bench-template-{i}-pool", "pool")
            for j in range(pool - 1):  # the other warm ones, taken before the node makes the next
                make(f"bench-template-{i}-drain{j}", None)
            make(f"bench-template-{i}-template", "template")  # while the node makes the next warm ones
            wait_warm(node_dir, count=pool)  # a boot does not compete with those restores
            make(f"bench-template-{i}-boot", "boot")
            for sid in list(ids):
                delete(ctx, sid)
                ids.discard(sid)
    return [
        Row("template", "create small from a warm sandbox → first exec (SDK)", "s", samples["pool"],
            ANCHORS["template"]),
        Row("template", "create small from its memory template (no warm one) → first exec (SDK)", "s",
            samples["template"], ANCHORS["template"]),
        Row("template", "create small --cold → first exec (SDK; the cold boot both replace)", "s", samples["boot"],
            ANCHORS["template"]),
    ]


@figure("forkmem", order=120)
def fig_forkmem(ctx: Ctx) -> list[Row]:
    """``forkmem``: fork with memory → exec answered at 128 MiB (see the module docstring)."""
    samples: list[float] = []
    with tracked(ctx) as ids:
        src = new(ctx, ids, "default", "bench-forkmem-src")
        pid = start_holder(src, 128, "128 MiB")
        for i in range(ctx.repeats):
            t0 = time.perf_counter()
            fork = src.fork(ttl=TTL, name=f"bench-forkmem-{i}", memory=True)
            ids.add(fork.id)
            ctx.made.add(fork.id)
            r = fork.exec(f"kill -0 {pid}")
            samples.append(since(t0))
            check(r.exit_code == 0, f"the holder {pid} is not in fork {fork.id}")
            check(fork.data.get("memoryRestored") is True, f"fork {fork.id} has memoryRestored "
                  f"{fork.data.get('memoryRestored')}")
            delete(ctx, fork.id)
            ids.discard(fork.id)
        check(src.exec(f"kill -0 {pid}").exit_code == 0, "the source's holder did not survive the forks")
    return [Row("forkmem", "fork --memory running default (128 MiB held) → exec answered (SDK)", "s", samples,
                ANCHORS["forkmem"], "same pid in the fork")]
