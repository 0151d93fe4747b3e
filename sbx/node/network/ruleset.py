"""The nftables rulesets of a node's network (what they are for: :mod:`sbx.node.network.bridge`): the ``inet``
table (sandbox isolation, the egress policy, the egress proxy's and the DNS resolver's redirects, the per-sandbox
connection limit, masquerading) and the ``bridge`` table that
pins every sandbox port to its own MAC and address, as text for :func:`sbx.node.network.nft.run`.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math

from sbx.node.network.egress import EgressPolicy


def table_name(node_name: str) -> str:
    """The name of this node's two nftables tables (``inet`` and ``bridge``): ``sbx_<node name>``, other characters
    than letters and digits made ``_``."""
    return "sbx_" + "".join(c if c.isalnum() else "_" for c in node_name)


def node_group(node_name: str) -> int:
    """The interface group (``IFLA_GROUP``, 1..2**31-1) this node gives its host veths, from a hash of its name:
    the bridge-family rules match ``meta iifgroup`` (this kernel has no ``meta ibrname`` for bridge tables)."""
    digest = hashlib.sha256(node_name.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 0x7FFFFFFE + 1


def _set_elements(items: list[str]) -> str:
    return f"elements = {{ {', '.join(items)} }}" if items else ""


def _redirect_rules(bridge: str, proxy_port: int) -> tuple[str, str]:
    """The egress proxy's part of the ``inet`` table (none when ``proxy_port`` is 0): a nat ``prerouting`` chain
    that redirects TCP 80/443 of the sandboxes in ``egress_proxied`` to the proxy, only towards destinations the
    egress policy lets through (the same allow / services / deny order as ``forward``; what it denies is not
    redirected and the forward chain drops it), and the ``input`` rule that admits exactly the redirected
    connections (``ct status dnat``) to the proxy's port; a sandbox dialling the port directly is dropped."""
    if not proxy_port:
        return "", ""
    to = f"tcp dport {{ 80, 443 }} redirect to :{proxy_port}"
    chain = f"""
  chain egress_redirect {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname != "{bridge}" return
    ip saddr != @egress_proxied return
    ip daddr @egress_allow {to}
    ip daddr . meta l4proto . th dport @egress_services {to}
    ip daddr @egress_deny return
    {to}
  }}"""
    accept = f'iifname "{bridge}" tcp dport {proxy_port} ct status dnat ip saddr @egress_proxied accept'
    return chain, accept


def _dns_rules(bridge: str) -> str:
    """The nat ``prerouting`` chain that sends a sandbox's DNS (UDP and TCP 53) to the node's resolver on the
    gateway (``redirect``: to the bridge's own address) when it is addressed to the host's nameservers or the
    resolver's upstreams (``dns_upstreams``: never reached directly) or to an address the egress policy denies (an
    old ``resolv.conf``, the gateway of the node a sandbox came from); DNS to allowed and public addresses is left
    alone. The ``input`` chain then admits it as any query to the gateway's port 53."""
    dns = "meta l4proto { udp, tcp } th dport 53"
    return f"""
  chain dns_redirect {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname != "{bridge}" return
    {dns} ip daddr @dns_upstreams counter name dns_redirected redirect to :53
    {dns} ip daddr @egress_allow return
    {dns} ip daddr @egress_deny counter name dns_redirected redirect to :53
  }}"""


def _dns_guard(bridge: str, gateway: str, dns_rate: float, dns_burst: int) -> str:
    """A coarse per-source guard in front of the resolver's socket: UDP queries to the gateway's port 53 beyond four
    times ``dns_rate`` per second (bursts of twice ``dns_burst``) from one address are dropped by the kernel (set
    ``dns_guard``, counter ``dns_dropped``), so one sandbox's flood can't fill the socket's receive queue and crowd
    out its neighbours' queries before the resolver's own per-source limit (the exact one) sees them. Empty when
    ``dns_rate`` is 0."""
    if not dns_rate:
        return ""
    rate, burst = max(1, math.ceil(4 * dns_rate)), max(1, 2 * dns_burst)
    return (f'iifname "{bridge}" ip daddr {gateway} udp dport 53 add @dns_guard {{ ip saddr limit rate over '
            f"{rate}/second burst {burst} packets }} counter name dns_dropped drop")


