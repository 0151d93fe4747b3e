"""Noticing a sandbox whose init ended on its own: power-off, halt or reboot inside, or a crash.

One thread (:class:`Watcher`) checks every running sandbox about once a second. Liveness comes from runc's own
state file (``<runc root>/<id>/state.json``: ``init_process_pid`` and ``init_process_start``) compared with
``/proc/<pid>/stat`` (a reused pid has another start time), so a check costs two small file reads, no runc call.

How it ended: PID 1 of a pid namespace that calls reboot(2) is killed by the kernel, SIGHUP for a restart and
SIGINT for power-off/halt (``man 2 reboot``), but that wait status goes to the init's parent, which is not the
node (``runc run -d`` leaves the init to the host's init, and a restarted server could never see it). So the
guest says it itself: the node installs an executable in ``/usr/lib/systemd/system-shutdown/`` at every boot,
which systemd-shutdown runs right before the final reboot(2) with one argument, ``reboot``, ``poweroff``,
``halt`` or ``kexec`` (systemd-shutdown(8)); it writes that word to :data:`KIND_FILE` on the sandbox's disk. In
a container systemd-shutdown unmounts nothing, so the disk is still writable then. No word means a crash (init
killed from the host, or died). The guest can write the file itself: it only chooses between its own reboot and
its own power-off.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("sbx.node.watch")

HOOK_PATH = "usr/lib/systemd/system-shutdown/sbx-shutdown-kind"
KIND_FILE = "var/lib/sbx/shutdown-kind"
HOOK_SCRIPT = (
    "#!/bin/sh\n"
    "# Written by the sbx node at every boot: tells the host whether this shutdown is a reboot or a power-off.\n"
    f'mkdir -p /{Path(KIND_FILE).parent} && printf "%s\\n" "$1" > /{KIND_FILE}.tmp\n'
    f"mv /{KIND_FILE}.tmp /{KIND_FILE}\n"
)

INTERVAL = 1.0
"""Seconds between two checks of all running sandboxes."""


def exit_kind(word: str | None) -> str:
    """What a sandbox's end means from the word its shutdown hook wrote: ``reboot`` (``reboot``, ``kexec``),
    ``poweroff`` (``poweroff``, ``halt``), ``crashed`` (nothing written, or anything else)."""
    w = (word or "").strip()
    if w in ("reboot", "kexec"):
        return "reboot"
    if w in ("poweroff", "halt"):
        return "poweroff"
    return "crashed"


def init_alive(state_file: Path) -> bool | None:
    """True while the container init recorded in runc's ``state_file`` lives (same pid, same start time);
    False once it is gone (or a zombie); None when there is no readable state file (no container)."""
    try:
        state = json.loads(state_file.read_text())
        pid = int(state["init_process_pid"])
        start = int(state["init_process_start"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is fields[0], starttime fields[19]
    return fields[0] not in ("Z", "X") and int(fields[19]) == start


class Watcher:
    """Calls ``check()`` every :data:`INTERVAL` seconds in a daemon thread until :meth:`stop`. ``check`` does
    the node's work (find ended sandboxes, clean up, report); exceptions are logged, never end the thread."""

    def __init__(self, check: Callable[[], None], interval: float = INTERVAL):
        self._check = check
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sbx-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._check()
            except Exception:
                log.exception("sandbox watch pass failed")
