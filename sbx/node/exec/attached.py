"""Attached execs through the sandbox's exec agent: :class:`ChannelMixin` (the host side of the protocol is
:mod:`sbx.node.exec.channel`; the agent is ``sbx/guest/files/usr/lib/sbx/sbx-agent``).

:meth:`ChannelMixin._channel_start` asks the agent to start a command and says whether ``runc exec`` must run it
instead; :meth:`ChannelMixin._channel_stream` turns the agent's frames into the same :class:`ExecEvent` stream
``runc exec`` gives (output, then one exit; 124 after a timeout). A stop calls :meth:`ChannelMixin._quiesce_channel`
before CRIU runs and :meth:`ChannelMixin._channel_resume` after.
"""

from __future__ import annotations

import json
import logging
import resource
import selectors
import socket
import time
from collections.abc import Callable, Iterator

from sbx.node.agentbase import NodeBase
from sbx.node.container import guestfs
from sbx.node.exec import channel
from sbx.node.types import ExecEvent, NodeError
from sbx.runtime.base import RuntimeError_
from sbx.runtime.runsc import AGENT_RELAY_PORT, AGENT_RELAY_TOKEN

START_TIMEOUT = 10.0
"""Seconds the exec agent has to say it started a command (or could not) before the node uses ``runc exec``."""
KILL_GRACE = 2.0
"""Seconds the exec agent has, after a timeout's kill request, to report the end before the node stops waiting."""

log = logging.getLogger("sbx.node")


