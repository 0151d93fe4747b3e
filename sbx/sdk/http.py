"""The SDK's HTTP transports: :class:`Client` (httpx, sync) and :class:`AsyncClient` (httpx, asyncio) drive the
shared calls of :mod:`sbx.sdk.protocol`. Each holds the server URL, the token and a connection pool; close it with
``close()`` or a ``with`` block (the sandbox handles close the client they made themselves)."""

from __future__ import annotations

import builtins
import json
from typing import Any

import httpx

import sbx.sdk.protocol as P
from sbx.sdk.config import ClientConfig, load_config
from sbx.sdk.errors import SbxError


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
    def list(self, labels: dict[str, str] | None = None) -> builtins.list[dict[str, Any]]:
        """All sandboxes (dicts as the API shows them), only those carrying every label in ``labels``."""
        return self.run(P.list_sandboxes(labels))  # type: ignore[no-any-return]

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

    async def list(self, labels: dict[str, str] | None = None) -> builtins.list[dict[str, Any]]:
        return await self.run(P.list_sandboxes(labels))  # type: ignore[no-any-return]

    async def snapshots(self, sandbox_id: str | None = None) -> builtins.list[dict[str, Any]]:
        return await self.run(P.snapshots(sandbox_id))  # type: ignore[no-any-return]

    async def delete_snapshot(self, name: str) -> None:
        await self.run(P.delete_snapshot(name))

    async def events(self, sandbox_id: str, after: int = 0, follow: bool = False, until_settled: bool = False,
                     on_event: P.LineHandler | None = None) -> builtins.list[dict[str, Any]]:
        return await self.run(  # type: ignore[no-any-return]
            P.events(sandbox_id, after, follow, until_settled, on_event)
        )
