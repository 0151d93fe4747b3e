"""The node's DNS resolver for its sandboxes: a forwarding resolver on the bridge's gateway address, port 53.

Sandboxes resolve through it, never through the host's nameservers directly (issue 33): their ``resolv.conf`` names
the gateway (:func:`resolv_conf`), and the node's ``inet`` table (:func:`sbx.node.network.ruleset.inet_ruleset`)
redirects to it every query a sandbox sends to the host's nameservers or to an address its egress policy denies
(an old ``resolv.conf``, the gateway of the node a sandbox came from, a build's RUN step given the host's
nameservers), so no sandbox reaches the host's resolver, and a sandbox that moved between nodes of different subnets
keeps resolving.

What it does with a query (UDP, or TCP with the two-byte length prefix of RFC 1035 4.2.2):

- checks it is one DNS query (``QR`` clear, one question; parsed with ``dnslib``); anything else is dropped;
- takes a token from the source address's bucket (:class:`TokenBuckets`: ``sandbox_dns_rate`` queries per second,
  ``sandbox_dns_burst`` at once). Over the limit the query is dropped, as a rate-limiting resolver does (no answer
  to amplify or to wait for), and one log line per source and 10 s says how many were dropped;
- forwards it to the upstreams (``dns_upstreams``, else the host's ``/etc/resolv.conf``, loopback ones included: the
  resolver runs on the host) in order, with a fresh random query id and a socket of its own per query (a random
  source port), over UDP (a truncated answer to a query that came over TCP is asked again over TCP), and sends
  back the first answer whose id matches, with the sandbox's id. No upstream answering in
  :data:`UPSTREAM_TIMEOUT` seconds gives ``SERVFAIL``;
- logs one line per answered query (logger ``sbx.node.dns``, INFO): source, type, name, response code, latency.

It runs in the node process: an asyncio loop in one daemon thread (:class:`Resolver`), started by the node's
``prepare`` after the bridge holds the gateway address. It keeps no state outside the process (no files, no
rules of its own): a node killed with ``-9`` leaves nothing half-configured, the sockets close with it, and the next
``prepare`` binds them again; meanwhile a query finds the port closed and the sandbox's resolver library tries again.

Chosen over Debian's ``unbound`` or ``dnsmasq``: unbound's ``ip-ratelimit`` would do the limit, but either is a
second daemon per node with its own configuration file to write, supervise and remove after a crash; dnsmasq has no
per-client limit. ``dnslib`` only parses and builds DNS messages; the forwarding is this module's.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from dnslib import QTYPE, RCODE, DNSError, DNSRecord

log = logging.getLogger("sbx.node.dns")

#: Seconds one upstream has to answer a query before the next one is asked.
UPSTREAM_TIMEOUT = 2.0
#: Seconds waited before asking the upstreams again after a ``SERVFAIL`` (:meth:`Resolver._forward`).
RETRY_DELAYS = (0.3, 1.0)
#: Largest UDP message read from a sandbox or an upstream (bytes).
MAX_UDP = 65535
#: Seconds a TCP connection from a sandbox may stay idle between two queries.
TCP_IDLE = 10.0
#: TCP connections one source address may hold open to the resolver at once; more are closed at once.
TCP_PER_SOURCE = 16
#: Queries being forwarded at once for all sandboxes together; more are dropped (the node's own bound).
MAX_IN_FLIGHT = 2048
#: Receive buffer of the resolver's UDP socket (bytes; set past ``net.core.rmem_max`` as root).
RECEIVE_BUFFER = 8 << 20
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
#: Seconds between two log lines about one source's dropped queries.
DROP_LOG_EVERY = 10.0


class ResolverConfigError(ValueError):
    """A resolver setting is wrong; ``code`` is ``invalid_dns_setting`` and ``message`` names the setting and the
    value."""

    code = "invalid_dns_setting"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def parse_upstreams(value: str | Iterable[str]) -> tuple[tuple[str, int], ...]:
    """The ``dns_upstreams`` setting as ``(ipv4 address, port)`` pairs: a comma-separated string
    (``"192.0.2.53,127.0.0.1:5353"``) or a list of strings; the port defaults to 53; empty items are ignored.
    Raises :class:`ResolverConfigError` naming the item that is not ``IPv4[:port]`` (port 1..65535)."""
    items = value.split(",") if isinstance(value, str) else list(value)
    out: list[tuple[str, int]] = []
    for item in items:
        item = str(item).strip()
        if not item:
            continue
        host, _, port_text = item.partition(":")
        try:
            addr = ipaddress.IPv4Address(host)
            port = int(port_text) if port_text else 53
        except ValueError:
            raise ResolverConfigError(
                f"dns_upstreams: {item!r} is not an IPv4 address with an optional :port") from None
        if not 1 <= port <= 65535:
            raise ResolverConfigError(f"dns_upstreams: {item!r} has a port outside 1..65535")
        out.append((str(addr), port))
    return tuple(dict.fromkeys(out))


def check_limits(rate: float, burst: int) -> None:
    """Validate the per-sandbox query limit: ``rate`` (queries per second, > 0) and ``burst`` (queries at once,
    >= 1). Raises :class:`ResolverConfigError` naming the setting."""
    if not rate > 0:
        raise ResolverConfigError(f"sandbox_dns_rate: {rate!r} must be a number of queries per second above 0")
    if burst < 1:
        raise ResolverConfigError(f"sandbox_dns_burst: {burst!r} must be a whole number of queries, 1 or more")


def host_upstreams(resolv_conf: Path = Path("/etc/resolv.conf")) -> list[tuple[str, int]]:
    """The host's IPv4 nameservers (``resolv.conf``'s ``nameserver`` lines, loopback ones included: the resolver runs
    on the host) as ``(address, 53)``, in order; ``[]`` when the file is unreadable."""
    try:
        lines = resolv_conf.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                out.append((str(ipaddress.IPv4Address(parts[1])), 53))
            except ValueError:
                continue
    return out


def resolv_conf(gateway: str) -> str:
    """The ``/etc/resolv.conf`` of a sandbox whose bridge gateway is ``gateway`` (``10.88.0.1``): the node's
    resolver only. ``edns0`` lets answers larger than 512 bytes come over UDP; ``timeout:2 attempts:5`` (glibc's
    most: a lookup waits up to 10 s) rides out a node restart (the resolver is back within its ``prepare``) and an
    upstream that stops answering for a few seconds (this project's CI host's does). Raises ``ValueError`` when
    ``gateway`` is not an IPv4 address."""
    ipaddress.IPv4Address(gateway)
    return f"# the node's resolver (sbx)\nnameserver {gateway}\noptions edns0 timeout:2 attempts:5\n"


@dataclass
class _Bucket:
    tokens: float
    at: float
    dropped: int = 0
    answered: int = 0
    logged_at: float = 0.0


@dataclass
class TokenBuckets:
    """One token bucket per key (a sandbox's source address): ``rate`` tokens per second up to ``burst``. Pure (the
    caller passes the time); not thread-safe (the resolver's loop is its one user)."""

    rate: float
    burst: int
    buckets: dict[str, _Bucket] = field(default_factory=dict)

    def take(self, key: str, now: float) -> bool:
        """Take one token of ``key``'s bucket at monotonic time ``now`` (seconds): True when there was one (a new
        key starts full), False when the bucket is empty (the miss is counted in its ``dropped``)."""
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(tokens=float(self.burst), at=now)
        b.tokens = min(float(self.burst), b.tokens + (now - b.at) * self.rate)
        b.at = now
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return True
        b.dropped += 1
        return False

    def prune(self, now: float, idle: float = 60.0) -> None:
        """Forget buckets untouched for ``idle`` seconds (they would be full again anyway)."""
        for key in [k for k, b in self.buckets.items() if now - b.at > idle]:
            del self.buckets[key]


def query_facts(data: bytes) -> tuple[int, str, str] | None:
    """``(id, type, name)`` of a DNS query message (``(4660, "A", "example.com.")``), or None when ``data`` is not
    one query (unparsable, a response, or not exactly one question)."""
    try:
        rec = DNSRecord.parse(data)
    except (DNSError, ValueError, IndexError, struct.error):
        return None
    if rec.header.qr or len(rec.questions) != 1:
        return None
    q = rec.questions[0]
    return rec.header.id, str(QTYPE.get(q.qtype, q.qtype)), str(q.qname)


def servfail(data: bytes) -> bytes:
    """A ``SERVFAIL`` answer to the query ``data`` (same id and question)."""
    rec = DNSRecord.parse(data)
    reply = rec.reply()
    reply.header.rcode = RCODE.SERVFAIL
    return bytes(reply.pack())


def with_id(message: bytes, qid: int) -> bytes:
    """``message`` with its 16-bit DNS id replaced by ``qid``."""
    return struct.pack("!H", qid) + message[2:]


def truncated(message: bytes) -> bool:
    """Whether the DNS message has its ``TC`` (truncated) flag set."""
    return len(message) >= 4 and bool(message[2] & 0x02)


def rcode_of(message: bytes) -> str:
    """The response code of a DNS message by name (``NOERROR``, ``NXDOMAIN``, ...); ``?`` when too short."""
    if len(message) < 4:
        return "?"
    code = message[3] & 0x0F
    return str(RCODE.get(code, code))


class Resolver:
    """The forwarding resolver on ``address``:``port`` (UDP and TCP), with per-source limits (module docstring).

    ``upstreams``: fixed ``(address, port)`` pairs, or empty for the host's ``/etc/resolv.conf`` (read again when it
    changes). ``rate`` / ``burst``: each source address's query limit in queries per second and queries at once
    (:class:`TokenBuckets`); bad ones raise :class:`ResolverConfigError` (:func:`check_limits`)."""

    def __init__(self, address: str, port: int = 53, upstreams: tuple[tuple[str, int], ...] = (),
                 rate: float = 50.0, burst: int = 200, resolv: Path = Path("/etc/resolv.conf")):
        check_limits(rate, burst)
        self.address, self.port = address, port
        self._fixed = upstreams
        self._resolv = resolv
        self._resolv_seen: tuple[float, list[tuple[str, int]]] | None = None
        self.buckets = TokenBuckets(rate, burst)
        self._tcp_open: dict[str, int] = {}
        self._in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.base_events.Server | None = None

    # ------------------------------------------------------------------ start and stop

    def start(self) -> None:
        """Bind UDP and TCP ``address:port`` and serve from a daemon thread. Raises ``OSError`` naming the address
        when a socket can't be bound (the address is not on this host yet, or another process holds the port)."""
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            try:  # room for a burst of queries from every sandbox (the kernel's guard drops floods before it)
                udp.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RECEIVE_BUFFER)
            except OSError:
                udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
            udp.bind((self.address, self.port))
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tcp.bind((self.address, self.port))
            tcp.listen(256)
        except OSError as e:
            udp.close()
            tcp.close()
            raise OSError(e.errno, f"the sandboxes' DNS resolver can't listen on {self.address}:{self.port}: "
                                   f"{e.strerror} (does another DNS server hold port {self.port} on every address "
                                   "of this host?)") from e
        udp.setblocking(False)
        tcp.setblocking(False)
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="sbx-dns", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(udp, tcp), loop).result(timeout=10)
        log.info("dns resolver on %s:%d (upstreams: %s; %.0f queries/s per sandbox, burst %d)", self.address,
                 self.port, ", ".join(f"{h}:{p}" for h, p in self.upstreams()) or "none",
                 self.buckets.rate, self.buckets.burst)

    async def _open(self, udp: socket.socket, tcp: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._udp, _ = await loop.create_datagram_endpoint(lambda: _UdpProtocol(self), sock=udp)
        self._tcp = await asyncio.start_server(self._serve_tcp, sock=tcp)
        loop.create_task(self._prune())

    def close(self) -> None:
        """Stop serving and close both sockets (idempotent)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return

        async def shut() -> None:
            if self._udp is not None:
                self._udp.close()
            if self._tcp is not None:
                self._tcp.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        try:
            asyncio.run_coroutine_threadsafe(shut(), loop).result(timeout=5)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=5)

    @property
    def running(self) -> bool:
        """Whether it serves (started, not closed, its thread alive)."""
        return self._loop is not None and self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ what it answers

    def upstreams(self) -> list[tuple[str, int]]:
        """Where queries go: the fixed list, else the host's ``resolv.conf`` (read again when its mtime changes)."""
        if self._fixed:
            return list(self._fixed)
        try:
            mtime = self._resolv.stat().st_mtime
        except OSError:
            mtime = -1.0
        if self._resolv_seen is None or self._resolv_seen[0] != mtime:
            self._resolv_seen = (mtime, host_upstreams(self._resolv))
        return list(self._resolv_seen[1])

    def _admit(self, source: str) -> bool:
        """Whether a query of ``source`` goes on (its bucket and the node's in-flight bound)."""
        now = time.monotonic()
        if self.buckets.take(source, now) and self._in_flight < MAX_IN_FLIGHT:
            return True
        b = self.buckets.buckets[source]
        if now - b.logged_at >= DROP_LOG_EVERY:
            log.warning("dns: %s is over its limit (%g queries/s, burst %d): %d queries dropped so far", source,
                        self.buckets.rate, self.buckets.burst, b.dropped)
            b.logged_at = now
        return False

    async def answer(self, source: str, data: bytes, tcp: bool) -> bytes | None:
        """The answer to the query ``data`` from ``source`` (an IPv4 address), or None when it is dropped (not one
        query, over the source's limit, or the node's in-flight bound reached)."""
        facts = query_facts(data)
        if facts is None or not self._admit(source):
            return None
        qid, qtype, qname = facts
        self._in_flight += 1
        started = time.monotonic()
        try:
            reply = await self._forward(data, tcp)
        finally:
            self._in_flight -= 1
        if reply is None:
            reply = servfail(data)
        else:
            reply = with_id(reply, qid)
        bucket = self.buckets.buckets.get(source)
        if bucket is not None:
            bucket.answered += 1
        log.info("dns %s %s %s %s %.1f ms", source, qtype, qname, rcode_of(reply), (time.monotonic() - started) * 1e3)
        return reply

    async def _forward(self, data: bytes, tcp: bool) -> bytes | None:
        """:meth:`_ask_upstreams`, asked again after each of :data:`RETRY_DELAYS` while the answer is
        ``SERVFAIL`` (an upstream's passing failure then costs the sandbox a delay, not a failed lookup: an image
        build's ``apt-get update`` gives up on the first one); the last answer, or None (no upstream answered in
        time: not asked again, the sandbox's own resolver retries on its timeout)."""
        reply = await self._ask_upstreams(data, tcp)
        for delay in RETRY_DELAYS:
            if reply is None or rcode_of(reply) != "SERVFAIL":
                break
            await asyncio.sleep(delay)
            reply = await self._ask_upstreams(data, tcp) or reply
        return reply

    async def _ask_upstreams(self, data: bytes, tcp: bool) -> bytes | None:
        """Ask each upstream in turn with a fresh id, over UDP; the first answer carrying it, or None. A truncated
        answer (``TC``) to a query that came over TCP is asked again over TCP, and kept when that fails."""
        for host, port in self.upstreams():
            qid = secrets.randbelow(1 << 16)
            try:
                reply = await asyncio.wait_for(_ask_udp(host, port, with_id(data, qid), qid), UPSTREAM_TIMEOUT)
            except (OSError, TimeoutError):
                continue
            if reply is None:
                continue
            if tcp and truncated(reply):
                try:
                    full = await asyncio.wait_for(_ask_tcp(host, port, with_id(data, qid), qid), UPSTREAM_TIMEOUT)
                except (OSError, TimeoutError, asyncio.IncompleteReadError, struct.error):
                    full = None
                reply = full or reply
            return reply
        return None

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        source = peer[0] if peer else "?"
        if self._tcp_open.get(source, 0) >= TCP_PER_SOURCE:
            writer.close()
            return
        self._tcp_open[source] = self._tcp_open.get(source, 0) + 1
        try:
            while True:
                head = await asyncio.wait_for(reader.readexactly(2), TCP_IDLE)
                data = await asyncio.wait_for(reader.readexactly(struct.unpack("!H", head)[0]), TCP_IDLE)
                reply = await self.answer(source, data, tcp=True)
                if reply is not None:
                    writer.write(struct.pack("!H", len(reply)) + reply)
                    await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            left = self._tcp_open.get(source, 1) - 1
            if left:
                self._tcp_open[source] = left
            else:
                self._tcp_open.pop(source, None)
            writer.close()

    async def _prune(self) -> None:
        while True:
            await asyncio.sleep(30)
            self.buckets.prune(time.monotonic())


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, resolver: Resolver):
        self.resolver = resolver
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)  # a selector transport, not a subclass

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        asyncio.get_running_loop().create_task(self._reply(data, addr))

    async def _reply(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = await self.resolver.answer(addr[0], data, tcp=False)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


async def _ask_udp(host: str, port: int, query: bytes, qid: int) -> bytes | None:
    """Send ``query`` to ``host:port`` over UDP from a socket of its own; the first reply carrying ``qid``."""
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.setblocking(False)
        s.connect((host, port))  # replies from anyone else are not delivered
        await loop.sock_sendall(s, query)
        while True:
            reply = await loop.sock_recv(s, MAX_UDP)
            if len(reply) >= 12 and struct.unpack("!H", reply[:2])[0] == qid:
                return reply


async def _ask_tcp(host: str, port: int, query: bytes, qid: int) -> bytes | None:
    """Send ``query`` to ``host:port`` over TCP (length-prefixed); its reply when it carries ``qid``."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(struct.pack("!H", len(query)) + query)
        await writer.drain()
        size = struct.unpack("!H", await reader.readexactly(2))[0]
        reply = await reader.readexactly(size)
        return reply if len(reply) >= 12 and struct.unpack("!H", reply[:2])[0] == qid else None
    finally:
        writer.close()


_running: dict[tuple[str, int], Resolver] = {}
_running_guard = threading.Lock()


def ensure_resolver(address: str, port: int = 53, upstreams: tuple[tuple[str, int], ...] = (),
                    rate: float = 50.0, burst: int = 200) -> Resolver:
    """The resolver of this process on ``address:port``, started when none runs (a second node object of the same
    node in one process, as tests make, shares it; its settings are updated). Raises :class:`ResolverConfigError`
    for bad limits and ``OSError`` when the sockets can't be bound."""
    check_limits(rate, burst)
    with _running_guard:
        r = _running.get((address, port))
        if r is not None and r.running:
            r._fixed = upstreams
            r.buckets.rate, r.buckets.burst = rate, burst
            return r
        r = Resolver(address, port, upstreams, rate, burst)
        r.start()
        _running[(address, port)] = r
        return r


def stop_resolver(address: str, port: int = 53) -> None:
    """Stop this process's resolver on ``address:port`` if one runs."""
    with _running_guard:
        r = _running.pop((address, port), None)
    if r is not None:
        r.close()

