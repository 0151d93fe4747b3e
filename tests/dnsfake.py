"""A fake nameserver for the tests of the node's DNS resolver (issue 33): the unit tests
(tests/unit/node/network/test_dns_resolver.py), the security floods (tests/security/test_floods.py) and DNS across a
live migration (tests/e2e/nodes/test_dns_moves.py) point ``SBX_DNS_UPSTREAMS`` or a resolver at it, so no real
nameserver is asked and what reaches "upstream" is counted. Also the program a sandbox runs to resolve in a loop."""

from __future__ import annotations

import socket
import struct
import threading

from dnslib import QTYPE, RCODE, RR, A, DNSRecord

#: The address every A query is answered with.
FAKE_ANSWER = "192.0.2.1"

#: A program a sandbox runs (``python3 - NAME LOG``): resolves NAME every 0.2 s through glibc and appends
#: ``<unix time> ok <address>`` or ``<unix time> fail <error>`` to LOG.
RESOLVE_LOOP = r'''
import socket, sys, time
name, log = sys.argv[1], sys.argv[2]
while True:
    try:
        line = "ok " + socket.gethostbyname(name)
    except OSError as e:
        line = "fail " + type(e).__name__
    with open(log, "a") as f:
        f.write(f"{time.time():.3f} {line}\n")
    time.sleep(0.2)
'''


class FakeNameserver:
    """A nameserver on ``address:port`` (port 0: the kernel picks; UDP, and TCP with ``tcp``) that answers every
    query with an A record of :data:`FAKE_ANSWER` and records the names asked in ``names``. A name starting with
    ``big`` gets a truncated UDP answer (``TC``, no records) and the full one over TCP; one starting with ``flaky``
gets ``SERVFAIL`` the first time it is asked. Bound to one address, so its
    UDP answers come from the address asked (a resolver's connected socket takes no other). Serves from daemon
    threads until :meth:`close`."""

    def __init__(self, address: str = "127.0.0.1", port: int = 0, tcp: bool = False):
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind((address, port))
        self.port: int = self.udp.getsockname()[1]
        self.names: list[str] = []
        self.tcp: socket.socket | None = None
        threading.Thread(target=self._serve_udp, daemon=True).start()
        if tcp:
            self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.tcp.bind((address, self.port))
            self.tcp.listen(16)
            threading.Thread(target=self._serve_tcp, daemon=True).start()

    @property
    def queries(self) -> int:
        """How many queries it was asked."""
        return len(self.names)

    def asked(self, suffix: str) -> int:
        """How many names ending in ``suffix`` it was asked."""
        return sum(1 for n in list(self.names) if n.endswith(suffix))

    def _answer(self, data: bytes, tcp: bool) -> bytes:
        q = DNSRecord.parse(data)
        self.names.append(str(q.q.qname))
        r = q.reply()
        if str(q.q.qname).startswith("flaky") and self.names.count(str(q.q.qname)) == 1:
            r.header.rcode = RCODE.SERVFAIL  # a passing failure: the first time only
        elif str(q.q.qname).startswith("big") and not tcp:
            r.header.tc = 1
        else:
            r.add_answer(RR(q.q.qname, QTYPE.A, rdata=A(FAKE_ANSWER), ttl=5))
        return bytes(r.pack())

    def _serve_udp(self) -> None:
        while True:
            try:
                data, peer = self.udp.recvfrom(4096)
            except OSError:
                return
            self.udp.sendto(self._answer(data, tcp=False), peer)

    def _serve_tcp(self) -> None:
        assert self.tcp is not None
        while True:
            try:
                conn, _ = self.tcp.accept()
            except OSError:
                return
            with conn:
                try:
                    n = struct.unpack("!H", recv_exactly(conn, 2))[0]
                    reply = self._answer(recv_exactly(conn, n), tcp=True)
                    conn.sendall(struct.pack("!H", len(reply)) + reply)
                except OSError:
                    continue

    def close(self) -> None:
        self.udp.close()
        if self.tcp is not None:
            self.tcp.close()


def recv_exactly(conn: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``conn``; raises ``OSError`` when it closes first."""
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise OSError("closed")
        data += chunk
    return data
