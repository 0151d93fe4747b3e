"""Netlink dumps that the kernel interrupted, read again.

A dump (every link, address or neighbour) that races a change of the same table (another sandbox's veth made or
removed meanwhile) ends with ``NLM_F_DUMP_INTR``: its answer may miss or repeat entries, and pyroute2 raises
``NetlinkDumpInterrupted``. The kernel's advice (netlink(7), ``NLM_F_DUMP_INTR``) is to dump again. Seen in CI:
a server starting while other test servers made veths failed its reconcile with "dump interrupted".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pyroute2.netlink.exceptions import NetlinkDumpInterrupted

ATTEMPTS = 8
"""How many times a dump is tried before the interruption is raised."""


def dump(call: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    """``list(call(*args, **kwargs))`` (a pyroute2 dump such as ``ipr.get_links``), again from the start when the
    kernel interrupted it, up to :data:`ATTEMPTS` times, a few milliseconds apart. Raises
    ``NetlinkDumpInterrupted`` after the last, and whatever ``call`` raises otherwise."""
    for attempt in range(ATTEMPTS):
        try:
            return list(call(*args, **kwargs))
        except NetlinkDumpInterrupted:
            if attempt == ATTEMPTS - 1:
                raise
            time.sleep(0.005 * (attempt + 1))
    raise AssertionError("unreachable")