def gateway_address(subnet: str) -> str:
    """The bridge's own address in ``subnet`` (its first host, ``10.88.0.1``), where the resolver listens."""
    net = ipaddress.IPv4Network(subnet)
    return str(net.network_address + 1)


class ConnectionLimitError(ValueError):
    """A connection limit setting is wrong; ``code`` is ``invalid_connection_limit`` and ``message`` names it."""

    code = "invalid_connection_limit"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def check_connection_limits(max_connections: int, connection_rate: int) -> None:
    """Validate the per-sandbox connection limits: ``max_connections`` (conntrack entries, 0 = none) and
    ``connection_rate`` (new connections per second, 0 = none), both whole numbers >= 0. Raises
    :class:`ConnectionLimitError` naming the setting."""
    for name, value in (("sandbox_max_connections", max_connections), ("sandbox_connection_rate", connection_rate)):
        if not isinstance(value, int) or value < 0:
            raise ConnectionLimitError(f"{name}: {value!r} must be a whole number, 0 (no limit) or more")


def _limit_rules(bridge: str, max_connections: int, connection_rate: int) -> str:
    """The rules that refuse a sandbox's new connection (any protocol conntrack follows: TCP, UDP, ICMP):

    - over ``connection_rate`` new connections per second (burst: twice that) from its address (dynamic set
      ``conn_rate``): a closed TCP connection stays in the conntrack table for ``TIME_WAIT`` (120 s) without
      counting as open, so this bounds what churn can leave there (about rate x 120 entries);
    - while its address already has ``max_connections`` open in the conntrack table (``ct count``, per source
      address in the dynamic set ``conn_limit``; TCP connections in ``TIME_WAIT`` or ``CLOSE`` no longer count).

    Counter ``conn_limited`` counts both. Refused by chain ``conn_refuse``: TCP with a reset, so the program sees
    ``ECONNREFUSED`` at once (the kernel rate-limits ICMP errors, resets it doesn't), the rest with an ICMP port
    unreachable. Empty when both are 0."""
    new = f'iifname "{bridge}" ct state new'
    rules = []
    if connection_rate:
        rules.append(f"{new} add @conn_rate {{ ip saddr limit rate over {connection_rate}/second burst "
                     f"{2 * connection_rate} packets }} counter name conn_limited jump conn_refuse")
    if max_connections:
        rules.append(f"{new} add @conn_limit {{ ip saddr ct count over {max_connections} }} "
                     "counter name conn_limited jump conn_refuse")
    return "\n    ".join(rules)


