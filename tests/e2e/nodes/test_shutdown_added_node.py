"""Server shutdown with an added node (issue 10's "only the configured node hears about shutdown"): on SIGTERM an
exec attached to a sandbox on a node added with `sbx node add` ends with ``server_shutdown`` within the grace, as
one on the server's own node does (tests/e2e/faults/test_shutdown.py), and its command is killed, not left running.

Own embedded server (node ``shutan``, bridge ``sbxshan0``, 10.81.0.0/16) and node agent 14 in a network namespace
of its own (tests/nodenet.py).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import SBX
from tests.e2e.faultsrv import FaultServer
from tests.e2e.helpers import poll
from tests.nodenet import NodeHost, node_netns


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FaultServer, NodeHost]]:
    tmp = tmp_path_factory.mktemp("sbx-shutdown-added")
    with node_netns(14, tmp) as node:
        node.start()
        fs = FaultServer(tmp, prefix="SBX_SHUTAN", node="shutan", bridge="sbxshan0", subnet="10.81.0.0/16",
                         SBX_NODE_HEARTBEAT_SECONDS="1", SBX_CONSOLIDATE_SECONDS="0")
        fs.start()
        try:
            yield fs, node
        finally:
            if fs.proc is None or fs.proc.poll() is not None:
                fs.start()
            fs.close()


def ok(fs: FaultServer, *args: str, timeout: float = 600) -> str:
    assert fs.srv is not None
    return fs.srv.sbx(*args, timeout=timeout, check=True).stdout


def running(fs: FaultServer, sid: str, command: str) -> bool:
    assert fs.srv is not None
    return fs.srv.sbx("exec", sid, f"pgrep -f '[{command[0]}]{command[1:]}'", timeout=120).returncode == 0


def test_sigterm_ends_an_exec_on_an_added_node_with_server_shutdown(cluster: tuple[FaultServer, NodeHost]) -> None:
    fs, node = cluster
    assert fs.srv is not None
    added = json.loads(ok(fs, "node", "add", node.url, "--token", node.token, "--json"))["node"]
    assert added["status"] == "ready"
    ok(fs, "node", "cordon", fs.node)  # the sandbox goes to the added node
    sid = ok(fs, "new", "--type", "small").strip()
    assert json.loads(ok(fs, "info", sid, "--json"))["sandbox"]["node"] == node.node_name
    client = subprocess.Popen([SBX, "exec", "--timeout", "0", sid, "sleep 610"], env=fs.srv.env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    poll(lambda: running(fs, sid, "sleep 610"), "sleep 610 to run", timeout=120)
    assert fs.term() == 0
    out, err = client.communicate(timeout=120)  # far below the 610 s the command would run
    assert client.returncode != 0 and "server_shutdown" in err, (out, err)
    fs.start()
    poll(lambda: not running(fs, sid, "sleep 610"), "the command to be killed with its stream", timeout=60)
    ok(fs, "delete", "--wait", sid)
