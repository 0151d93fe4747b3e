"""Sandbox handles: ``Sandbox`` / ``AsyncSandbox`` on one sandbox, over the transports of :mod:`sbx.sdk.http`
(``Client`` / ``AsyncClient``, re-exported here). Both pairs expose the same methods; only ``await`` differs.
"""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import sbx.sdk.protocol as P
from sbx.sdk.errors import SbxError
from sbx.sdk.files import AsyncFiles, Files
from sbx.sdk.http import AsyncClient, Client
from sbx.sdk.protocol import ExecResult

__all__ = ["AsyncClient", "AsyncSandbox", "Client", "Sandbox"]


class _Base:
    """Shared state of a sandbox handle: ``data`` is the last sandbox dict seen from the server. A handle that made
    its own client (no ``client=`` given) closes it in :meth:`close` and at the end of a ``with`` block; a handle
    from ``create``/``fork`` also deletes the sandbox there, one from ``connect``/``get``/``list`` does not."""

    def __init__(self, data: dict[str, Any], client: Any, owns_client: bool = False, delete_on_exit: bool = False):
        self.data = data
        self.client = client
        self._owns_client = owns_client
        self._delete_on_exit = delete_on_exit
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

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.data.get("labels") or {})

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.data.get('type')} {self.data.get('state')}>"


