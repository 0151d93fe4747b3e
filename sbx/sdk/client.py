"""Sync and async clients: thin transports that drive the shared calls in :mod:`sbx.sdk.protocol`.

``Client`` / ``AsyncClient`` hold the server URL, token and an httpx connection pool; ``Sandbox`` /
``AsyncSandbox`` are handles on one sandbox. Both pairs expose the same methods; only ``await`` differs.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Callable
from typing import Any

import httpx

from sbx.sdk import protocol as P
from sbx.sdk.config import ClientConfig, load_config
from sbx.sdk.errors import SbxError
from sbx.sdk.protocol import ExecResult


def _headers(cfg: ClientConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.token}", "User-Agent": "sbx-sdk"}


def _timeout(req: P.Request) -> httpx.Timeout:
    return httpx.Timeout(connect=10.0, read=req.timeout, write=30.0, pool=30.0)


def _body(req: P.Request) -> dict[str, Any]:
    """httpx keyword for the request body: raw ``content`` or ``json``."""
    return {"content": req.content} if req.content is not None else {"json": req.body}


def _decode(resp_status: int, raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        raise SbxError("bad_response", f"HTTP {resp_status}: not JSON", resp_status) from None


class Client:
    """A synchronous connection to an sbx server. ``url``/``token`` default to :func:`load_config`."""

    def __init__(self, url: str | None = None, token: str | None = None, transport: httpx.BaseTransport | None = None):
        self.config = load_config(url, token)
        self._http = httpx.Client(base_url=self.config.url, headers=_headers(self.config), transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, req: P.Request) -> P.Response:
        try:
            with self._http.stream(req.method, req.path, params=req.params, timeout=_timeout(req),
                                   **_body(req)) as resp:
                if resp.status_code >= 400:
                    raise P.error_from(resp.status_code, resp.read())
                if req.binary:
                    if req.on_chunk is None:
                        return P.Response(resp.status_code, resp.read())
                    for chunk in resp.iter_bytes():
                        req.on_chunk(chunk)
                    return P.Response(resp.status_code)
                if not req.stream:
                    return P.Response(resp.status_code, _decode(resp.status_code, resp.read()))
                for raw in resp.iter_lines():
                    obj = P.parse_line(raw)
                    if obj is not None and req.on_line is not None and req.on_line(obj):
                        break
                return P.Response(resp.status_code)
        except httpx.TransportError as e:
            raise SbxError("unreachable", f"cannot reach {self.config.url}: {e}") from None

    def run(self, call: P.Call) -> Any:
        """Drive one protocol call to its result."""
        try:
            req = next(call)
            while True:
                req = call.send(self._send(req))
        except StopIteration as done:
            return done.value

    # collection-level calls
    def list(self) -> builtins.list[dict[str, Any]]:
        """All sandboxes (dicts as the API shows them)."""
        return self.run(P.list_sandboxes())  # type: ignore[no-any-return]

    def snapshots(self, sandbox_id: str | None = None) -> builtins.list[dict[str, Any]]:
        """All snapshots, or one sandbox's."""
        return self.run(P.snapshots(sandbox_id))  # type: ignore[no-any-return]

    def delete_snapshot(self, name: str) -> None:
        """Delete snapshot ``name``."""
        self.run(P.delete_snapshot(name))

    def events(self, sandbox_id: str, after: int = 0, follow: bool = False, until_settled: bool = False,
               on_event: P.LineHandler | None = None) -> builtins.list[dict[str, Any]]:
        """A sandbox's lifecycle events (see the API); ``on_event`` sees each as it arrives."""
        return self.run(P.events(sandbox_id, after, follow, until_settled, on_event))  # type: ignore[no-any-return]


