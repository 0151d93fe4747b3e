"""The live-migration figure (``python -m bench --only migrate``; issue 11).

Two node agents (``sbx node serve``) run in network namespaces of their own, as in the several-node tests
(:mod:`tests.nodenet`, nodes 4 and 5 of the run's slot, so it needs the dev install). One ``default`` sandbox on
the first holds 128 MiB of random bytes in a Python process; it is moved back and forth ``repeats`` times with
:func:`sbx.node.migration.migrate`, driven through the node API as a control plane would. Per move:

- trigger → usable: from the call until an exec on the destination answered;
- pause: from the source's freeze (cgroup pause) to the destination running it (its confirmation);
- the process's PID and the SHA-256 of its memory are checked after every move (a move that changes them fails
  the figure).

The anchor is Sandbox0's drain trigger → usable destination, 3.40–3.64 s (median 3.52 s, six moves at 128 MiB).
"""

from __future__ import annotations

import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.report import Anchor, Row

if TYPE_CHECKING:
    from bench.figures import Ctx

ANCHOR = Anchor(3.52, "3.52 s", "Sandbox0: drain trigger → usable destination, 128 MiB (3.40–3.64 s, n=6)")

HOLDER = r"""
import hashlib, os, signal, time
data = bytearray(os.urandom(128 << 20))
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


def fig_migrate(ctx: Ctx) -> list[Row]:
    """``migrate``: see the module docstring. Rows: trigger → exec answered on the destination (s, against the
    anchor), the pause (s), and the freeze → everything sent and the destination's restore (s) as notes. Raises
    ``RuntimeError`` when a move fails or loses the process or its memory."""
    from sbx.config import TEST_SIZES
    from sbx.node.migration import migrate
    from sbx.node.remote.client import RemoteNode
    from sbx.node.types import SandboxSpec
    from tests.nodenet import node_netns_many

    def sh(node: RemoteNode, sid: str, command: str) -> str:
        out, code = b"", None
        for ev in node.exec(sid, command, user="root", timeout=120):
            if ev.kind == "stdout":
                out += ev.data
            elif ev.kind == "exit":
                code = ev.exit_code
        if code != 0:
            raise RuntimeError(f"{command!r} exited {code}")
        return out.decode()

    def check(node: RemoteNode, sid: str) -> str:
        sh(node, sid, "rm -f /root/mig.check; kill -USR1 $(cat /root/mig.pid)")
        deadline = time.monotonic() + 60
        while not (got := sh(node, sid, "cat /root/mig.check 2>/dev/null || true").strip()):
            if time.monotonic() > deadline:
                raise RuntimeError("the holder did not report")
            time.sleep(0.2)
        return got

    totals, pauses, dumps, sent, restores = [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="sbx-bench-mig-") as tmp, \
            node_netns_many([4, 5], Path(tmp)) as (a, b):
        a.start()
        b.start()
        hosts = [(RemoteNode(a.url, a.token), a.url), (RemoteNode(b.url, b.token), b.url)]
        spec = SandboxSpec(id="sb_" + secrets.token_hex(5), hostname="bench-mig", size=TEST_SIZES["default"])
        src = hosts[0][0]
        src.create(spec)
        try:
            src.exec_detached(spec.id, f"cat > /root/mig.py <<'EOF'\n{HOLDER}\nEOF\nexec python3 /root/mig.py",
                              user="root")
            deadline = time.monotonic() + 120
            while not sh(src, spec.id, "cat /root/mig.check 2>/dev/null || true").strip():
                if time.monotonic() > deadline:
                    raise RuntimeError("the 128 MiB holder did not start")
                time.sleep(0.3)
            before = check(src, spec.id)
            ctx.say(f"  128 MiB held by pid {before.split()[0]} in {spec.id}")
            for i in range(ctx.repeats):
                (src, _), (dst, dst_url) = hosts[i % 2], hosts[(i + 1) % 2]
                t0 = time.perf_counter()
                figures = migrate(src, dst, dst_url, spec)
                sh(dst, spec.id, "true")
                totals.append(time.perf_counter() - t0)
                pauses.append(float(figures["pauseS"]))
                dumps.append(float(figures["dumpS"]))
                sent.append(float(figures["freezeToSentS"]))
                restores.append(float(figures["restoreS"]))
                if check(dst, spec.id) != before:
                    raise RuntimeError(f"move {i + 1} changed the process or its memory")
                ctx.say(f"  move {i + 1}: {totals[-1]:.2f} s, paused {pauses[-1]:.2f} s, memory "
                        f"{figures['memoryBytes'] >> 20} MiB, disk deltas {figures['baseBytes'] >> 20}+"
                        f"{figures['finalBytes'] >> 20} MiB")
        finally:
            for node, _url in hosts:
                try:
                    node.delete(spec.id)
                except Exception as e:  # a node that is down: its folder goes with the namespace's cleanup
                    ctx.say(f"  delete on {node.url}: {e}")
        a.stop()
        b.stop()
    note = (f"of the pause: freeze → dump made {statistics.median(dumps):.2f} s, → sent "
            f"{statistics.median(sent):.2f} s, destination restore "
            f"{statistics.median(restores):.2f} s (medians); same pid and memory SHA-256 after every move")
    return [
        Row("migrate", "live migration trigger → exec answered on the destination, 128 MiB", "s", totals, ANCHOR,
            "two node agents in network namespaces, data node to node"),
        Row("migrate", "pause of a live migration (source frozen → destination running), 128 MiB", "s", pauses,
            None, note),
    ]
