"""Faults: the server killed with SIGKILL in the middle of an operation, and memory saves that fail, on real
sandboxes through the real server and CLI (issue 16).

The server is this module's own (tests/e2e/faultsrv.py: node ``faults``, bridge ``sbxfault0``, 10.88.0.0/16 unless
SBX_FAULT_NODE / SBX_FAULT_BRIDGE / SBX_FAULT_SUBNET say otherwise), because the tests kill and restart it. To hit
the window in which a running sandbox's root is frozen every time (measured 0.26-0.30 s into a snapshot or fork
without help), the server runs with ``SBX_TEST_HOLD_FROZEN`` (sbx.storage.disk), which keeps the filesystem
frozen for that many seconds with a marker file present; the test kills the server once the marker appears.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import SBX
from tests.e2e.faultsrv import FaultServer

HOLD = {"SBX_TEST_HOLD_FROZEN": "120"}
NO_HOLD = {"SBX_TEST_HOLD_FROZEN": ""}


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultServer]:
    fs = FaultServer(tmp_path_factory.mktemp("sbx-faults"))
    fs.start()
    try:
        yield fs
    finally:
        fs.close()


def sbx(fs: FaultServer, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    assert fs.srv is not None
    return fs.srv.sbx(*args, timeout=timeout)


def ok(fs: FaultServer, *args: str, timeout: float = 600) -> str:
    assert fs.srv is not None
    return fs.srv.sbx(*args, timeout=timeout, check=True).stdout


def info(fs: FaultServer, sid: str) -> dict:  # type: ignore[type-arg]
    return json.loads(ok(fs, "info", sid, "--json"))["sandbox"]  # type: ignore[no-any-return]


def new(fs: FaultServer) -> str:
    return ok(fs, "new", "--type", "small").strip()


def in_background(fs: FaultServer, *args: str) -> subprocess.Popen[str]:
    assert fs.srv is not None
    return subprocess.Popen([SBX, *args], env=fs.srv.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def writes_work(fs: FaultServer, sid: str, tag: str) -> None:
    """A write plus sync inside the sandbox finishes (a frozen root would hang it in D state: the CLI call then
    times out and the test fails)."""
    out = ok(fs, "exec", sid, f"echo {tag} > ~/{tag} && sync && cat ~/{tag}", timeout=120)
    assert out.strip() == tag


def test_kill_during_snapshot_of_a_running_sandbox_leaves_nothing_frozen(faults: FaultServer) -> None:
    sid = new(faults)
    writes_work(faults, sid, "before")
    faults.restart(**HOLD)
    snap = in_background(faults, "snapshot", sid, "frozen-snap")
    try:
        faults.wait_frozen_hold(sid)
        faults.kill9()
    finally:
        snap.kill()
        snap.wait()
    faults.start(**NO_HOLD)
    assert info(faults, sid)["state"] == "running"
    writes_work(faults, sid, "after")
    ok(faults, "snapshot", sid, "after-restart", timeout=120)
    names = [s["name"] for s in json.loads(ok(faults, "snapshots", sid, "--json"))["snapshots"]]
    assert names == ["after-restart"]  # the killed snapshot was never recorded, its half copy is gone
    out = json.loads(ok(faults, "stop", sid, "--wait", "--json", timeout=300))["sandbox"]
    assert (out["state"], out["memorySaved"]) == ("stopped", True)
    ok(faults, "resume", sid, "--wait", timeout=300)
    assert info(faults, sid)["memoryRestored"] is True
    assert ok(faults, "exec", sid, "cat ~/before ~/after").split() == ["before", "after"]
    ok(faults, "delete", sid)


def test_kill_during_fork_marks_the_fork_interrupted_and_thaws_the_source(faults: FaultServer) -> None:
    src = new(faults)
    faults.restart(**HOLD)
    fork_id = ok(faults, "fork", src).strip()
    faults.wait_frozen_hold(src)
    faults.kill9()
    faults.start(**NO_HOLD)
    fork = info(faults, fork_id)
    assert fork["state"] == "error", fork  # never "stopped" without a disk
    assert fork["error"]["code"] == "interrupted"
    r = sbx(faults, "resume", fork_id, "--wait")
    assert r.returncode != 0 and "Traceback" not in r.stderr + r.stdout
    writes_work(faults, src, "source-after")
    ok(faults, "delete", fork_id)
    # the same fork again, not killed, works
    again = ok(faults, "fork", src, "--wait", timeout=600).strip()
    assert ok(faults, "exec", again, "cat ~/source-after").strip() == "source-after"
    for sid in (again, src):
        ok(faults, "delete", sid)


def test_a_failed_memory_save_is_reported_and_memory_restored_is_not_stale(faults: FaultServer) -> None:
    sid = new(faults)
    ok(faults, "stop", sid, "--wait", timeout=300)
    ok(faults, "resume", sid, "--wait", timeout=300)
    assert info(faults, sid)["memoryRestored"] is True
    # A process in a UTS namespace of its own (as logind or Docker make them) can't be dumped by CRIU.
    ok(faults, "exec", "--user", "root", "--detach", sid, "unshare --uts sleep 100000")
    r = sbx(faults, "stop", sid, "--wait", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "warning: memory was not saved" in r.stderr
    got = info(faults, sid)
    assert (got["state"], got["memorySaved"], got["stopReason"]) == ("stopped", False, "requested")
    assert got["stopError"] and got["memoryRestored"] is None
    ok(faults, "resume", sid, "--wait", timeout=300)
    got = info(faults, sid)
    assert (got["memoryRestored"], got["resumeReason"]) == (False, "no_checkpoint")
    ok(faults, "delete", sid)

