"""Test slots: several copies of the end-to-end suite on one host (parallel workers, or several developers).

Every test server has a node name, a bridge and a /16 subnet that must not collide with another server running on
the same host at the same time. ``SBX_TEST_SLOT=N`` (0..7, default 0) moves them all: node and bridge names get the
suffix ``sN`` and the subnet's second octet moves up by 20·N, so slot 0 keeps the names the tests were written
with. Under pytest-xdist the worker number is the slot when SBX_TEST_SLOT is unset.

Not moved: ``tests/security/test_network.py``'s fake outside world, whose addresses (169.254.169.254 and the routed
targets) are fixed by what it tests; run it in one slot at a time.
"""

from __future__ import annotations

import ipaddress
import os


def slot() -> int:
    """This run's slot: ``SBX_TEST_SLOT``, else the xdist worker's number (``gwN``), else 0."""
    if "SBX_TEST_SLOT" in os.environ:
        n = int(os.environ["SBX_TEST_SLOT"])
    else:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
        n = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    if not 0 <= n <= 7:
        raise ValueError(f"SBX_TEST_SLOT must be 0..7, not {n}")
    return n


def slotted(node: str, bridge: str, subnet: str) -> tuple[str, str, str]:
    """``(node, bridge, subnet)`` moved to this run's slot; unchanged in slot 0. Bridge names stay <= 15 bytes."""
    n = slot()
    if n == 0:
        return node, bridge, subnet
    net = ipaddress.IPv4Network(subnet)
    a, b, _, _ = net.network_address.packed
    b += 20 * n
    if b > 255:
        raise ValueError(f"subnet {subnet} cannot move to slot {n}")
    bridge = f"{bridge}s{n}"
    if len(bridge) > 15:
        raise ValueError(f"bridge name {bridge} is longer than 15 bytes")
    return f"{node}s{n}", bridge, f"{a}.{b}.0.0/{net.prefixlen}"
