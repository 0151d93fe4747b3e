"""The live-migration figure (``python -m bench --only migrate``; issue 11).

Two node agents (``sbx node serve``) run in network namespaces of their own, as in the several-node tests
(:mod:`tests.nodenet`, nodes 4 and 5 of the run's slot, so it needs the dev install). Per working set (:data:`SETS`:
128 MiB in a ``default`` sandbox, then 1 GiB in an ``xlarge`` one, whose 2 GiB limit leaves room for systemd and
the image's page cache) a Python process in one sandbox on the first node holds that much random bytes; the sandbox
is moved back and forth with :func:`sbx.node.migration.live.migrate`, driven through the node API as a control plane
would (``sbx node drain`` calls the same function per sandbox). Each set makes ``repeats`` moves rounded up to an
even number, so the sandbox ends where it started: six with the default ``--repeats 5``, as the anchor's n=6; the
1 GiB set is not capped (a move takes 2–5 s end to end here; the whole figure about 90 s). Per move:

- trigger → usable: from the call until an exec on the destination answered;
- pause: from the source's freeze (cgroup pause) to the destination running it (its confirmation);
- the process's PID and the SHA-256 of its memory are checked after every move (a move that changes them fails
  the figure).

The anchor is Sandbox0's drain trigger → usable destination, 3.40–3.64 s (median 3.52 s, six moves at 128 MiB);
it has no 1 GiB figure, so that set's rows have none. Each row's note gives the 1-minute load average before the
set began and after it ended (``/proc/loadavg``): the host may be shared.
"""

from __future__ import annotations

import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.registry import figure
from bench.report import Anchor, Row

if TYPE_CHECKING:
    from bench.context import Ctx
    from sbx.node.remote.client import RemoteNode

ANCHOR = Anchor(3.52, "3.52 s", "Sandbox0: drain trigger → usable destination, 128 MiB (3.40–3.64 s, n=6)")
SETS = (("128 MiB", 128, "default"), ("1 GiB", 1024, "xlarge"))
"""(label, MiB held, test size) per working set."""

HOLDER = r"""
import hashlib, os, signal, sys, time
n = int(sys.argv[1]) << 20
data = bytearray(n)
for i in range(0, n, 1 << 20):
    data[i:i + (1 << 20)] = os.urandom(1 << 20)
def report(*_a):
    with open('/root/mig.tmp', 'w') as out:
        out.write(f"{os.getpid()} {hashlib.sha256(data).hexdigest()}\n")
    os.replace('/root/mig.tmp', '/root/mig.check')
signal.signal(signal.SIGUSR1, report)
open('/root/mig.pid', 'w').write(f"{os.getpid()}\n")
report()
while True:
    time.sleep(1)
"""


def moves(repeats: int) -> int:
    """Moves per working set for ``--repeats``: rounded up to an even number (back and forth)."""
    return repeats + repeats % 2


