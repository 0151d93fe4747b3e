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

log = logging.getLogger("sbx.node.container.watch")

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


class KernelOoms:
    """OOM kills read from the kernel log (``/dev/kmsg``), by memory cgroup of the killed task.

    The cgroup v1 counter ``memory.oom_control: oom_kill`` counts a kill only in the victim's own cgroup, so a
    systemd service or job killed in a child cgroup (``system.slice/x.service``) is missing from the sandbox's
    counter, and its cgroup (and count) goes away with the unit. The kernel logs every kill as one
    ``oom-kill:...,task_memcg=<path>,...`` record, so reading those catches all of them. Only records written after
    :meth:`open` are seen (the log is read from its end)."""

    def __init__(self, path: str = "/dev/kmsg"):
        self._path = path
        self._fd: int | None = None

    def open(self) -> bool:
        """Start reading at the end of the log; False when it can't be read (not root, no /dev/kmsg)."""
        import os

        try:
            self._fd = os.open(self._path, os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self._fd, 0, os.SEEK_END)
        except OSError as e:
            log.warning("OOM kills in child cgroups are not counted: %s: %s", self._path, e)
            self._fd = None
            return False
        return True

    def close(self) -> None:
        import os

        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def read(self) -> list[str]:
        """The ``task_memcg`` paths of the OOM kills logged since the last call (one entry per kill)."""
        import errno
        import os

        out: list[str] = []
        if self._fd is None:
            return out
        while True:
            try:
                rec = os.read(self._fd, 8192)
            except OSError as e:
                if e.errno == errno.EPIPE:  # the ring buffer overwrote records we had not read: go on
                    continue
                break  # EAGAIN: nothing more for now
            if not rec:
                break
            text = rec.decode(errors="replace")
            body = text.split(";", 1)[1] if ";" in text else text
            if not body.startswith("oom-kill:"):
                continue
            for part in body.strip().split(","):
                if part.startswith("task_memcg="):
                    out.append(part.removeprefix("task_memcg="))
        return out
