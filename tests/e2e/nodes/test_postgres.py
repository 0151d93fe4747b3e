"""The shared PostgreSQL store (issue 10, first slice): `sbx server` with ``SBX_DATABASE_URL`` keeps its sandboxes,
snapshots and events in PostgreSQL; a replica killed with SIGKILL is replaced by another server on the same database
and node, which sees the sandbox running, execs in it, shows the first server's events and runs its lifecycle.

Only one replica at a time runs the (embedded) node here. The server is this module's own (tests/e2e/faultsrv.py:
node ``pgrepl``, bridge ``sbxpgr0``, 10.86.0.0/16 unless SBX_PG_NODE / SBX_PG_BRIDGE / SBX_PG_SUBNET say otherwise);
the database is a throwaway cluster (tests/pgcluster.py).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.faultsrv import FaultServer
from tests.pgcluster import PgCluster, pg_cluster


@pytest.fixture(scope="module")
def pg() -> Iterator[PgCluster]:
    with pg_cluster() as cluster:
        yield cluster


def ok(fs: FaultServer, *args: str, timeout: float = 600) -> str:
    assert fs.srv is not None
    return fs.srv.sbx(*args, timeout=timeout, check=True).stdout


def events(fs: FaultServer, sid: str) -> list[dict]:  # type: ignore[type-arg]
    """The sandbox's lifecycle events as the API streams them (NDJSON, no follow)."""
    assert fs.srv is not None
    req = urllib.request.Request(f"{fs.srv.url}/v1/sandboxes/{sid}/events",
                                 headers={"Authorization": f"Bearer {fs.srv.token}"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return [json.loads(line) for line in resp.read().decode().splitlines() if line.strip()]


def test_a_replica_on_the_same_database_takes_over_after_kill9(pg: PgCluster, tmp_path: Path) -> None:
    url = pg.create_db("sbx_takeover")
    fs = FaultServer(tmp_path, prefix="SBX_PG", node="pgrepl", bridge="sbxpgr0", subnet="10.86.0.0/16",
                     SBX_DATABASE_URL=url)
    try:
        fs.start()
        sid = ok(fs, "new", "--type", "small").strip()
        assert ok(fs, "exec", sid, "echo kept > ~/f && sync && cat ~/f", timeout=120).strip() == "kept"
        # the rows are in PostgreSQL, and no SQLite file was made
        assert pg.psql(f"SELECT state FROM sandboxes WHERE id = '{sid}'", db="sbx_takeover") == "running"
        assert not (tmp_path / "state" / "sbx.db").exists()
        before = events(fs, sid)
        assert [e["event"] for e in before][-1] == "ready"

        fs.kill9()  # replica A dies; B starts on the same database and node
        fs.start()
        got = json.loads(ok(fs, "info", sid, "--json"))["sandbox"]
        assert got["state"] == "running"
        assert ok(fs, "exec", sid, "cat ~/f", timeout=120).strip() == "kept"
        after = events(fs, sid)
        assert after[: len(before)] == before  # A's events, as B serves them

        ok(fs, "stop", sid, "--wait", timeout=300)
        ok(fs, "resume", sid, "--wait", timeout=300)
        assert ok(fs, "exec", sid, "cat ~/f", timeout=120).strip() == "kept"
        states = [e.get("state") for e in events(fs, sid)[len(before):]]
        assert "stopped" in states and states[-1] == "ready"
        assert pg.psql(f"SELECT state FROM sandboxes WHERE id = '{sid}'", db="sbx_takeover") == "running"
    finally:
        fs.close()
