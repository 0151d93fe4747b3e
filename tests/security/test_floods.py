"""The container class's DNS and conntrack holes closed (issue 33), attacked from inside real sandboxes as root.

One server with small limits (``SBX_SANDBOX_DNS_RATE=20``, ``SBX_SANDBOX_DNS_BURST=50``,
``SBX_SANDBOX_MAX_CONNECTIONS=500``, ``SBX_SANDBOX_CONNECTION_RATE=200``) whose resolver forwards to a fake
nameserver on the host's loopback (this process: :class:`tests.dnsfake.FakeNameserver`, which answers every A query
with 192.0.2.1 and records the names), so what reaches "upstream" is counted and no real nameserver is flooded.
Sandboxes send traffic only to their node's bridge gateway (the resolver's port 53), or to the host's nameservers and
denied addresses on port 53, which the node redirects to that same resolver, never anywhere else.

- a sandbox's DNS goes to the node's resolver only: its ``resolv.conf`` names the gateway, and queries it addresses
  to the host's own nameservers (or any denied address), over UDP or TCP, are answered by the node's resolver;
- DNS keeps working across a stop and resume with memory, in a process that lived through it;
- a server killed with ``-9`` leaves nothing half-configured: the port is free, the rules whole, and the restarted
  server resolves again;
- the issue's test: a flood of 10,000 queries sent as fast as one sandbox can is held to its bucket (at most
  burst + rate x time answered, no more reach the upstream, most dropped by the kernel's guard before the resolver's
  socket) while a neighbour's queries are all answered, and 100,000 connection
  attempts from one sandbox leave at most 500 of its connections in the host's conntrack table while the neighbour's
  DNS and connections keep working.

Against main before this change (sandboxes resolving through the host's nameserver directly, no ``ct count``), the
redirect test fails (the real nameserver answers, not the fake), the flood reaches the host's nameserver unlimited,
and the connection flood holds every connection it opens."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sbx.node.network import bridge as network
from sbx.node.network import egress, ruleset
from tests.dnsfake import FAKE_ANSWER, RESOLVE_LOOP, FakeNameserver
from tests.e2e.conftest import Server, start_server
from tests.e2e.helpers import poll
from tests.security.conftest import info, new_sandbox, root

pytestmark = pytest.mark.e2e

RATE, BURST, MAX_CONNECTIONS, RATE_CONN = 20, 50, 500, 200


@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeNameserver]:
    ns = FakeNameserver()
    yield ns
    ns.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, upstream: FakeNameserver) -> Iterator[Server]:
    with start_server(
        tmp_path_factory.mktemp("sbx-flood"),
        node=os.environ.get("SBX_FLOOD_NODE", "flood"),
        bridge=os.environ.get("SBX_FLOOD_BRIDGE", "sbxflood0"),
        subnet=os.environ.get("SBX_FLOOD_SUBNET", "10.76.0.0/16"),
        SBX_SANDBOX_DNS_RATE=str(RATE),
        SBX_SANDBOX_DNS_BURST=str(BURST),
        SBX_SANDBOX_MAX_CONNECTIONS=str(MAX_CONNECTIONS),
        SBX_SANDBOX_CONNECTION_RATE=str(RATE_CONN),
        SBX_DNS_UPSTREAMS=f"127.0.0.1:{upstream.port}",
    ) as srv:
        yield srv


def _gateway(server: Server) -> str:
    return str(network.gateway_of(server.env["SBX_SUBNET"]).ip)


def _eth0(server: Server, sid: str) -> str:
    r = root(server, sid, "ip -4 -o addr show dev eth0 | awk '{print $4}'")
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split("/")[0]


def _python(server: Server, sid: str, program: str, *args: str, timeout: float = 300) -> Any:
    """Run ``program`` with ``python3 - ARGS`` as root inside ``sid``; its last output line parsed as JSON."""
    quoted = " ".join(f"'{a}'" for a in args)
    r = root(server, sid, f"python3 - {quoted} <<'EOF'\n{program}\nEOF", timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


# A DNS client inside a sandbox: asks each "address proto name" of argv[1:] once (2 s timeout) and prints
# {"name": answer or error}.
ASK = r'''
import json, socket, struct, sys
def query(name, qid):
    return (struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0)
            + b"".join(bytes([len(p)]) + p.encode() for p in name.strip(".").split(".")) + b"\0\0\1\0\1")
def answer(msg):
    # the last 4 bytes of a reply with one A answer are its address
    return ".".join(str(b) for b in msg[-4:]) if struct.unpack("!H", msg[6:8])[0] else "no answer"
out = {}
for i, spec in enumerate(sys.argv[1:]):
    addr, proto, name = spec.split()
    try:
        if proto == "udp":
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
            s.sendto(query(name, i), (addr, 53)); msg = s.recv(4096)
        else:
            s = socket.create_connection((addr, 53), timeout=2); m = query(name, i)
            s.sendall(struct.pack("!H", len(m)) + m); size = struct.unpack("!H", s.recv(2))[0]; msg = b""
            while len(msg) < size:
                msg += s.recv(size - len(msg))
        out[name] = answer(msg)
    except OSError as e:
        out[name] = type(e).__name__
print(json.dumps(out))
'''


def test_dns_goes_to_the_node_resolver_only(server: Server, upstream: FakeNameserver) -> None:
    """``resolv.conf`` names the gateway; queries a sandbox's root addresses to the host's nameservers, to a private
    address or to the gateway, over UDP and TCP, are all answered by the node's resolver (the fake upstream's
    address), never by the host's nameserver; glibc's lookups go the same way."""
    sid = new_sandbox(server)
    gw = _gateway(server)
    r = root(server, sid, "cat /etc/resolv.conf")
    assert [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("nameserver")] == [gw], r.stdout
    targets = [gw, "172.31.83.53", *egress.host_nameservers()]  # the host's nameservers, if it has any
    specs = [f"{t} {proto} {proto}{i}.direct.test" for i, t in enumerate(targets) for proto in ("udp", "tcp")]
    got = _python(server, sid, ASK, *specs)
    assert got == {spec.split()[2]: FAKE_ANSWER for spec in specs}, got
    assert upstream.asked(".direct.test.") >= len(specs)
    r = root(server, sid, "getent hosts glibc.direct.test")
    assert r.returncode == 0 and r.stdout.split()[0] == FAKE_ANSWER, r.stdout + r.stderr
    table = ruleset.table_name(server.env["SBX_NODE_NAME"])
    counter = subprocess.run(["nft", "list", "counter", "inet", table, "dns_redirected"], capture_output=True,
                             text=True, check=True).stdout
    assert int(counter.split("packets")[1].split()[0]) >= 2 * (len(targets) - 1)
    server.sbx("delete", sid, "--wait", check=True)


def test_dns_survives_a_stop_and_resume_with_memory(server: Server) -> None:
    """A process resolving in a loop before a stop with memory resolves again after the resume (same PID): the
    resolver is the node's, stateless, on the same gateway address."""
    sid = new_sandbox(server)
    r = root(server, sid, f"cat > /tmp/loop.py <<'EOF'\n{RESOLVE_LOOP}\nEOF\n"
                          "systemd-run --unit sbx-resolve python3 /tmp/loop.py loop.resume.test /tmp/resolve.log "
                          ">/dev/null 2>&1 || exit 3\n"
                          "for i in $(seq 100); do grep -q ' ok ' /tmp/resolve.log && break; sleep 0.1; done\n"
                          "systemctl show -p MainPID --value sbx-resolve")
    assert r.returncode == 0, r.stdout + r.stderr
    pid = r.stdout.split()[-1]
    server.sbx("stop", sid, "--wait", check=True)
    server.sbx("resume", sid, "--wait", check=True)
    assert info(server, sid)["sandbox"]["memoryRestored"] is True
    resumed = time.time()

    def fresh_ok() -> bool:
        r = root(server, sid, "tail -n 3 /tmp/resolve.log")
        lines = [ln.split() for ln in r.stdout.splitlines()]
        return any(float(ln[0]) > resumed and ln[1] == "ok" and ln[2] == FAKE_ANSWER for ln in lines if len(ln) == 3)

    poll(fresh_ok, "a lookup after the resume", timeout=30)
    r = root(server, sid, f"cat /proc/{pid}/comm")
    assert r.stdout.strip() == "python3", r.stdout + r.stderr
    server.sbx("delete", sid, "--wait", check=True)


