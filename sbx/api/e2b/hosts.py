"""E2B's per-port host names on the hosted-port proxy.

E2B's SDK names a sandbox's port ``<port>-<sandboxID>.<domain>`` (``Sandbox.get_host(port)``, ``domain`` being the
``E2B_DOMAIN`` its user sets), and an E2B ``sandboxID`` on sbx is the sbx id: ``8000-sb_q0w5h9m2rd.<domain>``.
The hosted-port proxy (:mod:`sbx.api.proxy`) serves that name as another name of the sandbox's own hosted port
(:func:`native_host`): it reaches exactly what ``<port>-<subdomain>.<domain>`` reaches, a port hosted with
``sbx host`` (or the SDK's or the API's routes), public or with its token, and nothing else.

A ``_`` is not a host-name character: plain HTTP clients send it, but TLS clients built on OpenSSL match no
wildcard certificate against it, so ``<port>-sb-<x>.<domain>`` (``-`` for ``_``) names the same port too.

A sandbox created through E2B's API reaches more under E2B's name, as on E2B: every port it listens on, hosted or
not (:func:`unhosted_route`), public by default, or with the sandbox's ``trafficAccessToken`` in the
``E2B-Traffic-Access-Token`` header when it was created with ``network.allowPublicTraffic`` false
(:data:`sbx.api.e2b.lifecycle.PORTS`). Its sbx name, and sandboxes made with sbx's own API, keep sbx's rule: a
port is reached only once it is hosted.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import sbx.api.e2b.lifecycle as lifecycle
from sbx.api.e2b.tokens import load_secret, traffic_token
from sbx.control.sandboxes.routes import Resolved, RouteRow, parse_host, route_host
from sbx.control.store.database import SandboxRow, as_utc

if TYPE_CHECKING:
    from sbx.control.service import ControlPlane

TRAFFIC_HEADER = b"e2b-traffic-access-token"
"""The header that carries a sandbox's ``trafficAccessToken`` (E2B's name)."""

_SANDBOX_LABEL = re.compile(r"^sb-([a-z0-9]{10})$")


def _named(cp: ControlPlane, host: str) -> tuple[int, SandboxRow, str] | None:
    """``(port, sandbox row, its sbx hosted-port name)`` for E2B's ``<port>-sb_<x>.<domain>`` (or ``sb-<x>``)
    under sbx's ``domain``; None when ``host`` is no such name or names no sandbox with a subdomain."""
    domain = cp.settings.domain
    parsed = parse_host(host.replace("_", "-"), domain)
    m = _SANDBOX_LABEL.match(parsed[1]) if parsed is not None else None
    if parsed is None or m is None:
        return None
    row = cp.store.get_sandbox("sb_" + m.group(1))
    if row is None or not row.subdomain:
        return None
    return parsed[0], row, route_host(parsed[0], row.subdomain, domain)


def native_host(cp: ControlPlane, host: str) -> str | None:
    """The sandbox's own hosted-port name (``<port>-<subdomain>.<domain>``) for E2B's ``<port>-sb_<x>.<domain>``
    (or ``sb-<x>``) under sbx's ``domain``; None when ``host`` is no such name or names no sandbox."""
    named = _named(cp, host)
    return named[2] if named is not None else None


def unhosted_route(cp: ControlPlane, host: str) -> Resolved | None:
    """For E2B's name of a port no route hosts, of a sandbox created through E2B's API: its row and a route made
    for this request only (not stored): public, or private with the sandbox's
    ``trafficAccessToken`` as its token (see the module's doc). None for any other host, and for a sandbox that
    is deleted or whose account has ended (the proxy then answers as for any unknown host)."""
    named = _named(cp, host)
    if named is None:
        return None
    port, row, name = named
    mode = (row.labels or {}).get(lifecycle.PORTS)
    if row.state in ("deleted", "deleting") or mode not in (lifecycle.PUBLIC, lifecycle.TRAFFIC_TOKEN):
        return None
    if cp.routes.account_ended(name):
        return None
    token = traffic_token(load_secret(cp.settings.state_dir), row.id) if mode == lifecycle.TRAFFIC_TOKEN else ""
    return Resolved(row, RouteRow(sandbox_id=row.id, port=port, public=mode == lifecycle.PUBLIC, token=token,
                                  created_at=as_utc(row.created_at)))