class AsyncClient:
    """The asyncio twin of :class:`Client`."""

    def __init__(self, url: str | None = None, token: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.config = load_config(url, token)
        self._http = httpx.AsyncClient(base_url=self.config.url, headers=_headers(self.config), transport=transport)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _send(self, req: P.Request) -> P.Response:
        try:
            async with self._http.stream(req.method, req.path, params=req.params, timeout=_timeout(req),
                                         **_body(req)) as resp:
                if resp.status_code >= 400:
                    raise P.error_from(resp.status_code, await resp.aread())
                if req.binary:
                    if req.on_chunk is None:
                        return P.Response(resp.status_code, await resp.aread())
                    async for chunk in resp.aiter_bytes():
                        req.on_chunk(chunk)
                    return P.Response(resp.status_code)
                if not req.stream:
                    return P.Response(resp.status_code, _decode(resp.status_code, await resp.aread()))
                async for raw in resp.aiter_lines():
                    obj = P.parse_line(raw)
                    if obj is not None and req.on_line is not None and req.on_line(obj):
                        break
                return P.Response(resp.status_code)
        except httpx.TransportError as e:
            raise SbxError("unreachable", f"cannot reach {self.config.url}: {e}") from None

    async def run(self, call: P.Call) -> Any:
        """Drive one protocol call to its result."""
        try:
            req = next(call)
            while True:
                req = call.send(await self._send(req))
        except StopIteration as done:
            return done.value

    async def list(self) -> builtins.list[dict[str, Any]]:
        return await self.run(P.list_sandboxes())  # type: ignore[no-any-return]

    async def snapshots(self, sandbox_id: str | None = None) -> builtins.list[dict[str, Any]]:
        return await self.run(P.snapshots(sandbox_id))  # type: ignore[no-any-return]

    async def delete_snapshot(self, name: str) -> None:
        await self.run(P.delete_snapshot(name))

    async def events(self, sandbox_id: str, after: int = 0, follow: bool = False, until_settled: bool = False,
                     on_event: P.LineHandler | None = None) -> builtins.list[dict[str, Any]]:
        return await self.run(  # type: ignore[no-any-return]
            P.events(sandbox_id, after, follow, until_settled, on_event)
        )


class _Base:
    """Shared state of a sandbox handle: ``data`` is the last sandbox dict seen from the server."""

    def __init__(self, data: dict[str, Any], client: Any):
        self.data = data
        self.client = client
        self.files = (AsyncFiles if isinstance(client, AsyncClient) else Files)(self)

    @property
    def id(self) -> str:
        return str(self.data["id"])

    @property
    def state(self) -> str:
        return str(self.data["state"])

    @property
    def type(self) -> str:
        return str(self.data["type"])

    @property
    def url(self) -> str:
        return str(self.data["url"])

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.data.get('type')} {self.data.get('state')}>"