class ChannelMixin(NodeBase):
    """The exec channel (part of :class:`sbx.node.agent.LocalNode`, through :class:`sbx.node.exec.jobs.ExecMixin`)."""

    def _channel_start(self, sid: str, argv: list[str], uid: int, gid: int, cwd: str,
                       env: list[str]) -> tuple[socket.socket, channel.Frames, list[tuple[bytes, bytes]]] | None:
        """Ask the sandbox's agent to start ``argv``; returns ``(socket, parser, frames after the start)`` once
        it said it started, or None when ``runc exec`` must run it instead (no agent, a stop is under way, the
        agent could not start it, or it misbehaved: then it is not asked again for
        :data:`channel.SUSPECT_SECONDS`)."""
        if sid in self._channel_quiet or self._channel_suspect.get(sid, 0.0) > time.monotonic():
            return None
        try:
            if self.runtime.gvisor(sid):  # its agent's socket is in gVisor's kernel: through the relay
                token = channel.relay_token(
                    lambda: guestfs.read_file(self._hostroot(sid), AGENT_RELAY_TOKEN.lstrip("/"), limit=128))
                sock = channel.connect_relay(self._lease(sid).address.split("/")[0], AGENT_RELAY_PORT, token)
            else:
                sock = channel.connect(self.runtime.state_root / sid / "state.json")
        except channel.Unavailable as e:
            if e.suspect:
                self._channel_suspect[sid] = time.monotonic() + channel.SUSPECT_SECONDS
                log.warning("exec agent of %s misbehaved, using runc exec: %s", sid, e)
            return None
        # runc exec gives the command the container's process env with the exec's own on top (later wins)
        merged: dict[str, str] = {}
        for item in [*self._container_env(sid), *env]:
            key, _, value = item.partition("=")
            merged[key] = value
        request = {"argv": argv, "uid": uid, "gid": gid, "cwd": cwd,
                   "env": [f"{k}={v}" for k, v in merged.items()],
                   "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}
        frames = channel.Frames()
        try:
            sock.sendall(channel.frame(b"R", json.dumps(request).encode()))
            sock.settimeout(START_TIMEOUT)
            got: list[tuple[bytes, bytes]] = []
            while not got:
                data = sock.recv(65536)
                if not data:
                    raise channel.ProtocolError("the agent closed the connection before starting the command")
                got = frames.feed(data)
            kind, payload = got[0]
            if kind == b"F":  # it could not start it (a missing cwd, say): runc exec reports that as it always did
                sock.close()
                return None
            if kind != b"S":
                raise channel.ProtocolError(f"the agent answered {kind!r} to a request")
        except (OSError, channel.ProtocolError) as e:
            sock.close()
            self._channel_suspect[sid] = time.monotonic() + channel.SUSPECT_SECONDS
            log.warning("exec agent of %s misbehaved, using runc exec: %s", sid, e)
            return None
        sock.setblocking(False)
        self._channel_socks.setdefault(sid, set()).add(sock)
        return sock, frames, got[1:]

    def _run_root(self, sid: str, argv: list[str], timeout: float = 60.0) -> bytes:
        """Run ``argv`` as root in ``/`` of sandbox ``sid`` with the container's env, wait at most ``timeout``
        seconds and return its stdout: through the exec agent when it answers (a few ms), else ``runc exec``
        (:meth:`sbx.runtime.runc.RuncRuntime.run`, ~20-35 ms here). Raises ``RuntimeError_`` on a non-zero exit
        (with its stderr) or when the command could not run."""
        started = self._channel_start(sid, argv, 0, 0, "/", []) if self.settings.exec_channel else None
        if started is None:
            return self.runtime.run(sid, argv, timeout=timeout)
        out: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        code = 124
        try:
            for ev in self._channel_stream(sid, *started, timeout, None):
                if ev.kind == "exit":
                    code = ev.exit_code if ev.exit_code is not None else 124
                elif ev.data:
                    out[ev.kind].append(ev.data)
        except NodeError as e:
            raise RuntimeError_("exec", f"{' '.join(argv)}: {e.message}") from e
        if code != 0:
            err = b"".join(out["stderr"]).decode(errors="replace").strip()[-1000:]
            raise RuntimeError_("exec", f"{' '.join(argv)} exited {code}: {err}")
        return b"".join(out["stdout"])

    def _container_env(self, sid: str) -> list[str]:
        """The container's process env from its bundle's ``config.json`` (what ``runc exec`` starts from), read
        again only when the file changed (a boot or restore writes it)."""
        path = self._bundle(sid) / "config.json"
        try:
            mtime = path.stat().st_mtime_ns
            cached = self._env_cache.get(sid)
            if cached is not None and cached[0] == mtime:
                return cached[1]
            env = [str(e) for e in json.loads(path.read_text())["process"]["env"]]
        except (OSError, ValueError, KeyError, TypeError):
            return []
        self._env_cache[sid] = (mtime, env)
        return env

    def _channel_stream(self, sid: str, sock: socket.socket, frames: channel.Frames,
                        pending: list[tuple[bytes, bytes]], timeout: float | None,
                        stop: Callable[[], bool] | None) -> Iterator[ExecEvent]:
        """The events of a command the agent started on ``sock`` (as :meth:`_stream` gives them for runc exec).
        A timeout asks the agent to kill the command's process group and waits :data:`KILL_GRACE` for the end;
        the caller going away, a shutdown or an error closes the connection, which makes the agent kill it."""
        deadline = None if timeout is None else time.monotonic() + min(max(timeout, 0.0), 1e6)
        timed_out = False
        code: int | None = None
        sel = selectors.DefaultSelector()
        sel.register(sock, selectors.EVENT_READ)
        try:
            while code is None:
                for kind, payload in pending:
                    if kind in (b"o", b"e"):
                        if payload:
                            yield ExecEvent(kind="stdout" if kind == b"o" else "stderr", data=payload)
                    elif kind == b"x":
                        code = channel.exit_code(payload)
                        break
                    else:
                        raise channel.ProtocolError(f"unexpected {kind!r} from the agent")
                pending = []
                if code is not None:
                    break
                if self._shutdown_at is not None and time.monotonic() >= self._shutdown_at:
                    raise NodeError("server_shutdown", "the server is shutting down; the command was ended")
                if deadline is not None and time.monotonic() >= deadline:
                    if timed_out:  # the agent did not report the end in time: don't rely on it for a while
                        self._channel_suspect[sid] = time.monotonic() + channel.SUSPECT_SECONDS
                        log.warning("exec agent of %s did not end a timed-out command", sid)
                        break
                    sock.setblocking(True)
                    sock.settimeout(1.0)
                    sock.sendall(channel.frame(b"K"))
                    sock.setblocking(False)
                    timed_out, deadline = True, time.monotonic() + KILL_GRACE
                if stop is not None and stop():
                    return
                wait = 0.5 if deadline is None else max(0.0, min(deadline - time.monotonic(), 0.5))
                ready = sel.select(wait)
                if not ready and self.runtime.gvisor(sid) and self.runtime.state(sid) != "running":
                    # its kernel ended (the memory cgroup killed it whole): the relay's connection hangs, not closes
                    code = 137
                    break
                if ready:
                    try:
                        data = sock.recv(1 << 20)
                    except BlockingIOError:
                        continue
                    if not data:
                        if timed_out:
                            break
                        if sid in self._channel_quiet:
                            raise NodeError(*self._channel_why.get(
                                sid, ("not_running", f"sandbox {sid} was stopped while the command ran")))
                        raise NodeError("exec_failed", "the sandbox's exec agent went away before the command ended")
                    pending = frames.feed(data)
        except channel.ProtocolError as e:
            self._channel_suspect[sid] = time.monotonic() + channel.SUSPECT_SECONDS
            log.warning("exec agent of %s misbehaved: %s", sid, e)
            raise NodeError("exec_failed", f"the sandbox's exec agent misbehaved: {e}") from e
        except OSError as e:
            raise NodeError("exec_failed", f"the exec channel failed: {e}") from e
        finally:
            sel.close()
            self._channel_socks.get(sid, set()).discard(sock)
            sock.close()
        if timed_out:
            yield ExecEvent(kind="exit", exit_code=124, timed_out=True)
        else:
            yield ExecEvent(kind="exit", exit_code=code if code is not None else 124)

    def _quiesce_channel(self, sid: str, wait: float = 3.0, why: tuple[str, str] | None = None) -> None:
        """Before a checkpoint: no new command goes through the agent, and every open connection to it is shut
        (the agent kills those commands and closes its side; CRIU can't dump a connection to the host). Waits up
        to ``wait`` seconds for their streams to end. The streams of those commands end with
        ``NodeError(*why)`` (default: ``not_running``, "stopped while the command ran"). Undo with
        :meth:`_channel_resume`."""
        if why is not None:
            self._channel_why[sid] = why
        self._channel_quiet.add(sid)
        for sock in list(self._channel_socks.get(sid, ())):
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while self._channel_socks.get(sid) and time.monotonic() < deadline:
            time.sleep(0.02)

    def _channel_resume(self, sid: str) -> None:
        self._channel_quiet.discard(sid)
        self._channel_why.pop(sid, None)
        self._channel_suspect.pop(sid, None)
