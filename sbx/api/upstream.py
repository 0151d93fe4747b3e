"""Opening a connection to a port of a sandbox, for the hosted-port proxy (:mod:`sbx.api.proxy`) and E2B's
port forwarding (:mod:`sbx.api.e2b.ports`): the sandbox is resumed first when it is stopped with ``autoResume``,
then reached at its address on its node's bridge, or through that node's port relay when it runs on another node
(:mod:`sbx.node.remote.relay`)."""

from __future__ import annotations

import asyncio
import logging
import os

from sbx.control.errors import ControlError
from sbx.control.service import ControlPlane
from sbx.node.remote.relay import open_relay
from sbx.node.types import NodeError

log = logging.getLogger("sbx.proxy")

CONNECT_TIMEOUT = 10.0


class Unreachable(Exception):
    """Why a sandbox's port could not be reached: the answer's HTTP ``status``, a stable ``code``, a ``message``
    that never holds the sandbox's internal address, and the sandbox's ``state`` when that is the reason."""

    def __init__(self, status: int, code: str, message: str, state: str | None = None, refused: bool = False):
        super().__init__(message)
        self.status, self.code, self.message, self.state = status, code, message, state
        self.refused = refused  # the sandbox runs but nothing listens on the port (yet)


async def open_upstream(cp: ControlPlane, sandbox_id: str, port: int
                        ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection to ``port`` of sandbox ``sandbox_id`` (resumed first when stopped with ``autoResume``).
    Raises :class:`Unreachable`: 409 ``not_running`` (with its state), 403 ``account_suspended``, 404, or 502
    ``upstream_unreachable`` (nothing answers within :data:`CONNECT_TIMEOUT` seconds) or the node's error code."""
    try:
        await asyncio.to_thread(cp.routes.ensure_running, sandbox_id)
        relay = await asyncio.to_thread(cp.node.relay, sandbox_id)
        address = "" if relay is not None else await asyncio.to_thread(cp.node.address, sandbox_id)
    except ControlError as e:
        raise Unreachable(e.status if e.status in (403, 404, 409) else 502, e.code, e.message, e.state) from e
    except NodeError as e:
        log.warning("proxy: no address for %s: %s", sandbox_id, e.message)
        raise Unreachable(502, e.code, f"sandbox {sandbox_id} cannot be reached") from e
    try:
        if relay is not None:
            return await open_relay(*relay, sandbox_id, port, timeout=CONNECT_TIMEOUT)
        return await asyncio.wait_for(asyncio.open_connection(address, port), CONNECT_TIMEOUT)
    except NodeError as e:
        if e.code != "unreachable":
            log.warning("proxy: relay to %s refused: %s %s", sandbox_id, e.code, e.message)
        raise Unreachable(502, "upstream_unreachable" if e.code == "unreachable" else e.code,
                          f"nothing answers on port {port} of sandbox {sandbox_id}",
                          refused=e.code == "unreachable") from e
    except (OSError, TimeoutError) as e:
        # never the sandbox's internal address: callers of a public route are not the sandbox's owner
        why = "timed out" if isinstance(e, TimeoutError) else (os.strerror(e.errno) if e.errno else "failed")
        raise Unreachable(502, "upstream_unreachable",
                          f"nothing answers on port {port} of sandbox {sandbox_id} ({why.lower()})",
                          refused=isinstance(e, ConnectionRefusedError)) from e