def inet_ruleset(table: str, bridge: str, subnet: str, egress: EgressPolicy, proxy_port: int = 0,
                 proxied: list[str] | None = None, max_connections: int = 0, connection_rate: int = 0,
                 dns_rate: float = 0, dns_burst: int = 0) -> str:
    """The node's ``inet`` table: sandbox isolation (``forward``: no sandbox to sandbox, egress policy; ``input``:
    from the bridge only replies, DNS to the node's resolver on the gateway, the redirected egress-proxy connections
    and TCP resets), the DNS redirect (:func:`_dns_rules`), the per-sandbox connection limits ``max_connections``
    (open conntrack entries per source address) and ``connection_rate`` (new ones per second; 0: no limit;
    :func:`_limit_rules`, applied to what a sandbox starts through the host and towards it), the kernel's guard in
    front of the resolver from ``dns_rate`` and ``dns_burst`` (the resolver's per-sandbox limit; 0: none;
    :func:`_dns_guard`) and masquerading. A
    reset from a sandbox is let in even when conntrack doesn't call it ``established`` (counter ``rst_untracked``):
    the resets that ``ss -K`` sends at a live migration's freeze must reach peers on the node
    (:func:`sbx.node.migration.outgoing.reset_connections`). It can only end a connection of the sandbox's own
    address (the bridge's pins stop spoofed sources), which it could end anyway.
    Raises ``ValueError`` when ``subnet`` is not an IPv4 network, :class:`ConnectionLimitError` (a ``ValueError``)
    for a negative limit."""
    check_connection_limits(max_connections, connection_rate)
    services = [f"{ip} . {proto} . {port}" for ip, proto, port in egress.services]
    redirect, admit = _redirect_rules(bridge, proxy_port)
    gateway = gateway_address(subnet)
    limit = _limit_rules(bridge, max_connections, connection_rate)
    guard = _dns_guard(bridge, gateway, dns_rate, dns_burst)
    return f"""
table inet {table}
delete table inet {table}
table inet {table} {{
  set egress_deny {{ type ipv4_addr; flags interval; auto-merge; {_set_elements(list(egress.deny))} }}
  set egress_allow {{ type ipv4_addr; flags interval; auto-merge; {_set_elements(list(egress.allow))} }}
  set egress_services {{ type ipv4_addr . inet_proto . inet_service; {_set_elements(services)} }}
  set egress_proxied {{ type ipv4_addr; {_set_elements(list(proxied or []))} }}
  set dns_upstreams {{ type ipv4_addr; {_set_elements(list(egress.nameservers))} }}
  set conn_limit {{ type ipv4_addr; size 65536; flags dynamic; }}
  set conn_rate {{ type ipv4_addr; size 65536; flags dynamic,timeout; timeout 60s; }}
  set dns_guard {{ type ipv4_addr; size 65536; flags dynamic,timeout; timeout 60s; }}{redirect}{_dns_rules(bridge)}
  counter rst_untracked {{ }}
  counter dns_redirected {{ }}
  counter conn_limited {{ }}
  counter dns_dropped {{ }}
  chain conn_refuse {{
    meta l4proto tcp reject with tcp reset
    reject
  }}
  chain forward {{
    type filter hook forward priority 0; policy accept;
    iifname "{bridge}" oifname "{bridge}" drop
    oifname "{bridge}" ct state established,related accept
    oifname "{bridge}" drop
    iifname "{bridge}" meta nfproto != ipv4 drop
    {limit}
    iifname "{bridge}" ip daddr @egress_allow accept
    iifname "{bridge}" ip daddr . meta l4proto . th dport @egress_services accept
    iifname "{bridge}" ip daddr @egress_deny drop
  }}
  chain input {{
    type filter hook input priority 0; policy accept;
    {guard}
    iifname "{bridge}" ct state established,related accept
    iifname "{bridge}" tcp flags & rst == rst counter name rst_untracked accept
    {limit}
    iifname "{bridge}" ip daddr {gateway} meta l4proto {{ udp, tcp }} th dport 53 accept
    {admit}
    iifname "{bridge}" drop
  }}
  chain postrouting {{
    type nat hook postrouting priority 100; policy accept;
    ip saddr {subnet} oifname != "{bridge}" masquerade
  }}
}}
"""


def bridge_ruleset(table: str, group: int) -> str:
    """The pinning table. The ``pins`` set survives a reload (``add`` keeps an existing set and its elements), so a
    server restart does not cut the sandboxes that kept running; the chain is rebuilt."""
    return f"""
add table bridge {table}
add set bridge {table} pins {{ type ifname . ether_addr . ipv4_addr; }}
add chain bridge {table} prerouting {{ type filter hook prerouting priority -300; policy accept; }}
flush chain bridge {table} prerouting
add rule bridge {table} prerouting meta iifgroup != {group} accept
add rule bridge {table} prerouting ether type arp iifname . ether saddr . arp saddr ip @pins \
  iifname . arp saddr ether . arp saddr ip @pins accept
add rule bridge {table} prerouting ether type ip iifname . ether saddr . ip saddr @pins accept
add rule bridge {table} prerouting drop
"""