class Sandbox(_Base):
    """A handle on one sandbox (synchronous).

    >>> with Sandbox.create(type="small", name="demo") as sb:   # deleted when the block ends
    ...     print(sb.exec("uname -a").stdout)
    """

    client: Client

    @classmethod
    def create(
        cls, type: str = "small", name: str | None = None, ttl: int | None = None, from_snapshot: str | None = None,
        no_snapshots: bool = False, env: dict[str, str] | None = None, wait: bool = True,
        client: Client | None = None, auto_resume: bool = False,
    ) -> Sandbox:
        """Create a sandbox (``ttl`` in seconds of inactivity; ``from_snapshot`` a snapshot name; ``auto_resume``:
        traffic on a hosted port resumes it when stopped); with ``wait`` returns once it runs. Raises
        :class:`SbxError` (``invalid_type``, ``not_found``, ...)."""
        c = client or Client()
        return cls(c.run(P.create(type, name, ttl, from_snapshot, no_snapshots, env, wait, auto_resume)), c)

    @classmethod
    def get(cls, sandbox_id: str, client: Client | None = None) -> Sandbox:
        """A handle on an existing sandbox; raises ``SbxError("not_found")``."""
        c = client or Client()
        return cls(c.run(P.get(sandbox_id)), c)

    @classmethod
    def list(cls, client: Client | None = None) -> builtins.list[Sandbox]:
        c = client or Client()
        return [cls(d, c) for d in c.list()]

    def info(self) -> dict[str, Any]:
        """Fresh sandbox dict from the server (also stored in ``data``)."""
        self.data = self.client.run(P.get(self.id))
        return self.data

    def exec(
        self, cmd: str, timeout: float | None = 30.0, user: str = "user", env: dict[str, str] | None = None,
        cwd: str | None = None, on_stdout: Callable[[str], None] | None = None,
        on_stderr: Callable[[str], None] | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (bash) and return its :class:`ExecResult`; ``timeout`` seconds (None: no limit)."""
        return self.client.run(  # type: ignore[no-any-return]
            P.exec_(self.id, cmd, timeout, user, env, cwd, on_stdout, on_stderr)
        )

    def exec_detached(self, cmd: str, user: str = "user") -> dict[str, Any]:
        """Start ``cmd`` as a detached job; returns the job dict."""
        return self.client.run(P.exec_detached(self.id, cmd, user))  # type: ignore[no-any-return]

    def jobs(self) -> builtins.list[dict[str, Any]]:
        return self.client.run(P.jobs(self.id))  # type: ignore[no-any-return]

    def job_logs(self, job_id: str, follow: bool = False) -> ExecResult:
        return self.client.run(P.job_logs(self.id, job_id, follow))  # type: ignore[no-any-return]

    def wait_job(self, job_id: str, timeout: float = 300.0) -> dict[str, Any]:
        return self.client.run(P.job_wait(self.id, job_id, timeout))  # type: ignore[no-any-return]

    def stop(self, keep_memory: bool = True, wait: bool = True) -> Sandbox:
        """Stop, saving memory by default."""
        self.data = self.client.run(P.stop(self.id, keep_memory, wait))
        return self

    def resume(self, type: str | None = None, require_memory: bool = False, ttl: int | None = None,
               wait: bool = True) -> Sandbox:
        """Resume, optionally at a bigger ``type`` (cold boot). Raises ``invalid_resize`` /
        ``invalid_require_memory`` / ``snapshots_disabled`` as :class:`SbxError`."""
        self.data = self.client.run(P.resume(self.id, type, require_memory, ttl, wait))
        return self

    def fork(self, type: str | None = None, ttl: int | None = None, name: str | None = None,
             env: dict[str, str] | None = None, wait: bool = True) -> Sandbox:
        """Fork into a new sandbox (disk copied, memory not); returns its handle."""
        return Sandbox(self.client.run(P.fork(self.id, type, ttl, name, env, wait)), self.client)

    def snapshot(self, name: str) -> dict[str, Any]:
        """Save a named snapshot of the disk; returns the snapshot dict."""
        return self.client.run(P.snapshot(self.id, name))  # type: ignore[no-any-return]

    def snapshots(self) -> builtins.list[dict[str, Any]]:
        return self.client.snapshots(self.id)

    def delete(self, wait: bool = True) -> None:
        """Delete the sandbox."""
        self.data = self.client.run(P.delete(self.id, wait))

    def host(self, port: int, public: bool = False) -> dict[str, Any]:
        """Publish ``port`` at ``https://<port>-<subdomain>.<domain>``; returns the route dict (``url``, ``token``
        for a private route: send it as ``X-Sbx-Token`` or ``?token=``)."""
        return self.client.run(P.host(self.id, port, public))  # type: ignore[no-any-return]

    def unhost(self, port: int) -> None:
        """Stop publishing ``port``."""
        self.client.run(P.unhost(self.id, port))

    def routes(self) -> builtins.list[dict[str, Any]]:
        """The hosted ports."""
        return self.client.run(P.routes(self.id))  # type: ignore[no-any-return]

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.delete()
        except SbxError as e:
            if e.code != "not_found":
                raise


class AsyncSandbox(_Base):
    """The asyncio twin of :class:`Sandbox` (same methods, awaited; ``async with`` deletes at the end)."""

    client: AsyncClient

    @classmethod
    async def create(
        cls, type: str = "small", name: str | None = None, ttl: int | None = None, from_snapshot: str | None = None,
        no_snapshots: bool = False, env: dict[str, str] | None = None, wait: bool = True,
        client: AsyncClient | None = None, auto_resume: bool = False,
    ) -> AsyncSandbox:
        c = client or AsyncClient()
        return cls(await c.run(P.create(type, name, ttl, from_snapshot, no_snapshots, env, wait, auto_resume)), c)

    @classmethod
    async def get(cls, sandbox_id: str, client: AsyncClient | None = None) -> AsyncSandbox:
        c = client or AsyncClient()
        return cls(await c.run(P.get(sandbox_id)), c)

    @classmethod
    async def list(cls, client: AsyncClient | None = None) -> builtins.list[AsyncSandbox]:
        c = client or AsyncClient()
        return [cls(d, c) for d in await c.list()]

    async def info(self) -> dict[str, Any]:
        self.data = await self.client.run(P.get(self.id))
        return self.data

    async def exec(
        self, cmd: str, timeout: float | None = 30.0, user: str = "user", env: dict[str, str] | None = None,
        cwd: str | None = None, on_stdout: Callable[[str], None] | None = None,
        on_stderr: Callable[[str], None] | None = None,
    ) -> ExecResult:
        return await self.client.run(  # type: ignore[no-any-return]
            P.exec_(self.id, cmd, timeout, user, env, cwd, on_stdout, on_stderr)
        )

    async def exec_detached(self, cmd: str, user: str = "user") -> dict[str, Any]:
        return await self.client.run(P.exec_detached(self.id, cmd, user))  # type: ignore[no-any-return]

    async def jobs(self) -> builtins.list[dict[str, Any]]:
        return await self.client.run(P.jobs(self.id))  # type: ignore[no-any-return]

    async def job_logs(self, job_id: str, follow: bool = False) -> ExecResult:
        return await self.client.run(P.job_logs(self.id, job_id, follow))  # type: ignore[no-any-return]

    async def wait_job(self, job_id: str, timeout: float = 300.0) -> dict[str, Any]:
        return await self.client.run(P.job_wait(self.id, job_id, timeout))  # type: ignore[no-any-return]

    async def stop(self, keep_memory: bool = True, wait: bool = True) -> AsyncSandbox:
        self.data = await self.client.run(P.stop(self.id, keep_memory, wait))
        return self

    async def resume(self, type: str | None = None, require_memory: bool = False, ttl: int | None = None,
                     wait: bool = True) -> AsyncSandbox:
        self.data = await self.client.run(P.resume(self.id, type, require_memory, ttl, wait))
        return self

    async def fork(self, type: str | None = None, ttl: int | None = None, name: str | None = None,
                   env: dict[str, str] | None = None, wait: bool = True) -> AsyncSandbox:
        return AsyncSandbox(await self.client.run(P.fork(self.id, type, ttl, name, env, wait)), self.client)

    async def snapshot(self, name: str) -> dict[str, Any]:
        return await self.client.run(P.snapshot(self.id, name))  # type: ignore[no-any-return]

    async def snapshots(self) -> builtins.list[dict[str, Any]]:
        return await self.client.snapshots(self.id)

    async def delete(self, wait: bool = True) -> None:
        self.data = await self.client.run(P.delete(self.id, wait))

    async def host(self, port: int, public: bool = False) -> dict[str, Any]:
        return await self.client.run(P.host(self.id, port, public))  # type: ignore[no-any-return]

    async def unhost(self, port: int) -> None:
        await self.client.run(P.unhost(self.id, port))

    async def routes(self) -> builtins.list[dict[str, Any]]:
        return await self.client.run(P.routes(self.id))  # type: ignore[no-any-return]

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.delete()
        except SbxError as e:
            if e.code != "not_found":
                raise


class Files:
    """``sandbox.files``: files of a running sandbox, read and written inside it as ``user`` (or ``root``). Paths are
    absolute or relative to the user's home (``~`` allowed). Errors: ``not_found``, ``permission_denied``,
    ``is_a_directory``, ``not_a_directory``, ``invalid_path``, ``not_running`` as :class:`SbxError`."""

    def __init__(self, sandbox: Any):
        self._sb: Any = sandbox

    def read(self, path: str, user: str = "user") -> bytes:
        """The file's bytes."""
        return self._sb.client.run(P.read_file(self._sb.id, path, user))  # type: ignore[no-any-return]

    def read_to(self, path: str, on_chunk: P.ChunkHandler, user: str = "user", archive: bool = False) -> int:
        """Stream the file (or, with ``archive``, a directory as tar) to ``on_chunk``; returns the byte count."""
        return self._sb.client.run(P.read_file(self._sb.id, path, user, on_chunk, archive))  # type: ignore

    def write(self, path: str, data: Any, user: str = "user", archive: bool = False) -> dict[str, Any]:
        """Write ``data`` (bytes, str, or an iterator of bytes for large files) to ``path``; parents are made.
        With ``archive``, ``data`` is a tar stream extracted into directory ``path``."""
        return self._sb.client.run(P.write_file(self._sb.id, path, data, user, archive))  # type: ignore

    def list(self, path: str = "~", user: str = "user") -> builtins.list[dict[str, Any]]:
        """Entries of a directory."""
        return self._sb.client.run(P.list_files(self._sb.id, path, user))  # type: ignore[no-any-return]

    def stat(self, path: str, user: str = "user") -> dict[str, Any]:
        """One entry (``type``, ``size``, ``mode``, ``mtime``)."""
        return self._sb.client.run(P.stat_file(self._sb.id, path, user))  # type: ignore[no-any-return]

    def exists(self, path: str, user: str = "user") -> bool:
        """True when ``path`` exists."""
        try:
            self.stat(path, user)
            return True
        except SbxError as e:
            if e.code == "not_found":
                return False
            raise

    def remove(self, path: str, user: str = "user") -> None:
        """Remove a file or a directory tree."""
        self._sb.client.run(P.remove_file(self._sb.id, path, user))


