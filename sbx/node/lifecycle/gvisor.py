"""What a sandbox of the ``gvisor`` runtime class gets instead of the container class's: its OCI config for runsc,
its init, and the operations it refuses.

**The config** (:func:`gvisor_config`) starts from the container class's (:func:`sbx.runtime.oci.build_config`: the
same hostname, limits, cgroup, tmpfs mounts and environment) and changes what runsc does differently:

- the root is the disk's plain mount (no shifted uid map: the sandbox's root is root of gVisor's kernel, which
  runs as an unprivileged, seccomp-confined process on the host; the disk keeps the unshifted owners it has
  in every class);
- no user namespace, and the network namespace is a named one the node made and wired
  (:meth:`sbx.runtime.runsc.RunscRuntime.fresh_netns`): runsc reads its interfaces at start, so no prestart hook;
- no host ``/sys`` or ``/proc`` binds (LXCFS files, the masks of ``/sys``): gVisor's ``/proc`` and ``/sys`` are its
  own and show none of the host's facts; no cgroupfs mount, no OCI seccomp profile (gVisor's syscall surface is
  its own); no cpuset (runsc can't write it below the node's cgroup here; the CPU quota stays);
- the process is sbx's minimal init (tini, :data:`GVISOR_INIT_ARGS`): systemd 252 does not run as PID 1 under
  this runsc (runtime-facts).

**The init**: the node writes the minimal init's files (:data:`INIT_FILES`: the host's static tini and
``sbx-init``) into the disk at every start (:func:`install_init`), so every image, the default one included, boots
without an image rebuild; sshd and the exec agent start as in a minimal-init image.

**The exec channel**: the agent's unix socket is inside gVisor's kernel, out of the host's reach, so the node also
writes the agent's relay (``sbx/guest/gvisor/sbx-relay``) and a fresh token; the sandbox's first script
(:data:`GVISOR_INIT`) starts the relay, then the minimal init's script; the node connects to the sandbox's address on
:data:`sbx.runtime.runsc.AGENT_RELAY_PORT` with the token (:func:`sbx.node.exec.channel.connect_relay`). A command
the agent starts is a process of the init's tree: what it leaves running survives a stop and resume with memory.

**Refused** (``not_supported``, answered 409 by the API): fork with memory, live migration (runsc has no page server
and its images are restored on one host here), detached jobs (``systemd-run``: there is no systemd), templates
and warm pools (runc's memory images).
"""

from __future__ import annotations

import copy
import secrets
from pathlib import Path
from typing import Any

from sbx.guest import minimal
from sbx.node.container import guestfs
from sbx.node.types import NodeError
from sbx.runtime import runsc

GVISOR = "gvisor"
#: The static tini of the host (package tini), copied into a gvisor sandbox's disk.
TINI_STATIC = Path("/usr/bin/tini-static")
#: The init script's source in sbx (what :mod:`sbx.guest.minimal` images get).
INIT_SCRIPT = Path(__file__).resolve().parents[2] / "guest" / "files" / "usr" / "lib" / "sbx" / "sbx-init"
#: The exec agent's relay in sbx (not part of the default image's recipe: the node writes it at every start).
RELAY_SCRIPT = Path(__file__).resolve().parents[2] / "guest" / "gvisor" / "sbx-relay"
#: ``(host file, path in the sandbox)`` of what :func:`install_init` writes, mode 0755.
INIT_FILES = ((TINI_STATIC, minimal.MINIMAL_TINI), (INIT_SCRIPT, minimal.MINIMAL_INIT_SCRIPT),
              (RELAY_SCRIPT, runsc.AGENT_RELAY))
#: The gvisor class's first script: the relay in the background (a process of the init's tree, so a restore keeps
#: it; its stdio the guest's /dev/null), then the minimal init's script in its place.
GVISOR_INIT = "/usr/lib/sbx/sbx-init-gvisor"
GVISOR_INIT_TEXT = f"""#!/bin/sh
# sbx-init-gvisor: written by the node at every start of a gvisor sandbox (sbx/node/lifecycle/gvisor.py)
if [ -x /usr/bin/python3 ] && [ -f {runsc.AGENT_RELAY} ]; then
    /usr/bin/python3 -IS {runsc.AGENT_RELAY} {runsc.AGENT_RELAY_PORT} </dev/null >/dev/null 2>&1 &
fi
exec /bin/sh {minimal.MINIMAL_INIT_SCRIPT}
"""
#: The process of a gvisor sandbox: tini (PID 1, reaping, signals to the group) running :data:`GVISOR_INIT`.
GVISOR_INIT_ARGS = (minimal.MINIMAL_TINI, "-g", "--", "/bin/sh", GVISOR_INIT)
#: Mount destinations of the container class that a gvisor sandbox does without (see the module doc).
_DROPPED_MOUNT_TYPES = {"cgroup"}


def gvisor_config(config: dict[str, Any], root: str, netns: str) -> dict[str, Any]:
    """The runsc ``config.json`` made from the container class's ``config`` (not changed): root path ``root`` (an
    absolute path: the disk's plain mount), network namespace ``netns`` (a path), the minimal init as the process,
    and no user namespace, hooks, host ``/proc``/``/sys`` binds, masks, cgroupfs or seccomp profile."""
    out = copy.deepcopy(config)
    out["root"] = {"path": root, "readonly": False}
    out["process"]["args"] = list(GVISOR_INIT_ARGS)
    out["process"]["env"] = [e for e in out["process"]["env"] if not e.startswith("SYSTEMD_")]
    out["hooks"] = {}
    out["annotations"] = {k: v for k, v in out.get("annotations", {}).items() if not k.startswith("org.criu.")}
    out["mounts"] = [
        m for m in out["mounts"]
        if m.get("type") not in _DROPPED_MOUNT_TYPES and m.get("type") != "bind"
    ]
    linux = out["linux"]
    for key in ("uidMappings", "gidMappings", "maskedPaths", "readonlyPaths", "seccomp"):
        linux.pop(key, None)
    # runsc fails the start writing cpuset.cpus below the node's cgroup (EACCES, measured); the CFS quota stays
    linux.get("resources", {}).get("cpu", {}).pop("cpus", None)
    namespaces = []
    for ns in linux["namespaces"]:
        if ns["type"] in ("user", "cgroup"):
            continue
        namespaces.append({"type": "network", "path": netns} if ns["type"] == "network" else dict(ns))
    linux["namespaces"] = namespaces
    return out


def install_init(root: Path) -> None:
    """Write the minimal init's files and the agent's relay (:data:`INIT_FILES`) and a new relay token (root's,
    0600) into the disk mounted (plainly) at ``root``, never following the guest's symlinks. Raises ``NodeError``
    ``boot_failed`` when a host file is missing (tini: run ``sbx setup``) or the guest's path is unsafe."""
    try:
        for host, guest in INIT_FILES:
            guestfs.write_file(root, guest.lstrip("/"), host.read_bytes(), mode=0o755)
        guestfs.write_file(root, GVISOR_INIT.lstrip("/"), GVISOR_INIT_TEXT.encode(), mode=0o755)
        guestfs.write_file(root, runsc.AGENT_RELAY_TOKEN.lstrip("/"), secrets.token_hex(24).encode() + b"\n",
                           mode=0o600)
    except (OSError, guestfs.UnsafePath) as e:
        raise NodeError("boot_failed", f"the gvisor class's init: {e}") from e
