"""Network attacks from inside real sandboxes, as root: address takeover, spoofed frames, metadata and private ranges.

The "outside" is a network namespace on the host (:func:`remote`) reached through a veth and host routes, so
traffic to it crosses the host's forward path exactly as traffic to a cloud metadata service or a private LAN
would: it answers HTTP on port 80 at 169.254.169.254 (metadata), 172.31.83.10 (private, denied), 172.31.84.10
(private, allowed on the ``egress_allow`` server) and 198.51.100.10 (a public-like address: the internet stays
reachable), each body naming the address that answered. SBX_SECNET_* variables move its names and link addresses;
SBX_SECALLOW_NODE / _BRIDGE / _SUBNET move the second server.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from sbx.node.network import bridge as network
from tests.e2e.conftest import Server, start_server
from tests.e2e.helpers import poll
from tests.outside import outside_netns
from tests.security.conftest import new_sandbox, root

pytestmark = pytest.mark.e2e

METADATA = "169.254.169.254"
PRIVATE = "172.31.83.10"
ALLOWED = "172.31.84.10"
PUBLIC = "198.51.100.10"
TARGETS = (METADATA, PRIVATE, ALLOWED, PUBLIC)

REMOTE_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("remote " + self.connection.getsockname()[0] + "\\n").encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("0.0.0.0", 80), H).serve_forever()
"""


@pytest.fixture(scope="module")
def remote() -> Iterator[str]:
    """A fake outside world in a network namespace: the host routes :data:`TARGETS` to it. Yields the host's own
    address on the link (a private address of the host). Removed afterwards, routes included."""
    tag = os.environ.get("SBX_SECNET_TAG", "sbxnr")
    link = os.environ.get("SBX_SECNET_LINK", "172.31.252.0/30")
    with outside_netns(tag, link, TARGETS, [[sys.executable, "-c", REMOTE_SERVER]]) as host_ip:

        def answers() -> bool:
            try:
                with urllib.request.urlopen(f"http://{PUBLIC}/", timeout=2) as r:
                    return r.read() == f"remote {PUBLIC}\n".encode()
            except OSError:
                return False

        poll(answers, "the fake remote's HTTP server", timeout=60)
        yield host_ip


@pytest.fixture(scope="module")
def allow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A second server with ``SBX_EGRESS_ALLOW=172.31.84.0/24``."""
    with start_server(
        tmp_path_factory.mktemp("sbx-secallow"),
        node=os.environ.get("SBX_SECALLOW_NODE", "secallow"),
        bridge=os.environ.get("SBX_SECALLOW_BRIDGE", "sbxsecallow0"),
        subnet=os.environ.get("SBX_SECALLOW_SUBNET", "10.79.0.0/16"),
        SBX_EGRESS_ALLOW="172.31.84.0/24",
    ) as srv:
        yield srv


def _bridge(server: Server) -> str:
    return server.env["SBX_BRIDGE"]


def _reaches(server: Server, sid: str, ip: str, port: int = 80) -> bool:
    """True if an HTTP GET from inside ``sid`` to ``ip:port`` gets the fake remote's answer for ``ip``."""
    r = root(server, sid, f"curl -s -m 5 http://{ip}:{port}/", timeout=60)
    return r.returncode == 0 and r.stdout == f"remote {ip}\n"


def _addr(server: Server, sid: str) -> tuple[str, str]:
    """``(ipv4, mac)`` of the sandbox's eth0, read from inside."""
    r = root(server, sid, "ip -4 -o addr show dev eth0 | awk '{print $4}'; cat /sys/class/net/eth0/address")
    assert r.returncode == 0, r.stderr
    cidr, mac = r.stdout.split()
    return cidr.split("/")[0], mac


# --------------------------------------------------------------------------------------------- egress