class AsyncFiles:
    """The asyncio twin of :class:`Files`."""

    def __init__(self, sandbox: Any):
        self._sb: Any = sandbox

    async def read(self, path: str, user: str = "user") -> bytes:
        return await self._sb.client.run(P.read_file(self._sb.id, path, user))  # type: ignore[no-any-return]

    async def read_to(self, path: str, on_chunk: P.ChunkHandler, user: str = "user", archive: bool = False) -> int:
        return await self._sb.client.run(P.read_file(self._sb.id, path, user, on_chunk, archive))  # type: ignore

    async def write(self, path: str, data: Any, user: str = "user", archive: bool = False) -> dict[str, Any]:
        return await self._sb.client.run(P.write_file(self._sb.id, path, data, user, archive))  # type: ignore

    async def list(self, path: str = "~", user: str = "user") -> builtins.list[dict[str, Any]]:
        return await self._sb.client.run(P.list_files(self._sb.id, path, user))  # type: ignore[no-any-return]

    async def stat(self, path: str, user: str = "user") -> dict[str, Any]:
        return await self._sb.client.run(P.stat_file(self._sb.id, path, user))  # type: ignore[no-any-return]

    async def exists(self, path: str, user: str = "user") -> bool:
        try:
            await self.stat(path, user)
            return True
        except SbxError as e:
            if e.code == "not_found":
                return False
            raise

    async def remove(self, path: str, user: str = "user") -> None:
        await self._sb.client.run(P.remove_file(self._sb.id, path, user))
