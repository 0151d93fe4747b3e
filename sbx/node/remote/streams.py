"""The node API's two streams (:mod:`sbx.node.remote.server`): an attached exec's events as NDJSON lines
(:func:`exec_lines`) and a spawned process's pipes or pty relayed over a WebSocket (:func:`relay_process`; the
frames are :mod:`sbx.node.remote.spawned`'s).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import threading
import tty
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect

from sbx.node.exec.terminal import set_winsize
from sbx.node.host.tools import hang_up
from sbx.node.remote import wire
from sbx.node.remote.spawned import OUT_STDERR, OUT_STDOUT
from sbx.node.types import ExecEvent, NodeError

log = logging.getLogger("sbx.node.remote")

KEEPALIVE = 0.4
"""Seconds between ``{}`` lines while an exec is silent (the caller polls its ``stop`` on each line)."""


async def exec_lines(events: Iterator[ExecEvent], left: threading.Event) -> AsyncIterator[str]:
    """NDJSON lines of ``events`` read in a thread, with ``{}`` every :data:`KEEPALIVE` seconds of silence. When
    the response ends early (the caller went away) ``left`` is set: the node's exec sees its ``stop`` and kills
    the command."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def put(item: tuple[str, Any]) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the server's loop closed (shutdown): nobody listens, so the command is stopped
            left.set()

    def produce() -> None:
        try:
            for ev in events:
                put(("event", ev))
            put(("end", None))
        except NodeError as e:
            put(("error", e))
        except Exception as e:  # a bug on the node: say so in the stream, not as a cut connection
            log.exception("exec stream failed")
            put(("error", NodeError("exec_failed", str(e))))

    threading.Thread(target=produce, name="node-exec", daemon=True).start()
    try:
        while True:
            try:
                kind, item = await asyncio.wait_for(queue.get(), KEEPALIVE)
            except TimeoutError:
                yield "{}\n"
                continue
            if kind == "end":
                return
            if kind == "error":
                yield json.dumps({"error": {"code": item.code, "message": item.message}}) + "\n"
                return
            yield json.dumps(wire.encode(item), separators=(",", ":")) + "\n"
    finally:
        left.set()


async def relay_process(ws: WebSocket, proc: subprocess.Popen[bytes]) -> None:
    """Relay between the WebSocket and a spawned process until it has exited (then ``{"type": "exit"}``) or the
    caller went away (then the process is hung up: SIGHUP, SIGKILL after 5 s)."""
    master: int | None = getattr(proc, "pty_master", None)
    outs: list[tuple[int, int]] = []
    if master is not None:
        with contextlib.suppress(OSError):
            tty.setraw(master)
        outs.append((master, OUT_STDOUT))
    else:
        for f, channel in ((proc.stdout, OUT_STDOUT), (proc.stderr, OUT_STDERR)):
            if f is not None:
                outs.append((f.fileno(), channel))
    send_lock = asyncio.Lock()

    async def pump(fd: int, channel: int) -> None:
        while True:
            try:
                chunk = await asyncio.to_thread(os.read, fd, 65536)
            except OSError:  # EIO: the pty's other side is gone
                chunk = b""
            if not chunk:
                return
            async with send_lock:
                await ws.send_bytes(bytes([channel]) + chunk)

    async def feed() -> None:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                raise WebSocketDisconnect()
            if msg.get("bytes") is not None:
                data: bytes = msg["bytes"]
                if master is not None:
                    await asyncio.to_thread(_write_all, master, data)
                elif proc.stdin is not None:
                    await asyncio.to_thread(_write_file, proc.stdin, data)
                continue
            ctl = json.loads(msg.get("text") or "{}")
            if ctl.get("type") == "eof" and proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            elif ctl.get("type") == "resize" and master is not None:
                with contextlib.suppress(OSError, ValueError):
                    set_winsize(master, int(ctl["cols"]), int(ctl["rows"]))
            elif ctl.get("type") == "signal" and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    proc.send_signal(int(ctl["signal"]))

    feeder = asyncio.create_task(feed())
    try:
        async def pumps() -> None:
            await asyncio.gather(*(pump(fd, ch) for fd, ch in outs))

        waiting = asyncio.create_task(pumps())
        await asyncio.wait({waiting, feeder}, return_when=asyncio.FIRST_COMPLETED)
        if waiting.done():
            code = await asyncio.to_thread(proc.wait)
            async with send_lock:
                await ws.send_text(json.dumps({"type": "exit", "code": code}))
            with contextlib.suppress(Exception):
                await ws.close()
        else:
            waiting.cancel()
    finally:
        feeder.cancel()
        await asyncio.to_thread(hang_up, proc)
        if master is not None:
            with contextlib.suppress(OSError):
                os.close(master)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_file(f: Any, data: bytes) -> None:
    try:
        f.write(data)
        f.flush()
    except (OSError, ValueError):  # the process closed its stdin: what it did not read is dropped, as with a pipe
        pass


