"""``process.Process/Start``'s events, made as fast as the sandbox allows (:mod:`sbx.api.e2b.procs` says what a
process is: an sbx job and a follower):

1. A command a ready job may run (:mod:`sbx.api.e2b.pool`) is handed to one by its follower: one attached exec.
   (Not tried when the server knows the sandbox has none: a sandbox it made, whose first command then starts
   its ready jobs.)
2. Otherwise (no ready job, or a command as root, in a ``cwd``, with stdin or a terminal) the job is started in a
   thread of its own while its follower, started at once, waits for the job carrying the start's nonce: one
   exec's time sooner than following it once started. A start that fails ends the follower (within half a second,
   the exec's stop poll) and is the stream's error; a job started but not found by its follower within
   :data:`FIND_GRACE` seconds is ``not_found``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import sbx.api.e2b.pool as pool
import sbx.api.e2b.procs as procs
from sbx.api.e2b.connect import ConnectError
from sbx.api.e2b.follower import START_WAIT

if TYPE_CHECKING:
    from sbx.control.service import ControlPlane

FIND_GRACE = 2.0
"""Seconds a started job's follower may take to find it (it takes a poll of 5 ms when the sandbox runs)."""


def start(cp: ControlPlane, ready: pool.Pool, sid: str, spec: procs.Launch, left: threading.Event
          ) -> Iterator[dict[str, Any]]:
    """The ``ProcessEvent`` messages of starting ``spec`` in sandbox ``sid`` until the process ends or ``left``
    is set (the client went away: the process goes on); ``ready`` keeps the sandbox's ready jobs."""
    first = True
    if spec.ready is not None and ready.worth_claiming(sid):
        text, meta = spec.ready
        try:
            for event in procs.follow(cp, sid, "", False, left.is_set, locate=pool.claim(text, meta)):
                yield event
                if first:  # the command runs: another ready job for the next one, while this one goes on
                    first = False
                    ready.claimed(sid)
            return
        except procs.NoReadyJob:
            pass
    for event in _launch_and_follow(cp, sid, spec, left):
        yield event
        if first and spec.ready is not None:  # ready jobs for the next commands, now that this one runs
            first = False
            ready.empty(sid)


def _launch_and_follow(cp: ControlPlane, sid: str, spec: procs.Launch, left: threading.Event
                       ) -> Iterator[dict[str, Any]]:
    """Step 2 of the module's doc."""
    launched: Future[str] = Future()
    done_at: list[float] = []
    seen: list[bool] = []

    def run() -> None:
        try:
            launched.set_result(procs.launch(cp, sid, spec))
        except BaseException as e:  # handed to the stream below
            launched.set_exception(e)
        done_at.append(time.monotonic())

    threading.Thread(target=run, name="e2b-start", daemon=True).start()

    def failed() -> bool:
        return launched.done() and launched.exception() is not None

    def lost() -> bool:
        return bool(done_at) and not seen and time.monotonic() - done_at[0] > FIND_GRACE

    def gone() -> bool:
        return left.is_set() or failed() or lost()

    try:
        for event in procs.follow(cp, sid, lambda: launched.result(timeout=START_WAIT), False, gone,
                                  pty=spec.pty, nonce=spec.nonce):
            seen.append(True)
            yield event
    except ConnectError:
        if not failed() and not lost():
            raise
    error = launched.exception() if failed() else None
    if error is not None:
        raise error
    if not seen and not left.is_set():
        raise ConnectError("not_found", f"process of job {launched.result()} not found")
