"""E2B's own SDK (the ``e2b`` package, issue 31) timed next to sbx's in the same run: the ``create`` figure adds
"create small → first command" through ``e2b.Sandbox.create(template="small")`` and ``commands.run("true")``,
the ``exec`` figure adds ``commands.run("true")`` round trips on its sandbox, each right after an SDK
``exec("true")`` there, and each pair's difference: what the E2B layer adds per command (issue 31's goal: at most
10 ms), for pairs 0.25 s apart and back to back (:mod:`sbx.api.e2b.pool`: a command runs in a ready job started
beforehand; commands faster than those start find none and start their own).

The SDK is pointed at the benchmark server as its README says (``api_url`` = ``<server>/e2b``, ``sandbox_url`` =
the server, the server's key), per call, so the environment is left alone. Without the ``e2b`` package (it is in
the dev extras) these rows are left out, with a line saying so.
"""

from __future__ import annotations

import time
from typing import Any

from bench.context import TTL, Ctx, check, delete, since
from bench.report import Anchor, Row
from sbx.sdk import Sandbox as NativeSandbox

GOAL = Anchor(0.010, "10 ms", "issue 31 goal: the E2B layer adds at most 10 ms per command")
PACE = 0.25
"""Seconds between two paced pairs: an agent's commands come seconds apart, time enough to start a ready job."""
NOTE = "an E2B command runs in a ready sbx job (it outlives the call and a pause) handed over by an attached exec"


def _params(ctx: Ctx) -> dict[str, Any] | None:
    """The SDK's connection parameters for the benchmark server; None (and a line) without the package."""
    try:
        import e2b  # noqa: F401
    except ImportError:
        ctx.say("  e2b is not installed (pip install -e '.[dev]'): the E2B SDK rows are left out")
        return None
    return {"api_key": ctx.srv.token, "api_url": ctx.srv.url + "/e2b", "sandbox_url": ctx.srv.url}


def create_rows(ctx: Ctx, ids: set[str]) -> list[Row]:
    """``ctx.repeats`` times: ``e2b.Sandbox.create(template="small")`` until ``commands.run("true")`` answers;
    each sandbox is killed after its run (not timed). Sandbox ids go in ``ids`` while they live."""
    params = _params(ctx)
    if params is None:
        return []
    from e2b import Sandbox

    samples = []
    for _ in range(ctx.repeats):
        t0 = time.perf_counter()
        sb = Sandbox.create(template="small", timeout=TTL, metadata={"bench": "e2b-create"}, **params)
        ids.add(sb.sandbox_id)
        ctx.made.add(sb.sandbox_id)
        r = sb.commands.run("true")
        samples.append(since(t0))
        check(r.exit_code == 0, f"first command in {sb.sandbox_id} exited {r.exit_code}")
        delete(ctx, sb.sandbox_id)
        ids.discard(sb.sandbox_id)
    return [Row("create", "create small → first command answered (E2B SDK, same server)", "s", samples)]


def command_rows(ctx: Ctx, native: NativeSandbox, runs: int) -> list[Row]:
    """``runs`` pairs on the running sandbox ``native``, :data:`PACE` seconds apart, then ``runs`` back to back:
    an SDK ``exec("true")``, then E2B's ``commands.run("true")`` on the same sandbox; the E2B round trips and each
    pair's difference, for both."""
    params = _params(ctx)
    if params is None:
        return []
    from e2b import Sandbox

    sb = Sandbox.connect(native.id, timeout=TTL, **params)
    for _ in range(3):  # the SDK's connection pool, the server's first calls, the sandbox's ready jobs
        sb.commands.run("true")
    rows = []
    for pace, how in ((PACE, f"{PACE:g} s apart"), (0.0, "back to back")):
        samples, added = [], []
        for _ in range(runs):
            time.sleep(pace)
            t0 = time.perf_counter()
            native.exec("true")
            mine = since(t0)
            t0 = time.perf_counter()
            r = sb.commands.run("true")
            samples.append(since(t0))
            added.append(samples[-1] - mine)
            check(r.exit_code == 0, f"commands.run exited {r.exit_code}")
        rows += [
            Row("exec", f"commands.run `true` round trip (E2B SDK, {how})", "s", samples),
            Row("exec", f"E2B layer's cost per command (E2B − SDK exec, paired, {how})", "s", added, GOAL,
                note=NOTE if pace else "faster than ready jobs start: most commands start their own"),
        ]
    return rows
