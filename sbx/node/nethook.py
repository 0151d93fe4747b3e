"""OCI ``prestart`` hook of a sandbox: ``python -m sbx.node.nethook LEASE_FILE BRIDGE NODE [CGROUP_PATH UID_BASE]``.

It hands the container its cgroups (:func:`sbx.node.cgdelegate.delegate` to host uid/gid ``UID_BASE``, the
sandbox's shifted root; skipped for ``UID_BASE`` 0, the identity map) and wires its network (pinned by node
``NODE``'s bridge rules).

runc runs it with the container state JSON on stdin (OCI runtime spec, "hooks": the state includes ``pid``, the
container init's host PID), after it made the namespaces and before systemd starts; on CRIU restore runc runs it
again for the fresh network namespace. ``LEASE_FILE`` holds the sandbox's :class:`sbx.node.network.Lease` as JSON.
Exits non-zero (failing the start) if wiring fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sbx.node.cgdelegate import delegate
from sbx.node.network import lease_from_json, wire_sandbox


def main(argv: list[str]) -> int:
    lease_file, bridge, node = argv[1], argv[2], argv[3]
    state = json.load(sys.stdin)
    if len(argv) >= 6 and int(argv[5]):
        delegate(argv[4], int(argv[5]), int(argv[5]))
    wire_sandbox(int(state["pid"]), lease_from_json(Path(lease_file).read_text()), bridge, node)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
