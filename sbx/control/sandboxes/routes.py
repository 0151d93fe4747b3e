"""Hosted ports: routes that publish a sandbox's TCP port at ``https://<port>-<subdomain>.<domain>``.

A route belongs to one sandbox and one port. It is private unless ``public``: a private route is reached only with
its token (random, per route, kept in the database). Routes are rows of the ``routes`` table (migration 0002), so
they survive stop/resume, a resize and a server restart; a fork gets a new id and subdomain and so no routes; a
deleted sandbox's routes are removed with it.

The proxy (:mod:`sbx.api.proxy`) resolves a ``Host`` header with :meth:`Routes.resolve` and makes sure the sandbox
runs with :meth:`Routes.ensure_running` (resuming a stopped one whose ``auto_resume`` is set).
"""

from __future__ import annotations

import datetime as dt
import re
import secrets
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import Boolean, DateTime, Integer, String, delete, select
from sqlalchemy.orm import Mapped, mapped_column

from sbx.config import Settings
from sbx.control.accounts.keys import ENDED, AccountRow
from sbx.control.errors import ControlError, not_found
from sbx.control.store.database import Base, SandboxRow, Store, iso, utcnow
from sbx.control.store.state import TRANSIENT, Lifecycle

TOKEN_PREFIX = "sbxr_"
AUTO_RESUME_WAIT = 300.0
"""Seconds a proxied request may wait for its sandbox to be resumed (or to finish starting)."""

_HOST_RE = re.compile(r"^(\d{1,5})-([a-z0-9][a-z0-9-]*)$")


class RouteRow(Base):
    """One hosted port: ``sandbox_id`` + ``port`` (1-65535), ``public`` (no token needed), ``token``."""

    __tablename__ = "routes"

    sandbox_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    port: Mapped[int] = mapped_column(Integer, primary_key=True)
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    token: Mapped[str] = mapped_column(String(80))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


def route_url(port: int, subdomain: str, domain: str) -> str:
    """The public URL of a hosted port: ``https://<port>-<subdomain>.<domain>``."""
    return f"https://{port}-{subdomain}.{domain}"


def route_host(port: int, subdomain: str, domain: str) -> str:
    """The ``Host`` header that reaches a hosted port on the proxy listener: ``<port>-<subdomain>.<domain>``."""
    return f"{port}-{subdomain}.{domain}"


def parse_host(host: str, domain: str) -> tuple[int, str] | None:
    """``"8000-calm-brave-otter.sbx.localhost[:7080]"`` -> ``(8000, "calm-brave-otter")``; None when the host is
    not a hosted-port name under ``domain`` (case-insensitive)."""
    name = host.strip().lower().rstrip(".")
    if name.startswith("["):
        return None
    name = name.rsplit(":", 1)[0] if ":" in name else name
    suffix = "." + domain.lower().strip(".")
    if not name.endswith(suffix):
        return None
    m = _HOST_RE.match(name[: -len(suffix)])
    if m is None:
        return None
    port = int(m.group(1))
    return (port, m.group(2)) if 1 <= port <= 65535 else None


class RoutesPlane(Protocol):
    """What :class:`Routes` uses of its control plane (:class:`sbx.control.service.ControlPlane` is one)."""

    @property
    def settings(self) -> Settings: ...
    @property
    def store(self) -> Store: ...
    @property
    def lifecycle(self) -> Lifecycle: ...
    def get(self, sandbox_id: str) -> SandboxRow: ...
    def resume(self, sandbox_id: str, type: str | None = None, require_memory: bool = False,
               ttl: int | None = None, wait: float | None = None) -> SandboxRow: ...
    def wait_settled(self, sandbox_id: str, timeout: float = 600.0) -> SandboxRow: ...


@dataclass
class Resolved:
    """A request's target: the sandbox row and its route."""

    sandbox: SandboxRow
    route: RouteRow


