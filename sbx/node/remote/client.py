""":class:`RemoteNode`: a :class:`sbx.node.types.NodeAgent` whose calls go to a node agent process
(``sbx node serve``) over HTTP, so the control plane uses a node on another machine exactly as the embedded one.

Adding a NodeAgent method: put its name in :data:`sbx.node.remote.wire.CALLS` (the node serves it) and add a
method here that returns ``self._call("<name>", <its arguments>)``; the arguments and result cross the wire as
JSON with the dataclasses of :mod:`sbx.node.types` by name (:func:`sbx.node.remote.wire.encode`).

Transport: an ``https://`` node is reached with mutual TLS (:mod:`sbx.tls`): this process's certificate from its
TLS folder (``Settings.tls_dir``), the node's checked against the installation CA and its URL's host; the node
token still goes along on every request. With a TLS folder, a plain ``http://`` node is refused unless it is on
loopback (``node_tls_required``); without one, an ``https://`` node is (``node_tls_missing``).

Errors: what the node raises comes back as the same :class:`NodeError` (code and message); a node that cannot
be reached (refused, reset, timed out, a 5xx) is ``NodeError("node_unreachable")``; a wrong token is
``NodeError("node_unauthorized")``.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from sbx import logs, tls
from sbx.config import Settings
from sbx.node.remote import imagelink, wire
from sbx.node.remote.egresslink import EgressClient
from sbx.node.remote.spawned import RemoteProcess
from sbx.node.types import (
    ExecEvent,
    JobInfo,
    NodeError,
    NodeInfo,
    NodeStatus,
    ResumeResult,
    SandboxSpec,
    SnapshotInfo,
    Stats,
    StopResult,
)

log = logging.getLogger("sbx.node.remote")

CONNECT_TIMEOUT = 5.0
"""Seconds to open a connection to the node before the call fails with ``node_unreachable``."""


class RemoteNode(EgressClient):
    """The node at ``url`` (``http://10.0.0.2:7700``), authenticated with ``token`` (its node token); its egress
    proxy's calls are :class:`sbx.node.remote.egresslink.EgressClient`'s.

    Calls block like the embedded node's; several threads may call at once (one connection pool)."""

    def __init__(self, url: str, token: str, settings: Settings | None = None, identity: tls.Identity | None = None):
        """``identity``: the TLS files to reach an ``https://`` node with; default: those of ``settings.tls_dir``
        (:func:`sbx.tls.identity`). Raises ``NodeError`` (``node_tls_required``, ``node_tls_missing``; see the
        module docstring), ``httpx.InvalidURL``."""
        self.url = url.rstrip("/")
        self.settings = settings
        if identity is None and settings is not None:
            identity = tls.identity(settings.tls_dir)
        self._ssl = _client_ssl(self.url, identity)
        self._headers = {"Authorization": f"Bearer {token}"}
        self._http = httpx.Client(base_url=self.url, headers=self._headers, verify=self._ssl or True,
                                  timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT),
                                  limits=httpx.Limits(max_connections=200, max_keepalive_connections=20),
                                  event_hooks={"request": [_pass_ids]})
        self._shutdown_at: float | None = None
        self._relay: tuple[str, int] | None = None
        self._watching = threading.Event()
        self._watcher: threading.Thread | None = None

    # --- the transport -------------------------------------------------------------------------------------------
    def _unreachable(self, e: Exception) -> NodeError:
        return NodeError("node_unreachable", f"the node at {self.url} cannot be reached ({type(e).__name__}: {e})")

    def _check(self, resp: httpx.Response) -> None:
        if resp.status_code < 400:
            return
        try:
            err = resp.json()["error"]
            code, message = str(err["code"]), str(err["message"])
        except (ValueError, KeyError, TypeError):
            code, message = "node_unreachable", f"the node at {self.url} answered {resp.status_code}"
        if resp.status_code == 401:
            code = "node_unauthorized"
        elif resp.status_code >= 500:
            code = "node_unreachable"
        raise NodeError(code, message)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on the node with JSON-encoded arguments; the decoded result."""
        body = {"args": wire.encode(list(args)), "kwargs": wire.encode(kwargs)}
        try:
            resp = self._http.post(f"/v1/node/call/{method}", json=body)
        except httpx.HTTPError as e:
            raise self._unreachable(e) from None
        self._check(resp)
        return wire.decode(resp.json()["result"])

    # --- host-side steps the server runs around the control plane ------------------------------------------------
    def prepare(self, progress: Callable[[str], None] | None = None, wait: float = 60.0) -> None:
        """Wait up to ``wait`` seconds until the node answers its health check with this token (the node
        prepares its own host). Raises ``node_unreachable`` or ``node_unauthorized``."""
        if progress:
            progress(f"node at {self.url}")
        deadline = time.monotonic() + wait
        while True:
            try:
                resp = self._http.get("/v1/node/health", timeout=CONNECT_TIMEOUT)
                self._check(resp)
                return
            except httpx.HTTPError as e:
                if time.monotonic() > deadline:
                    raise self._unreachable(e) from None
            except NodeError as e:
                if e.code != "node_unreachable" or time.monotonic() > deadline:
                    raise
            time.sleep(0.5)

    def begin_shutdown(self, grace: float) -> None:
        """The server is going away: attached execs through this client end with ``server_shutdown`` after
        ``grace`` seconds (their commands are killed on the node when the stream closes)."""
        self._shutdown_at = time.monotonic() + grace

    def cleanup_host(self) -> bool:
        """Nothing of this host belongs to a remote node: False."""
        return False

    def close(self) -> None:
        """Close the connection pool (the router drops a removed node)."""
        self.unwatch()
        self.close_egress()
        self._http.close()

    def relay_target(self) -> tuple[str, int, str, ssl.SSLContext | None]:
        """``(host, port, token, tls)`` of the node's port relay (:mod:`sbx.node.remote.relay`; ``tls``: the
        client context when the node is reached over TLS, its relay is then TLS too), asked once. Raises
        ``NodeError`` (``node_unreachable``; ``relay_unavailable`` when the node runs none)."""
        if self._relay is None:
            try:
                resp = self._http.get("/v1/node/relay", timeout=CONNECT_TIMEOUT)
            except httpx.HTTPError as e:
                raise self._unreachable(e) from None
            self._check(resp)
            port = int(resp.json().get("port", 0))
            if not port:
                raise NodeError("relay_unavailable", f"the node at {self.url} runs no port relay")
            self._relay = (httpx.URL(self.url).host, port)
        return (*self._relay, self._headers["Authorization"].split(" ", 1)[1], self._ssl)

    # --- a stopped sandbox moving between nodes (sbx.node.migration.transfer) ------------------------------------
    def transfer_parent(self) -> dict[str, str]:
        return self._call("transfer_parent")  # type: ignore[no-any-return]

    def export_stopped(self, id: str, parent: dict[str, str] | None = None, kind: str = "move") -> dict[str, Any]:
        return self._call("export_stopped", id, parent, kind)  # type: ignore[no-any-return]

    def export_snapshot(self, id: str, snapshot: str, parent: dict[str, str] | None = None) -> dict[str, Any]:
        return self._call("export_snapshot", id, snapshot, parent)  # type: ignore[no-any-return]

    def end_export(self, id: str, kind: str = "move") -> None:
        self._call("end_export", id, kind)

    def begin_import(self, manifest: dict[str, Any]) -> None:
        self._call("begin_import", manifest)

    def abort_import(self, id: str) -> None:
        self._call("abort_import", id)

    def commit_import(self, id: str) -> None:
        self._call("commit_import", id)

    def export_file(self, id: str, name: str, kind: str = "move") -> Iterator[bytes]:
        """File ``name`` of the export of ``id`` for ``kind``, streamed from the node in pieces (never whole in
        memory)."""
        try:
            resp = self._http.send(self._http.build_request("GET", f"/v1/node/transfer/{id}/{name}",
                                                            params={"kind": kind}), stream=True)
        except httpx.HTTPError as e:
            raise self._unreachable(e) from None
        if resp.status_code >= 400:
            resp.read()
            resp.close()
            self._check(resp)

        def pieces() -> Iterator[bytes]:
            try:
                yield from resp.iter_bytes(1 << 20)
            except httpx.HTTPError as e:
                raise self._unreachable(e) from None
            finally:
                resp.close()

        return pieces()

    def import_stream(self, id: str, name: str, chunks: Iterator[bytes]) -> None:
        """Stream ``chunks`` into file ``name`` of the import of ``id`` on the node (it checks the hash)."""
        self._put_stream(f"/v1/node/transfer/{id}/{name}", chunks)

    def _put_stream(self, path: str, chunks: Iterator[bytes]) -> None:
        try:
            resp = self._http.put(path, content=chunks)
        except httpx.HTTPError as e:
            raise self._unreachable(e) from None
        self._check(resp)

    # --- seal replicas (sbx.node.migration.replicas) -------------------------------------------------------------
    def begin_replica(self, manifest: dict[str, Any]) -> None:
        self._call("begin_replica", manifest)

    def replica_stream(self, id: str, name: str, chunks: Iterator[bytes]) -> None:
        """Stream ``chunks`` into file ``name`` of the replica of ``id`` being made on the node (hash-checked)."""
        self._put_stream(f"/v1/node/replica/{id}/{name}", chunks)

    def seal_replica(self, id: str) -> dict[str, Any]:
        return self._call("seal_replica", id)  # type: ignore[no-any-return]

    def drop_replica(self, id: str) -> None:
        self._call("drop_replica", id)

    def replicas(self) -> dict[str, dict[str, Any]]:
        return self._call("replicas")  # type: ignore[no-any-return]

    def promote_replica(self, id: str) -> dict[str, Any]:
        return self._call("promote_replica", id)  # type: ignore[no-any-return]

    # --- NodeAgent -----------------------------------------------------------------------------------------------
    def build_image(self, dockerfile: Path, context: Path, progress: Callable[[str], None] | None = None,
                    bases: dict[str, str] | None = None) -> Any:
        return imagelink.call_build(self._http, dockerfile, context, progress, bases)

    def import_image(self, archive: Path, progress: Callable[[str], None] | None = None) -> Any:
        return imagelink.call_import(self._http, archive, progress)

    def delete_image(self, key: str) -> None:
        self._call("delete_image", key)

    def pool_take(self, size: str) -> str | None:
        return self._call("pool_take", size)  # type: ignore[no-any-return]

    def create(self, spec: SandboxSpec, from_snapshot: str | None = None, cold: bool = False) -> str:
        return self._call("create", spec, from_snapshot=from_snapshot, cold=cold)  # type: ignore[no-any-return]

    def exec_detached(self, id: str, command: str, *, user: str = "user", env: dict[str, str] | None = None,
                      cwd: str | None = None, timeout: float | None = None, stdin: str | None = None) -> JobInfo:
        return self._call("exec_detached", id, command, user=user, env=env, cwd=cwd,  # type: ignore[no-any-return]
                          timeout=timeout, stdin=stdin)

    def kill_job(self, id: str, job: str) -> None:
        return self._call("kill_job", id, job)  # type: ignore[no-any-return]

    def jobs(self, id: str) -> list[JobInfo]:
        return self._call("jobs", id)  # type: ignore[no-any-return]

    def job_output(self, id: str, job: str, stream: str, offset: int = 0) -> bytes:
        return self._call("job_output", id, job, stream, offset)  # type: ignore[no-any-return]

    def stop(self, id: str, keep_memory: bool = True) -> StopResult:
        return self._call("stop", id, keep_memory=keep_memory)  # type: ignore[no-any-return]

    def resume(self, id: str, spec: SandboxSpec, *, cold: bool = False, require_memory: bool = False) -> ResumeResult:
        return self._call("resume", id, spec, cold=cold, require_memory=require_memory)  # type: ignore[no-any-return]

    def fork(self, source_id: str, spec: SandboxSpec, memory: bool = False) -> None:
        return self._call("fork", source_id, spec, memory=memory)  # type: ignore[no-any-return]

    def fork_stopped(self, source_id: str, spec: SandboxSpec, memory: bool = False) -> None:
        self._call("fork_stopped", source_id, spec, memory=memory)

    def snapshot(self, id: str, name: str) -> SnapshotInfo:
        return self._call("snapshot", id, name)  # type: ignore[no-any-return]

    def delete_snapshot(self, name: str) -> None:
        return self._call("delete_snapshot", name)  # type: ignore[no-any-return]

    def snapshots(self) -> list[SnapshotInfo]:
        return self._call("snapshots")  # type: ignore[no-any-return]

    def delete(self, id: str) -> None:
        return self._call("delete", id)  # type: ignore[no-any-return]

    def stats(self, id: str, space: bool = True) -> Stats:
        return self._call("stats", id, space=space)  # type: ignore[no-any-return]

    def status(self, id: str, settled: bool = False) -> NodeStatus:
        return self._call("status", id, settled=settled)  # type: ignore[no-any-return]

    def address(self, id: str) -> str:
        return self._call("address", id)  # type: ignore[no-any-return]

    def reconcile(self, known: dict[str, str]) -> dict[str, NodeStatus]:
        return self._call("reconcile", known)  # type: ignore[no-any-return]

    def info(self) -> NodeInfo:
        return self._call("info")  # type: ignore[no-any-return]

    # live migration (sbx.node.migration.outgoing): prepare and abort on the destination, migrate_out on the source
    def migrate_prepare(self, spec: SandboxSpec, fingerprint: dict[str, str]) -> dict[str, Any]:
        return self._call("migrate_prepare", spec, fingerprint)  # type: ignore[no-any-return]

    def migrate_abort(self, id: str) -> bool:
        return self._call("migrate_abort", id)  # type: ignore[no-any-return]

    def migrate_out(self, id: str, target: str, ticket: str, image: dict[str, str] | None = None) -> dict[str, Any]:
        return self._call("migrate_out", id, target, ticket, image=image)  # type: ignore[no-any-return]

    # --- streams -------------------------------------------------------------------------------------------------
    def exec(
        self,
        id: str,
        command: str,
        *,
        user: str = "user",
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> Iterator[ExecEvent]:
        """As :meth:`sbx.node.types.NodeAgent.exec`; errors before the command started (``not_running``) are
        raised here, not on the first iteration. ``stop`` is checked on every line (the node sends one at least
        every 0.4 s); closing the stream makes the node kill the command."""
        body = wire.encode({"id": id, "command": command, "user": user, "timeout": timeout, "env": env, "cwd": cwd})
        try:
            resp = self._http.send(self._http.build_request("POST", "/v1/node/exec", json=body), stream=True)
        except httpx.HTTPError as e:
            raise self._unreachable(e) from None
        if resp.status_code >= 400:
            resp.read()
            resp.close()
            self._check(resp)
        return self._events(resp, stop)

    def _events(self, resp: httpx.Response, stop: Callable[[], bool] | None) -> Iterator[ExecEvent]:
        try:
            for line in resp.iter_lines():
                if self._shutdown_at is not None and time.monotonic() >= self._shutdown_at:
                    raise NodeError("server_shutdown", "the server is shutting down; the command was ended")
                if stop is not None and stop():
                    return
                if not line.strip():
                    continue
                item = json.loads(line)
                if "error" in item:
                    raise NodeError(str(item["error"]["code"]), str(item["error"]["message"]))
                if item:
                    yield wire.decode(item)
        except httpx.HTTPError as e:
            raise self._unreachable(e) from None
        finally:
            resp.close()

    def spawn(self, id: str, argv: list[str], *, user: str = "user", stdin: bool = False,
              tty: bool = False, env: dict[str, str] | None = None,
              size: tuple[int, int] | None = None) -> RemoteProcess:
        """As :meth:`sbx.node.types.NodeAgent.spawn`, relayed over the node's WebSocket
        (:mod:`sbx.node.remote.spawned`)."""
        from websockets.sync.client import connect

        ws_url = "ws" + self.url[len("http"):] + "/v1/node/spawn"
        try:
            ws = connect(ws_url, additional_headers=self._headers, open_timeout=CONNECT_TIMEOUT,
                         max_size=None, compression=None, ssl=self._ssl)
        except Exception as e:  # refused, reset, handshake refused (401)
            raise self._unreachable(e) from None
        try:
            ws.send(json.dumps({"id": id, "argv": argv, "user": user, "stdin": stdin, "tty": tty, "env": env,
                                "size": list(size) if size else None}))
            answer = json.loads(ws.recv(timeout=60))
        except Exception as e:
            ws.close()
            raise self._unreachable(e) from None
        if answer.get("type") != "started":
            ws.close()
            raise NodeError(str(answer.get("code", "node_unreachable")), str(answer.get("message", answer)))
        return RemoteProcess(ws, argv, stdin=stdin, tty=tty)

    def watch(self, on_exit: Callable[[str, str, str | None], None]) -> None:
        """Poll the node's ``exits`` (a long poll, reconnecting every second while the node is away) and call
        ``on_exit`` for each sandbox that ended on its own, from a thread of this client."""
        if self._watcher is not None:
            return
        self._watching.set()

        def loop() -> None:
            last, boot = -1, ""
            while self._watching.is_set():
                try:
                    resp = self._http.get("/v1/node/exits", params={"after": last, "wait": 10, "boot": boot},
                                          timeout=httpx.Timeout(20.0, connect=CONNECT_TIMEOUT))
                    self._check(resp)
                    data = resp.json()
                except (httpx.HTTPError, NodeError, ValueError):
                    time.sleep(1.0)
                    continue
                for ev in data["events"]:
                    try:
                        on_exit(ev["id"], ev["kind"], ev["detail"])
                    except Exception:
                        log.exception("handling the exit of %s failed", ev["id"])
                last, boot = data["last"], data["boot"]

        self._watcher = threading.Thread(target=loop, name="remote-node-watch", daemon=True)
        self._watcher.start()

    def unwatch(self) -> None:
        """Stop polling (at shutdown)."""
        self._watching.clear()
        self._watcher = None


def _client_ssl(url: str, identity: tls.Identity | None) -> ssl.SSLContext | None:
    """The TLS context to reach the node at ``url`` with (None: plain HTTP, allowed without a TLS folder or on
    loopback). Raises ``NodeError`` (see the module docstring), ``httpx.InvalidURL``."""
    parsed = httpx.URL(url)
    if parsed.scheme == "https":
        if identity is None:
            raise NodeError("node_tls_missing", f"{url} is an https node but this server has no TLS certificate "
                                                "(run `sbx ca init`, or set SBX_NODE_TLS_DIR)")
        return identity.client_context()
    if identity is not None and not _loopback(parsed.host):
        raise NodeError("node_tls_required", f"{url}: this server has TLS certificates, so it reaches nodes only "
                                             "over https:// (mutual TLS); give the node's https:// URL")
    return None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _pass_ids(request: httpx.Request) -> None:
    """An httpx request hook: the ids the caller's log lines carry (:mod:`sbx.logs`) go along as ``X-Request-Id``
    and ``X-Sbx-Sandbox-Id``, so the node agent's lines for this call name them too."""
    rid, sid = logs.request_id.get(), logs.sandbox_id.get()
    if rid:
        request.headers["X-Request-Id"] = rid
    if sid:
        request.headers["X-Sbx-Sandbox-Id"] = sid
