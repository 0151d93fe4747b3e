"""Ready jobs: an E2B command that can, starts in an sbx job started beforehand, so that it costs one attached exec
(its follower) instead of a job's start (``systemd-run``) and then that exec.

A ready job is an ordinary sbx job of the user ``user`` (:meth:`sbx.control.service.ControlPlane.exec_detached`,
so it is a unit of the sandbox's systemd: it outlives any call and a pause) whose command (:func:`ready_command`)
prints its pid as every E2B process does (:mod:`sbx.api.e2b.procs`), makes a named pipe ``e2b-in`` and the marker
``e2b-ready`` in its folder, and waits for one shell snippet on the pipe, which it ``eval`` s: the command's
exports, then ``exec`` of the command itself, which so takes over the job's pid. A ``Start`` of a command that runs
as ``user`` in the home directory, without stdin or a terminal, sends a follower that claims a ready job
(:func:`claim`: ``mkdir`` of ``e2b-claimed`` in its folder, atomic; the job's process alive and in its own unit),
writes the command's meta (``e2b-meta``, which ``commands.list`` reads) and the snippet, then follows the job as
usual. With no ready job the follower prints ``noclaim`` and the command starts the usual way. After each
``Start`` of such a command, one ready job is started in the background (:class:`Pool`), so a sandbox that runs
E2B commands keeps one idle ``bash`` waiting (``sbx jobs`` lists it).
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from sbx.api.e2b.follower import JOBS_DIR, NAP
from sbx.control.errors import ControlError

if TYPE_CHECKING:
    from sbx.control.service import ControlPlane

log = logging.getLogger("sbx.api.e2b")

READY_MARK = "# sbx-e2b-ready"
NO_CLAIM = b"noclaim"
"""The first line of a claiming follower that found no ready job."""
TARGET = 2
"""Ready jobs kept per sandbox."""
HOLD_WAIT = 30.0
"""Longest wait (seconds) of :meth:`Pool.hold` for a ready job's start in flight."""
SNIPPET_MAX = 16 << 10
"""Largest snippet sent to a ready job (bigger commands start the usual way)."""


def ready_command() -> str:
    """The command of a ready job (see the module's doc)."""
    return ("printf '%s\\n' \"$$\" >&2\n"
            'd=$(dirname "$(readlink /proc/$$/fd/1)") && mkfifo -m 600 "$d/e2b-in" && : > "$d/e2b-ready" || exit 1\n'
            's=; IFS= read -r -d "" s < "$d/e2b-in"; rm -f "$d/e2b-in" "$d/e2b-ready"\n'
            'eval "$s"\n'
            f"{READY_MARK}")


def snippet(argv: str, env: dict[str, str] | None) -> str:
    """What a ready job ``eval`` s: ``env`` exported, then ``exec`` of ``argv`` (already quoted)."""
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in (env or {}).items())
    return f"{exports}exec {argv}\n"


def claim(text: str, meta_line: str) -> str:
    """Shell (run as root) setting ``d`` to a ready job's folder it claimed and handed ``text`` (a
    :func:`snippet`), its ``meta_line`` written to ``e2b-meta``; ``noclaim`` and exit 0 when there is none."""
    return (
        f'd=; for f in {JOBS_DIR}/job_*/e2b-ready; do\n'
        '  [ -e "$f" ] || continue; c=${f%/e2b-ready}; mkdir "$c/e2b-claimed" 2>/dev/null || continue\n'
        '  p=; IFS= read -r p < "$c/stderr"; case "$p" in ""|*[!0-9]*) continue;; esac\n'
        '  [ ! -e "$c/exit" ] && [ -p "$c/e2b-in" ] || continue; g=; IFS= read -r -d "" g < "/proc/$p/cgroup"\n'
        '  case "$g" in *"sbx-${c##*/}.service"*) d=$c; break;; esac\n'
        'done\n'
        f'[ -n "$d" ] || {{ echo {NO_CLAIM.decode()}; exit 0; }}\n'
        f'printf "%s\\n" {shlex.quote(meta_line)} > "$d/e2b-meta"\n'
        f'exec 3<>"$d/e2b-in"; printf "%s" {shlex.quote(text)} >&3; exec 3>&-\n'
        'i=0; while [ -p "$d/e2b-in" ]; do i=$((i+1)); '
        f'if [ $i -gt 200 ]; then rm -f "$d/e2b-meta"; echo {NO_CLAIM.decode()}; exit 0; fi; {NAP}; done\n'
    )


