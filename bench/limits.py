"""``python -m bench.limits``: what the abuse limits shared by every replica (issue 35) cost per request.

One `sbx` API server (uvicorn, the real app with a fake node: only the API and the control plane are timed) on a
throwaway PostgreSQL cluster of this machine (tests/pgcluster.py), an account's key whose rate limit is never
reached (so every request takes its token and passes), and ``--clients`` threads each with its own keep-alive
connection calling ``GET /v1/sandboxes`` for ``--seconds``: requests/s and latency percentiles with the token bucket
in the database (:class:`sbx.control.accounts.limits.SharedLimits`, the PostgreSQL default) and with the in-memory
bucket of a single server, alternating ``--rounds`` times. Also the bare cost of one
:meth:`~sbx.control.accounts.limits.SharedLimits.take` (one statement and its commit) in a loop. Prints one JSON
document. Needs root (PostgreSQL runs as its own user); takes about ``2 * rounds * seconds`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from sbx.api.app import create_app
from sbx.config import load_settings
from sbx.control.accounts.limits import SharedLimits
from sbx.control.service import ControlPlane
from tests.fakes import FakeNode
from tests.pgcluster import pg_cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _load(url: str, token: str, clients: int, seconds: float) -> dict[str, float]:
    """``clients`` threads calling ``GET /v1/sandboxes`` for ``seconds``: requests/s and latency (ms)."""
    lat: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds
    bad: list[int] = []

    def run() -> None:
        mine: list[float] = []
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
            while time.monotonic() < stop:
                t = time.perf_counter()
                r = c.get("/v1/sandboxes")
                mine.append((time.perf_counter() - t) * 1000)
                if r.status_code != 200:
                    bad.append(r.status_code)
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=run) for _ in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    if bad:
        raise SystemExit(f"{len(bad)} requests failed: {sorted(set(bad))}")
    q = statistics.quantiles(lat, n=100)
    return {"rps": round(len(lat) / elapsed, 1), "p50_ms": round(q[49], 2), "p99_ms": round(q[98], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sbx-bench-limits-"))
    with pg_cluster() as pg:
        db = pg.create_db("bench_limits")
        settings = load_settings(home=tmp / "home", state_dir=tmp / "state", profile="test", node_name="bench-lim",
                                 auto_snapshot_seconds=0, database_url=db, rate_limit=1e9, rate_burst=10**9,
                                 port=_free_port())
        node = FakeNode(tmp / "node")
        cp = ControlPlane(settings, node)  # type: ignore[arg-type]
        app = create_app(settings, node, token="sbx_bench_admin_" + "x" * 30, control=cp)  # type: ignore[arg-type]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning",
                                               access_log=False))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{settings.port}"
        while not server.started:
            time.sleep(0.05)
        try:
            _acct, _key, token = cp.accounts.create_account("bench", "team")
            gate = app.state.gate
            shared = gate.shared
            assert isinstance(shared, SharedLimits)
            _load(url, token, args.clients, 2.0)  # warm-up
            runs: dict[str, list[dict[str, float]]] = {"shared": [], "memory": []}
            for _ in range(args.rounds):
                for mode in ("shared", "memory"):
                    gate.shared = shared if mode == "shared" else None
                    runs[mode].append(_load(url, token, args.clients, args.seconds))
            n = 2000
            t = time.perf_counter()
            for _ in range(n):
                shared.take("key_bench_loop", 1e9, 10**9)
            take_ms = (time.perf_counter() - t) * 1000 / n
            out: dict[str, Any] = {
                "clients": args.clients, "seconds": args.seconds, "rounds": args.rounds, "cpus": os.cpu_count(),
                "route": "GET /v1/sandboxes", "take_ms": round(take_ms, 3),
                **{mode: {"rps": statistics.median(r["rps"] for r in rs),
                          "p50_ms": statistics.median(r["p50_ms"] for r in rs),
                          "p99_ms": statistics.median(r["p99_ms"] for r in rs), "runs": rs}
                   for mode, rs in runs.items()},
            }
            out["rps_cost_pct"] = round(100 * (1 - out["shared"]["rps"] / out["memory"]["rps"]), 1)
            print(json.dumps(out, indent=2))
        finally:
            server.should_exit = True
            thread.join(timeout=30)
            node.close()


if __name__ == "__main__":
    main()
