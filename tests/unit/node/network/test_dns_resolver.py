"""The node's DNS resolver (issue 33, :mod:`sbx.node.network.resolver`): its pure parts (settings, token buckets,
message checks, the sandbox's resolv.conf, the nftables rules that send DNS to it and cap connections) and the
resolver itself on loopback addresses against a fake upstream: answers keep the client's id, one source over its
limit is held there while another is answered, a dead upstream gives SERVFAIL, TCP and truncation."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from dnslib import RCODE, A, DNSRecord

from sbx.config import load_settings
from sbx.node.network import egress, resolver, ruleset
from tests.dnsfake import FakeNameserver, recv_exactly

# ----------------------------------------------------------------------------------------------- pure parts


def test_upstreams_parse_with_default_port_and_refuse_garbage() -> None:
    assert resolver.parse_upstreams("192.0.2.53, 127.0.0.1:5353,,192.0.2.53") == (
        ("192.0.2.53", 53), ("127.0.0.1", 5353))
    assert resolver.parse_upstreams(["198.51.100.1:53"]) == (("198.51.100.1", 53),)
    assert resolver.parse_upstreams("") == ()
    for bad in ("dns.example", "192.0.2.1:0", "192.0.2.1:70000", "192.0.2.1:x", "2001:db8::1"):
        with pytest.raises(resolver.ResolverConfigError) as e:
            resolver.parse_upstreams(bad)
        assert e.value.code == "invalid_dns_setting" and "dns_upstreams" in e.value.message


def test_limits_are_checked() -> None:
    resolver.check_limits(0.5, 1)
    with pytest.raises(resolver.ResolverConfigError, match="sandbox_dns_rate"):
        resolver.check_limits(0, 10)
    with pytest.raises(resolver.ResolverConfigError, match="sandbox_dns_burst"):
        resolver.check_limits(10, 0)


def test_settings_come_from_the_environment_with_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SBX_CONFIG", "/nonexistent/server.toml")
    s = load_settings()
    assert (s.sandbox_dns_rate, s.sandbox_dns_burst, s.dns_upstreams, s.sandbox_max_connections,
            s.sandbox_connection_rate) == (50.0, 200, "", 4096, 200)
    monkeypatch.setenv("SBX_SANDBOX_DNS_RATE", "5")
    monkeypatch.setenv("SBX_SANDBOX_DNS_BURST", "20")
    monkeypatch.setenv("SBX_DNS_UPSTREAMS", "192.0.2.53")
    monkeypatch.setenv("SBX_SANDBOX_MAX_CONNECTIONS", "100")
    s = load_settings()
    assert (s.sandbox_dns_rate, s.sandbox_dns_burst, s.dns_upstreams, s.sandbox_max_connections) == (
        5.0, 20, "192.0.2.53", 100)
    monkeypatch.setenv("SBX_SANDBOX_MAX_CONNECTIONS", "lots")
    with pytest.raises(ValueError, match="SBX_SANDBOX_MAX_CONNECTIONS='lots' is not a valid int"):
        load_settings()


def test_token_bucket_gives_the_burst_then_the_rate_per_key() -> None:
    b = resolver.TokenBuckets(rate=10.0, burst=5)
    assert [b.take("10.88.0.2", 100.0) for _ in range(7)] == [True] * 5 + [False] * 2
    assert b.take("10.88.0.3", 100.0)  # another sandbox has its own bucket
    assert not b.take("10.88.0.2", 100.05)  # half a token
    assert b.take("10.88.0.2", 100.125)  # a whole token again at 10/s
    assert [b.take("10.88.0.2", 200.0) for _ in range(6)].count(True) == 5  # never more than the burst
    assert b.buckets["10.88.0.2"].dropped == 4
    b.prune(300.0, idle=60.0)
    assert b.buckets == {}


def test_query_facts_accept_one_question_only() -> None:
    q = DNSRecord.question("example.com", "AAAA")
    q.header.id = 4660
    assert resolver.query_facts(bytes(q.pack())) == (4660, "AAAA", "example.com.")
    assert resolver.query_facts(b"\x00\x01garbage") is None
    assert resolver.query_facts(bytes(q.reply().pack())) is None  # a response, not a query
    two = DNSRecord.question("a.example", "A")
    two.add_question(DNSRecord.question("b.example", "A").q)
    assert resolver.query_facts(bytes(two.pack())) is None
    fail = DNSRecord.parse(resolver.servfail(bytes(q.pack())))
    assert (fail.header.id, fail.header.rcode, str(fail.q.qname)) == (4660, RCODE.SERVFAIL, "example.com.")
    assert resolver.rcode_of(bytes(fail.pack())) == "SERVFAIL" and resolver.rcode_of(b"") == "?"


def test_resolv_conf_names_the_gateway_only() -> None:
    text = resolver.resolv_conf("10.88.0.1")
    assert [ln.split()[1] for ln in text.splitlines() if ln.startswith("nameserver")] == ["10.88.0.1"]
    assert "options edns0" in text
    with pytest.raises(ValueError):
        resolver.resolv_conf("gateway")


def test_host_upstreams_keep_loopback_ones(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("nameserver 127.0.0.53\nnameserver 2001:db8::1\nnameserver 10.255.255.53\nsearch x\n")
    assert resolver.host_upstreams(conf) == [("127.0.0.53", 53), ("10.255.255.53", 53)]
    assert resolver.host_upstreams(tmp_path / "missing") == []


def test_ruleset_redirects_dns_and_caps_connections() -> None:
    pol = egress.EgressPolicy(nameservers=("10.255.255.53",))
    text = ruleset.inet_ruleset("sbx_u", "sbxu0", "10.77.0.0/16", pol, max_connections=300)
    assert "elements = { 10.255.255.53 }" in text
    assert "ip daddr @dns_upstreams counter name dns_redirected redirect to :53" in text
    assert "ip daddr @egress_deny counter name dns_redirected redirect to :53" in text
    assert 'iifname "sbxu0" ip daddr 10.77.0.1 meta l4proto { udp, tcp } th dport 53 accept' in text
    limit = 'ct state new add @conn_limit { ip saddr ct count over 300 } counter name conn_limited jump conn_refuse'
    assert text.count(limit) == 2  # forward (through the host) and input (towards it)
    assert "limit rate" not in text
    text = ruleset.inet_ruleset("sbx_u", "sbxu0", "10.77.0.0/16", pol, max_connections=300, connection_rate=50)
    rate = "add @conn_rate { ip saddr limit rate over 50/second burst 100 packets }"
    assert text.count(rate) == 2 and text.index(rate) < text.index(limit)  # a refused churn is never counted
    none = ruleset.inet_ruleset("sbx_u", "sbxu0", "10.77.0.0/16", pol)
    assert "ct count" not in none and "limit rate" not in none
    guarded = ruleset.inet_ruleset("sbx_u", "sbxu0", "10.77.0.0/16", pol, dns_rate=2.5, dns_burst=20)
    guard = ('iifname "sbxu0" ip daddr 10.77.0.1 udp dport 53 add @dns_guard { ip saddr limit rate over '
             "10/second burst 40 packets } counter name dns_dropped drop")
    input_chain = guarded.split("chain input")[1]
    assert guard in input_chain and input_chain.index(guard) < input_chain.index("established,related accept")
    for most, per_second in ((-1, 0), (0, -5)):
        with pytest.raises(ruleset.ConnectionLimitError) as e:
            ruleset.inet_ruleset("sbx_u", "sbxu0", "10.77.0.0/16", pol, max_connections=most,
                                 connection_rate=per_second)
        assert e.value.code == "invalid_connection_limit" and "sandbox_" in e.value.message
    assert ruleset.gateway_address("10.77.0.0/16") == "10.77.0.1"


# ----------------------------------------------------------------------------------------------- the resolver


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def upstream() -> Iterator[FakeNameserver]:
    up = FakeNameserver(tcp=True)
    yield up
    up.close()


def _ask(port: int, name: str, source: str = "127.0.0.1", qid: int = 4242, timeout: float = 2.0) -> DNSRecord | None:
    q = DNSRecord.question(name, "A")
    q.header.id = qid
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((source, 0))
        s.settimeout(timeout)
        s.sendto(bytes(q.pack()), ("127.0.0.1", port))
        try:
            return DNSRecord.parse(s.recv(4096))
        except TimeoutError:
            return None


def _ask_tcp(port: int, name: str) -> DNSRecord:
    q = bytes(DNSRecord.question(name, "A").pack())
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(struct.pack("!H", len(q)) + q)
        n = struct.unpack("!H", recv_exactly(c, 2))[0]
        return DNSRecord.parse(recv_exactly(c, n))


def test_resolver_forwards_and_keeps_the_query_id(upstream: FakeNameserver) -> None:
    port = _free_port()
    r = resolver.Resolver("127.0.0.1", port, upstreams=(("127.0.0.1", upstream.port),), rate=100, burst=100)
    r.start()
    try:
        a = _ask(port, "www.example.com", qid=777)
        assert a is not None and a.header.id == 777 and str(a.rr[0].rdata) == "192.0.2.1"
        assert _ask_tcp(port, "tcp.example.com").rr[0].rdata == A("192.0.2.1")
        big = _ask_tcp(port, "big.example.com")  # truncated over UDP: asked again over TCP
        assert not big.header.tc and str(big.rr[0].rdata) == "192.0.2.1"
        udp_big = _ask(port, "big.example.com")  # a UDP client gets the truncated answer and retries itself
        assert udp_big is not None and udp_big.header.tc
        assert r.buckets.buckets["127.0.0.1"].answered == 4
    finally:
        r.close()
    assert not r.running


def test_one_source_over_its_limit_is_held_while_another_is_answered(upstream: FakeNameserver) -> None:
    port = _free_port()
    r = resolver.Resolver("127.0.0.1", port, upstreams=(("127.0.0.1", upstream.port),), rate=5, burst=10)
    r.start()
    try:
        flood = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        flood.bind(("127.0.0.2", 0))
        started = time.monotonic()
        for i in range(300):
            q = DNSRecord.question(f"flood{i}.example", "A")
            flood.sendto(bytes(q.pack()), ("127.0.0.1", port))
        neighbour = [_ask(port, f"n{i}.example", source="127.0.0.3") for i in range(5)]
        assert all(a is not None and a.rr for a in neighbour)
        time.sleep(0.3)
        flood.settimeout(0.2)
        answered = 0
        while True:
            try:
                flood.recv(4096)
                answered += 1
            except TimeoutError:
                break
        elapsed = time.monotonic() - started
        assert answered <= 10 + 5 * elapsed + 1, (answered, elapsed)
        assert answered >= 10
        assert r.buckets.buckets["127.0.0.2"].dropped >= 300 - answered
        assert upstream.queries <= answered + 5  # what was dropped never reached the upstream
    finally:
        r.close()


def test_dead_upstream_gives_servfail_and_a_second_one_is_tried(upstream: FakeNameserver) -> None:
    port, dead = _free_port(), _free_port()
    r = resolver.Resolver("127.0.0.1", port, upstreams=(("127.0.0.1", dead),), rate=100, burst=100)
    r.start()
    try:
        a = _ask(port, "x.example", timeout=resolver.UPSTREAM_TIMEOUT + 3)
        assert a is not None and a.header.rcode == RCODE.SERVFAIL
    finally:
        r.close()
    r = resolver.Resolver("127.0.0.1", port, upstreams=(("127.0.0.1", dead), ("127.0.0.1", upstream.port)),
                          rate=100, burst=100)
    r.start()
    try:
        a = _ask(port, "y.example", timeout=5)
        assert a is not None and a.header.rcode == RCODE.NOERROR and a.rr
    finally:
        r.close()


def test_a_passing_servfail_is_asked_again(upstream: FakeNameserver) -> None:
    port = _free_port()
    r = resolver.Resolver("127.0.0.1", port, upstreams=(("127.0.0.1", upstream.port),), rate=100, burst=100)
    r.start()
    try:
        a = _ask(port, "flaky.example", timeout=5)
        assert a is not None and a.header.rcode == RCODE.NOERROR and a.rr
        assert upstream.asked("flaky.example.") == 2
    finally:
        r.close()


def test_junk_is_dropped_and_the_port_taken_is_an_error() -> None:
    port = _free_port()
    r = resolver.Resolver("127.0.0.1", port, upstreams=(("127.0.0.1", 9),))
    r.start()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(0.5)
            s.sendto(b"not dns at all", ("127.0.0.1", port))
            with pytest.raises(TimeoutError):
                s.recv(4096)
        with pytest.raises(OSError):
            resolver.Resolver("127.0.0.1", port).start()
    finally:
        r.close()


def test_ensure_resolver_shares_one_per_address() -> None:
    port = _free_port()
    a = resolver.ensure_resolver("127.0.0.1", port, (("127.0.0.1", 9),), rate=10, burst=20)
    try:
        b = resolver.ensure_resolver("127.0.0.1", port, (("127.0.0.1", 10),), rate=3, burst=4)
        assert a is b and (b.buckets.rate, b.buckets.burst) == (3, 4) and b.upstreams() == [("127.0.0.1", 10)]
    finally:
        resolver.stop_resolver("127.0.0.1", port)
    assert not a.running
