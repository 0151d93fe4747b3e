"""Sandbox networking on one node: a host bridge, NAT to the host's network, and one veth pair per sandbox.

Layout (all names derive from :class:`sbx.config.Settings`):

- a Linux bridge ``settings.bridge`` holding the first address of ``settings.subnet`` (the sandboxes' gateway);
- an nftables table ``sbx_<node>`` that masquerades traffic leaving the subnet, drops traffic between sandboxes,
  and drops traffic from sandboxes to the host itself (so the API port and host services are out of reach);
- per sandbox, a veth pair: the host end ``v<10 chars of the id>`` is a bridge port with ``isolated on`` (kernel
  bridge port isolation: isolated ports can't talk to each other), the other end is ``eth0`` inside the
  container's network namespace with a fixed address.

The container's network namespace is made by runc; :func:`wire_sandbox` runs from the OCI ``prestart`` hook (see
:mod:`sbx.node.nethook`), which runc runs again on CRIU restore (runtime-facts: checkpoint with
``--empty-ns network`` and rewire on restore). Netlink work goes through pyroute2.
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pyroute2 import IPRoute, NetNS
from pyroute2.netlink.exceptions import NetlinkError


@dataclass(frozen=True)
class Lease:
    """A sandbox's place on the bridge: ``address`` (``10.88.0.7/16``), ``gateway`` (``10.88.0.1``),
    ``host_veth`` (host-side interface name, at most 15 bytes)."""

    address: str
    gateway: str
    host_veth: str


def veth_name(sandbox_id: str) -> str:
    """Host-side veth name for a sandbox: ``v`` + the 10 characters after ``sb_`` (15-byte IFNAMSIZ limit)."""
    return "v" + sandbox_id.removeprefix("sb_")[:14]


def mac_for(host_veth: str) -> str:
    """A stable, locally administered MAC address for a sandbox's ``eth0`` (from its veth name). A real machine
    keeps its MAC across reboots; so does a sandbox across restore and cold boot, so the host's ARP cache never
    points at a MAC that is gone (with a new random MAC each time, the first connections after a resume went
    nowhere until the stale neighbour entry expired)."""
    digest = hashlib.sha256(host_veth.encode()).digest()
    return "02:" + ":".join(f"{b:02x}" for b in digest[:5])


def gateway_of(subnet: str) -> ipaddress.IPv4Interface:
    """The bridge's own address: the first host of ``subnet``."""
    net = ipaddress.IPv4Network(subnet)
    return ipaddress.IPv4Interface(f"{net.network_address + 1}/{net.prefixlen}")


def allocate(subnet: str, taken: set[str]) -> str:
    """Pick the lowest free address (``a.b.c.d/prefix``) in ``subnet`` after the gateway; ``taken`` holds the
    addresses in use (same form). Raises ``RuntimeError`` when the subnet is full."""
    net = ipaddress.IPv4Network(subnet)
    used = {ipaddress.IPv4Interface(a).ip for a in taken}
    gw = gateway_of(subnet).ip
    for host in net.hosts():
        if host != gw and host not in used:
            return f"{host}/{net.prefixlen}"
    raise RuntimeError(f"no free address left in {subnet}")


def _nft_table(node_name: str) -> str:
    return "sbx_" + "".join(c if c.isalnum() else "_" for c in node_name)


def ensure_bridge(bridge: str, subnet: str, node_name: str) -> None:
    """Create (idempotently) the bridge with the gateway address, enable IPv4 forwarding, and (re)load this
    node's nftables table. Raises ``subprocess.CalledProcessError`` if nft rejects the ruleset."""
    gw = gateway_of(subnet)
    with IPRoute() as ipr:
        if not ipr.link_lookup(ifname=bridge):
            ipr.link("add", ifname=bridge, kind="bridge")
        idx = ipr.link_lookup(ifname=bridge)[0]
        addrs = {a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(index=idx, family=2)}
        if str(gw.ip) not in addrs:
            ipr.addr("add", index=idx, address=str(gw.ip), prefixlen=gw.network.prefixlen)
        ipr.link("set", index=idx, state="up")
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
    table = _nft_table(node_name)
    ruleset = f"""
table inet {table}
delete table inet {table}
table inet {table} {{
  chain forward {{
    type filter hook forward priority 0; policy accept;
    iifname "{bridge}" oifname "{bridge}" drop
    oifname "{bridge}" ct state established,related accept
    oifname "{bridge}" drop
  }}
  chain input {{
    type filter hook input priority 0; policy accept;
    iifname "{bridge}" ct state established,related accept
    iifname "{bridge}" drop
  }}
  chain postrouting {{
    type nat hook postrouting priority 100; policy accept;
    ip saddr {subnet} oifname != "{bridge}" masquerade
  }}
}}
"""
    subprocess.run(["nft", "-f", "-"], input=ruleset.encode(), check=True, capture_output=True)


