"""E2B's per-port host names on the hosted-port proxy.

E2B's SDK names a sandbox's port ``<port>-<sandboxID>.<domain>`` (``Sandbox.get_host(port)``, ``domain`` being the
``E2B_DOMAIN`` its user sets), and an E2B ``sandboxID`` on sbx is the sbx id: ``8000-sb_q0w5h9m2rd.<domain>``.
The hosted-port proxy (:mod:`sbx.api.proxy`) serves that name as another name of the sandbox's own hosted port
(:func:`native_host`): it reaches exactly what ``<port>-<subdomain>.<domain>`` reaches, a port hosted with
``sbx host`` (or the SDK's or the API's routes), public or with its token, and nothing else.

A ``_`` is not a host-name character: plain HTTP clients send it, but TLS clients built on OpenSSL match no
wildcard certificate against it, so ``<port>-sb-<x>.<domain>`` (``-`` for ``_``) names the same port too.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from sbx.control.sandboxes.routes import parse_host, route_host

if TYPE_CHECKING:
    from sbx.control.service import ControlPlane

_SANDBOX_LABEL = re.compile(r"^sb-([a-z0-9]{10})$")


def native_host(cp: ControlPlane, host: str) -> str | None:
    """The sandbox's own hosted-port name (``<port>-<subdomain>.<domain>``) for E2B's ``<port>-sb_<x>.<domain>``
    (or ``sb-<x>``) under sbx's ``domain``; None when ``host`` is no such name or names no sandbox."""
    domain = cp.settings.domain
    parsed = parse_host(host.replace("_", "-"), domain)
    m = _SANDBOX_LABEL.match(parsed[1]) if parsed is not None else None
    if parsed is None or m is None:
        return None
    row = cp.store.get_sandbox("sb_" + m.group(1))
    if row is None or not row.subdomain:
        return None
    return route_host(parsed[0], row.subdomain, domain)
