"""The mitmproxy addon of the node's egress proxy (loaded by ``mitmdump -s``; runs in the proxy's own virtualenv,
so it imports only the standard library and mitmproxy, never sbx).

For each request from a sandbox it asks the server, over the control socket named in the config file
(``--set sbx_config=<dir>/addon.json``), what to inject: the socket answers the actions of the sandbox's bound
secrets whose rules name the request (:meth:`sbx.control.secrets.vault.Secrets.resolve`). The host asked about is the
TLS server name (SNI) the client sent, which the upstream's certificate is verified against, so a sandbox can't
point a trusted name at an address of its choosing; for plain HTTP the ``Host`` header counts only when the
destination address is one that name resolves to on the host. Actions set a header or replace a placeholder
(``sbx-secret:NAME``) in header values, the query and a body of at most 1 MiB (larger bodies stream through
untouched). Responses stream (``flow.response.stream``), so server-sent events pass event by event. Each request
that received a secret is reported back (``op: used``) with its status for the audit log.

A failed upstream TLS handshake (an untrusted or mismatched certificate) makes the client's handshake fail too
(:meth:`SbxInject.tls_start_client`): the sandbox sees a TLS error, as it would talking to the server directly.

Defence in depth for the egress policy: :meth:`SbxInject.server_connect` refuses an upstream address in the
node's denied ranges (unless allowed), although the nftables redirect already leaves such traffic to the forward
chain, which drops it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import urllib.parse
from typing import Any

from mitmproxy import ctx, http  # type: ignore[import-not-found,unused-ignore]

BODY_MAX = 1024 * 1024
"""Largest request body in which placeholders are replaced, in bytes."""


class SbxInject:
    def __init__(self) -> None:
        self.socket = ""
        self.deny: list[Any] = []
        self.allow: list[Any] = []
        self.services: set[tuple[str, int]] = set()
        self._upstream_failed: set[str] = set()  # client connection ids whose upstream TLS handshake failed

    def load(self, loader: Any) -> None:
        loader.add_option("sbx_config", str, "", "sbx egress proxy configuration (JSON)")

    def configure(self, updated: set[str]) -> None:
        if "sbx_config" in updated and ctx.options.sbx_config:
            with open(ctx.options.sbx_config) as f:
                cfg = json.load(f)
            self.socket = cfg["socket"]
            self.deny = [ipaddress.ip_network(n) for n in cfg.get("deny", [])]
            self.allow = [ipaddress.ip_network(n) for n in cfg.get("allow", [])]
            self.services = {(ip, int(port)) for ip, proto, port in cfg.get("services", []) if proto == "tcp"}

    async def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        reader, writer = await asyncio.open_unix_connection(self.socket)
        try:
            writer.write(json.dumps(message).encode() + b"\n")
            await writer.drain()
            line = await reader.readline()
        finally:
            writer.close()
        return json.loads(line or b"{}")

    def _denied(self, ip: str, port: int) -> bool:
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return True
        if addr.version != 4:
            return True
        if any(addr in n for n in self.allow) or (ip, port) in self.services:
            return False
        return any(addr in n for n in self.deny)

    def server_connect(self, data: Any) -> None:
        address = data.server.address
        if address and self._denied(str(address[0]), int(address[1])):
            data.server.error = f"sbx egress policy: {address[0]} is out of reach for sandboxes"

    def tls_failed_server(self, data: Any) -> None:
        """The upstream's TLS handshake failed (its certificate does not verify for the name, or it speaks no
        TLS): remember it for this client connection."""
        self._upstream_failed.add(data.context.client.id)
        ctx.log.info(f"sbx egress: upstream TLS failed: {data.conn.error}")

    def tls_start_client(self, data: Any) -> None:
        """Runs after mitmproxy's own TLS setup: for a client whose upstream failed TLS, replace the prepared
        connection with one that holds no certificate, so the client's handshake fails too. A sandbox sees a TLS
        error, as it would without the proxy, rather than a proxy-made certificate followed by a 502 page."""
        if data.context.client.id in self._upstream_failed:
            self._upstream_failed.discard(data.context.client.id)
            from OpenSSL import SSL  # type: ignore[import-untyped,import-not-found,unused-ignore]

            data.ssl_conn = SSL.Connection(SSL.Context(SSL.TLS_SERVER_METHOD))
            data.ssl_conn.set_accept_state()

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        length = flow.request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > BODY_MAX:
            flow.request.stream = True

    @staticmethod
    def _host(flow: http.HTTPFlow) -> tuple[str | None, bool]:
        """The name the request is checked against, and whether it still has to be confirmed by DNS (plain
        HTTP: the Host header is the client's word only)."""
        if flow.client_conn.tls:
            return flow.client_conn.sni or None, False
        return (flow.request.host_header or "").rsplit(":", 1)[0].strip("[]") or None, True

    @staticmethod
    async def _resolves_to(host: str, flow: http.HTTPFlow) -> bool:
        if flow.server_conn.address is None:
            return False
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, None)
        except OSError:
            return False
        return str(flow.server_conn.address[0]) in {i[4][0] for i in infos}

    async def request(self, flow: http.HTTPFlow) -> None:
        host, confirm = self._host(flow)
        if host is None:
            return
        req = flow.request
        path = req.path.split("?", 1)[0]
        try:
            answer = await self.ask({"op": "resolve", "client": flow.client_conn.peername[0], "host": host,
                                     "method": req.method, "path": path})
        except (OSError, ValueError) as e:
            ctx.log.warn(f"sbx egress: control socket: {e}")
            return
        if not answer.get("actions") or (confirm and not await self._resolves_to(host, flow)):
            return
        used = []
        for act in answer.get("actions", []):
            if act["action"] == "header":
                req.headers[act["header"]] = act["value"]
                used.append(act["secret"])
            elif act["action"] == "replace" and _replace(req, act["placeholder"], act["value"]):
                used.append(act["secret"])
        if used:
            flow.metadata["sbx_used"] = (sorted(set(used)), host, path)

    async def _report(self, flow: http.HTTPFlow, status: int | None) -> None:
        found = flow.metadata.pop("sbx_used", None)
        if not found:
            return
        names, host, path = found
        try:
            await self.ask({"op": "used", "client": flow.client_conn.peername[0], "secrets": names, "host": host,
                            "method": flow.request.method, "path": path, "status": status})
        except (OSError, ValueError) as e:
            ctx.log.warn(f"sbx egress: audit: {e}")

    async def responseheaders(self, flow: http.HTTPFlow) -> None:
        flow.response.stream = True  # no buffering: server-sent events pass as they come
        await self._report(flow, flow.response.status_code)

    async def error(self, flow: http.HTTPFlow) -> None:
        await self._report(flow, None)


