"""The node's bridge keeps one MAC address while sandbox ports come and go (sbx.node.network.bridge.bridge_mac). A
bridge with no address of its own takes its lowest port's and changes it at every join and leave, so every sandbox's
cached gateway MAC went stale for a while: a live migration's resets were dropped on the old MAC and the peer hung. Runs
the node's real ensure_bridge in a throwaway network namespace (``unshare --net``; root needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import json
from pyroute2 import IPRoute
from sbx.node.network import bridge as network

network.ensure_bridge("sbxmac0", "10.66.0.0/16", "macnode")
seen = []
with IPRoute() as ipr:
    br = ipr.link_lookup(ifname="sbxmac0")[0]
    mac = lambda: ipr.get_links(br)[0].get_attr("IFLA_ADDRESS")
    seen.append(mac())
    for i, port_mac in enumerate(["00:00:00:00:00:01", "00:00:00:00:00:02"]):  # lower than any random one
        ipr.link("add", ifname=f"vmac{i}", kind="veth", peer=f"pmac{i}")
        port = ipr.link_lookup(ifname=f"vmac{i}")[0]
        ipr.link("set", index=port, address=port_mac)
        ipr.link("set", index=port, master=br, state="up")
        seen.append(mac())
    ipr.link("del", index=ipr.link_lookup(ifname="vmac0")[0])
    seen.append(mac())
network.ensure_bridge("sbxmac0", "10.66.0.0/16", "macnode")  # a server restart
with IPRoute() as ipr:
    seen.append(ipr.get_links(ipr.link_lookup(ifname="sbxmac0")[0])[0].get_attr("IFLA_ADDRESS"))
print(json.dumps(seen))
"""


def test_the_bridge_mac_stays_while_ports_join_and_leave() -> None:
    assert os.geteuid() == 0, "needs root: a network namespace, a bridge, nftables"
    root = Path(__file__).resolve().parents[4]
    p = subprocess.run(["unshare", "--net", sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": str(root)})
    assert p.returncode == 0, p.stderr
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    from sbx.node.network.bridge import bridge_mac

    assert seen == [bridge_mac("sbxmac0")] * 5, seen
