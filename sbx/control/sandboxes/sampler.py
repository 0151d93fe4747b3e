"""Recent resource samples of running sandboxes, for the console's graphs: :class:`Sampler`.

A daemon thread takes a node stats sample (:meth:`sbx.node.types.NodeAgent.stats`, without the disk scan) of every
running sandbox every ``settings.stats_sample_seconds`` and keeps the last :data:`WINDOW_SECONDS` of them per
sandbox, in memory (a server restart starts the graphs afresh). A sandbox that stops keeps its samples until they
age out; a deleted one loses them when the delete finishes. CPU percent is the node's own measure: the average since the
node's previous sample of that sandbox.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from sbx.node.types import NodeAgent, NodeError

log = logging.getLogger("sbx.control")

WINDOW_SECONDS = 3600
"""How far back samples are kept, in seconds (one hour)."""


@dataclass(frozen=True)
class Sample:
    """One sample: ``at`` (Unix seconds), memory used and limit (MiB), CPU percent (100 = one core busy)."""

    at: float
    memory_used_mb: int
    memory_total_mb: int
    cpu_percent: float


class Sampler:
    """Samples the running sandboxes that ``running()`` lists (ids) through ``node`` every ``every`` seconds
    (0 or less: never). Thread-safe; :meth:`series` reads what is kept."""

    def __init__(self, node: NodeAgent, running: Callable[[], list[str]], every: float,
                 clock: Callable[[], float] = time.time):
        self.node = node
        self.running = running
        self.every = every
        self._clock = clock
        self._keep = max(2, math.ceil(WINDOW_SECONDS / every) + 1) if every > 0 else 2
        self._series: dict[str, deque[Sample]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once; not when ``every`` is 0 or less)."""
        if self._thread is None and self.every > 0:
            self._thread = threading.Thread(target=self._loop, name="sbx-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the thread (waits for a pass in progress, bounded)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def run_once(self) -> None:
        """One pass: sample each running sandbox; drop series of sandboxes no longer listed whose samples all
        aged out. A failed sample is skipped (logged at debug level)."""
        ids = self.running()
        now = self._clock()
        taken: dict[str, Sample] = {}
        for sid in ids:
            try:
                st = self.node.stats(sid, space=False)
            except NodeError as e:
                log.debug("sampling %s failed: %s", sid, e)
                continue
            if st.memory_total_mb <= 0:  # not running on the node (any more)
                continue
            taken[sid] = Sample(now, st.memory_used_mb, st.memory_total_mb, round(float(st.cpu_percent), 1))
        with self._lock:
            for sid, sample in taken.items():
                self._series.setdefault(sid, deque(maxlen=self._keep)).append(sample)
            for sid in list(self._series):
                q = self._series[sid]
                while q and q[0].at < now - WINDOW_SECONDS:
                    q.popleft()
                if not q:
                    del self._series[sid]

    def forget(self, sandbox_id: str) -> None:
        """Drop a sandbox's samples (it was deleted)."""
        with self._lock:
            self._series.pop(sandbox_id, None)

    def series(self, sandbox_id: str, seconds: float = WINDOW_SECONDS) -> list[Sample]:
        """The sandbox's samples of the last ``seconds``, oldest first (empty when none)."""
        since = self._clock() - seconds
        with self._lock:
            return [s for s in self._series.get(sandbox_id, ()) if s.at >= since]

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.run_once()
            except Exception:  # a bug or a store hiccup must not end the graphs for good
                log.exception("stats sampling pass failed")