# Sends argv[2] DNS queries for distinct names to argv[1] from one socket as fast as it can, reading answers as they
# come and for 1.5 s after; prints {"sent", "answered", "seconds"} (seconds: first send to last read).
DNS_FLOOD = r'''
import json, socket, struct, sys, time
gw, count = sys.argv[1], int(sys.argv[2])
def query(name, qid):
    return (struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0)
            + b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0\0\1\0\1")
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.setblocking(False)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
answered, t0 = 0, time.monotonic()
def drain():
    global answered
    try:
        while True:
            s.recv(4096); answered += 1
    except BlockingIOError:
        pass
for i in range(count):
    while True:
        try:
            s.sendto(query(f"f{i}.flood.test", i & 0xFFFF), (gw, 53)); break
        except BlockingIOError:
            time.sleep(0.001)
    if i % 100 == 0:
        drain()
end = time.monotonic() + 1.5
while time.monotonic() < end:
    drain(); time.sleep(0.01)
print(json.dumps({"sent": count, "answered": answered, "seconds": time.monotonic() - t0}))
'''

# Asks argv[1] one query every 0.1 s for argv[2] seconds, each with a 2 s timeout; prints {"asked", "answered",
# "max_ms"}.
DNS_PROBE = r'''
import json, socket, struct, sys, time
gw, seconds = sys.argv[1], float(sys.argv[2])
def query(name, qid):
    return (struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0)
            + b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0\0\1\0\1")
asked = answered = 0
worst, end = 0.0, time.monotonic() + seconds
while time.monotonic() < end:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
    t = time.monotonic(); s.sendto(query(f"n{asked}.probe.test", asked), (gw, 53)); asked += 1
    try:
        s.recv(4096); answered += 1; worst = max(worst, time.monotonic() - t)
    except OSError:
        pass
    s.close(); time.sleep(0.1)
print(json.dumps({"asked": asked, "answered": answered, "max_ms": round(worst * 1000, 1)}))
'''