@pytest.mark.parametrize("runtime", ["container", "gvisor"])
def test_metadata_private_ranges_and_the_host_are_out_of_reach(sec_server: Server, remote: str, runtime: str) -> None:
    sid = new_sandbox(sec_server, "--runtime", runtime)
    assert _reaches(sec_server, sid, PUBLIC), "the public-like address must stay reachable (NAT as before)"
    assert not _reaches(sec_server, sid, METADATA)
    assert not _reaches(sec_server, sid, PRIVATE)
    assert not _reaches(sec_server, sid, ALLOWED)  # allowed only on the egress_allow server
    # a TCP connect (not only HTTP) to the metadata address fails too, so does UDP to it
    r = root(sec_server, sid, f"timeout 10 bash -c 'exec 3<>/dev/tcp/{METADATA}/80' && echo connected", timeout=60)
    assert "connected" not in r.stdout

    # a listener on one of the host's own private addresses (the remote link's host end) is out of reach
    class Hello(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"remote {remote}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_a: Any) -> None:
            pass

    httpd = HTTPServer((remote, 0), Hello)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with urllib.request.urlopen(f"http://{remote}:{httpd.server_port}/", timeout=10) as resp:
            assert resp.read() == f"remote {remote}\n".encode()  # it answers the host itself
        assert not _reaches(sec_server, sid, remote, httpd.server_port)
    finally:
        httpd.shutdown()
        httpd.server_close()

    # what a Debian machine needs still works although the nameserver may sit on a private address
    from sbx.node.host.image import mirror_lines
    from sbx.node.network import egress

    hosts = [h for h, _p in egress.mirror_endpoints(mirror_lines())]
    if hosts and egress.host_nameservers():
        r = root(sec_server, sid, f"getent hosts {hosts[0]}", timeout=120)
        assert r.returncode == 0 and r.stdout.strip(), r.stdout + r.stderr
    r = root(sec_server, sid, "apt-get update -o Acquire::Retries=3", timeout=600)
    assert r.returncode == 0 and "Err:" not in r.stdout, r.stdout + r.stderr
    sec_server.sbx("delete", sid, "--wait", check=True)


def test_egress_allow_opens_exactly_its_range(allow_server: Server, remote: str) -> None:
    sid = new_sandbox(allow_server)
    assert _reaches(allow_server, sid, ALLOWED)
    assert _reaches(allow_server, sid, PUBLIC)
    assert not _reaches(allow_server, sid, PRIVATE)
    assert not _reaches(allow_server, sid, METADATA)
    allow_server.sbx("delete", sid, "--wait", check=True)


# --------------------------------------------------------------------------------------------- address takeover

GARP = r"""
import socket, struct, sys, time
victim = socket.inet_aton(sys.argv[1])
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("eth0", 0))
mac = bytes.fromhex(open("/sys/class/net/eth0/address").read().strip().replace(":", ""))
bcast = b"\xff" * 6
for i in range(8):  # gratuitous replies and requests claiming the victim's address
    op = 2 if i % 2 == 0 else 1
    arp = struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, op, mac, victim, bcast if op == 2 else b"\0" * 6, victim)
    s.send(bcast + mac + b"\x08\x06" + arp + b"\0" * 18)
    time.sleep(0.25)
"""

SITE = "mkdir -p /srv/site && echo {name} > /srv/site/index.html && cd /srv/site && python3 -m http.server 8000"


def _serve(server: Server, sid: str, name: str) -> None:
    server.sbx("exec", sid, "-u", "root", "--detach", SITE.format(name=name), check=True)
    server.sbx("exec", sid, "for i in $(seq 150); do (exec 3<>/dev/tcp/127.0.0.1/8000) 2>/dev/null && exit 0; "
                            "sleep 0.2; done; exit 1", check=True)


def _proxied(server: Server, host: str, token: str) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.proxy_port}/",
                                 headers={"Host": host, "X-Sbx-Token": token})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _host_neighbour(bridge: str, ip: str) -> str:
    return subprocess.run(["ip", "neigh", "show", "to", ip, "dev", bridge], capture_output=True, text=True).stdout


def test_taking_over_another_sandboxs_address_fails(sec_server: Server) -> None:
    a, b = new_sandbox(sec_server), new_sandbox(sec_server)
    a_ip, _a_mac = _addr(sec_server, a)
    b_ip, b_mac = _addr(sec_server, b)
    _serve(sec_server, a, "from-A")
    _serve(sec_server, b, "from-B")
    route = json.loads(sec_server.sbx("host", b, "8000", "--json", check=True).stdout)["route"]
    assert _proxied(sec_server, route["host"], route["token"]) == (200, b"from-B\n")

    # A claims B's address: the address on its eth0, then gratuitous ARP for it
    r = root(sec_server, a, f"ip addr add {b_ip}/32 dev eth0 && python3 - {b_ip} <<'EOF'\n{GARP}\nEOF")
    assert r.returncode == 0, r.stdout + r.stderr
    time.sleep(1)  # let the host process what got through (a fixed pause: nothing to poll for when nothing comes)
    assert b_mac in _host_neighbour(_bridge(sec_server), b_ip)
    for _ in range(3):
        assert _proxied(sec_server, route["host"], route["token"]) == (200, b"from-B\n")
    # and A cannot talk to B directly, with or without B's address
    r = root(sec_server, a, f"curl -s -m 5 --interface {a_ip} http://{b_ip}:8000/; "
                            f"curl -s -m 5 http://{b_ip}:8000/", timeout=60)
    assert "from-B" not in r.stdout
    sec_server.sbx("delete", a, "--wait", check=True)
    sec_server.sbx("delete", b, "--wait", check=True)