class Sandbox(_Base):
    """A handle on one sandbox (synchronous).

    >>> with Sandbox.create(type="small", name="demo") as sb:   # deleted (and its client closed) at the end
    ...     print(sb.exec("uname -a").stdout)
    >>> sb = Sandbox.connect("sb_0fg7b2lbka")                    # from another process; sb.close() when done
    """

    client: Client

    @classmethod
    def create(
        cls, type: str = "small", name: str | None = None, ttl: int | None = None, from_snapshot: str | None = None,
        no_snapshots: bool = False, env: dict[str, str] | None = None, wait: bool = True,
        client: Client | None = None, auto_resume: bool = False, labels: dict[str, str] | None = None,
        cold: bool = False, image: str | None = None, runtime: str | None = None,
        volumes: list[dict[str, Any]] | None = None,
    ) -> Sandbox:
        """Create a sandbox (``ttl`` in seconds of inactivity; ``from_snapshot`` a snapshot name; ``auto_resume``:
        an exec, a file call, a shell or traffic on a hosted port resumes it when stopped; ``labels`` string
        metadata for :meth:`list`; ``cold``: boot, not from the size's memory template; ``image``: start from this
        image, :mod:`sbx.sdk.images`; ``runtime``: ``"container"`` or ``"gvisor"``; ``volumes``: volumes to mount,
        :func:`sbx.sdk.volumes.mount`); with ``wait`` returns once it
        runs. Raises :class:`SbxError` (``invalid_type``, ``not_found``, ...)."""
        c = client or Client()
        try:
            data = c.run(P.create(type, name, ttl, from_snapshot, no_snapshots, env, wait, auto_resume, labels, cold,
                                  image=image, runtime=runtime, volumes=volumes))
        except BaseException:
            if client is None:
                c.close()
            raise
        return cls(data, c, owns_client=client is None, delete_on_exit=True)

    @classmethod
    def connect(cls, sandbox_id: str, client: Client | None = None) -> Sandbox:
        """A handle on an existing sandbox (made by another process, say); raises ``SbxError("not_found")``.
        Leaving a ``with`` block closes the handle's client but keeps the sandbox."""
        c = client or Client()
        try:
            data = c.run(P.get(sandbox_id))
        except BaseException:
            if client is None:
                c.close()
            raise
        return cls(data, c, owns_client=client is None)

    get = connect

    @classmethod
    def list(cls, labels: dict[str, str] | None = None, client: Client | None = None) -> builtins.list[Sandbox]:
        """Handles on every sandbox (carrying every label in ``labels``); they share one client."""
        c = client or Client()
        return [cls(d, c) for d in c.list(labels)]

    def info(self) -> dict[str, Any]:
        """Fresh sandbox dict from the server (also stored in ``data``)."""
        self.data = self.client.run(P.get(self.id))
        return self.data

    def exec(
        self, cmd: str, timeout: float | None = 30.0, user: str = "user", env: dict[str, str] | None = None,
        cwd: str | None = None, on_stdout: Callable[[Any], object] | None = None,
        on_stderr: Callable[[Any], object] | None = None, binary: bool = False,
    ) -> ExecResult:
        """Run ``cmd`` (bash) and return its :class:`ExecResult`; ``timeout`` seconds (None: no limit; exit 124
        when it fires), ``cwd`` absolute or relative to the home, ``on_stdout``/``on_stderr`` see output as it
        comes (``str``; ``bytes`` with ``binary``, which carries the output exactly)."""
        return self.client.run(  # type: ignore[no-any-return]
            P.exec_(self.id, cmd, timeout, user, env, cwd, on_stdout, on_stderr, binary)
        )

    def exec_detached(self, cmd: str, user: str = "user", env: dict[str, str] | None = None,
                      cwd: str | None = None, timeout: float | None = None, stdin: str | None = None
                      ) -> dict[str, Any]:
        """Start ``cmd`` as a background job (it survives stop/resume with memory); returns the job dict
        (``id``, ``running``, ``exitCode``...). ``timeout`` seconds kills it (exit 124), ``stdin`` is fed to it."""
        return self.client.run(  # type: ignore[no-any-return]
            P.exec_detached(self.id, cmd, user, env, cwd, timeout, stdin))

    def jobs(self) -> builtins.list[dict[str, Any]]:
        """The background jobs, oldest first."""
        return self.client.run(P.jobs(self.id))  # type: ignore[no-any-return]

    def job_logs(self, job_id: str, follow: bool = False, on_stdout: Callable[[str], object] | None = None,
                 on_stderr: Callable[[str], object] | None = None) -> ExecResult:
        """A job's output so far (``follow``: until it ends, passing pieces to the callbacks as they come)."""
        return self.client.run(  # type: ignore[no-any-return]
            P.job_logs(self.id, job_id, follow, on_stdout, on_stderr))

    def wait_job(self, job_id: str, timeout: float = 300.0) -> dict[str, Any]:
        """Wait (at most ``timeout`` seconds) for a job to end; returns the job dict."""
        return self.client.run(P.job_wait(self.id, job_id, timeout))  # type: ignore[no-any-return]

    def kill_job(self, job_id: str) -> dict[str, Any]:
        """Kill a background job (all its processes); returns the job dict (``exitCode`` 137)."""
        return self.client.run(P.kill_job(self.id, job_id))  # type: ignore[no-any-return]

    def stop(self, keep_memory: bool = True, wait: bool = True) -> Sandbox:
        """Stop, saving memory by default."""
        self.data = self.client.run(P.stop(self.id, keep_memory, wait))
        return self

    def migrate(self, to: str | None = None, wait: bool = True) -> Sandbox:
        """Move this running sandbox to node ``to`` (default: placement picks) while it runs (admin key): same id,
        processes and memory after one short pause. Raises ``insufficient_capacity`` (507), ``not_running`` /
        ``invalid_destination`` (409), ``migration_failed`` (the sandbox runs where it was) as :class:`SbxError`."""
        self.data = self.client.run(P.migrate(self.id, to, wait))
        return self

    def resume(self, type: str | None = None, require_memory: bool = False, ttl: int | None = None,
               wait: bool = True) -> Sandbox:
        """Resume, optionally at a bigger ``type`` (cold boot). Raises ``invalid_resize`` /
        ``invalid_require_memory`` / ``snapshots_disabled`` as :class:`SbxError`."""
        self.data = self.client.run(P.resume(self.id, type, require_memory, ttl, wait))
        return self

    def fork(self, type: str | None = None, ttl: int | None = None, name: str | None = None,
             env: dict[str, str] | None = None, wait: bool = True, memory: bool = False) -> Sandbox:
        """Fork into a new sandbox (disk copied; with ``memory`` its running processes and memory too); returns its
        handle (sharing this one's client; a ``with`` block on it deletes the fork)."""
        return Sandbox(self.client.run(P.fork(self.id, type, ttl, name, env, wait, memory)), self.client,
                       delete_on_exit=True)

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

    def close(self) -> None:
        """Close the handle's HTTP client if the handle made it (the sandbox keeps running)."""
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._delete_on_exit:
                try:
                    self.delete()
                except SbxError as e:
                    if e.code != "not_found":
                        raise
        finally:
            self.close()


class _Creating:
    """What :meth:`AsyncSandbox.create` returns: await it for the handle, or use it directly in ``async with``
    (the sandbox is created on entry and deleted on exit)."""

    def __init__(self, make: Callable[[], Awaitable[AsyncSandbox]]):
        self._make = make
        self._sandbox: AsyncSandbox | None = None

    def __await__(self) -> Generator[Any, None, AsyncSandbox]:
        return self._make().__await__()

    async def __aenter__(self) -> AsyncSandbox:
        self._sandbox = await self._make()
        return self._sandbox

    async def __aexit__(self, *exc: object) -> None:
        if self._sandbox is not None:
            await self._sandbox.__aexit__(*exc)


