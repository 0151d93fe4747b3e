"""Faults around memory images (issue 16, cases 2 and 5): a memory image never comes back over a disk that moved
on, and a container whose halt began is never checkpointed, on real sandboxes through the real server and CLI.

The server is tests/e2e/faultsrv.py's (node/bridge/subnet from SBX_FAULT_NODE / _BRIDGE / _SUBNET). Two test-only
switches of the node (sbx.node.container.recovery) make the windows deterministic: ``SBX_TEST_HOLD_RESTORE`` holds a
resume
after CRIU restored the container and before the image is discarded (marker ``<sandbox dir>/restore-hold``), and
``SBX_TEST_FAIL_CHECKPOINT=1`` makes a stop's memory save fail so the node halts the container instead.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.e2e.faults.test_faults import _runc_running, _settled, in_background, info, new, ok, writes_work
from tests.e2e.faultsrv import FaultServer
from tests.e2e.helpers import poll

HOLD_RESTORE = {"SBX_TEST_HOLD_RESTORE": "300"}
FAIL_CHECKPOINT = {"SBX_TEST_FAIL_CHECKPOINT": "1"}
PLAIN = {"SBX_TEST_HOLD_RESTORE": "", "SBX_TEST_FAIL_CHECKPOINT": ""}

# A service whose stop never ends: systemd's shutdown gets stuck half-way on it (the node's halt waits its grace).
HANG_UNIT = """[Unit]
Description=a service whose stop hangs (test)
[Service]
ExecStart=/bin/sleep infinity
ExecStop=/bin/sleep 100000
TimeoutStopSec=infinity
"""


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultServer]:
    fs = FaultServer(tmp_path_factory.mktemp("sbx-fault-memory"))
    fs.start()
    try:
        yield fs
    finally:
        fs.close()


def test_an_interrupted_resume_never_restores_its_image_over_a_newer_disk(faults: FaultServer) -> None:
    """Case 5: the server dies after CRIU restored the sandbox but before the image was dropped. The sandbox runs
    on, its disk moves on (a new file), a stop without memory follows: the next resume must cold-boot from the
    newer disk, not bring back the old image."""
    sid = new(faults)
    writes_work(faults, sid, "gen1")
    out = ok(faults, "stop", sid, "--wait", timeout=300)
    assert info(faults, sid)["memorySaved"] is True, out
    faults.restart(**HOLD_RESTORE)
    resume = in_background(faults, "resume", sid, "--wait")
    try:
        poll(lambda: (faults.sandbox_dir(sid) / "restore-hold").exists(), f"{sid}'s restore to be held",
             timeout=300, interval=0.05)
        assert _runc_running(faults, sid)  # restored from the image and running when the server dies
        faults.kill9()
    finally:
        resume.kill()
        resume.wait()
    faults.start(**PLAIN)
    _settled(faults, sid, state="running")  # the restored container survived the server
    writes_work(faults, sid, "gen2")  # the disk moves on from the image's state
    ok(faults, "stop", sid, "--wait", "--no-memory", timeout=300)
    ok(faults, "resume", sid, "--wait", timeout=300)
    got = info(faults, sid)
    assert got["state"] == "running"
    assert got["memoryRestored"] is False, got  # the old code restored the stale image here
    assert got["resumeReason"] in ("no_checkpoint", "stale_checkpoint"), got
    assert ok(faults, "exec", sid, "cat ~/gen1 ~/gen2").split() == ["gen1", "gen2"]
    ok(faults, "delete", sid)


def test_a_container_whose_halt_began_is_never_checkpointed(faults: FaultServer) -> None:
    """Case 2: a stop's memory save fails, the node falls back to halting, systemd's shutdown is half-way (a
    service whose stop hangs) when the server dies. After the restart the sandbox must end stopped without memory
    (the old code checkpointed the half-halted container and restored it as healthy), and a resume is a cold boot
    in which commands run."""
    sid = new(faults)
    writes_work(faults, sid, "kept")
    ok(faults, "exec", "--user", "root", sid,
       f"cat > /etc/systemd/system/sbx-hang.service <<'EOF'\n{HANG_UNIT}EOF\n"
       "systemctl daemon-reload && systemctl start sbx-hang", timeout=120)
    faults.restart(**FAIL_CHECKPOINT)
    stop = in_background(faults, "stop", sid, "--wait")
    try:
        def save_failed() -> bool:
            rec = faults.node_record(sid)
            return rec.get("phase") == "stopping" and bool(rec.get("lastError"))

        poll(save_failed, f"{sid}'s memory save to fail", timeout=300, interval=0.05)
        time.sleep(1.0)  # the halt has begun; systemd now waits for sbx-hang's stop
        assert _runc_running(faults, sid)  # half shut down, not gone
        faults.kill9()
    finally:
        stop.kill()
        stop.wait()
    faults.start(**PLAIN)
    got = _settled(faults, sid, state="stopped")
    assert got["memorySaved"] is False, got
    assert not _runc_running(faults, sid)
    ok(faults, "resume", sid, "--wait", timeout=300)
    got = info(faults, sid)
    assert (got["state"], got["memoryRestored"], got["resumeReason"]) == ("running", False, "no_checkpoint"), got
    assert ok(faults, "exec", sid, "echo alive && cat ~/kept", timeout=120).split() == ["alive", "kept"]
    status = ok(faults, "exec", sid, "systemctl is-system-running --wait || true", timeout=300).strip()
    assert status in ("running", "degraded"), status  # a fresh boot, not a shutdown carried over
    ok(faults, "delete", sid)