def _pattern(placeholder: str) -> re.Pattern[str]:
    return re.compile(re.escape(placeholder) + r"(?![A-Za-z0-9_-])")


def _replace(req: http.Request, placeholder: str, value: str) -> bool:
    """Replace ``placeholder`` in header values, the query (URL-encoded either way) and a body up to
    :data:`BODY_MAX`; True if it was found anywhere."""
    found = False
    pat = _pattern(placeholder)
    for name, old in list(req.headers.items(multi=True)):
        if placeholder in old:
            new = pat.sub(lambda _m: value, old)
            req.headers.set_all(name, [new if v == old else v for v in req.headers.get_all(name)])
            found = True
    if "?" in req.path:
        base, query = req.path.split("?", 1)
        encoded = urllib.parse.quote(placeholder, safe="")
        enc_pat = re.compile(re.escape(encoded) + r"(?![A-Za-z0-9_-])")
        new_query = enc_pat.sub(lambda _m: urllib.parse.quote(value, safe=""), pat.sub(
            lambda _m: urllib.parse.quote(value, safe=""), query))
        if new_query != query:
            req.path = base + "?" + new_query
            found = True
    if not req.stream and req.raw_content is not None and 0 < len(req.raw_content) <= BODY_MAX:
        body = req.get_content(strict=False) or b""
        if placeholder.encode() in body:
            bpat = re.compile(re.escape(placeholder.encode()) + rb"(?![A-Za-z0-9_-])")
            req.set_content(bpat.sub(lambda _m: value.encode(), body))
            found = True
    return found


addons = [SbxInject()]
