"""When each sandbox was last used, for the TTL reaper (:class:`Activity`)."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("sbx.control")




class Activity:
    """When each sandbox was last used, for the TTL reaper. An exec (for its whole run), an attached log stream
    or a job wait counts as activity. Times are ``time.monotonic()`` seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._active: dict[str, int] = {}

    def touch(self, sandbox_id: str) -> None:
        with self._lock:
            self._last[sandbox_id] = time.monotonic()

    def begin(self, sandbox_id: str) -> None:
        """An attached session starts (exec, log follow); the sandbox is active until :meth:`end`."""
        with self._lock:
            self._active[sandbox_id] = self._active.get(sandbox_id, 0) + 1
            self._last[sandbox_id] = time.monotonic()

    def end(self, sandbox_id: str) -> None:
        with self._lock:
            n = self._active.get(sandbox_id, 0) - 1
            if n > 0:
                self._active[sandbox_id] = n
            else:
                self._active.pop(sandbox_id, None)
            self._last[sandbox_id] = time.monotonic()

    def idle_for(self, sandbox_id: str) -> float:
        """Seconds since the last activity; 0 while a session is attached. A sandbox never seen counts from now."""
        now = time.monotonic()
        with self._lock:
            if self._active.get(sandbox_id):
                return 0.0
            return now - self._last.setdefault(sandbox_id, now)

    def forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._last.pop(sandbox_id, None)
            self._active.pop(sandbox_id, None)