class Routes:
    """Route operations of a control plane (``control.routes``). Thread-safe (every call is one short database
    session)."""

    def __init__(self, control: RoutesPlane):
        self.control = control
        self.store: Store = control.store

    def view(self, row: RouteRow, subdomain: str) -> dict[str, Any]:
        """The API shape of a route: ``{"port","public","url","host","token","createdAt"}`` (``host`` is the
        ``Host`` header that reaches it on the proxy listener)."""
        domain = self.control.settings.domain
        return {
            "port": row.port,
            "public": row.public,
            "url": route_url(row.port, subdomain, domain),
            "host": route_host(row.port, subdomain, domain),
            "token": row.token,
            "createdAt": iso(row.created_at),
        }

    @staticmethod
    def _check_port(port: int) -> None:
        if not 1 <= port <= 65535:
            raise ControlError("invalid_port", f"port must be 1-65535, got {port}", 400)

    def host(self, sandbox_id: str, port: int, public: bool = False) -> RouteRow:
        """Publish ``port`` of the sandbox (any live state). Hosting a port again changes only ``public`` and keeps
        the token. Raises 400 ``invalid_port``, 404 ``not_found``."""
        self._check_port(port)
        self.control.get(sandbox_id)
        with self.store.session() as s, s.begin():
            row = s.get(RouteRow, (sandbox_id, port))
            if row is None:
                row = RouteRow(sandbox_id=sandbox_id, port=port, public=public,
                               token=TOKEN_PREFIX + secrets.token_urlsafe(24), created_at=utcnow())
                s.add(row)
            else:
                row.public = public
        return row

    def unhost(self, sandbox_id: str, port: int) -> None:
        """Remove the route of ``port``. Raises 404 ``not_found`` (unknown sandbox or no such route)."""
        self._check_port(port)
        self.control.get(sandbox_id)
        with self.store.session() as s, s.begin():
            row = s.get(RouteRow, (sandbox_id, port))
            if row is None:
                raise not_found(f"route for port {port} of sandbox {sandbox_id}")
            s.delete(row)

    def list(self, sandbox_id: str) -> list[RouteRow]:
        """The sandbox's routes by port. Raises 404 ``not_found``."""
        self.control.get(sandbox_id)
        with self.store.session() as s:
            return list(s.scalars(select(RouteRow).where(RouteRow.sandbox_id == sandbox_id).order_by(RouteRow.port)))

    def drop_all(self, sandbox_id: str) -> None:
        """Remove every route of the sandbox (on delete)."""
        with self.store.session() as s, s.begin():
            s.execute(delete(RouteRow).where(RouteRow.sandbox_id == sandbox_id))

    def resolve(self, host: str) -> Resolved | None:
        """The live sandbox and route a ``Host`` header names, or None (also when the sandbox's account is being
        deleted or deleted: :meth:`account_ended` tells that case apart)."""
        parsed = parse_host(host, self.control.settings.domain)
        if parsed is None:
            return None
        port, subdomain = parsed
        with self.store.session() as s:
            sb = s.scalar(select(SandboxRow).where(SandboxRow.subdomain == subdomain))
            if sb is None or sb.state == "deleted":
                return None
            account = s.get(AccountRow, sb.account_id)
            if account is not None and account.state in ENDED:
                return None
            route = s.get(RouteRow, (sb.id, port))
            return None if route is None else Resolved(sb, route)

    def account_ended(self, host: str) -> bool:
        """Whether ``host`` names a sandbox of an account being deleted or deleted (issue 36): the proxy answers
        401 there, as for any token that no longer opens anything, where an unknown host is 404."""
        parsed = parse_host(host, self.control.settings.domain)
        if parsed is None:
            return False
        with self.store.session() as s:
            sb = s.scalar(select(SandboxRow).where(SandboxRow.subdomain == parsed[1]))
            account = s.get(AccountRow, sb.account_id) if sb is not None else None
            return account is not None and account.state in ENDED

    def ensure_running(self, sandbox_id: str) -> SandboxRow:
        """Make sure the sandbox runs before a proxied request is passed on: wait for one that is starting or
        resuming; resume a stopped one whose ``auto_resume`` is set (waiting up to :data:`AUTO_RESUME_WAIT`
        seconds). Raises 409 ``not_running`` with the state otherwise, or the resume's error."""
        cp = self.control
        row = cp.get(sandbox_id)
        if row.state == "running":
            return row
        if row.state in ("stopped", "error") and row.auto_resume and not row.no_snapshots:
            cp.resume(sandbox_id, wait=AUTO_RESUME_WAIT)
            return cp.wait_settled(sandbox_id, AUTO_RESUME_WAIT)
        if row.state in TRANSIENT and row.state != "deleting" and (row.state != "stopping" or row.auto_resume):
            settled = cp.lifecycle.wait_for(sandbox_id, {"running", "stopped"}, AUTO_RESUME_WAIT)
            if settled.state == "running":
                return settled
            return self.ensure_running(sandbox_id)
        raise ControlError("not_running", f"sandbox {sandbox_id} is {row.state}", 409, row.state)
