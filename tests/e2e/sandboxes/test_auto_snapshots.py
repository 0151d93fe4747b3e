"""Automatic snapshots on real sandboxes, through the CLI of a second server whose reaper snapshots every running
sandbox every 2 s and keeps the newest 2 (``SBX_AUTO_SNAPSHOT_SECONDS``, ``SBX_AUTO_SNAPSHOT_KEEP``): they appear
on their own, old ones are pruned, a ``--no-snapshots`` sandbox gets none, ``new --from`` an automatic snapshot
boots with the files it held, and deleting the sandbox deletes its automatic snapshots.

The server has its own node, bridge and subnet (SBX_E2E_NODE + "auto", SBX_E2E_BRIDGE2, SBX_E2E_SUBNET2).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import Server, start_server
from tests.e2e.helpers import poll

pytestmark = pytest.mark.e2e

KEEP = 2


@pytest.fixture(scope="module")
def auto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(
        tmp_path_factory.mktemp("sbx-auto-e2e"),
        node=os.environ.get("SBX_E2E_NODE", "e2e") + "auto",
        bridge=os.environ.get("SBX_E2E_BRIDGE2", "sbxe2e1"),
        subnet=os.environ.get("SBX_E2E_SUBNET2", "10.92.0.0/16"),
        SBX_AUTO_SNAPSHOT_SECONDS="2",
        SBX_AUTO_SNAPSHOT_KEEP=str(KEEP),
    ) as srv:
        yield srv


def _autos(server: Server, sid: str) -> list[str]:
    listed = json.loads(server.sbx("snapshots", sid, "--json", check=True).stdout)["snapshots"]
    assert all(s["auto"] and s["sandboxId"] == sid for s in listed), listed
    return sorted(s["name"] for s in listed)


def _run(server: Server, sid: str, command: str) -> str:
    r = server.sbx("exec", sid, command, "--timeout", "120")
    assert r.returncode == 0, f"{command!r} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_running_sandboxes_are_snapshotted_and_only_the_newest_kept(auto_server: Server) -> None:
    server = auto_server
    sid = server.sbx("new", "--type", "small", "--name", "auto-src", check=True).stdout.strip()
    plain = server.sbx("new", "--type", "small", "--no-snapshots", "--name", "auto-off", check=True).stdout.strip()
    _run(server, sid, "echo before > ~/state.txt; sync")

    seen: set[str] = set()

    def three_taken() -> bool:
        seen.update(_autos(server, sid))
        return len(seen) >= KEEP + 1

    poll(three_taken, f"{KEEP + 1} automatic snapshots of {sid}", timeout=120)
    assert all(re.fullmatch(rf"auto-{sid}-\d{{8}}T\d{{6}}Z", n) for n in seen), seen

    def pruned() -> list[str] | None:
        names = _autos(server, sid)
        seen.update(names)
        return names if len(names) == KEEP and names == sorted(seen)[-KEEP:] else None

    kept = poll(pruned, f"only the newest {KEEP} automatic snapshots left", timeout=60)
    assert _autos(server, plain) == []

    child = server.sbx("new", "--type", "small", "--from", kept[-1], check=True).stdout.strip()
    assert _run(server, child, "cat ~/state.txt").strip() == "before"

    # Deleting a sandbox deletes its automatic snapshots (named ones stay); the child made from one keeps running.
    server.sbx("delete", sid, "--wait", check=True)
    listed = json.loads(server.sbx("snapshots", "--json", check=True).stdout)["snapshots"]
    assert [s["name"] for s in listed if s["sandboxId"] == sid] == []
    assert _run(server, child, "cat ~/state.txt").strip() == "before"
