"""Issue 31 end to end, through E2B's own SDK: commands that run in ready jobs (:mod:`sbx.api.e2b.pool`, the E2B
layer's fast start) behave as commands started their own way: the sandbox's env and the command's, the user and
home directory, output, exit codes, the pid the SDK reports is the process's, ``commands.list`` names them (and
not the idle ready jobs), they outlive a pause, and ``commands.kill`` ends them."""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e.api.test_e2b_sdk import e2b_env  # noqa: F401  (a fixture: the SDK's URLs and key)
from tests.e2e.conftest import Server

e2b = pytest.importorskip("e2b")

pytestmark = pytest.mark.e2e

CLAIMED = "ls -d /var/lib/sbx-jobs/*/e2b-claimed 2>/dev/null | wc -l"


def _why(server: Server, sandbox_id: str) -> str:
    """What the sandbox's sbx record says of its last stop and resume, and the server's warnings about it."""
    info = json.loads(server.sbx("info", sandbox_id, "--json", check=True).stdout)["sandbox"]
    keep = {k: info.get(k) for k in ("memorySaved", "stopError", "memoryRestored", "resumeReason")}
    warned = [line for line in server.log.read_text(errors="replace").splitlines()
              if sandbox_id in line and ("WARNING" in line or "passing reason" in line)]
    return f"{keep} {warned[-5:]}"


def test_commands_in_ready_jobs_behave_as_any_command(e2b_env: Server) -> None:  # noqa: F811
    from e2b import CommandExitException, Sandbox

    sbx = Sandbox.create(timeout=600, envs={"FROM_SANDBOX": "s"})
    try:
        first = sbx.commands.run("echo first")  # starts its own job, and the sandbox's ready jobs
        assert first.stdout == "first\n"
        time.sleep(1.5)  # time for the ready jobs to start

        def claimed() -> int:
            return int(sbx.commands.run(CLAIMED, user="root").stdout)  # as root: never a ready job's

        before = claimed()
        r = sbx.commands.run('echo "$FROM_SANDBOX $FROM_CALL $(id -un) $PWD $$"; echo e >&2',
                             envs={"FROM_CALL": "c d"})
        words = r.stdout.split()
        assert words[:5] == ["s", "c", "d", "user", "/home/user"] and r.stderr == "e\n"
        assert claimed() == before + 1  # it ran in a ready job
        time.sleep(0.5)
        with pytest.raises(CommandExitException) as failed:
            sbx.commands.run("echo out; exit 5")
        assert failed.value.exit_code == 5 and failed.value.stdout == "out\n"
        time.sleep(0.5)
        big = sbx.commands.run("seq 1 200000")
        assert big.stdout.splitlines()[-1] == "200000" and len(big.stdout.splitlines()) == 200000

        time.sleep(0.5)
        bg = sbx.commands.run("sleep 600", background=True)
        assert sbx.commands.run(f"cat /proc/{bg.pid}/cmdline | tr '\\0' ' '").stdout == "sleep 600 "  # its pid
        listed = {p.pid: p for p in sbx.commands.list()}
        assert bg.pid in listed and listed[bg.pid].args[-1] == "sleep 600"
        assert len(listed) == 1  # the idle ready jobs are not E2B processes
        before = claimed()

        assert sbx.pause() is True
        again = Sandbox.connect(sbx.sandbox_id)
        assert bg.pid in [p.pid for p in again.commands.list()], _why(e2b_env, sbx.sandbox_id)
        time.sleep(0.5)
        assert again.commands.run("echo after the pause").stdout == "after the pause\n"  # a ready job kept too
        assert claimed() == before + 1
        assert again.commands.kill(bg.pid) is True
        assert bg.pid not in [p.pid for p in again.commands.list()]
    finally:
        sbx.kill()
