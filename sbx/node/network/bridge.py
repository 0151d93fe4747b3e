"""Sandbox networking on one node: a host bridge, NAT to the host's network, and one veth pair per sandbox.

Layout (all names derive from :class:`sbx.config.Settings`):

- a Linux bridge ``settings.bridge`` holding the first address of ``settings.subnet`` (the sandboxes' gateway);
- an nftables table ``inet sbx_<node>`` that masquerades traffic leaving the subnet, drops traffic between
  sandboxes, drops traffic from sandboxes to the host itself (so the API port and host services are out of reach),
  and applies the egress policy (:mod:`sbx.node.network.egress`: no private, link-local or metadata addresses, no IPv6);
- an nftables table ``bridge sbx_<node>`` that pins every sandbox port to its own MAC and IPv4 address: a frame
  entering the bridge from one of this node's veths passes only if it is IPv4 whose Ethernet source and IP
  source are the sandbox's own, or ARP whose Ethernet source, ARP sender MAC and ARP sender IP are its own.
  Everything else (spoofed sources, gratuitous ARP for another address, IPv6, VLAN tags) is dropped before the
  bridge or the host sees it. The node's veths are recognised by their interface group
  (:func:`sbx.node.network.ruleset.node_group`, set before the veth joins the bridge), so a port is filtered from
  its first frame, and one missing from the ``pins`` set passes nothing;
- per sandbox, a veth pair: the host end ``v<10 chars of the id>`` is a bridge port with ``isolated on`` (kernel
  bridge port isolation: isolated ports can't talk to each other), the other end is ``eth0`` inside the
  container's network namespace with a fixed address and MAC (:func:`mac_for`); the host keeps a permanent
  neighbour entry for the address (a sandbox's ARP can't repoint it) and ``rp_filter`` is strict on the bridge.

The container's network namespace is made by runc; :func:`wire_sandbox` runs from the OCI ``prestart`` hook (see
:mod:`sbx.node.network.nethook`), which runc runs again on CRIU restore (runtime-facts: checkpoint with
``--empty-ns network`` and rewire on restore). Netlink work goes through pyroute2; the two tables' rules are
built in :mod:`sbx.node.network.ruleset`.
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from sbx.node.network import netlink, ruleset
from sbx.node.network.egress import EgressPolicy
from sbx.node.network.nft import NftError
from sbx.node.network.nft import run as _nft
from sbx.node.network.nsjoin import CLONE_NEWNET, in_namespace

NUD_PERMANENT = 0x80  # linux/neighbour.h


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


def bridge_mac(bridge: str) -> str:
    """The stable, locally administered MAC address of the bridge ``bridge`` (from its name). Set explicitly, it
    stays: a bridge without one takes the lowest MAC of its ports and changes it whenever a sandbox's port joins
    or leaves, and every other sandbox's cached gateway MAC then points nowhere until its neighbour entry expires.
    Measured: a live migration's reset (sent at the freeze) was dropped on the old MAC, so the peer hung, while a
    template build's port came and went (the kernel's ``br_stp_recalculate_bridge_id`` keeps an address only
    when it was set: ``NET_ADDR_SET``)."""
    digest = hashlib.sha256(f"bridge:{bridge}".encode()).digest()
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


def ensure_bridge(bridge: str, subnet: str, node_name: str, egress: EgressPolicy | None = None,
                  proxy_port: int = 0, max_connections: int = 0, connection_rate: int = 0, dns_rate: float = 0,
                  dns_burst: int = 0) -> None:
    """Create (idempotently) the bridge with the gateway address and its fixed MAC (:func:`bridge_mac`), enable IPv4
    forwarding, set strict ``rp_filter`` on the bridge, (re)load this node's ``inet`` table with ``egress``
    (default: :class:`EgressPolicy`'s fixed deny list, no exceptions), the egress proxy's redirect to
    ``proxy_port`` (0: none; the ``egress_proxied`` set starts empty, see :func:`set_proxied`), the DNS redirect to
    the node's resolver and the per-sandbox limits of ``max_connections`` open conntrack entries and
    ``connection_rate`` new connections per second (0: none; :func:`sbx.node.network.ruleset.inet_ruleset`), the
    kernel's guard in front of the resolver (from the resolver's ``dns_rate`` queries per second and ``dns_burst``;
    0: none), and
    load its ``bridge`` pinning table, keeping the pins of running sandboxes. The ``inet`` table is replaced in one
    transaction: a node killed half-way leaves the old one.
    Raises :class:`sbx.node.network.nft.NftError` if nft rejects the ruleset,
    :class:`sbx.node.network.ruleset.ConnectionLimitError` for a negative limit."""
    gw = gateway_of(subnet)
    with IPRoute() as ipr:
        if not ipr.link_lookup(ifname=bridge):
            ipr.link("add", ifname=bridge, kind="bridge")
        idx = ipr.link_lookup(ifname=bridge)[0]
        mac = bridge_mac(bridge)
        if ipr.get_links(idx)[0].get_attr("IFLA_ADDRESS") != mac:
            ipr.link("set", index=idx, address=mac)  # set once, so ports coming and going never change it
        addrs = {a.get_attr("IFA_ADDRESS") for a in netlink.dump(ipr.get_addr, index=idx, family=2)}
        if str(gw.ip) not in addrs:
            ipr.addr("add", index=idx, address=str(gw.ip), prefixlen=gw.network.prefixlen)
        ipr.link("set", index=idx, state="up")
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
    _rp_filter(bridge)
    table = ruleset.table_name(node_name)
    _nft(ruleset.inet_ruleset(table, bridge, subnet, egress or EgressPolicy(), proxy_port,
                              max_connections=max_connections, connection_rate=connection_rate,
                              dns_rate=dns_rate, dns_burst=dns_burst))
    pins = ruleset.bridge_ruleset(table, ruleset.node_group(node_name))
    try:
        _nft(pins)
    except NftError:  # a table of an older layout: start it afresh (sync_pins refills it)
        _nft(f"table bridge {table}\ndelete table bridge {table}\n" + pins)


def _rp_filter(ifname: str) -> None:
    """Strict reverse-path filtering (``rp_filter=1``) on ``ifname``; gone interfaces are ignored."""
    try:
        Path(f"/proc/sys/net/ipv4/conf/{ifname}/rp_filter").write_text("1\n")
    except FileNotFoundError:
        pass


def remove_bridge(bridge: str, node_name: str) -> None:
    """Delete the bridge and this node's nftables tables (used by tests and ``reconcile``)."""
    subprocess.run(["nft", "delete", "table", "inet", ruleset.table_name(node_name)], capture_output=True)
    subprocess.run(["nft", "delete", "table", "bridge", ruleset.table_name(node_name)], capture_output=True)
    with IPRoute() as ipr:
        _delete_link(ipr, bridge)


