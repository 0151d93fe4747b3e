"""The minimal init: how a sandbox of an image without systemd (and without apt to add it) runs.

An image that has neither systemd nor apt (a busybox or musl image) gets, from the sbx layer
(:mod:`sbx.node.images.layer`), ``/usr/lib/sbx/tini`` (a static tini) and ``/usr/lib/sbx/sbx-init`` (a POSIX sh
script, ``files/usr/lib/sbx/sbx-init``). The node boots it with :data:`MINIMAL_INIT_ARGS` as the OCI process and
waits for :data:`MINIMAL_READY_FILE` instead of ``systemctl is-system-running``.

What such a sandbox has: tini as PID 1 (it reaps orphans and forwards signals to the script's process group, ``-g``);
sshd when the image has one (host keys made at first boot); the exec agent (``/usr/lib/sbx/sbx-agent``) when the image
has ``python3``; ``sbx exec`` through runc otherwise. What it lacks: systemd units and everything built on them
(journald, logind sessions, timers, ``systemctl``), detached jobs that outlive the exec agent, and the first-boot
identity service (the node writes hostname and machine id before boot as for every sandbox). Stopping: the node sends
signal 37 (``SIGRTMIN+3``, systemd's halt) or ``SIGTERM``; the script stops its children and exits, tini exits with it.
"""

from __future__ import annotations

from sbx.guest.recipe import GuestFile

#: Where the sbx layer puts the static tini in the image.
MINIMAL_TINI = "/usr/lib/sbx/tini"
#: The init script (``files/usr/lib/sbx/sbx-init``) in the image.
MINIMAL_INIT_SCRIPT = "/usr/lib/sbx/sbx-init"
#: The OCI process args of a sandbox whose image's init is ``minimal``: a shell that points its standard streams at
#: ``/dev/null`` and becomes tini (PID 1 stays one process). ``runc run -d`` hands the container the node's pipes;
#: systemd reopens its own, tini and the script would keep them open and the node's ``runc run`` would wait for their
#: end (seen: the boot timed out after 120 s).
MINIMAL_INIT_ARGS = ("/bin/sh", "-c", f"exec </dev/null >/dev/null 2>&1; exec {MINIMAL_TINI} -g -- /bin/sh "
                     f"{MINIMAL_INIT_SCRIPT}")
#: The file the init script creates once sshd and the exec agent (those the image has) are started.
MINIMAL_READY_FILE = "/run/sbx-init.ready"
#: The signals the init script stops on: SIGTERM and SIGRTMIN+3 (37, how the node asks for a halt).
MINIMAL_STOP_SIGNALS = (15, 37)

#: Guest files a minimal-init image gets (sources under ``sbx/guest/files``); tini comes from the host's static build.
MINIMAL_FILES = (
    GuestFile("usr/lib/sbx/sbx-init", MINIMAL_INIT_SCRIPT, 0o755),
    GuestFile("usr/lib/sbx/sbx-agent", "/usr/lib/sbx/sbx-agent", 0o755),
    GuestFile("etc/sbx/README", "/etc/sbx/README", 0o644),
    GuestFile("etc/hosts", "/etc/hosts", 0o644),
)
