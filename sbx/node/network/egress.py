"""What sandboxes may reach outside the node: the egress policy, computed once when the server starts.

By default a sandbox reaches the internet (NAT through the host) and nothing that is private or belongs to the
host's own surroundings. :func:`egress_policy` makes the three lists :func:`sbx.node.network.bridge.ensure_bridge` loads
into nftables:

- ``deny`` (:data:`DEFAULT_DENY`): link-local and cloud metadata (169.254.0.0/16), RFC 1918 (10/8, 172.16/12,
  192.168/16, which also holds every sandbox subnet), shared address space (100.64/10), loopback, "this network",
  IETF protocol assignments, benchmarking, multicast and reserved ranges, plus every IPv4 network the host itself
  sits on (its LAN or cloud VPC, e.g. ``192.0.2.0/24``). IPv6 is not forwarded for sandboxes at all (they have no
  IPv6 address), which covers ULA ``fc00::/7`` and ``fe80::/10``. The host's own addresses are out of reach
  anyway: the node's ``input`` chain drops everything a sandbox starts towards the host.
- ``allow``: CIDRs from the server setting ``egress_allow`` (``SBX_EGRESS_ALLOW=10.1.0.0/16,192.168.5.7``),
  reachable on every port even inside a denied range.
- ``services``: exact ``(address, protocol, port)`` exceptions a sandbox needs to work as a Debian machine, also
  when they sit on private addresses: the Debian mirrors the image's apt sources name (the node passes them in:
  :func:`sbx.node.host.aptsources.mirror_lines_if_any`), resolved to IPv4 addresses here, at server start, on the
  URI's port (80 for ``http``, 443 for ``https``). A mirror that moves to a new address needs a server restart; an
  apt proxy the guest is told about must be listed in ``egress_allow``.
- ``nameservers``: the host's nameservers (:func:`host_nameservers`) and the node resolver's upstreams. No sandbox
  reaches them: its DNS (UDP and TCP 53) to any of them, or to any address ``deny`` covers, is redirected to the
  node's own resolver on the bridge gateway (:mod:`sbx.node.network.resolver`, issue 33), which forwards it with a
  per-sandbox rate limit.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

#: IPv4 ranges a sandbox may not reach unless ``egress_allow`` lists them (see the module docstring).
DEFAULT_DENY = (
    "0.0.0.0/8",  # "this network"
    "10.0.0.0/8",  # RFC 1918 (and the sandbox subnets)
    "100.64.0.0/10",  # shared address space (carrier-grade NAT, some cloud services)
    "127.0.0.0/8",  # loopback
    "169.254.0.0/16",  # link-local: cloud metadata services
    "172.16.0.0/12",  # RFC 1918
    "192.0.0.0/24",  # IETF protocol assignments
    "192.168.0.0/16",  # RFC 1918
    "198.18.0.0/15",  # benchmarking
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved, broadcast
)


class EgressConfigError(ValueError):
    """The ``egress_allow`` setting holds something that is not an IPv4 network; ``code`` is
    ``invalid_egress_allow`` and ``message`` names the item."""

    code = "invalid_egress_allow"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class EgressPolicy:
    """Egress rules for one node: ``deny`` and ``allow`` are IPv4 CIDRs (``"10.0.0.0/8"``); ``services`` are
    ``(ipv4 address, "tcp" | "udp", port)`` triples reachable even inside a denied range; ``nameservers`` are IPv4
    addresses whose port 53 sandboxes never reach (their queries go to the node's resolver instead)."""

    deny: tuple[str, ...] = DEFAULT_DENY
    allow: tuple[str, ...] = ()
    services: tuple[tuple[str, str, int], ...] = ()
    nameservers: tuple[str, ...] = ()


def parse_allow(value: str | Iterable[str]) -> tuple[str, ...]:
    """The ``egress_allow`` setting as normalised IPv4 CIDRs: a comma-separated string (the environment variable)
    or a list of strings (TOML); a bare address means ``/32``; empty items are ignored. Raises
    :class:`EgressConfigError` naming the bad item for anything that is not an IPv4 network (host bits set, IPv6,
    garbage)."""
    items = value.split(",") if isinstance(value, str) else list(value)
    out = []
    for item in items:
        item = str(item).strip()
        if not item:
            continue
        try:
            out.append(str(ipaddress.IPv4Network(item, strict=True)))
        except ValueError as e:
            raise EgressConfigError(f"egress_allow: {item!r} is not an IPv4 network ({e})") from None
    return tuple(out)


def host_nameservers(resolv_conf: Path = Path("/etc/resolv.conf")) -> list[str]:
    """The host's nameservers a sandbox could send packets to: the IPv4 ``nameserver`` lines of the host's
    ``resolv.conf`` in order, minus loopback ones (a stub resolver on the host is out of a sandbox's reach anyway).
    Sandboxes don't resolve through them (the node's resolver does: :mod:`sbx.node.network.resolver`); their port 53
    is redirected to that resolver (:attr:`EgressPolicy.nameservers`). ``[]`` when the file is unreadable."""
    servers = []
    try:
        lines = resolv_conf.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split()
        if len(parts) < 2 or parts[0] != "nameserver":
            continue
        try:
            addr = ipaddress.ip_address(parts[1])
        except ValueError:
            continue
        if addr.version == 4 and not addr.is_loopback:
            servers.append(str(addr))
    return servers


def mirror_endpoints(lines: Iterable[str]) -> list[tuple[str, int]]:
    """``(host, port)`` of the ``http``/``https`` URIs in one-line apt sources (``deb URI suite comps``);
    other schemes (``file:``) need no network and are skipped."""
    out: list[tuple[str, int]] = []
    for line in lines:
        parts = line.split()
        uris = [p for p in parts[1:] if "://" in p]
        for uri in uris[:1]:
            u = urlsplit(uri)
            if u.scheme in ("http", "https") and u.hostname:
                port = u.port or (443 if u.scheme == "https" else 80)
                if (u.hostname, port) not in out:
                    out.append((u.hostname, port))
    return out


def _resolve_ipv4(host: str, port: int) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as e:
        log.warning("egress: cannot resolve apt mirror %s: %s (sandboxes reach it only if it is public)", host, e)
        return []
    return sorted({str(info[4][0]) for info in infos})


def host_networks() -> list[str]:
    """IPv4 networks of the host's interfaces (``192.0.2.0/24``), loopback excluded: the host's neighbours."""
    from pyroute2 import IPRoute

    from sbx.node.network import netlink

    nets = set()
    with IPRoute() as ipr:
        for a in netlink.dump(ipr.get_addr, family=socket.AF_INET):
            addr, plen = a.get_attr("IFA_ADDRESS"), a["prefixlen"]
            net = ipaddress.IPv4Network(f"{addr}/{plen}", strict=False)
            if not net.is_loopback:
                nets.add(str(net))
    return sorted(nets)


def egress_policy(allow: str | Iterable[str] = "", apt_lines: Iterable[str] = (),
                  dns_upstreams: Iterable[str] = ()) -> EgressPolicy:
    """The node's policy: :data:`DEFAULT_DENY` plus :func:`host_networks`, ``allow`` parsed by :func:`parse_allow`
    (raises :class:`EgressConfigError` when bad), services for the apt mirrors of ``apt_lines`` (the node passes the
    image's, :func:`sbx.node.host.aptsources.mirror_lines_if_any`), and as ``nameservers`` the host's
    (:func:`host_nameservers`) plus the non-loopback IPv4 addresses of ``dns_upstreams`` (the node resolver's
    configured upstreams). Resolves the mirror host names, so call it once at server start."""
    allowed = parse_allow(allow)
    services: list[tuple[str, str, int]] = []
    for host, port in mirror_endpoints(apt_lines):
        services += [(ip, "tcp", port) for ip in _resolve_ipv4(host, port)]
    deny = tuple(dict.fromkeys([*DEFAULT_DENY, *host_networks()]))
    extra = [a for a in dns_upstreams if not ipaddress.IPv4Address(a).is_loopback]
    return EgressPolicy(deny=deny, allow=allowed, services=tuple(dict.fromkeys(services)),
                        nameservers=tuple(dict.fromkeys([*host_nameservers(), *extra])))
