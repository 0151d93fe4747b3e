"""Giving freed space back to the host (issue 17): a thread that trims the data volume every ``settings.trim_seconds``
and soon after each delete.

Sandbox disks are mounted with ``discard`` (:func:`sbx.storage.disk.mount`), so what a sandbox deletes becomes holes
in its image file at once; deleting a sandbox, a snapshot or a memory image frees blocks of the XFS volume. Neither
shrinks the volume's sparse backing file on the host until the volume is trimmed
(:func:`sbx.storage.volume.trim_volume`), which this thread does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("sbx.trim")

AFTER_DELETE_DELAY = 1.0
"""Seconds a trim requested by a delete waits, so that a burst of deletes costs one trim."""


FOLLOW_UPS = 3
"""Passes after a trim that gave space back which trim any freed space at all (``min_slack`` of
:data:`FOLLOW_UP_SLACK`): blocks still being freed then (discards a sandbox's disk sends a while after its journal
commits, a deleted disk freed in the background by XFS) are given back too, not left under the usual threshold."""

FOLLOW_UP_SECONDS = 5.0
"""Seconds between follow-up passes."""

FOLLOW_UP_SLACK = 64 * 1024 * 1024
"""Bytes of freed space a follow-up pass gives back (the usual threshold is the trim function's own)."""


class Trimmer:
    """Calls ``trim(min_slack)`` in a daemon thread every ``every`` seconds (0 or less: never on a timer) and
    :data:`AFTER_DELETE_DELAY` seconds after :meth:`request`. ``trim`` returns the bytes trimmed, or None when it did
    not trim; ``min_slack`` is None (its own threshold) except in the :data:`FOLLOW_UPS` passes that follow, every
    :data:`FOLLOW_UP_SECONDS`, a trim that ran. A failing trim is logged and retried at the next turn; it never stops
    the thread."""

    def __init__(self, trim: Callable[[int | None], int | None], every: float):
        self._trim = trim
        self.every = every
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._follow = 0
        self.passes = 0
        """Trims done so far (each call of ``trim``, failed or not)."""

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="sbx-trim", daemon=True)
            self._thread.start()

    def request(self) -> None:
        """Ask for a trim soon (after a delete)."""
        self._wake.set()

    def stop(self) -> None:
        """End the thread; waits for a trim in progress (bounded)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def run_once(self) -> None:
        """One trim now (a follow-up one while follow-ups are due), logging the outcome."""
        self.passes += 1
        follow_up = self._follow > 0
        if follow_up:
            self._follow -= 1
        try:
            trimmed = self._trim(FOLLOW_UP_SLACK if follow_up else None)
        except Exception as e:  # a failed fstrim must not end the thread
            log.warning("trimming the data volume failed: %s", e)
            return
        if trimmed is not None:
            log.info("trimmed the data volume: freed blocks given back to the host%s",
                     " (follow-up)" if follow_up else "")
            if not follow_up:
                self._follow = FOLLOW_UPS

    def _loop(self) -> None:
        while not self._stop.is_set():
            wait = FOLLOW_UP_SECONDS if self._follow > 0 else (self.every if self.every > 0 else None)
            requested = self._wake.wait(wait)
            if self._stop.is_set():
                return
            if requested:
                self._stop.wait(AFTER_DELETE_DELAY)
                if self._stop.is_set():
                    return
                self._wake.clear()
            self.run_once()
