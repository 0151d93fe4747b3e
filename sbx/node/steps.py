"""Wall time of each step of a lifecycle operation (stop, resume, fork with memory, create from a template).

An operation makes a :class:`Steps`, calls :meth:`Steps.mark` after each step and :meth:`Steps.done` at the end.
The steps are logged at DEBUG on the ``sbx.node.steps`` logger as one line (``stop sb_x: checkpoint 212.4 ms,
cleanup 31.0 ms, ... total 301.2 ms``), and, when the environment variable ``SBX_STEP_LOG`` names a file, appended
to it as one JSON object per operation (``{"op", "id", "steps": [[name, seconds], ...], "total"}``), which is what
a profile of the benchmark reads (the benchmark's server inherits the variable). Costs a clock read per step.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("sbx.node.steps")


class Steps:
    """Step timer of one operation ``op`` (``"stop"``) on sandbox ``sid``."""

    def __init__(self, op: str, sid: str):
        self.op, self.sid = op, sid
        self.t0 = self.last = time.perf_counter()
        self.steps: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        """Record the time since the previous mark (or the start) as step ``name`` (seconds)."""
        now = time.perf_counter()
        self.steps.append((name, now - self.last))
        self.last = now

    def add(self, name: str, seconds: float) -> None:
        """Record step ``name`` of ``seconds`` that ran beside the others (in another thread): it does not move
        the mark the next :meth:`mark` measures from."""
        self.steps.append((name, seconds))

    def done(self) -> None:
        """Log the steps (see the module docstring). Never raises."""
        total = time.perf_counter() - self.t0
        if log.isEnabledFor(logging.DEBUG):
            parts = ", ".join(f"{n} {s * 1000:.1f} ms" for n, s in self.steps)
            log.debug("%s %s: %s, total %.1f ms", self.op, self.sid, parts, total * 1000)
        path = os.environ.get("SBX_STEP_LOG")
        if path:
            line = json.dumps({"op": self.op, "id": self.sid, "total": round(total, 6),
                               "steps": [[n, round(s, 6)] for n, s in self.steps]})
            try:
                with open(path, "a") as f:
                    f.write(line + "\n")
            except OSError:
                pass


class Beside:
    """``fn()`` in a thread of its own, started at once, for work beside a step of the operation (beside CRIU's
    dump in a fork with memory and in a live migration); :meth:`join` waits for it and re-raises what it raised.
    ``seconds``: how long it ran (for :meth:`Steps.add`)."""

    def __init__(self, fn: Callable[[], object]):
        self.seconds = 0.0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="sbx-beside", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            self._error = e
        self.seconds = time.perf_counter() - t0

    def join(self, quiet: bool = False) -> None:
        """Wait for it; re-raise its error unless ``quiet``."""
        self._thread.join()
        if not quiet and self._error is not None:
            raise self._error
