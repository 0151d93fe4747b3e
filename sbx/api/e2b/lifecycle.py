"""What an E2B sandbox does at its timeout: pause (sbx's own rule, the default here) or, when created with
``autoPause: false`` (the SDK's ``lifecycle={"on_timeout": "kill"}``), be killed.

sbx's reaper stops every sandbox idle for its ttl, keeping its memory (``stop_reason`` ``idle``). A sandbox that
must be killed instead carries the label :data:`ON_TIMEOUT` = ``kill`` (visible to sbx's own API and CLI, hidden
from E2B's ``metadata``), and :class:`TimeoutKills`, a thread of the server process, deletes each such sandbox
once the reaper has stopped it for being idle. A pause asked for (``pause()``) is not a timeout: that sandbox
stays paused until it is resumed or killed. Several replicas may each run one; a delete already under way is
skipped.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from sbx.control.errors import ControlError

if TYPE_CHECKING:
    from sbx.control.service import ControlPlane
    from sbx.control.store.database import SandboxRow

log = logging.getLogger("sbx.api.e2b")

ON_TIMEOUT = "e2b.on-timeout"
"""The label of a sandbox killed at its timeout (value ``kill``)."""
KILL = "kill"
PORTS = "e2b.ports"
"""The label of a sandbox created through E2B's API: how ``<port>-<sandboxID>.<domain>`` reaches its ports that
no route hosts (:mod:`sbx.api.e2b.hosts`): :data:`PUBLIC` (E2B's default) or :data:`TRAFFIC_TOKEN`
(``network.allowPublicTraffic`` false: with the sandbox's ``trafficAccessToken``)."""
PUBLIC = "public"
TRAFFIC_TOKEN = "traffic-token"
OWN_LABELS = (ON_TIMEOUT, PORTS)
"""Labels the E2B layer sets and E2B's ``metadata`` does not show."""
TICK = 2.0
"""Seconds between two sweeps."""


def kills_on_timeout(row: SandboxRow) -> bool:
    """Whether the sandbox is killed (not paused) at its timeout."""
    return (row.labels or {}).get(ON_TIMEOUT) == KILL


def metadata(row: SandboxRow) -> dict[str, str]:
    """E2B's ``metadata`` of the sandbox: its labels without the E2B layer's own (:data:`OWN_LABELS`)."""
    return {k: v for k, v in (row.labels or {}).items() if k not in OWN_LABELS}


def sweep(cp: ControlPlane) -> list[str]:
    """Delete (in the background) every sandbox of :func:`kills_on_timeout` that the reaper stopped for being
    idle; returns their ids."""
    killed = []
    for row in cp.list_sandboxes({ON_TIMEOUT: KILL}):
        if row.state != "stopped" or row.stop_reason != "idle":
            continue
        try:
            cp.delete(row.id)
        except ControlError as e:  # another replica's sweep, or a delete by its owner, got there first
            log.info("timeout kill of %s skipped: %s", row.id, e.message)
            continue
        log.info("%s reached its timeout and is killed (autoPause false)", row.id)
        killed.append(row.id)
    return killed


class TimeoutKills:
    """The sweeping thread: :func:`sweep` every :data:`TICK` seconds from :meth:`start` to :meth:`stop`."""

    def __init__(self, cp: ControlPlane, tick: float = TICK):
        self.cp = cp
        self.tick = tick
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sweeping (in a daemon thread)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="e2b-timeout-kills", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sweeping and wait for a sweep under way."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.tick + 30)

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            try:
                sweep(self.cp)
            except Exception:  # a database hiccup: the next sweep tries again
                log.exception("timeout kills: sweep failed")

    def around(self, app: FastAPI) -> None:
        """Run from ``app``'s start to its end: its lifespan is wrapped."""
        inner: Callable[[Any], Any] = app.router.lifespan_context

        @asynccontextmanager
        async def lifespan(a: Any) -> AsyncIterator[Any]:
            async with inner(a) as state:
                self.start()
                try:
                    yield state
                finally:
                    with contextlib.suppress(Exception):
                        self.stop()

        app.router.lifespan_context = lifespan