# argv[2] TCP connection attempts to argv[1]:53 (stops after argv[3] seconds); keeps every connection that opens,
# writes {"attempts", "held", "refused", "other", "seconds"} to /tmp/connflood.json and holds them argv[4] seconds.
CONN_FLOOD = r'''
import errno, json, resource, socket, sys, time
gw, attempts, budget, hold = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held, refused, other, t0, done = [], 0, {}, time.monotonic(), 0
for done in range(1, attempts + 1):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM); s.settimeout(2)
    rc = s.connect_ex((gw, 53))
    if rc == 0:
        held.append(s)
        continue
    s.close()
    if rc == errno.ECONNREFUSED:
        refused += 1
    else:
        name = errno.errorcode.get(rc, str(rc)); other[name] = other.get(name, 0) + 1
    if time.monotonic() - t0 > budget:
        break
result = {"attempts": done, "held": len(held), "refused": refused, "other": other,
          "seconds": round(time.monotonic() - t0, 2)}
with open("/tmp/connflood.json", "w") as f:
    json.dump(result, f)
print(json.dumps(result), flush=True)
time.sleep(hold)
'''

TCP_CONNECT = r'''
import json, socket, sys
try:
    socket.create_connection((sys.argv[1], 53), timeout=3).close(); print(json.dumps("connected"))
except OSError as e:
    print(json.dumps(type(e).__name__))
'''


def _conntrack_of(address: str) -> tuple[int, int, dict[str, int]]:
    """``(open, all, kinds)``: entries of the host's conntrack table that ``address`` started (its original
    direction's source); ``open`` leaves out TCP connections in ``TIME_WAIT`` or ``CLOSE`` (ended, what ``ct count``
    no longer counts); ``kinds`` counts them by protocol, state and destination port."""
    opened = every = 0
    kinds: dict[str, int] = {}
    with open("/proc/net/nf_conntrack") as f:
        for line in f:
            src = line.split("src=", 1)
            if len(src) == 2 and src[1].split(" ", 1)[0] == address:
                every += 1
                opened += not (" TIME_WAIT " in line or " CLOSE " in line)
                fields = line.split()
                state = fields[5] if fields[2] == "tcp" else ""
                dport = next((x for x in fields if x.startswith("dport=")), "")
                kind = f"{fields[2]} {state} {dport}"
                kinds[kind] = kinds.get(kind, 0) + 1
    return opened, every, kinds


def _counter(server: Server, name: str) -> int:
    table = ruleset.table_name(server.env["SBX_NODE_NAME"])
    out = subprocess.run(["nft", "list", "counter", "inet", table, name], capture_output=True, text=True,
                         check=True).stdout
    return int(out.split("packets")[1].split()[0])