class AsyncSandbox(_Base):
    """The asyncio twin of :class:`Sandbox` (same methods, awaited).

    >>> async with AsyncSandbox.create(type="small") as sb:     # no `await` needed before create
    ...     print((await sb.exec("uname -a")).stdout)
    """

    client: AsyncClient

    @classmethod
    def create(
        cls, type: str = "small", name: str | None = None, ttl: int | None = None, from_snapshot: str | None = None,
        no_snapshots: bool = False, env: dict[str, str] | None = None, wait: bool = True,
        client: AsyncClient | None = None, auto_resume: bool = False, labels: dict[str, str] | None = None,
        cold: bool = False, image: str | None = None, runtime: str | None = None,
        volumes: list[dict[str, Any]] | None = None,
    ) -> _Creating:
        """As :meth:`Sandbox.create`; ``await`` it, or ``async with`` it directly."""

        async def make() -> AsyncSandbox:
            c = client or AsyncClient()
            try:
                data = await c.run(P.create(type, name, ttl, from_snapshot, no_snapshots, env, wait, auto_resume,
                                            labels, cold, image=image, runtime=runtime, volumes=volumes))
            except BaseException:
                if client is None:
                    await c.close()
                raise
            return cls(data, c, owns_client=client is None, delete_on_exit=True)

        return _Creating(make)

    @classmethod
    async def connect(cls, sandbox_id: str, client: AsyncClient | None = None) -> AsyncSandbox:
        """As :meth:`Sandbox.connect`."""
        c = client or AsyncClient()
        try:
            data = await c.run(P.get(sandbox_id))
        except BaseException:
            if client is None:
                await c.close()
            raise
        return cls(data, c, owns_client=client is None)

    get = connect

    @classmethod
    async def list(cls, labels: dict[str, str] | None = None, client: AsyncClient | None = None
                   ) -> builtins.list[AsyncSandbox]:
        c = client or AsyncClient()
        return [cls(d, c) for d in await c.list(labels)]

    async def info(self) -> dict[str, Any]:
        self.data = await self.client.run(P.get(self.id))
        return self.data

    async def exec(
        self, cmd: str, timeout: float | None = 30.0, user: str = "user", env: dict[str, str] | None = None,
        cwd: str | None = None, on_stdout: Callable[[Any], object] | None = None,
        on_stderr: Callable[[Any], object] | None = None, binary: bool = False,
    ) -> ExecResult:
        return await self.client.run(  # type: ignore[no-any-return]
            P.exec_(self.id, cmd, timeout, user, env, cwd, on_stdout, on_stderr, binary)
        )

    async def exec_detached(self, cmd: str, user: str = "user", env: dict[str, str] | None = None,
                            cwd: str | None = None, timeout: float | None = None, stdin: str | None = None
                            ) -> dict[str, Any]:
        return await self.client.run(  # type: ignore[no-any-return]
            P.exec_detached(self.id, cmd, user, env, cwd, timeout, stdin))

    async def jobs(self) -> builtins.list[dict[str, Any]]:
        return await self.client.run(P.jobs(self.id))  # type: ignore[no-any-return]

    async def job_logs(self, job_id: str, follow: bool = False, on_stdout: Callable[[str], object] | None = None,
                       on_stderr: Callable[[str], object] | None = None) -> ExecResult:
        return await self.client.run(  # type: ignore[no-any-return]
            P.job_logs(self.id, job_id, follow, on_stdout, on_stderr))

    async def wait_job(self, job_id: str, timeout: float = 300.0) -> dict[str, Any]:
        return await self.client.run(P.job_wait(self.id, job_id, timeout))  # type: ignore[no-any-return]

    async def kill_job(self, job_id: str) -> dict[str, Any]:
        return await self.client.run(P.kill_job(self.id, job_id))  # type: ignore[no-any-return]

    async def stop(self, keep_memory: bool = True, wait: bool = True) -> AsyncSandbox:
        self.data = await self.client.run(P.stop(self.id, keep_memory, wait))
        return self

    async def migrate(self, to: str | None = None, wait: bool = True) -> AsyncSandbox:
        self.data = await self.client.run(P.migrate(self.id, to, wait))
        return self

    async def resume(self, type: str | None = None, require_memory: bool = False, ttl: int | None = None,
                     wait: bool = True) -> AsyncSandbox:
        self.data = await self.client.run(P.resume(self.id, type, require_memory, ttl, wait))
        return self

    async def fork(self, type: str | None = None, ttl: int | None = None, name: str | None = None,
                   env: dict[str, str] | None = None, wait: bool = True, memory: bool = False) -> AsyncSandbox:
        return AsyncSandbox(await self.client.run(P.fork(self.id, type, ttl, name, env, wait, memory)), self.client,
                            delete_on_exit=True)

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

    async def close(self) -> None:
        if self._owns_client:
            await self.client.close()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self._delete_on_exit:
                try:
                    await self.delete()
                except SbxError as e:
                    if e.code != "not_found":
                        raise
        finally:
            await self.close()
