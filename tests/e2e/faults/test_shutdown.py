"""Server shutdown (issue 16, item 9): SIGTERM ends attached exec streams within a bounded grace with the error
code ``server_shutdown`` (their commands are killed, not left running unseen), then removes the node's bridge,
nftables table, ``/run/sbx/<node>`` and cgroup folders when no sandbox runs; an exec a kill -9'd server left
running is killed when the server starts again.

Own server: node ``shutdn``, bridge ``sbxshut0``, 10.87.0.0/16 unless SBX_SHUT_NODE / SBX_SHUT_BRIDGE /
SBX_SHUT_SUBNET say otherwise.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import SBX
from tests.e2e.faultsrv import FaultServer
from tests.e2e.helpers import poll


@pytest.fixture(scope="module")
def shut(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultServer]:
    fs = FaultServer(tmp_path_factory.mktemp("sbx-shutdown"), prefix="SBX_SHUT", node="shutdn", bridge="sbxshut0",
                     subnet="10.87.0.0/16")
    fs.start()
    try:
        yield fs
    finally:
        if fs.proc is not None and fs.proc.poll() is None:
            fs.close()


def ok(fs: FaultServer, *args: str, timeout: float = 600) -> str:
    if fs.proc is None or fs.proc.poll() is not None:  # an earlier test stopped it (and maybe failed)
        fs.start()
    assert fs.srv is not None
    return fs.srv.sbx(*args, timeout=timeout, check=True).stdout


def attached(fs: FaultServer, sid: str, command: str) -> subprocess.Popen[str]:
    """``sbx exec`` of ``command`` running in the background; returns once the command runs in the sandbox."""
    assert fs.srv is not None
    proc = subprocess.Popen([SBX, "exec", "--timeout", "0", sid, command], env=fs.srv.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    poll(lambda: running(fs, sid, command), f"{command!r} to run in {sid}", timeout=120)
    return proc


def running(fs: FaultServer, sid: str, command: str) -> bool:
    assert fs.srv is not None
    # the [s] keeps pgrep from matching the bash -c that runs it
    r = fs.srv.sbx("exec", sid, f"pgrep -f '[{command[0]}]{command[1:]}'", timeout=120)
    return r.returncode == 0


def test_sigterm_ends_attached_execs_with_server_shutdown_and_kills_their_commands(shut: FaultServer) -> None:
    sid = ok(shut, "new", "--type", "small").strip()
    client = attached(shut, sid, "sleep 600")
    assert shut.term() == 0
    out, err = client.communicate(timeout=120)  # far below the 600 s the command would run
    assert client.returncode != 0
    assert "server_shutdown" in err, (out, err)
    shut.start()
    assert not running(shut, sid, "sleep 600")  # killed with its stream, not left running unseen
    ok(shut, "delete", "--wait", sid)


def test_an_exec_left_by_a_killed_server_is_killed_at_restart(shut: FaultServer) -> None:
    sid = ok(shut, "new", "--type", "small").strip()
    client = attached(shut, sid, "sleep 700")
    shut.kill9()
    client.communicate(timeout=120)
    assert client.returncode != 0  # the client sees the server go away
    shut.start()
    assert not running(shut, sid, "sleep 700")
    ok(shut, "delete", "--wait", sid)


def test_sigterm_with_no_sandbox_running_removes_the_node_from_the_host(shut: FaultServer) -> None:
    ok(shut, "list")
    assert shut.srv is not None
    assert not shut.srv.api("GET", "/v1/sandboxes")["sandboxes"]
    bridge = shut.env["SBX_BRIDGE"]
    assert Path("/sys/class/net", bridge).exists()
    assert shut.term() == 0
    assert not Path("/sys/class/net", bridge).exists()
    table = "sbx_" + "".join(c if c.isalnum() else "_" for c in shut.node)
    assert subprocess.run(["nft", "list", "table", "inet", table], capture_output=True).returncode != 0
    assert not Path("/run/sbx", shut.node).exists()
    assert not any(Path("/sys/fs/cgroup", ctrl, "sbx", shut.node).exists() for ctrl in ("memory", "cpu", "pids"))