def test_floods_are_held_to_their_limits_while_a_neighbour_keeps_working(server: Server,
                                                                        upstream: FakeNameserver) -> None:
    """The issue's test line. DNS: 10,000 queries from sandbox A as fast as it sends get at most burst + rate x time
    answers, and no more reach the upstream, while every query of neighbour B in that time is answered. Connections:
    100,000 TCP connection attempts from A to the gateway leave at most ``MAX_CONNECTIONS`` of A's connections open
    in the host's conntrack table (the rest refused with a reset; the ended ones bounded by the new-connection rate),
    while B's DNS and a new TCP connection of B work."""
    a, b = new_sandbox(server), new_sandbox(server)
    gw, a_ip = _gateway(server), _eth0(server, a)

    result: dict[str, Any] = {}

    def probe() -> None:
        result["neighbour"] = _python(server, b, DNS_PROBE, gw, "4", timeout=120)

    t = threading.Thread(target=probe)
    t.start()
    time.sleep(1.0)  # the neighbour's queries are under way (its exec and python start take ~0.3 s)
    dropped_before = _counter(server, "dns_dropped")
    dns = _python(server, a, DNS_FLOOD, gw, "10000", timeout=120)
    t.join(timeout=180)
    neighbour = result["neighbour"]
    kernel_dropped = _counter(server, "dns_dropped") - dropped_before
    print(f"dns flood: {dns}, dropped by the kernel's guard {kernel_dropped}, upstream asked "
          f"{upstream.asked('.flood.test.')}, neighbour {neighbour}")  # for the report
    assert dns["sent"] == 10000
    bound = BURST + RATE * dns["seconds"] + 2
    assert BURST <= dns["answered"] <= bound, dns
    assert upstream.asked(".flood.test.") <= bound, (upstream.asked(".flood.test."), dns)
    assert neighbour["answered"] == neighbour["asked"] >= 20, neighbour
    assert kernel_dropped >= 10000 - (2 * BURST + 4 * RATE * dns["seconds"]) - 10, kernel_dropped
    assert "is over its limit" in server.log.read_text()

    limited_before = _counter(server, "conn_limited")

    def conns() -> None:
        result["conn"] = _python(server, a, CONN_FLOOD, gw, "100000", "120", "30", timeout=300)

    t = threading.Thread(target=conns)
    t.start()
    try:
        def flooded() -> dict[str, Any] | None:
            r = root(server, a, "cat /tmp/connflood.json 2>/dev/null || true", timeout=30)
            return json.loads(r.stdout) if r.stdout.strip() else None

        conn = poll(flooded, "the connection flood's end", timeout=240, interval=1)
        opened, every, kinds = _conntrack_of(a_ip)
        print(f"connection flood: {conn}, A's conntrack entries: {opened} open, {every} in all: {kinds}")  # report
        assert conn["attempts"] == 100000, conn
        assert conn["held"] <= MAX_CONNECTIONS and conn["held"] + conn["refused"] == conn["attempts"], conn
        # the kernel's ct count (nf_conncount) forgets ended entries lazily, a few at each new connection, so a
        # handful more than the limit may stand at one moment (seen: 501 of 500); never the flood's 100,000
        assert opened <= MAX_CONNECTIONS * 1.02, (opened, every, kinds)
        # what ended stays a while (TIME_WAIT): bounded by the new-connection rate (the flood's time plus the wait)
        assert every <= MAX_CONNECTIONS + 2 * RATE_CONN + RATE_CONN * (conn["seconds"] + 30), (opened, every)
        assert _counter(server, "conn_limited") - limited_before >= 100000 - MAX_CONNECTIONS
        # A itself is held: its next connection is refused; the neighbour is not
        assert _python(server, a, TCP_CONNECT, gw) == "ConnectionRefusedError"
        assert _python(server, b, TCP_CONNECT, gw) == "connected"
        got = _python(server, b, ASK, f"{gw} udp n1.after.test", f"{gw} tcp n2.after.test")
        assert got == {"n1.after.test": FAKE_ANSWER, "n2.after.test": FAKE_ANSWER}, got
    finally:
        t.join(timeout=300)
    for sid in (a, b):
        server.sbx("delete", sid, "--wait", check=True)


def test_a_server_killed_with_9_leaves_dns_whole(tmp_path_factory: pytest.TempPathFactory,
                                                 upstream: FakeNameserver) -> None:
    """The resolver lives in the server's process and keeps nothing outside it: after ``kill -9`` the gateway's
    port 53 is free at once (nothing half-bound), the node's nftables table is whole (one DNS redirect chain, the
    sandbox still pinned), the sandbox keeps running, and the restarted server resolves for it again."""
    from tests.e2e.faultsrv import FaultServer

    fs = FaultServer(tmp_path_factory.mktemp("sbx-floodkill"), prefix="SBX_FLOODKILL", node="floodk",
                     bridge="sbxfloodk0", subnet="10.71.0.0/16", SBX_DNS_UPSTREAMS=f"127.0.0.1:{upstream.port}")
    try:
        srv = fs.start()
        sid = new_sandbox(srv)
        gw = _gateway(srv)
        assert _python(srv, sid, ASK, f"{gw} udp before.kill.test") == {"before.kill.test": FAKE_ANSWER}
        fs.kill9()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((gw, 53))  # free: the killed process's socket went with it
        table = subprocess.run(["nft", "list", "table", "inet", ruleset.table_name(fs.node)], capture_output=True,
                               text=True, check=True).stdout
        assert table.count("chain dns_redirect") == 1 and "conn_limit" in table
        srv = fs.start()
        assert _python(srv, sid, ASK, f"{gw} udp after.kill.test", f"{gw} tcp after2.kill.test") == {
            "after.kill.test": FAKE_ANSWER, "after2.kill.test": FAKE_ANSWER}
        assert upstream.asked("kill.test.") >= 3
    finally:
        fs.close()