def _pin(lease: Lease) -> str:
    """The ``pins`` element of a lease: ``"veth" . mac . ip``."""
    ip = ipaddress.IPv4Interface(lease.address).ip
    return f'"{lease.host_veth}" . {mac_for(lease.host_veth)} . {ip}'


def pin_sandbox(lease: Lease, bridge: str, node_name: str) -> None:
    """Pin ``lease``'s port before its container starts or is restored: the ``pins`` element (its veth name, MAC
    and address) and the host's permanent neighbour entry for the address on ``bridge`` (a gratuitous ARP from a
    neighbour can't move it). Idempotent. The node runs it in its own process (a warm nftables context, well under
    a millisecond) rather than in the prestart hook, which is a fresh process on every start and restore.
    Raises ``NetlinkError`` / :class:`sbx.node.network.nft.NftError` when the kernel refuses a step."""
    _nft(f"add element bridge {ruleset.table_name(node_name)} pins {{ {_pin(lease)} }}\n")
    address = str(ipaddress.IPv4Interface(lease.address).ip)
    with IPRoute() as ipr:
        for br_idx in ipr.link_lookup(ifname=bridge):
            ipr.neigh("replace", dst=address, lladdr=mac_for(lease.host_veth), ifindex=br_idx, state=NUD_PERMANENT)


