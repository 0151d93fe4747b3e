"""A gvisor sandbox across a crash of its server (issue 33): kill -9 of `sbx server` leaves runsc's Sandbox and
gofer running (they live in sessions of their own); the restarted server's reconcile finds the sandbox through
runsc's state (no runc state file), keeps it running with what a command left running, execs in it again through
the agent's relay, and stops and resumes it with memory."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.faultsrv import FaultServer

pytestmark = pytest.mark.e2e


@pytest.fixture
def gvr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultServer]:
    fs = FaultServer(tmp_path_factory.mktemp("sbx-gvr"), prefix="SBX_GVR", node="gvrestart", bridge="sbxgvr0",
                     subnet="10.76.0.0/16")
    fs.start()
    try:
        yield fs
    finally:
        fs.close()


def _ok(r: Any) -> str:
    assert r.returncode == 0, f"{r.returncode}\n{r.stdout}\n{r.stderr}"
    return str(r.stdout)


def test_a_gvisor_sandbox_outlives_a_killed_server(gvr: FaultServer) -> None:
    srv = gvr.srv
    assert srv is not None
    sid = json.loads(_ok(srv.sbx("new", "--runtime", "gvisor", "--ttl", "0", "--json")))["sandbox"]["id"]
    bg = _ok(srv.sbx("exec", sid, "sleep 100000 >/dev/null 2>&1 & echo $!")).strip()
    _ok(srv.sbx("exec", sid, "echo in-memory > /tmp/m"))
    srv = gvr.restart()
    info = json.loads(_ok(srv.sbx("info", sid, "--json")))["sandbox"]
    assert (info["state"], info["runtime"]) == ("running", "gvisor"), info
    assert gvr.node_record(sid)["phase"] == "running"
    assert "sleep 100000" in _ok(srv.sbx("exec", sid, f"tr '\\0' ' ' < /proc/{bg}/cmdline"))
    assert "sbx-agent" in _ok(srv.sbx("exec", sid, "tr '\\0' ' ' < /proc/$PPID/cmdline"))
    _ok(srv.sbx("stop", sid, "--wait"))
    _ok(srv.sbx("resume", sid, "--wait"))
    info = json.loads(_ok(srv.sbx("info", sid, "--json")))["sandbox"]
    assert info["memoryRestored"] is True, info
    assert _ok(srv.sbx("exec", sid, "cat /tmp/m")).strip() == "in-memory"
    assert "sleep 100000" in _ok(srv.sbx("exec", sid, f"tr '\\0' ' ' < /proc/{bg}/cmdline"))
