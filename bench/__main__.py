"""``python -m bench``: time sbx on real sandboxes and compare with the seed guides' figures.

Starts a real ``sbx server`` (:mod:`bench.server`: node ``bench``, bridge ``sbxb0``, subnet ``10.92.0.0/16``,
test size profile, temp state dir and HOME), runs the figures the figure modules register (:mod:`bench.registry`;
each repeated; median and min–max), prints a table with the seed anchors and the ratio ours/anchor, and writes
the JSON document to ``bench/results/<timestamp>.json``. Every sandbox it made is deleted and the server stopped
at the end, also after Ctrl-C. Needs root (runc, CRIU, loop devices).

Usage: ``python -m bench [--repeats 5] [--only create,exec,ws128,ws1g,resize,fork,disk,grow,egress,density,
template,forkmem,migrate,migrate-tls,migclient,remote,xresume,xresume-tls] [--json] [--disk-fill 0.25]
[--density-max 300] [--density-idle 60] [--out DIR] [--keep-tmp]``.
``density`` (idle small sandboxes on one node, :mod:`bench.density`), ``migrate`` (a running sandbox moved between
two node agents of its own, :mod:`bench.migrate`; ``migrate-tls``: its 128 MiB moves over mutual TLS and over
plain links in one run), ``migclient`` (the pause a client's exec loop sees during a
live migration through the server, :mod:`bench.migclient`), ``remote`` (create and exec through a node agent in its own
network namespace vs the embedded node, :mod:`bench.remote`) and ``xresume`` (resume with memory on another node vs
the same node, :mod:`bench.xresume`; ``xresume-tls``: its 128 MiB rounds over mutual TLS and over plain links) run
only when ``--only`` names them. Exit status 0, 1 when a figure failed, 2
for bad options, 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

# each figure module registers its figures (bench.registry) when imported
from bench import (  # noqa: F401,E501
    classes,
    density,
    egress,
    figures,
    imagefigs,
    memfigs,
    migclient,
    migrate,
    remote,
    report,
    xresume,
)
from bench.context import Ctx
from bench.registry import figures as registered
from bench.report import Row

FIGURES = registered()
"""Figure name (what ``--only`` takes) -> :class:`bench.registry.Figure`, in the order they run."""


def _names(value: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in FIGURES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown figure {', '.join(unknown) or '(none)'}; choose from {', '.join(FIGURES)}")
    return names


def default_figures() -> list[str]:
    """The figures a run without ``--only`` does: all but the opt-in ones (``density``, ``migrate``,
    ``migclient``, ``remote``, ``xresume``)."""
    return [n for n, f in FIGURES.items() if not f.opt_in]


def _host() -> dict[str, Any]:
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return {"hostname": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
            "memory_gib": round(mem / (1 << 30), 1), "python": platform.python_version()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="runs per figure (default 5; grow and ws1g do at most 3)")
    p.add_argument("--only", type=_names,
                   help=f"comma-separated figures to run, of: {', '.join(FIGURES)} "
                        f"({', '.join(n for n, f in FIGURES.items() if f.opt_in)} only when named here)")
    p.add_argument("--json", action="store_true", help="print only the JSON document (progress still on stderr)")
    p.add_argument("--disk-fill", type=float, default=0.25,
                   help="share of each disk the disk figure fills with data (default 0.25: 5 GiB at 20 GiB)")
    p.add_argument("--density-max", type=int, default=300,
                   help="density figure: create at most this many small sandboxes (default 300)")
    p.add_argument("--density-idle", type=float, default=60.0,
                   help="density figure: seconds they stay idle before each must answer exec (default 60)")
    p.add_argument("--out", type=Path, default=report.RESULTS_DIR, help="where the JSON goes (bench/results)")
    p.add_argument("--keep-tmp", action="store_true", help="keep the server's temp dir (state, log) afterwards")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    if not 0 < a.disk_fill <= 0.9:
        p.error("--disk-fill must be in (0, 0.9]")
    if a.density_max < 1:
        p.error("--density-max must be at least 1")
    if a.density_idle < 0:
        p.error("--density-idle must be 0 or more")
    return a


def run(a: argparse.Namespace, err: Console,
        timings: dict[str, float]) -> tuple[list[Row], list[dict[str, str]], bool]:
    """Run the chosen figures (their wall times go to ``timings``); returns (rows, errors, interrupted)."""
    from bench.server import cleanup_host, node_settings, running_server

    chosen = a.only or default_figures()
    rows: list[Row] = []
    errors: list[dict[str, str]] = []

    def say(message: str) -> None:
        err.print(message, markup=False, highlight=False)

    def run_figures(ctx: Ctx) -> None:
        for name in chosen:
            say(f"bench: {name} ...")
            t0 = time.monotonic()
            try:
                got = FIGURES[name].run(ctx)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # a failed figure is reported, the others still run
                say(f"bench: {name} failed: {type(e).__name__}: {e}")
                errors.append({"figure": name, "error": f"{type(e).__name__}: {e}"})
                timings[name] = time.monotonic() - t0
                if ctx.server is not None and ctx.server.proc.poll() is not None:
                    say(f"bench: the sbx server exited ({ctx.server.proc.returncode}); end of its log:\n"
                        f"{ctx.server.log_tail()}")
                    errors.append({"figure": "server", "error": f"exited with {ctx.server.proc.returncode}"})
                    return
                continue
            timings[name] = time.monotonic() - t0
            rows.extend(got)
            for r in got:
                say(f"  {r.name}: {report.fmt_time(r.median, r.unit)} ({report.fmt_spread(r)}, n={r.n})")
            say(f"  ({name} took {timings[name]:.0f} s)")

    try:
        if any(FIGURES[n].needs_server for n in chosen):
            say("bench: starting sbx server (node bench, test profile)")
            with running_server(keep_tmp=a.keep_tmp) as srv, srv.client() as client:
                run_figures(Ctx(srv, client, a.repeats, a.disk_fill, say,
                            density_max=a.density_max, density_idle=a.density_idle))
        else:
            try:
                run_figures(Ctx(None, None, a.repeats, a.disk_fill, say,
                            density_max=a.density_max, density_idle=a.density_idle))
            finally:
                cleanup_host(node_settings())
    except KeyboardInterrupt:
        say("bench: interrupted; partial results follow")
        return rows, errors, True
    return rows, errors, False


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    err = Console(stderr=True, width=170, soft_wrap=True)
    if os.geteuid() != 0:
        err.print("bench: needs root (it boots real sandboxes)", markup=False)
        return 2
    started = datetime.now(UTC)
    timings: dict[str, float] = {}
    try:
        rows, errors, interrupted = run(a, err, timings)
    except Exception as e:  # the server did not start
        err.print(f"bench: {type(e).__name__}: {e}", markup=False, highlight=False)
        return 1
    finished = datetime.now(UTC)
    options = {"repeats": a.repeats, "only": a.only or default_figures(), "profile": "test",
               "disk_fill": a.disk_fill, "interrupted": interrupted}
    if "density" in options["only"]:
        options.update(density_max=a.density_max, density_idle=a.density_idle)
    doc = report.document(rows, started=started, finished=finished, options=options, host=_host(),
                          errors=errors, figure_seconds=timings)
    path = report.write_json(doc, a.out, when=started)
    if a.json:
        print(json.dumps(doc, indent=1))
    else:
        title = (f"sbx bench — {doc['host']['hostname']}, {doc['host']['cpus']} cores, test profile, "
                 f"{doc['duration_s']:.0f} s")
        console = Console()
        if not console.is_terminal:
            console = Console(width=170)
        console.print(report.table(rows, title))
        for failure in errors:
            err.print(f"FAILED {failure['figure']}: {failure['error']}", markup=False, highlight=False)
    err.print(f"bench: results in {path}", markup=False, highlight=False)
    if interrupted:
        return 130
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