def wire_sandbox(pid: int, lease: Lease, bridge: str, node_name: str) -> None:
    """Give the network namespace of host process ``pid`` (the container's init) an ``eth0`` with
    ``lease.address``, the MAC :func:`mac_for` and a default route, and plug the host end into ``bridge`` as an
    isolated port in ``node_name``'s interface group (:func:`sbx.node.network.ruleset.node_group`, set before the
    port joins the bridge, so the pinning rules see its first frame) with strict ``rp_filter``. The port passes only
    what the lease's pin allows: :func:`pin_sandbox` must have run (without it the sandbox has no network, it is
    never unfiltered).
    A stale host end of the same name (from a crashed run) is replaced; a second run (restore) repairs the first.
    Raises ``NetlinkError`` when the kernel refuses a step."""
    netns_path = f"/proc/{pid}/ns/net"
    tmp_peer = "p" + lease.host_veth[1:]
    mac = mac_for(lease.host_veth)
    with IPRoute() as ipr:
        _delete_link(ipr, lease.host_veth)
        # the peer is made in the sandbox's namespace: moving it there afterwards took 15-35 ms here (the kernel
        # waits for an RCU grace period when a device leaves a namespace), this ~1 ms
        fd = os.open(netns_path, os.O_RDONLY)
        try:
            ipr.link("add", ifname=lease.host_veth, kind="veth",
                     peer={"ifname": tmp_peer, "address": mac, "net_ns_fd": fd})
        finally:
            os.close(fd)
        host_idx = ipr.link_lookup(ifname=lease.host_veth)[0]
        br_idx = ipr.link_lookup(ifname=bridge)[0]
        ipr.link("set", index=host_idx, group=ruleset.node_group(node_name))  # filtered from here on
        _rp_filter(lease.host_veth)
        ipr.link("set", index=host_idx, master=br_idx)
        ipr.brport("set", index=host_idx, isolated=1)  # kernel bridge port isolation
        ipr.link("set", index=host_idx, state="up")
    iface = ipaddress.IPv4Interface(lease.address)

    def inside(ns: IPRoute) -> None:
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

    in_netns(netns_path, inside)


def in_netns(netns_path: str, work: Callable[[IPRoute], None]) -> None:
    """Run ``work(ipr)`` with a netlink socket of the network namespace at ``netns_path``, from a thread that
    joined it (:func:`sbx.node.network.nsjoin.in_namespace`). Re-raises what ``work`` raised."""

    def run() -> None:
        with IPRoute() as ipr:
            work(ipr)

    in_namespace(netns_path, CLONE_NEWNET, run)


def unwire_sandbox(lease: Lease, bridge: str = "", node_name: str = "") -> None:
    """Remove the host end of a sandbox's veth pair if it is still there (deleting one end removes both), and,
    given ``bridge`` and ``node_name``, the lease's pin and permanent neighbour entry. Idempotent."""
    with IPRoute() as ipr:
        _delete_link(ipr, lease.host_veth)
        if not (bridge and node_name and lease.address):
            return
        for br_idx in ipr.link_lookup(ifname=bridge):
            try:
                ipr.neigh("del", dst=str(ipaddress.IPv4Interface(lease.address).ip), ifindex=br_idx)
            except NetlinkError:
                pass
    pin, table = _pin(lease), ruleset.table_name(node_name)
    # `add` first so the `delete` can't fail on a missing element (bookworm's nft 1.0.6 has no `destroy`)
    _nft(f"add element bridge {table} pins {{ {pin} }}\ndelete element bridge {table} pins {{ {pin} }}\n")


def sync_pins(bridge: str, node_name: str, leases: list[Lease]) -> None:
    """Make the pins and the bridge's permanent neighbour entries exactly those of ``leases`` (the sandboxes that
    run): one nft transaction replaces the ``pins`` set, stale permanent entries are deleted. For ``reconcile``,
    which repairs what a crash between wiring and recording (or before an unwire) left behind."""
    table = ruleset.table_name(node_name)
    items = [_pin(lease) for lease in leases]
    _nft(f"flush set bridge {table} pins\n" + (f"add element bridge {table} pins {{ {', '.join(items)} }}\n"
                                                 if items else ""))
    wanted = {str(ipaddress.IPv4Interface(lease.address).ip): mac_for(lease.host_veth) for lease in leases}
    with IPRoute() as ipr:
        found = ipr.link_lookup(ifname=bridge)
        if not found:
            return
        br_idx = found[0]
        for n in netlink.dump(ipr.get_neighbours, family=2, ifindex=br_idx):
            dst = n.get_attr("NDA_DST")
            if n["state"] & NUD_PERMANENT and dst not in wanted:
                try:
                    ipr.neigh("del", dst=dst, ifindex=br_idx)
                except NetlinkError:
                    pass
        for dst, mac in wanted.items():
            ipr.neigh("replace", dst=dst, lladdr=mac, ifindex=br_idx, state=NUD_PERMANENT)


def set_proxied(node_name: str, address: str, on: bool) -> None:
    """Add ``address`` (``10.88.0.7``) to this node's ``egress_proxied`` set (its outbound 80/443 goes to the egress
    proxy from the next connection on) or take it out. Idempotent. Raises :class:`sbx.node.network.nft.NftError`."""
    table = ruleset.table_name(node_name)
    batch = f"add element inet {table} egress_proxied {{ {address} }}\n"
    if not on:  # `add` first so the `delete` can't fail on a missing element
        batch += f"delete element inet {table} egress_proxied {{ {address} }}\n"
    _nft(batch)


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
        for link in netlink.dump(ipr.get_links):
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
