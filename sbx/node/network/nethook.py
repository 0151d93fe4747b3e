"""OCI ``prestart`` hook of a sandbox:
``python -m sbx.node.network.nethook LEASE_FILE BRIDGE NODE [CGROUP_PATH UID_BASE]``.

It hands the container its cgroups (:func:`sbx.node.container.cgdelegate.delegate` to host uid/gid ``UID_BASE``, the
sandbox's shifted root; skipped for ``UID_BASE`` 0, the identity map) and wires its network (pinned by node
``NODE``'s bridge rules).

runc runs it with the container state JSON on stdin (OCI runtime spec, "hooks": the state includes ``pid``, the
container init's host PID), after it made the namespaces and before systemd starts; on CRIU restore runc runs it again
for the fresh network namespace. ``LEASE_FILE`` holds the sandbox's :class:`sbx.node.network.bridge.Lease` as JSON.
Exits non-zero (failing the start) if wiring fails. The node normally runs the same work in its own process
(:mod:`sbx.node.network.hookd`, reached by :mod:`sbx.node.network.hookclient`); this entry point is the fallback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sbx.node.container.cgdelegate import delegate
from sbx.node.network.bridge import lease_from_json, wire_sandbox


def apply(args: list[str], pid: int) -> None:
    """The hook's work for arguments ``LEASE_FILE BRIDGE NODE [CGROUP_PATH UID_BASE]`` and the container init's
    host ``pid``: delegate the cgroups, then wire the network. Raises what those raise."""
    lease_file, bridge, node = args[0], args[1], args[2]
    if len(args) >= 5 and int(args[4]):
        delegate(args[3], int(args[4]), int(args[4]))
    wire_sandbox(pid, lease_from_json(Path(lease_file).read_text()), bridge, node)


def main(argv: list[str]) -> int:
    state = json.load(sys.stdin)
    apply(argv[1:], int(state["pid"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
