"""DNS across a live migration between nodes of different subnets (issue 33): the sandbox's ``resolv.conf`` names
its first node's gateway, and after the move that address is not on the new node; the new node redirects DNS sent to
a denied address (the old gateway is one) to its own resolver, so a process that lived through the move resolves
again at once, and so does a new lookup.

Two node agents (nodes 1 and 2, each in a network namespace of its own: subnets ``*.16.0/20`` and ``*.32.0/20``)
whose resolvers forward to a fake nameserver of this process (:class:`tests.dnsfake.FakeNameserver`) at the host's
end of node 1's link, which both namespaces route to, answering every A query with 192.0.2.1, so no real nameserver
is asked."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from tests.dnsfake import FAKE_ANSWER, RESOLVE_LOOP, FakeNameserver
from tests.e2e.cluster import cordon, info, node_cluster, ok
from tests.e2e.conftest import Server
from tests.e2e.helpers import poll
from tests.nodenet import NodeHost, node_host

pytestmark = pytest.mark.e2e

@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, list[NodeHost]]]:
    tmp = tmp_path_factory.mktemp("sbx-dnsmoves")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # a free port; the address exists once node 1's link does
    address = node_host(1, tmp).host_ip  # the host's end of node 1's link: both namespaces route to it
    with node_cluster(tmp, [1, 2], "dnsmsrv", "sbxdnsm", "10.75.0.0/16",
                      node_env={"SBX_DNS_UPSTREAMS": f"{address}:{port}"}) as c:
        ns = FakeNameserver(address, port)  # bound to that address: its answers come from the address asked
        try:
            yield c
        finally:
            ns.close()


def test_a_process_resolves_through_a_live_migration_to_another_subnet(cluster: tuple[Server, list[NodeHost]]) -> None:
    srv, nodes = cluster
    n1, n2 = nodes[0], nodes[1]
    assert n1.subnet != n2.subnet
    cordon(srv, nodes, 2)
    sid = ok(srv, "new", "--type", "small").strip()
    assert info(srv, sid)["node"] == n1.node_name
    resolv = ok(srv, "exec", sid, "-u", "root", "cat /etc/resolv.conf")
    gw1 = n1.subnet.split("/")[0].rsplit(".", 1)[0] + ".1"
    assert f"nameserver {gw1}" in resolv, resolv
    ok(srv, "exec", sid, "-u", "root", f"cat > /root/loop.py <<'EOF'\n{RESOLVE_LOOP}\nEOF")
    ok(srv, "exec", sid, "-u", "root", "--detach", "python3 /root/loop.py loop.moves.test /root/resolve.log")
    poll(lambda: f"ok {FAKE_ANSWER}" in ok(srv, "exec", sid, "-u", "root", "cat /root/resolve.log 2>/dev/null || true"),
         "a lookup on the first node", 60)
    pid = ok(srv, "exec", sid, "-u", "root", "pgrep -o -f '[l]oop.py'").strip()

    ok(srv, "node", "uncordon", n2.node_name)
    ok(srv, "migrate", sid, "--to", n2.node_name, "--wait", timeout=600)
    moved = time.time()
    assert info(srv, sid)["node"] == n2.node_name
    assert ok(srv, "exec", sid, "-u", "root", "cat /etc/resolv.conf") == resolv  # still the first node's gateway

    def resolved_after_the_move() -> bool:
        log = ok(srv, "exec", sid, "-u", "root", "tail -n 5 /root/resolve.log")
        lines = [ln.split() for ln in log.splitlines()]
        return any(len(ln) == 3 and float(ln[0]) > moved and ln[1:] == ["ok", FAKE_ANSWER] for ln in lines)

    poll(resolved_after_the_move, "a lookup of the same process on the second node", 30)
    assert ok(srv, "exec", sid, "-u", "root", "pgrep -o -f '[l]oop.py'").strip() == pid
    out = ok(srv, "exec", sid, "-u", "root", "getent hosts fresh.moves.test")
    assert out.split()[0] == FAKE_ANSWER, out
    ok(srv, "delete", sid, "--wait")
