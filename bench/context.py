"""What every figure works with: :class:`Ctx` (the server, an SDK client, the options) and the helpers the figure
modules share to make, wait for and delete sandboxes through the SDK or the real ``sbx`` command.

Each helper that makes a sandbox adds its id to the figure's tracked set (:func:`tracked`) and to ``Ctx.made``, so
a figure deletes everything it made, also when it fails or on Ctrl-C. Below :mod:`bench.registry` and every figure
module; it imports none of them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.server import BenchServer
from sbx.sdk import Client, Sandbox, SbxError

TTL = 1800  # seconds: long enough for any figure, short enough that a crashed run's sandboxes stop by themselves
EXEC_READY_TIMEOUT = 120.0  # seconds to wait for a resumed or new sandbox to answer a command


@dataclass
class Ctx:
    """What a figure needs: the ``server``, an SDK ``client`` on it, ``repeats`` (``--repeats``), the share of
    each disk ``disk_fill`` filled with data in the ``disk`` figure, ``say`` for progress lines, and the density
    figure's ``density_max`` sandboxes and ``density_idle`` seconds (``--density-max``, ``--density-idle``)."""

    server: BenchServer | None
    client: Client | None
    repeats: int
    disk_fill: float = 0.25
    say: Callable[[str], None] = lambda _m: None
    density_max: int = 300
    density_idle: float = 60.0
    made: set[str] = field(default_factory=set)

    @property
    def srv(self) -> BenchServer:
        """The server; raises ``RuntimeError`` when the figure runs without one."""
        if self.server is None:
            raise RuntimeError("this figure needs the benchmark server")
        return self.server

    @property
    def sdk(self) -> Client:
        """The SDK client on the server; raises ``RuntimeError`` when the figure runs without one."""
        if self.client is None:
            raise RuntimeError("this figure needs the benchmark server")
        return self.client


def since(t0: float) -> float:
    """Seconds since ``t0``, a :func:`time.perf_counter` value."""
    return time.perf_counter() - t0


def delete(ctx: Ctx, sid: str) -> None:
    """Delete sandbox ``sid`` and wait until it is gone; a sandbox already gone is fine, another error is only
    said (the run goes on)."""
    try:
        Sandbox({"id": sid, "state": "?"}, ctx.sdk).delete(wait=True)
    except SbxError as e:
        if e.code != "not_found":
            ctx.say(f"  could not delete {sid}: {e}")
    ctx.made.discard(sid)


@contextmanager
def tracked(ctx: Ctx) -> Iterator[set[str]]:
    """A set the figure adds sandbox ids to; every id still in it at the end is deleted (also on Ctrl-C)."""
    ids: set[str] = set()
    try:
        yield ids
    finally:
        for sid in sorted(ids):
            delete(ctx, sid)


def new(ctx: Ctx, ids: set[str], type: str, name: str) -> Sandbox:
    """SDK ``Sandbox.create`` of ``type`` named ``name`` (waits until it runs), tracked in ``ids``."""
    sb = Sandbox.create(type=type, name=name, ttl=TTL, client=ctx.sdk)
    ids.add(sb.id)
    ctx.made.add(sb.id)
    return sb


def check(ok: bool, what: str) -> None:
    """Raise ``RuntimeError(what)`` unless ``ok``: a figure's check failed."""
    if not ok:
        raise RuntimeError(what)


def wait_exec(sb: Sandbox, timeout: float = EXEC_READY_TIMEOUT) -> None:
    """Return once ``true`` runs in ``sb`` with exit 0; raises ``RuntimeError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            r = sb.exec("true", timeout=20)
            if r.exit_code == 0:
                return
            last = f"exit {r.exit_code}: {r.stderr.strip()}"
        except SbxError as e:
            last = str(e)
        time.sleep(0.05)
    raise RuntimeError(f"{sb.id} did not answer a command within {timeout:.0f} s ({last})")


def cli_new(ctx: Ctx, ids: set[str], type: str, name: str) -> str:
    """``sbx new --type TYPE --name NAME`` (returns once the sandbox runs), tracked in ``ids``; its id."""
    sid = ctx.srv.sbx("new", "--type", type, "--name", name, "--ttl", str(TTL)).stdout.strip()
    ids.add(sid)
    ctx.made.add(sid)
    return sid


def cli_info(ctx: Ctx, sid: str) -> dict:  # type: ignore[type-arg]
    """The sandbox object of ``sbx info SID --json``."""
    return json.loads(ctx.srv.sbx("info", sid, "--json").stdout)["sandbox"]  # type: ignore[no-any-return]


def cli_wait_exec(ctx: Ctx, sid: str, timeout: float = EXEC_READY_TIMEOUT) -> None:
    """Return once ``sbx exec SID true`` exits 0; raises ``RuntimeError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        r = ctx.srv.sbx("exec", sid, "true", check=False)
        if r.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"sbx exec {sid} true -> {r.returncode}: {r.stderr.strip()}")
        time.sleep(0.05)


def du(path: Path) -> int | None:
    """Bytes allocated under ``path`` (None when it is missing)."""
    if not path.exists():
        return None
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


HOLDER = """import os, sys, time
n = int(sys.argv[1]) << 20
buf = bytearray(n)
for i in range(0, n, 1 << 20):
    buf[i:i + (1 << 20)] = os.urandom(1 << 20)
with open(os.path.expanduser("~/bench-ws.ready"), "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(3600)
"""
"""A Python script that holds ``argv[1]`` MiB of touched random memory and writes its PID to ``~/bench-ws.ready``
once it does."""


def start_holder(sb: Sandbox, mib: int, label: str) -> str:
    """Start :data:`HOLDER` detached in ``sb`` holding ``mib`` MiB and wait until it is ready; its PID. Raises
    ``RuntimeError`` when it does not get ready within 300 s."""
    r = sb.exec(f"cat > ~/bench-ws.py <<'PYEOF'\n{HOLDER}PYEOF")
    check(r.exit_code == 0, f"writing the holder script: {r.stderr}")
    sb.exec_detached(f"python3 ~/bench-ws.py {mib}")
    deadline = time.monotonic() + 300
    pid = ""
    while not pid:
        check(time.monotonic() < deadline, f"the {label} holder did not get ready")
        pid = sb.exec("cat ~/bench-ws.ready 2>/dev/null").stdout.strip()
        if not pid:
            time.sleep(0.2)
    return pid