SEND = r"""
import socket, struct, sys

def csum(data):
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF

def frame(src_mac, src_ip, dst_mac, dst_ip, payload):
    udp = struct.pack("!HHHH", 40000, 9, 8 + len(payload), 0) + payload
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                      socket.inet_aton(src_ip), socket.inet_aton(dst_ip))
    hdr = hdr[:10] + struct.pack("!H", csum(hdr)) + hdr[12:]
    mac = lambda m: bytes.fromhex(m.replace(":", ""))
    return mac(dst_mac) + mac(src_mac) + b"\x08\x00" + hdr + udp

s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("eth0", 0))
dst_mac, dst_ip = sys.argv[1], sys.argv[2]
for spec in sys.argv[3:]:
    src_mac, src_ip, marker = spec.split(",")
    for _ in range(3):
        s.send(frame(src_mac, src_ip, dst_mac, dst_ip, marker.encode()))
"""


def test_spoofed_source_mac_or_ip_gets_nothing_through(sec_server: Server) -> None:
    a, b = new_sandbox(sec_server), new_sandbox(sec_server)
    a_ip, a_mac = _addr(sec_server, a)
    b_ip, b_mac = _addr(sec_server, b)
    bridge = _bridge(sec_server)
    br_mac = Path(f"/sys/class/net/{bridge}/address").read_text().strip()
    gw = str(network.gateway_of(sec_server.env["SBX_SUBNET"]).ip)
    tag = secrets.token_hex(4)
    frames = {
        "control": (a_mac, a_ip),  # A's own addresses: must get through, else this test can't see anything
        "mac": ("02:de:ad:be:ef:01", a_ip),
        "victim-mac": (b_mac, a_ip),
        "ip": (a_mac, b_ip),
        "other-ip": (a_mac, "10.255.254.253"),
        "both": (b_mac, b_ip),
    }
    seen: set[str] = set()
    sniffer = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    sniffer.bind((bridge, 0))
    sniffer.settimeout(0.2)
    stop = threading.Event()

    def sniff() -> None:  # frames that reached the bridge device, i.e. got past the bridge's ports
        while not stop.is_set():
            try:
                data = sniffer.recv(65535)
            except TimeoutError:
                continue
            for name in frames:
                if f"sbx-{tag}-{name}.".encode() in data:
                    seen.add(name)

    t = threading.Thread(target=sniff, daemon=True)
    t.start()
    try:
        specs = " ".join(f"{mac},{ip},sbx-{tag}-{name}." for name, (mac, ip) in frames.items())
        r = root(sec_server, a, f"python3 - {br_mac} {gw} {specs} <<'EOF'\n{SEND}\nEOF")
        assert r.returncode == 0, r.stdout + r.stderr
        poll(lambda: "control" in seen, "A's own frame on the bridge", timeout=30, interval=0.2)
        time.sleep(1)  # the spoofed frames were sent before the control frame's last copy; give stragglers time
    finally:
        stop.set()
        t.join()
        sniffer.close()
    assert seen == {"control"}
    sec_server.sbx("delete", a, "--wait", check=True)
    sec_server.sbx("delete", b, "--wait", check=True)


# --------------------------------------------------------------------------------------------- repair


def test_stale_pins_and_neighbours_are_swept(sec_server: Server) -> None:
    """What a crash between wiring and recording leaves (a pin and a permanent neighbour entry of a sandbox that
    no longer runs) is gone after ``sync_pins``, which reconcile runs at every start; live pins stay."""
    node, bridge = sec_server.env["SBX_NODE_NAME"], _bridge(sec_server)
    sid = new_sandbox(sec_server)
    ip, mac = _addr(sec_server, sid)
    live = network.Lease(f"{ip}/16", "", network.veth_name(sid))
    stale = network.Lease(str(ipaddress.IPv4Network(sec_server.env["SBX_SUBNET"])[65000]) + "/16", "", "vstalestale1")
    stale_ip = stale.address.split("/")[0]
    subprocess.run(["nft", "add", "element", "bridge", f"sbx_{node}", "pins", "{", network._pin(stale), "}"],
                   check=True)
    subprocess.run(["ip", "neigh", "replace", stale_ip, "lladdr", network.mac_for(stale.host_veth), "dev", bridge,
                    "nud", "permanent"], check=True)
    network.sync_pins(bridge, node, [live])
    pins = subprocess.run(["nft", "list", "set", "bridge", f"sbx_{node}", "pins"], capture_output=True,
                          text=True, check=True).stdout
    assert "vstalestale1" not in pins and network.veth_name(sid) in pins
    assert _host_neighbour(bridge, stale_ip).strip() == ""
    assert mac in _host_neighbour(bridge, ip) and "PERMANENT" in _host_neighbour(bridge, ip)
    _serve(sec_server, sid, "still-here")  # the live pin still lets the sandbox answer the host
    with urllib.request.urlopen(f"http://{ip}:8000/", timeout=60) as resp:
        assert resp.read() == b"still-here\n"
    sec_server.sbx("delete", sid, "--wait", check=True)