def remove_bridge(bridge: str, node_name: str) -> None:
    """Delete the bridge and this node's nftables table (used by tests and ``reconcile``)."""
    subprocess.run(["nft", "delete", "table", "inet", _nft_table(node_name)], capture_output=True)
    with IPRoute() as ipr:
        _delete_link(ipr, bridge)


def wire_sandbox(pid: int, lease: Lease, bridge: str) -> None:
    """Give the network namespace of host process ``pid`` (the container's init) an ``eth0`` with
    ``lease.address`` and a default route, and plug the host end into ``bridge`` as an isolated port.
    A stale host end of the same name (from a crashed run) is replaced."""
    netns_path = f"/proc/{pid}/ns/net"
    tmp_peer = "p" + lease.host_veth[1:]
    with IPRoute() as ipr:
        _delete_link(ipr, lease.host_veth)
        ipr.link("add", ifname=lease.host_veth, kind="veth", peer=tmp_peer)
        peer_idx = ipr.link_lookup(ifname=tmp_peer)[0]
        ipr.link("set", index=peer_idx, address=mac_for(lease.host_veth))
        fd = os.open(netns_path, os.O_RDONLY)
        try:
            ipr.link("set", index=peer_idx, net_ns_fd=fd)
        finally:
            os.close(fd)
        host_idx = ipr.link_lookup(ifname=lease.host_veth)[0]
        br_idx = ipr.link_lookup(ifname=bridge)[0]
        ipr.link("set", index=host_idx, master=br_idx)
        ipr.link("set", index=host_idx, state="up")
        address = str(ipaddress.IPv4Interface(lease.address).ip)
        try:  # drop what the host remembered about this address (a neighbour entry from before a restore)
            ipr.neigh("del", dst=address, ifindex=br_idx)
        except NetlinkError:
            pass
    # Port isolation: pyroute2 0.7 has no bridge-port attribute helper for it, so use iproute2's `bridge`.
    subprocess.run(["bridge", "link", "set", "dev", lease.host_veth, "isolated", "on"], check=True, capture_output=True)
    iface = ipaddress.IPv4Interface(lease.address)
    ns = NetNS(netns_path)
    try:
        lo = ns.link_lookup(ifname="lo")[0]
        ns.link("set", index=lo, state="up")
        idx = ns.link_lookup(ifname=tmp_peer)[0]
        ns.link("set", index=idx, ifname="eth0")
        ns.addr("add", index=idx, address=str(iface.ip), prefixlen=iface.network.prefixlen)
        ns.link("set", index=idx, state="up")
        try:
            ns.route("add", dst="default", gateway=lease.gateway)
        except NetlinkError as e:  # already there
            if e.code != errno.EEXIST:
                raise
    finally:
        ns.close()


def unwire_sandbox(lease: Lease) -> None:
    """Remove the host end of a sandbox's veth pair if it is still there (deleting one end removes both)."""
    with IPRoute() as ipr:
        _delete_link(ipr, lease.host_veth)


def _delete_link(ipr: IPRoute, name: str) -> None:
    """Delete interface ``name`` if it exists. A veth vanishes by itself when its container's network namespace
    goes away, possibly between the lookup and the delete: "No such device" (ENODEV) then means done."""
    for idx in ipr.link_lookup(ifname=name):
        try:
            ipr.link("del", index=idx)
        except NetlinkError as e:
            if e.code != errno.ENODEV:
                raise


def host_veths(prefix: str = "v") -> list[str]:
    """Names of host interfaces that are veth devices starting with ``prefix``."""
    out = []
    with IPRoute() as ipr:
        for link in ipr.get_links():
            info = link.get_attr("IFLA_LINKINFO")
            kind = info.get_attr("IFLA_INFO_KIND") if info else None
            name = link.get_attr("IFLA_IFNAME")
            if kind == "veth" and name.startswith(prefix):
                out.append(name)
    return out


def lease_to_json(lease: Lease) -> str:
    return json.dumps({"address": lease.address, "gateway": lease.gateway, "host_veth": lease.host_veth})


def lease_from_json(text: str) -> Lease:
    d = json.loads(text)
    return Lease(address=d["address"], gateway=d["gateway"], host_veth=d["host_veth"])
