"""The cross-node resume figure (``python -m bench --only xresume``; issue 10, "resume on another node").

One ``sbx server`` of its own drives two node agents (``sbx node serve``), each in a network namespace of its own
as in the several-node tests (:mod:`tests.nodenet`, nodes 7 and 8 of the run's slot, which no test uses; so it
needs the dev install): node 7 is the server's configured node (``SBX_NODE_URL``), node 8 is added with
``sbx node add URL --token T`` (README "One server, several nodes"). Per working set (128 MiB in a ``default``
sandbox, then 1 GiB in an ``xlarge`` one, the test sizes of ``ws128`` / ``ws1g``) a detached python3 holds that
much touched random memory (:data:`bench.context.HOLDER`). Each round, on the same sandbox:

- same node: ``stop --wait`` (memory saved), only its node uncordoned, ``resume --wait`` until an exec answers;
- cross node: ``stop --wait``, its node cordoned and the other uncordoned, ``resume --wait`` until an exec
  answers on the other node (the disk delta and memory image move node -> server -> node first).

Every resume must report ``memoryRestored`` and the holder must keep its PID; the node the sandbox ends on is
checked. The bytes a move sent and the server's own time for it come from the server's log line ("moved ...: N
bytes in F files ... in S s", :mod:`sbx.control.sandboxes.moving`). There is no published timing for a cross-node resume
(the fork guide only says "A resume restores memory only on a machine with the same CPU type"), so the cross-node
row's reference is the same-node row of the same working set, and its ratio is cross-node / same-node. The
same-node rows keep the references of ``ws128`` (issue 13's 0.35 s goal) and ``ws1g`` (the seed's 3.4 s resume).

The server and the agents run in sessions of their own, so a Ctrl-C reaches only the benchmark, which then
deletes the sandbox through the server (a second Ctrl-C is ignored meanwhile), stops the server and the agents and
removes the namespaces.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.context import TTL, Ctx, check, du, since, start_holder, tracked, wait_exec
from bench.registry import figure
from bench.report import Anchor, Row

if TYPE_CHECKING:
    from bench.server import BenchServer
    from tests.nodenet import NodeHost

NODES = (7, 8)
"""The :mod:`tests.nodenet` node numbers this figure uses (tests use 1-6, ``migrate`` 4 and 5)."""
SERVER_NODE, SERVER_BRIDGE = "xrsrv", "sbxxrsv"  # the server's own names (it has no local node: SBX_NODE_URL)
SERVER_SUBNET = "10.96.0.0/16"
MOVED = re.compile(r"moved (sb_\w+) from (\S+) to (\S+): (\d+) bytes in (\d+) files \((\w+) disk delta, "
                   r"memory (\w+)\) in ([\d.]+) s")
SETS = (("128 MiB", 128, "default", None), ("1 GiB", 1024, "xlarge", 3))
"""(label, MiB held, size, most rounds) per working set; the 1 GiB set does at most 3 rounds, as ``ws1g``."""


@contextmanager
def _server(tmp: Path, node: NodeHost) -> Iterator[BenchServer]:
    """``sbx server`` (test profile, info log) whose configured node is ``node``, in its own session; on exit
    (also on Ctrl-C) deletes its sandboxes and stops it. Raises ``ServerError`` when it does not start."""
    from bench import server as S
    from tests.slots import slotted

    srv = S.start(tmp, start_timeout=300, node=slotted(SERVER_NODE, SERVER_BRIDGE, SERVER_SUBNET), log_level="info",
                  env_extra={"SBX_NODE_URL": node.url, "SBX_NODE_TOKEN": node.token,
                             "SBX_CONSOLIDATE_SECONDS": "0", "SBX_REPLICATE_SECONDS": "0", "SBX_WARM_POOL": "0",
                             "SBX_NODE_HEARTBEAT_SECONDS": "1", "SBX_NODE_UNREACHABLE_SECONDS": "5"})
    proc, log = srv.proc, srv.log
    try:
        yield srv
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if proc.poll() is None:
                left = srv.delete_all()
                if left:
                    print(f"bench: xresume could not delete {', '.join(left)}")
        finally:
            code = S._terminate(proc)
            signal.signal(signal.SIGINT, previous)
        if code != 0:
            print(f"bench: the xresume server exited with {code}; log: {log}")


@contextmanager
def two_nodes(ctx: Ctx, tmp: Path, tls: bool = True) -> Iterator[tuple[BenchServer, list[NodeHost]]]:
    """Nodes :data:`NODES` in network namespaces of their own with their agents (over mutual TLS, or plain HTTP
    without ``tls``), and a server (:func:`_server`) whose configured node is the first, the second added with
    ``sbx node add``; yields ``(server, nodes)``. On exit the server, the agents and the namespaces go. Raises
    ``RuntimeError`` when the add does not answer ready."""
    from tests.nodenet import node_netns_many

    with ExitStack() as stack:
        nodes = stack.enter_context(node_netns_many(list(NODES), tmp))
        for n in nodes:
            n.tls = tls
            n.start()
        srv = stack.enter_context(_server(tmp / "server", nodes[0]))
        added = json.loads(srv.sbx("node", "add", nodes[1].url, "--token", nodes[1].token, "--json").stdout)["node"]
        if (added["name"], added["status"]) != (nodes[1].node_name, "ready"):
            raise RuntimeError(f"sbx node add gave {added}")
        ctx.say(f"  server on {nodes[0].node_name}, added {added['name']} ({added['url']})")
        yield srv, nodes


def _moves(log: Path, sid: str) -> list[dict[str, Any]]:
    """The server log's move lines for ``sid``, oldest first: ``{"src", "dst", "bytes", "files", "delta",
    "memory", "seconds"}``."""
    out = []
    for m in MOVED.finditer(log.read_text(errors="replace")):
        if m.group(1) == sid:
            out.append({"src": m.group(2), "dst": m.group(3), "bytes": int(m.group(4)), "files": int(m.group(5)),
                        "delta": m.group(6), "memory": m.group(7) == "True", "seconds": float(m.group(8))})
    return out


def _working_set(ctx: Ctx, srv: BenchServer, nodes: list[NodeHost], label: str, mib: int, type: str,
                 runs: int) -> list[Row]:
    """The rounds of one working set (module docstring); rows: same-node resume, cross-node resume (reference:
    the same-node median), and the move itself as the server timed it. Raises ``RuntimeError`` when a resume
    lands on the wrong node, does not restore memory, or loses the holder."""
    from sbx.config import load_settings
    from sbx.sdk import Sandbox
    from sbx.sdk import nodes as N

    names = [n.node_name for n in nodes]

    def only(name: str) -> None:
        """Cordon every node but ``name``."""
        for n in names:
            sdk.run(N.cordon(n, n != name))

    same: list[float] = []
    cross: list[float] = []
    images: list[int] = []
    with srv.client() as sdk:
        sub = Ctx(srv, sdk, ctx.repeats, say=ctx.say)
        with tracked(sub) as ids:
            only(names[0])
            sb = Sandbox.create(type=type, name=f"bench-xresume-{mib}", ttl=TTL, client=sdk)
            ids.add(sb.id)
            check(sb.data.get("node") == names[0], f"{sb.id} was placed on {sb.data.get('node')}")
            pid = start_holder(sb, mib, label)
            ctx.say(f"  {label} held by pid {pid} in a {type} sandbox {sb.id} on {names[0]}")
            here = 0
            for i in range(runs):
                for moving, samples in ((False, same), (True, cross)):
                    sb.stop(wait=True)
                    check(sb.data.get("memorySaved") is True, f"round {i + 1}: {sb.id} stopped without its memory "
                          f"(stopReason {sb.data.get('stopReason')}, stopError {sb.data.get('stopError')})")
                    if not moving:
                        node = nodes[here]
                        mem = load_settings(node_name=node.node_name, bridge=node.bridge, subnet=node.subnet,
                                            profile="test", state_dir=node.state).node_dir
                        size = du(mem / "sandboxes" / sb.id / "memory")
                        if size is not None:
                            images.append(size)
                    to = 1 - here if moving else here
                    only(names[to])
                    t0 = time.perf_counter()
                    sb.resume(wait=True)
                    wait_exec(sb)
                    samples.append(since(t0))
                    sb.info()
                    check((sb.data.get("node"), sb.data.get("memoryRestored")) == (names[to], True),
                          f"round {i + 1}: {sb.id} resumed on {sb.data.get('node')} with memoryRestored "
                          f"{sb.data.get('memoryRestored')} (resumeReason {sb.data.get('resumeReason')}), "
                          f"wanted {names[to]} with memory")
                    check(sb.exec(f"kill -0 {pid}").exit_code == 0,
                          f"round {i + 1}: the holder {pid} did not survive the resume on {names[to]}")
                    here = to
                    what = f"{names[1 - to]} → {names[to]}" if moving else f"on {names[to]}"
                    ctx.say(f"  round {i + 1}: resume {what} {samples[-1]:.2f} s")
            moves = _moves(srv.log, sb.id)
    check(len(moves) == runs and all(m["memory"] for m in moves),
          f"the server logged {len(moves)} moves with memory of {sb.id}, wanted {runs}: {moves}")
    sent = statistics.median(m["bytes"] for m in moves)
    img = int(statistics.median(images)) if images else 0
    requested = ctx.repeats if runs < ctx.repeats else None
    ref = Anchor(statistics.median(same), f"{statistics.median(same):.2f} s",
                 f"same-node resume of the same {label} (no published cross-node figure)")
    same_anchor = Anchor(0.35, "0.35 s", "issue 13 goal: resume → exec answered at 128 MiB") if mib == 128 else \
        Anchor(3.4, "3.4 s", "resize guide: sbx resume --type default until it answers (a cold boot)")
    return [
        Row("xresume", f"resume --wait → exec answered, same node, {label} (memory restored)", "s", same,
            same_anchor, f"memory image {img >> 20} MiB; same pid every time", requested),
        Row("xresume", f"resume --wait → exec answered on the other node, {label} (memory restored)", "s", cross,
            ref, f"moved {sent / (1 << 20):.0f} MiB per move ({moves[-1]['delta']} disk delta + memory image, "
            f"node → server → node); same pid every time", requested),
        Row("xresume", f"of it: the move (server log), {label}", "s", [m["seconds"] for m in moves], None,
            f"{sent / (1 << 20) / statistics.median(m['seconds'] for m in moves):.0f} MiB/s", requested),
    ]


@figure("xresume", order=160, opt_in=True, needs_server=False)
def fig_xresume(ctx: Ctx) -> list[Row]:
    """``xresume``: see the module docstring; 128 MiB for ``repeats`` rounds, then 1 GiB for ``min(repeats, 3)``.
    Raises ``RuntimeError`` when the setup fails or a resume misses (wrong node, memory not restored, holder
    gone)."""
    import pytest

    rows: list[Row] = []
    try:
        with tempfile.TemporaryDirectory(prefix="sbx-bench-xr-") as tmp:
            try:
                with two_nodes(ctx, Path(tmp)) as (srv, nodes):
                    for label, mib, type, most in SETS:
                        runs = min(ctx.repeats, most) if most else ctx.repeats
                        rows += _working_set(ctx, srv, nodes, label, mib, type, runs)
            except Exception as e:
                raise RuntimeError(f"{e} (logs kept in {keep_logs(Path(tmp))})") from e
    except pytest.fail.Exception as e:  # tests.nodenet reports a node that did not start this way
        raise RuntimeError(str(e)) from None
    return rows


@figure("xresume-tls", order=161, opt_in=True, needs_server=False)
def fig_xresume_tls(ctx: Ctx) -> list[Row]:
    """``xresume-tls`` (issue 35): the 128 MiB set of :func:`fig_xresume` twice in one run, first with the node
    agents serving mutual TLS (the disk delta and memory image cross node → server → node inside TLS), then with
    new agents and a new server over plain HTTP. Rows as :func:`fig_xresume`'s, labelled by the link. Raises
    ``RuntimeError`` as it does."""
    import pytest

    label, mib, type, _most = SETS[0]
    rows: list[Row] = []
    try:
        for on in (True, False):
            link = "mutual TLS" if on else "plain HTTP"
            with tempfile.TemporaryDirectory(prefix="sbx-bench-xrtls-") as tmp:
                try:
                    with two_nodes(ctx, Path(tmp), tls=on) as (srv, nodes):
                        rows += _working_set(ctx, srv, nodes, f"{label}, {link}", mib, type, ctx.repeats)
                except Exception as e:
                    raise RuntimeError(f"{e} (logs kept in {keep_logs(Path(tmp))})") from e
    except pytest.fail.Exception as e:
        raise RuntimeError(str(e)) from None
    return rows


def keep_logs(tmp: Path) -> Path:
    """Copy the server's and the node agents' logs out of ``tmp`` (removed afterwards) to a new folder; its path."""
    kept = Path(tempfile.mkdtemp(prefix="sbx-bench-xr-logs-"))
    for log in [tmp / "server" / "server.log", *tmp.glob("node*/node-*.log")]:
        if log.is_file():
            shutil.copy(log, kept / f"{log.parent.name}-{log.name}")
    return kept