class Pool:
    """Keeps :data:`TARGET` ready jobs per sandbox that runs E2B commands, as far as this server process knows
    (a claim that finds none resets its count): :meth:`claimed` and :meth:`empty` say what a ``Start`` found,
    and ready jobs are started in background threads, one at a time per sandbox."""

    def __init__(self, cp: ControlPlane):
        self.cp = cp
        self._lock = threading.Condition()
        self._ready: dict[str, int] = {}
        self._busy: set[str] = set()
        self._held: dict[str, int] = {}

    @contextlib.contextmanager
    def hold(self, sandbox_id: str, wait: float = HOLD_WAIT) -> Iterator[None]:
        """While the block runs (a pause), start no ready job in the sandbox, after waiting up to ``wait``
        seconds for a start in flight to end: a pause that came while ``systemd-run`` was talking to the
        sandbox's systemd would cut that job's start half way, and its checkpoint could fail on the open
        connection and stop the sandbox without its memory."""
        with self._lock:
            self._held[sandbox_id] = self._held.get(sandbox_id, 0) + 1
            self._lock.wait_for(lambda: sandbox_id not in self._busy, timeout=wait)
        try:
            yield
        finally:
            with self._lock:
                self._held[sandbox_id] -= 1
                if not self._held[sandbox_id]:
                    del self._held[sandbox_id]

    def worth_claiming(self, sandbox_id: str) -> bool:
        """Whether a ready job may be there: not when this process knows there is none (a sandbox it made, or
        whose last claim found none, and none started since); yes for a sandbox it knows nothing of."""
        with self._lock:
            return self._ready.get(sandbox_id, 1) > 0

    def claimed(self, sandbox_id: str) -> None:
        """A ready job of the sandbox was used: start another."""
        with self._lock:
            self._ready[sandbox_id] = max(0, self._ready.get(sandbox_id, 0) - 1)
        self._refill(sandbox_id)

    def empty(self, sandbox_id: str, refill: bool = True) -> None:
        """The sandbox has no ready job (new, or a claim found none): start some, unless not ``refill``."""
        with self._lock:
            self._ready[sandbox_id] = 0
        if refill:
            self._refill(sandbox_id)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone."""
        with self._lock:
            self._ready.pop(sandbox_id, None)

    def _refill(self, sandbox_id: str) -> None:
        with self._lock:
            if sandbox_id in self._busy or sandbox_id in self._held or self._ready.get(sandbox_id, 0) >= TARGET:
                return
            self._busy.add(sandbox_id)
        threading.Thread(target=self._fill, args=(sandbox_id,), name="e2b-ready-job", daemon=True).start()

    def _fill(self, sandbox_id: str) -> None:
        try:
            while True:
                with self._lock:
                    if self._ready.get(sandbox_id, 0) >= TARGET or sandbox_id in self._held:
                        return
                self.cp.exec_detached(sandbox_id, ready_command(), user="user")
                with self._lock:
                    self._ready[sandbox_id] = self._ready.get(sandbox_id, 0) + 1
        except ControlError as e:  # a sandbox that stopped or went: its next command starts the usual way
            log.info("no ready job for %s: %s", sandbox_id, e.message)
        except Exception:
            log.exception("starting a ready job in %s failed", sandbox_id)
        finally:
            with self._lock:
                self._busy.discard(sandbox_id)
                self._lock.notify_all()
