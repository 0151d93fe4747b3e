"""Helpers shared by the end-to-end tests."""

from __future__ import annotations

import time
from typing import Any


def poll(fn: Any, what: str, timeout: float = 60.0, interval: float = 0.5) -> Any:
    """Call ``fn`` every ``interval`` seconds until it returns something truthy (returned), for at most ``timeout``
    seconds; then fail with ``what`` and the last value. A bound for tests that wait on background work, not a speed
    assertion (the unit tests' ``wait_until`` is this with a shorter interval)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} (last: {value!r})")
        time.sleep(interval)