def loadavg() -> float:
    """The host's 1-minute load average (``/proc/loadavg``)."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def _sh(node: RemoteNode, sid: str, command: str) -> str:
    """Run ``command`` as root in ``sid`` on ``node``; its stdout. Raises ``RuntimeError`` on a non-zero exit."""
    from tests.nodenet import exec_out

    code, out = exec_out(node, sid, command)
    if code != 0:
        raise RuntimeError(f"{command!r} exited {code}")
    return out


def _report(node: RemoteNode, sid: str, timeout: float = 120) -> str:
    """Ask the holder for ``"PID SHA256"`` of its memory (SIGUSR1) and wait for its answer. Raises
    ``RuntimeError`` when it does not answer within ``timeout`` seconds."""
    _sh(node, sid, "rm -f /root/mig.check; kill -USR1 $(cat /root/mig.pid)")
    deadline = time.monotonic() + timeout
    while not (got := _sh(node, sid, "cat /root/mig.check 2>/dev/null || true").strip()):
        if time.monotonic() > deadline:
            raise RuntimeError("the holder did not report")
        time.sleep(0.2)
    return got


def _working_set(ctx: Ctx, hosts: list[tuple[RemoteNode, str]], label: str, mib: int, size: str) -> list[Row]:
    """The moves of one working set (module docstring); rows: trigger → exec answered, the pause. Raises
    ``RuntimeError`` when a move fails or loses the process or its memory."""
    from sbx.config import TEST_SIZES
    from sbx.node.migration.live import migrate
    from sbx.node.types import SandboxSpec

    totals: list[float] = []
    pauses: list[float] = []
    dumps: list[float] = []
    sent: list[float] = []
    restores: list[float] = []
    images: list[int] = []
    load0 = loadavg()
    spec = SandboxSpec(id="sb_" + secrets.token_hex(5), hostname=f"bench-mig-{mib}", size=TEST_SIZES[size])
    src = hosts[0][0]
    src.create(spec)
    try:
        src.exec_detached(spec.id, f"cat > /root/mig.py <<'EOF'\n{HOLDER}\nEOF\nexec python3 /root/mig.py {mib}",
                          user="root")
        deadline = time.monotonic() + 300
        while not _sh(src, spec.id, "cat /root/mig.check 2>/dev/null || true").strip():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {label} holder did not start")
            time.sleep(0.3)
        before = _report(src, spec.id)
        ctx.say(f"  {label} held by pid {before.split()[0]} in a {size} sandbox {spec.id} (load {load0:.2f})")
        for i in range(moves(ctx.repeats)):
            (src, _), (dst, dst_url) = hosts[i % 2], hosts[(i + 1) % 2]
            t0 = time.perf_counter()
            figures = migrate(src, dst, dst_url, spec)
            _sh(dst, spec.id, "true")
            totals.append(time.perf_counter() - t0)
            pauses.append(float(figures["pauseS"]))
            dumps.append(float(figures["dumpS"]))
            sent.append(float(figures["freezeToSentS"]))
            restores.append(float(figures["restoreS"]))
            images.append(int(figures["memoryBytes"]))
            if _report(dst, spec.id) != before:
                raise RuntimeError(f"{label}, move {i + 1} changed the process or its memory")
            ctx.say(f"  {label} move {i + 1}: {totals[-1]:.2f} s, paused {pauses[-1]:.2f} s (at disk delta "
                    f"{figures['finalDiskS']:.2f}, dump {dumps[-1]:.2f}, sent {sent[-1]:.2f}, restored "
                    f"{figures['restoredS']:.2f}: disk "
                    f"{figures['diskS']:.2f} + restore {restores[-1]:.2f}), memory "
                    f"{figures['memoryBytes'] >> 20} MiB, disk deltas {figures['baseBytes'] >> 20}+"
                    f"{figures['finalBytes'] >> 20} MiB, load {loadavg():.2f}")
    finally:
        for node, _url in hosts:
            try:
                node.delete(spec.id)
            except Exception as e:  # a node that is down: its folder goes with the namespace's cleanup
                ctx.say(f"  delete on {node.url}: {e}")
    load = f"load average {load0:.2f} before, {loadavg():.2f} after"
    note = (f"of the pause: freeze → dump made {statistics.median(dumps):.2f} s, → sent "
            f"{statistics.median(sent):.2f} s, destination restore {statistics.median(restores):.2f} s (medians); "
            f"memory image {statistics.median(images) / (1 << 20):.0f} MiB; same pid and memory SHA-256 after "
            f"every move; {load}")
    return [
        Row("migrate", f"live migration trigger → exec answered on the destination, {label}", "s", totals,
            ANCHOR if mib == 128 else None, f"two node agents in network namespaces, data node to node; {load}"),
        Row("migrate", f"pause of a live migration (source frozen → destination running), {label}", "s", pauses,
            None, note),
    ]


@figure("migrate", order=130, opt_in=True, needs_server=False)
def fig_migrate(ctx: Ctx) -> list[Row]:
    """``migrate``: see the module docstring. Rows per working set of :data:`SETS`: trigger → exec answered on the
    destination (s, against the anchor at 128 MiB), the pause (s; its note: the medians of freeze → dump made,
    → everything sent and the destination's restore, the memory image, the load). Raises ``RuntimeError`` when a
    move fails or loses the process or its memory."""
    from sbx import tls
    from sbx.node.remote.client import RemoteNode
    from tests.nodenet import node_netns_many, run_ca

    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="sbx-bench-mig-") as tmp, \
            node_netns_many([4, 5], Path(tmp)) as (a, b):
        a.start()
        b.start()
        ident = tls.identity(run_ca())  # the nodes serve mutual TLS (tests.nodenet's default)
        hosts = [(RemoteNode(a.url, a.token, identity=ident), a.url), (RemoteNode(b.url, b.token, identity=ident),
                                                                        b.url)]
        for label, mib, size in SETS:
            rows += _working_set(ctx, hosts, label, mib, size)
        a.stop()
        b.stop()
    return rows


@figure("migrate-tls", order=131, opt_in=True, needs_server=False)
def fig_migrate_tls(ctx: Ctx) -> list[Row]:
    """``migrate-tls`` (issue 35): the 128 MiB set of :func:`fig_migrate` twice in one run, the node agents serving
    mutual TLS (every call, the transfer and CRIU's page stream inside TLS: :mod:`sbx.tls`), then the same agents
    restarted without certificates (plain HTTP and raw TCP pages). Rows as :func:`fig_migrate`'s, labelled by
    the link. Raises ``RuntimeError`` when a move fails or loses the process or its memory."""
    from sbx import tls
    from sbx.node.remote.client import RemoteNode
    from tests.nodenet import node_netns_many, run_ca

    label, mib, size = SETS[0]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="sbx-bench-migtls-") as tmp, \
            node_netns_many([4, 5], Path(tmp)) as (a, b):
        for on in (True, False):
            for n in (a, b):
                n.tls = on
                if not on:
                    shutil.rmtree(n.tls_dir, ignore_errors=True)
                n.start()
            ident = tls.identity(run_ca()) if on else None
            hosts = [(RemoteNode(n.url, n.token, identity=ident), n.url) for n in (a, b)]
            link = "mutual TLS" if on else "plain HTTP/TCP"
            ctx.say(f"  nodes over {link}")
            rows += _working_set(ctx, hosts, f"{label}, {link}", mib, size)
            for node, _url in hosts:
                node.close()
            a.stop()
            b.stop()
    return rows
