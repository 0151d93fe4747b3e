"""A network namespace for a build's RUN steps, plugged into the node's bridge like a sandbox's.

:func:`build_network` starts a holder process (``unshare --net -- sleep infinity``: the namespace lives as long as
it does), pins the build's lease and wires the namespace's ``eth0`` onto the bridge exactly as a sandbox's
(:func:`sbx.node.network.bridge.pin_sandbox`, :func:`~sbx.node.network.bridge.wire_sandbox`), and yields
``/proc/<holder>/ns/net`` for ``buildah bud --network ns:<path>``. The node's nftables rules then treat the RUN steps
as a sandbox: the egress policy (the package mirror and the public internet as configured, never private addresses,
the host's own services, the bridge gateway's ports or other sandboxes). On exit the veth, pin and holder go.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

from sbx.config import Settings
from sbx.node.images.errors import ImageError
from sbx.node.network import bridge

#: Seconds the holder may take to enter its new network namespace.
HOLDER_START = 5.0


def nameservers(settings: Settings) -> list[str]:
    """The nameservers RUN steps and the sbx layer's apt get (``buildah bud --dns``): the node's resolver on its
    bridge gateway (:mod:`sbx.node.network.resolver`, started by the node's ``prepare``), the one a sandbox's
    ``resolv.conf`` names; the egress rules keep the host's own nameservers out of a sandbox's (and a build's)
    reach."""
    return [str(bridge.gateway_of(settings.subnet).ip)]


@contextmanager
def build_network(lease: bridge.Lease, bridge_name: str, node_name: str) -> Iterator[str]:
    """A network namespace on ``bridge_name`` with ``lease``'s address (filtered as a sandbox of ``node_name``);
    yields its path (``/proc/<pid>/ns/net``). Raises ``ImageError("image_build_failed")`` when it can't be made;
    nothing is left then or after the block."""
    holder = subprocess.Popen(["unshare", "--net", "--", "sleep", "infinity"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    path = f"/proc/{holder.pid}/ns/net"
    try:
        mine = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + HOLDER_START
        while True:
            try:
                if os.readlink(path) != mine and _execd(holder.pid):
                    break
            except OSError:
                pass
            if holder.poll() is not None or time.monotonic() > deadline:
                raise ImageError("image_build_failed", "the build's network namespace did not start")
            time.sleep(0.01)
        try:
            bridge.pin_sandbox(lease, bridge_name, node_name)
            bridge.wire_sandbox(holder.pid, lease, bridge_name, node_name)
        except Exception as e:
            raise ImageError("image_build_failed", f"wiring the build's network: {e}") from e
        yield path
    finally:
        try:
            bridge.unwire_sandbox(lease, bridge_name, node_name)
        finally:
            if holder.poll() is None:
                os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()


def _execd(pid: int) -> bool:
    """True once ``unshare`` has exec'd its command (``sleep``): the namespace is then final."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() == "sleep"
    except OSError:
        return False
