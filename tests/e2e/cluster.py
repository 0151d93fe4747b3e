"""What the several-node end-to-end tests share (tests/e2e/nodes/test_drain.py, test_consolidation.py,
test_fork_elsewhere.py, test_secrets_nodes.py): :func:`node_cluster`, a ``sbx server`` driving node agents that
each run in a network namespace of their own (tests/nodenet.py), and the CLI helpers and the 128 MiB holder process
they check a move with."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from tests.e2e.conftest import Server, start_server
from tests.e2e.helpers import poll
from tests.nodenet import NodeHost, node_netns_many

HOLDER = r"""
import hashlib, os, signal, time
data = os.urandom(128 << 20)
f = open('/home/user/unlinked', 'w+b')
f.write(os.urandom(65536))
f.seek(12345)
os.unlink('/home/user/unlinked')
def report(*_a):
    st = os.fstat(f.fileno())
    with open('/home/user/holder.check.tmp', 'w') as out:
        out.write(f"{os.getpid()} {hashlib.sha256(data).hexdigest()} {f.tell()} {st.st_nlink}\n")
    os.replace('/home/user/holder.check.tmp', '/home/user/holder.check')
signal.signal(signal.SIGUSR1, report)
open('/home/user/holder.pid', 'w').write(f"{os.getpid()}\n")
report()
while True:
    time.sleep(1)
"""


@contextmanager
def node_cluster(tmp: Path, ks: list[int], node: str, bridge: str, subnet: str,
                 node_env: dict[str, str] | None = None, **env: str) -> Iterator[tuple[Server, list[NodeHost]]]:
    """Node agents ``ks`` started in their namespaces (``node_env``: more settings for each) and a server
    (``node``/``bridge``/``subnet``: its own names, moved to the run's slot; ``env``: more settings) whose configured
    node is the first, the others added with ``sbx node add`` and checked ``ready``. Heartbeats every second,
    unreachable after 5 s. On exit the server stops, then the agents and their namespaces go."""
    with ExitStack() as stack:
        nodes = stack.enter_context(node_netns_many(ks, tmp))
        for n in nodes:
            n.extra_env.update(node_env or {})
            n.start()
        (tmp / "server").mkdir()
        srv = stack.enter_context(start_server(
            tmp / "server", node=node, bridge=bridge, subnet=subnet, SBX_NODE_URL=nodes[0].url,
            SBX_NODE_TOKEN=nodes[0].token, SBX_NODE_HEARTBEAT_SECONDS="1", SBX_NODE_UNREACHABLE_SECONDS="5",
            **env))
        for n in nodes[1:]:
            added = json.loads(ok(srv, "node", "add", n.url, "--token", n.token, "--json"))["node"]
            assert (added["name"], added["status"]) == (n.node_name, "ready"), added
        yield srv, nodes


def ok(srv: Server, *args: str, timeout: float = 300) -> str:
    """``sbx ARGS``'s output; fails the test when it exits non-zero."""
    return srv.sbx(*args, timeout=timeout, check=True).stdout


def info(srv: Server, sid: str) -> dict[str, Any]:
    """``sbx info SID --json``'s sandbox."""
    return json.loads(ok(srv, "info", sid, "--json"))["sandbox"]  # type: ignore[no-any-return]


def cordon(srv: Server, nodes: list[NodeHost], *ks: int) -> None:
    """Cordon nodes ``ks`` and uncordon the others."""
    for n in nodes:
        ok(srv, "node", "cordon" if n.k in ks else "uncordon", n.node_name)


def start_holder(srv: Server, sid: str) -> None:
    """Start :data:`HOLDER` in sandbox ``sid`` and wait for its first report."""
    ok(srv, "exec", sid, f"cat > ~/holder.py <<'EOF'\n{HOLDER}\nEOF")
    ok(srv, "exec", sid, "--detach", "python3 ~/holder.py")
    poll(lambda: srv.sbx("exec", sid, "test -s ~/holder.check", timeout=60).returncode == 0, "the holder", 120)


def holder(srv: Server, sid: str) -> list[str]:
    """PID, SHA-256 of the 128 MiB, offset and link count of the unlinked file, as the holder reports them now."""
    ok(srv, "exec", sid, "rm -f ~/holder.check; kill -USR1 $(cat ~/holder.pid); for i in $(seq 100); do "
                         "[ -s ~/holder.check ] && exit 0; sleep 0.1; done; exit 1", timeout=60)
    return ok(srv, "exec", sid, "cat ~/holder.check", timeout=60).split()
