"""The remote-node figure (``python -m bench --only remote``, opt-in): create and exec through a node agent in a
network namespace of its own, against the same operations on the benchmark server's embedded node.

The node agent (``sbx node serve``, node :data:`NODE_NAME`) runs in namespace ``sbxbench-nd``, joined to the host by
the veth pair ``sbxbndh8`` / ``eth0`` on ``10.78.248.0/24`` (host ``.1``, node ``.2``, port 7700), its sandboxes on
bridge ``sbxbnd8`` / ``10.78.128.0/20`` inside that namespace: :func:`tests.nodenet.host_netns` and
:meth:`tests.nodenet.NodeHost.start` build and start it exactly as the several-node tests do, with names no test
uses (the tests take nodes 1..6 on ``10.93.0.0/16`` moved by their slot). A second ``sbx server``
(:func:`bench.server.running_server` with ``SBX_NODE_URL`` / ``SBX_NODE_TOKEN``) drives it, so every node call
crosses the veth as HTTP, as it would to another host. The benchmark's own server (embedded node) runs meanwhile;
each run does the embedded and the remote side back to back, in alternating order, so host load hits both alike.

Timed, on each side: ``sbx new --type small`` (the whole CLI process; it returns once the sandbox runs), the SDK's
``Sandbox.create(type="small")`` (returns once it runs), and on one running small sandbox the SDK's
``exec("true")`` round trip (``max(20, 4 x repeats)`` runs) and ``sbx exec ID true`` as a process
(``max(5, repeats)`` runs). Each remote row's anchor is the embedded row's median, so its ratio is the overhead
remote/embedded.

Clean-up, also after Ctrl-C (ignored while it runs) or a failure: the figure's sandboxes are deleted through their
server, the remote server is stopped, then the agent (SIGTERM: it removes its bridge, nftables table and run dir),
the namespace (the veth goes with it), the node's folder on the volume and its empty cgroups.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bench.context import Ctx, check, cli_info, cli_new, delete, new, since, tracked, wait_exec
from bench.memfigs import wait_template
from bench.registry import figure
from bench.report import Anchor, Row, fmt_time
from bench.server import BenchServer, cleanup_host, running_server
from sbx.config import Settings, load_settings
from tests.nodenet import NodeAgentError, NodeHost, host_netns

NODE_NAME = "benchnd"
NETNS = "sbxbench-nd"
LINK = "10.78.248"  # /24: host .1, node .2
SUBNET = "10.78.128.0/20"  # the node's sandboxes, on its bridge inside the namespace


def node_host(tmp: Path) -> NodeHost:
    """The remote node's names and addresses, its agent's state (node token, logs) under ``tmp/node``; nothing is
    created."""
    return NodeHost(k=8, netns=NETNS, node_name=NODE_NAME, bridge="sbxbnd8", subnet=SUBNET, host_veth="sbxbndh8",
                    host_ip=f"{LINK}.1", node_ip=f"{LINK}.2", state=tmp / "node")


def node_settings(h: NodeHost) -> Settings:
    """The :class:`Settings` the agent of ``h`` runs with (its folder on the volume, run dir, cgroups)."""
    return load_settings(node_name=h.node_name, bridge=h.bridge, subnet=h.subnet, profile="test", state_dir=h.state)


@contextmanager
def remote_server(say: Callable[[str], None]) -> Iterator[tuple[NodeHost, BenchServer]]:
    """The node agent in its namespace and a server driving it, for the figure's duration; yields both. Removes
    all of it afterwards, also after Ctrl-C (ignored during the clean-up). Raises ``NodeAgentError`` when the agent
    does not start, ``bench.server.ServerError`` when the server does not."""
    tmp = Path(tempfile.mkdtemp(prefix="sbx-bench-remote-"))
    h = node_host(tmp)
    stack = ExitStack()
    try:
        say(f"  node agent {h.node_name} in namespace {h.netns} at {h.url}")
        stack.enter_context(host_netns(h))
        h.start()
        srv = stack.enter_context(running_server(env_extra={
            "SBX_NODE_URL": h.url, "SBX_NODE_TOKEN": h.token,
            # the server's own node settings name nothing on this host: it has no embedded node
            "SBX_NODE_NAME": "benchrs", "SBX_BRIDGE": "sbxbrs0", "SBX_SUBNET": "10.78.0.0/20",
        }))
        yield h, srv
    except NodeAgentError:  # its message ends with the agent's log
        raise
    except Exception:
        if h.proc is not None:
            say(f"  end of the node agent's log:\n{h.logs()[-2000:]}")
        raise
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            stack.close()  # sandboxes deleted, server stopped, then the agent, the namespace and its veth
            cleanup_host(node_settings(h))  # run dir and empty cgroups the agent left
            if h.proc is not None and h.proc.returncode not in (0, None):
                say(f"  the node agent exited with {h.proc.returncode}; its logs are in {h.state}")
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            signal.signal(signal.SIGINT, previous)


def _pair(embedded: Row, remote: Row) -> list[Row]:
    """The embedded row, then the remote one with the embedded median as its anchor (ratio = remote/embedded)."""
    e = embedded.median
    scale = 1000.0 if embedded.unit == "s" else 1.0
    remote.anchor = Anchor(e, fmt_time(e, embedded.unit), "remote rows: the embedded row above (ratio = "
                           "remote/embedded, medians of interleaved runs)")
    remote.note = (f"{(remote.median - e) * scale:+.1f} ms over embedded" +
                   (f"; {remote.note}" if remote.note else ""))
    return [embedded, remote]


@figure("remote", order=150, opt_in=True)
def fig_remote(ctx: Ctx) -> list[Row]:
    """``remote``: create (``sbx new --type small``, SDK ``Sandbox.create``) and exec (SDK ``exec("true")``,
    ``sbx exec ID true``) through a node agent in its own network namespace vs the embedded node (module doc).
    Checks every remote sandbox is on the remote node and every exec exits 0. Returns 8 rows, embedded then
    remote for each operation."""
    with remote_server(ctx.say) as (h, rsrv), rsrv.client() as rclient:
        rctx = Ctx(rsrv, rclient, ctx.repeats, say=ctx.say)
        sides = {"embedded": ctx, "remote": rctx}
        samples: dict[tuple[str, str], list[float]] = {(op, side): [] for op in ("new", "create", "exec", "cli")
                                                        for side in sides}

        def order(i: int) -> list[tuple[str, Ctx]]:
            items = list(sides.items())
            return items if i % 2 == 0 else items[::-1]

        def where(c: Ctx, sid: str, node: str | None) -> None:
            if c is rctx:
                check(node == h.node_name, f"{sid} is on node {node}, not on {h.node_name}")

        with tracked(ctx) as eids, tracked(rctx) as rids:
            ids = {"embedded": eids, "remote": rids}
            # a first small sandbox boots cold and has its node build the small memory template, which every
            # later create starts from: both nodes get theirs before anything is timed
            for side, c in sides.items():
                sb = new(c, ids[side], "small", f"bench-remote-first-{side}")
                where(c, sb.id, sb.data.get("node"))
                delete(c, sb.id)
                ids[side].discard(sb.id)
            wait_template(ctx.srv.settings.node_dir)
            wait_template(node_settings(h).node_dir)
            for i in range(ctx.repeats):
                for side, c in order(i):
                    t0 = time.perf_counter()
                    sid = cli_new(c, ids[side], "small", f"bench-remote-new-{side}-{i}")
                    samples[("new", side)].append(since(t0))
                    info = cli_info(c, sid)
                    check(info["state"] == "running", f"sbx new returned with {sid} {info['state']}")
                    where(c, sid, info.get("node"))
                    delete(c, sid)
                    ids[side].discard(sid)
                for side, c in order(i + 1):
                    t0 = time.perf_counter()
                    sb = new(c, ids[side], "small", f"bench-remote-create-{side}-{i}")
                    samples[("create", side)].append(since(t0))
                    check(sb.data["state"] == "running", f"Sandbox.create returned with {sb.id} {sb.data['state']}")
                    where(c, sb.id, sb.data.get("node"))
                    delete(c, sb.id)
                    ids[side].discard(sb.id)
            boxes = {}
            for side, c in sides.items():
                sb = new(c, ids[side], "small", f"bench-remote-exec-{side}")
                where(c, sb.id, sb.data.get("node"))
                wait_exec(sb)
                boxes[side] = sb
            for i in range(max(20, 4 * ctx.repeats)):
                for side, _c in order(i):
                    t0 = time.perf_counter()
                    r = boxes[side].exec("true")
                    samples[("exec", side)].append(since(t0))
                    check(r.exit_code == 0, f"exec in {boxes[side].id} exited {r.exit_code}")
            for i in range(max(5, ctx.repeats)):
                for side, c in order(i):
                    t0 = time.perf_counter()
                    c.srv.sbx("exec", boxes[side].id, "true")
                    samples[("cli", side)].append(since(t0))

    what = {"new": "sbx new --type small → running", "create": "Sandbox.create small → running (SDK)",
            "exec": "exec `true` round trip (SDK)", "cli": "sbx exec ID true (CLI process)"}
    rows = []
    for op, label in what.items():
        note = "from the small memory template" if op in ("new", "create") else ""
        rows += _pair(Row("remote", f"{label}, embedded node", "s", samples[(op, "embedded")], note=note),
                      Row("remote", f"{label}, remote node", "s", samples[(op, "remote")], note=note))
    return rows
