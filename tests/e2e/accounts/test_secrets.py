"""The credential proxy end to end (issue 14): secrets the server keeps, the node's egress proxy injects, and
sandboxes never hold.

The outside world is a network namespace the host routes TEST-NET-3 addresses to (:func:`remote`, the pattern of
``tests/security/test_network.py`` with its own names and addresses, moved by the test slot). In it, HTTPS servers
with certificates from a test CA of their own: ``api.sbx-test.example`` (answers 401 unless the Authorization
header carries the current token), ``other.sbx-test.example`` (a host the rule does not name; reports what
arrived) and a WebSocket server. Sandboxes map those names in ``/etc/hosts``; the server's egress proxy trusts the
test CA upstream (``SBX_EGRESS_UPSTREAM_CA``); sandboxes trust the proxy's CA (installed at boot).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.conftest import Server, start_server
from tests.e2e.helpers import poll
from tests.outside import make_ca, outside_netns
from tests.slots import slot

pytestmark = pytest.mark.e2e

API_HOST, OTHER_HOST, WS_HOST = "api.sbx-test.example", "other.sbx-test.example", "ws.sbx-test.example"
H2_HOST = "h2.sbx-test.example"
REPO = Path(__file__).resolve().parents[3]
EGRESS_PYTHON = REPO / ".venv-egress" / "bin" / "python"  # has the h2 library (mitmproxy's dependency)
TOKEN_FILE_NAME = "tokens.json"


def _addresses() -> tuple[str, str, str, str, ipaddress.IPv4Network]:
    """Per-slot addresses: four TEST-NET-3 servers and a /30 link (172.31.248.0/30 + 4 per slot)."""
    n = slot()
    base = 10 + 4 * n
    link = ipaddress.IPv4Network(f"172.31.248.{4 * n}/30")
    return f"203.0.113.{base}", f"203.0.113.{base + 1}", f"203.0.113.{base + 2}", f"203.0.113.{base + 3}", link


API_IP, OTHER_IP, WS_IP, H2_IP, LINK = _addresses()
HOSTS_LINES = "".join(f"{ip} {h}\\n" for ip, h in ((API_IP, API_HOST), (OTHER_IP, OTHER_HOST), (WS_IP, WS_HOST),
                                                    (H2_IP, H2_HOST)))

H2_SERVER = r'''
import asyncio, json, ssl, sys
import h2.config, h2.connection, h2.events

tokens_file, certdir, ip = sys.argv[1:4]

def current():
    with open(tokens_file) as f:
        return json.load(f)["valid"]

async def handle(reader, writer):
    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
    conn.initiate_connection()
    writer.write(conn.data_to_send())
    heads = {}
    while True:
        data = await reader.read(65536)
        if not data:
            break
        for ev in conn.receive_data(data):
            if isinstance(ev, h2.events.RequestReceived):
                heads[ev.stream_id] = dict(ev.headers)
            elif isinstance(ev, h2.events.StreamEnded):
                h = heads.pop(ev.stream_id, {})
                ok = h.get("authorization") == "Bearer " + current()
                body = b"ok h2\n" if ok else b"unauthorized\n"
                conn.send_headers(ev.stream_id, [(":status", "200" if ok else "401"),
                                                 ("content-length", str(len(body)))])
                conn.send_data(ev.stream_id, body, end_stream=True)
        writer.write(conn.data_to_send())
        await writer.drain()
    writer.close()

async def main():
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(f"{certdir}/h2.crt", f"{certdir}/h2.key")
    ctx.set_alpn_protocols(["h2"])
    server = await asyncio.start_server(handle, ip, 443, ssl=ctx)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()

asyncio.run(main())
'''

SERVERS = r'''
import http.server, json, socketserver, ssl, sys, threading, time, asyncio

tokens_file, certdir, api_ip, other_ip, ws_ip = sys.argv[1:6]

def current():
    with open(tokens_file) as f:
        return json.load(f)["valid"]

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, code, obj, ctype="application/json"):
        body = json.dumps(obj).encode() if ctype == "application/json" else obj
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n).decode(errors="replace") if n else ""

    def handle_one(self):
        body = self._body()
        valid = current()
        auth = self.headers.get("Authorization", "")
        host = self.server.name
        if self.path.startswith("/sse"):
            if auth != "Bearer " + valid:
                return self._send(401, {"error": "unauthorized"})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(4):
                self.wfile.write(f"data: event {i}\n\n".encode())
                self.wfile.flush()
                time.sleep(1.0)
            self.close_connection = True
            return
        if host == "api":
            # what carried the current token (booleans only: the token itself is never echoed back)
            seen = {"header": auth == "Bearer " + valid, "query": valid in self.path, "body": valid in body,
                    "basic": auth.startswith("Basic ")}
            if not (seen["header"] or seen["query"] or seen["body"] or self._basic_ok(auth, valid)):
                return self._send(401, {"error": "unauthorized", "authorization": auth})
            return self._send(200, {"ok": True, **seen})
        # other: report what arrived, placeholders included
        return self._send(200, {"host": self.headers.get("Host"), "authorization": auth, "path": self.path,
                                "body": body, "xtoken": self.headers.get("X-Token")})

    def _basic_ok(self, auth, valid):
        import base64
        if not auth.startswith("Basic "):
            return False
        try:
            return base64.b64decode(auth[6:]).decode() == "agent:" + valid
        except Exception:
            return False

    do_GET = do_POST = do_PUT = handle_one

    def log_message(self, *a):
        pass

class TLSServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

def serve(ip, port, name, tls):
    srv = TLSServer((ip, port), Handler)
    srv.name = name
    if tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(f"{certdir}/{name}.crt", f"{certdir}/{name}.key")
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()

for ip, name in ((api_ip, "api"), (other_ip, "other")):
    serve(ip, 443, name, True)
    serve(ip, 80, name, False)

import websockets
from websockets.asyncio.server import serve as ws_serve

def check(conn, request):
    if request.headers.get("Authorization") != "Bearer " + current():
        return conn.respond(401, "unauthorized\n")
    return None

async def echo(ws):
    async for msg in ws:
        await ws.send("echo " + msg)

async def main():
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(f"{certdir}/ws.crt", f"{certdir}/ws.key")
    async with ws_serve(echo, ws_ip, 443, ssl=ctx, process_request=check):
        print("ready", flush=True)
        await asyncio.Future()

asyncio.run(main())
'''


@dataclass
class Remote:
    ca: Path
    tokens: Path
    host_ip: str = ""  # the host's own (private) address on the link to the namespace
    valid: str = ""

    def accept(self, token: str) -> None:
        """The API server accepts ``token`` (only it) from now on."""
        self.valid = token
        tmp = self.tokens.with_suffix(".tmp")
        tmp.write_text(json.dumps({"valid": token}))
        tmp.replace(self.tokens)


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Remote]:
    """The fake outside world (see the module docstring); removed afterwards with its routes."""
    folder = tmp_path_factory.mktemp("secrets-remote")
    ca = make_ca(folder, "sbx test upstream CA",
                 {"api": API_HOST, "other": OTHER_HOST, "ws": WS_HOST, "h2": H2_HOST})
    tokens = folder / TOKEN_FILE_NAME
    remote = Remote(ca=ca, tokens=tokens)
    remote.accept("tok-initial-" + os.urandom(8).hex())
    (folder / "servers.py").write_text(SERVERS)
    (folder / "h2server.py").write_text(H2_SERVER)
    servers = ([sys.executable, str(folder / "servers.py"), str(tokens), str(folder), API_IP, OTHER_IP, WS_IP],
               [str(EGRESS_PYTHON), str(folder / "h2server.py"), str(tokens), str(folder), H2_IP])
    with outside_netns(f"sbxsec{slot()}", str(LINK), (API_IP, OTHER_IP, WS_IP, H2_IP), servers,
                       ready_line=True) as host_ip:
        remote.host_ip = host_ip

        def answers() -> bool:
            try:
                with socket.create_connection((OTHER_IP, 80), timeout=2):
                    return True
            except OSError:
                return False

        poll(answers, "the test servers", timeout=30)
        yield remote


@pytest.fixture(scope="module")
def sec_server(tmp_path_factory: pytest.TempPathFactory, remote: Remote) -> Iterator[Server]:
    """A server whose egress proxy trusts the test CA upstream."""
    with start_server(tmp_path_factory.mktemp("sbx-secrets"), node="creds", bridge="sbxcred0", subnet="10.94.0.0/16",
                      SBX_EGRESS_UPSTREAM_CA=str(remote.ca)) as srv:
        yield srv


def _sh(server: Server, sid: str, command: str, user: str = "root", timeout: float = 120) -> str:
    r = server.sbx("exec", sid, "--user", user, "--timeout", str(int(timeout)), command, timeout=timeout + 30)
    assert r.returncode == 0, f"{command!r} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _new(server: Server, *args: str) -> str:
    sid = server.sbx("new", *args, check=True).stdout.strip()
    _sh(server, sid, f"printf '{HOSTS_LINES}' >> /etc/hosts")
    return sid


def _curl(server: Server, sid: str, url: str, *args: str) -> tuple[int, str]:
    """``curl`` from inside; returns (HTTP status, body). Status 0: no HTTP answer (the body is curl's error)."""
    cmd = "curl -sS --max-time 20 -o /tmp/body -w '%{http_code}' " + " ".join(shlex.quote(a) for a in [*args, url])
    r = server.sbx("exec", sid, "--user", "root", f"{cmd}; echo; cat /tmp/body 2>/dev/null", timeout=90)
    first, _, rest = r.stdout.partition("\n")
    code = int(first.strip() or 0) if first.strip().isdigit() else 0
    return code, rest + (r.stderr if code == 0 else "")


def _set_secret(server: Server, name: str, value: str, *args: str) -> dict:  # type: ignore[type-arg]
    r = subprocess.run([server.env["PATH"].split(":")[0] + "/sbx", "secret", "set", name, *args, "--json"],
                       input=value + "\n", env=server.env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)["secret"]  # type: ignore[no-any-return]


@dataclass
class Setup:
    server: Server
    token: str
    bound: str  # a sandbox created with --secret apitok
    plain: str  # a sandbox without any binding


@pytest.fixture(scope="module")
def setup(sec_server: Server, remote: Remote) -> Setup:
    """Secret ``apitok`` (placeholder replacement on the api, h2 and ws hosts; not ``other``), a sandbox bound to
    it at create and one without."""
    token = "tok-" + os.urandom(12).hex()
    remote.accept(token)
    sec = _set_secret(sec_server, "apitok", token, "--host", API_HOST, "--host", H2_HOST, "--host", WS_HOST)
    assert sec["placeholder"] == "sbx-secret:apitok" and sec["version"] == 1
    bound = _new(sec_server, "--secret", "apitok")
    plain = _new(sec_server)
    _sh(sec_server, plain, f"cat > /tmp/testca.crt <<'EOF'\n{remote.ca.read_text()}EOF")
    return Setup(sec_server, token, bound, plain)


HDR = "Authorization: Bearer sbx-secret:apitok"


def test_placeholder_is_replaced_only_for_the_hosts_its_rules_name(setup: Setup) -> None:
    srv, bound = setup.server, setup.bound
    listed = srv.sbx("secret", "list", "--json", check=True).stdout
    assert setup.token not in listed and "apitok" in listed
    assert json.loads(listed)["secrets"][0]["sandboxes"] == [bound]
    # the bound sandbox: the proxy puts the token in, so the API answers 200
    code, body = _curl(srv, bound, f"https://{API_HOST}/whoami", "-H", HDR)
    assert code == 200, body
    assert json.loads(body)["header"] is True
    # query and body placeholders too
    code, body = _curl(srv, bound, f"https://{API_HOST}/q?key=sbx-secret:apitok", "-X", "POST",
                       "--data-binary", '{"key": "sbx-secret:apitok"}', "-H", "Content-Type: application/json")
    assert code == 200 and json.loads(body)["query"] and json.loads(body)["body"], body
    # a longer name sharing the prefix is not this placeholder
    code, body = _curl(srv, bound, f"https://{OTHER_HOST}/x", "-H", "X-Token: sbx-secret:apitok2")
    assert code == 200 and json.loads(body)["xtoken"] == "sbx-secret:apitok2"
    # the same request to a host the rule doesn't name arrives with the placeholder unchanged
    code, body = _curl(srv, bound, f"https://{OTHER_HOST}/whoami?key=sbx-secret:apitok", "-H", HDR,
                       "--data-binary", "sbx-secret:apitok")
    seen = json.loads(body)
    assert code == 200 and seen["authorization"] == "Bearer sbx-secret:apitok", body
    assert seen["path"] == "/whoami?key=sbx-secret:apitok" and seen["body"] == "sbx-secret:apitok"
    # plain HTTP goes through the proxy too
    code, body = _curl(srv, bound, f"http://{OTHER_HOST}/plain", "-H", HDR)
    assert code == 200 and json.loads(body)["authorization"] == "Bearer sbx-secret:apitok", body
    # a sandbox without the binding is not proxied (end-to-end TLS with the real server's certificate, which only
    # the test CA verifies) and gets 401: the server saw the placeholder itself
    code, body = _curl(srv, setup.plain, f"https://{API_HOST}/whoami", "-H", HDR, "--cacert", "/tmp/testca.crt")
    assert code == 401 and "sbx-secret:apitok" in body, body
    code, body = _curl(srv, bound, f"https://{API_HOST}/whoami", "-H", HDR, "--cacert", "/tmp/testca.crt")
    assert code == 0, "the bound sandbox's TLS is the proxy's, not the test CA's"

    log = json.loads(srv.sbx("secret", "log", "apitok", "--json", check=True).stdout)["uses"]
    assert [(u["sandbox"], u["host"], u["method"], u["path"], u["status"]) for u in log] == [
        (bound, API_HOST, "GET", "/whoami", 200), (bound, API_HOST, "POST", "/q", 200)]
    table = srv.sbx("secret", "log", "apitok", check=True).stdout
    assert "/whoami" in table and "200" in table


WS_CLIENT = r'''
import base64, os, socket, ssl, sys
host = sys.argv[1]
ctx = ssl.create_default_context()
s = ctx.wrap_socket(socket.create_connection((host, 443), timeout=20), server_hostname=host)
key = base64.b64encode(os.urandom(16)).decode()
s.sendall((f"GET /echo HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
           "Authorization: Bearer sbx-secret:apitok\r\n\r\n").encode())
head = b""
while b"\r\n\r\n" not in head:
    head += s.recv(1)
print(head.split(b"\r\n")[0].decode())
if b" 101 " not in head.split(b"\r\n")[0]:
    sys.exit(0)
msg, mask = b"hello", os.urandom(4)
s.sendall(bytes([0x81, 0x80 | len(msg)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(msg)))
hdr = s.recv(2)
print(s.recv(hdr[1] & 0x7F).decode())
'''


def test_http2_and_websocket_carry_the_secret(setup: Setup) -> None:
    srv = setup.server
    r = srv.sbx("exec", setup.bound, "--user", "root", "curl -sS --http2 -o /tmp/h2 -w '%{http_version} "
                f"%{{http_code}}' -H '{HDR}' https://{H2_HOST}/h2; echo; cat /tmp/h2", check=True)
    assert r.stdout.split("\n")[:2] == ["2 200", "ok h2"], r.stdout
    r = srv.sbx("exec", setup.plain, "--user", "root", "curl -sS --http2 --cacert /tmp/testca.crt -o /dev/null -w "
                f"'%{{http_version}} %{{http_code}}' -H '{HDR}' https://{H2_HOST}/h2", check=True)
    assert r.stdout.strip() == "2 401", r.stdout
    _sh(srv, setup.bound, f"cat > /tmp/ws.py <<'EOF'\n{WS_CLIENT}EOF")
    out = _sh(srv, setup.bound, f"python3 /tmp/ws.py {WS_HOST}")
    assert out.splitlines() == ["HTTP/1.1 101 Switching Protocols", "echo hello"], out


def test_sse_streams_event_by_event(setup: Setup) -> None:
    out = _sh(setup.server, setup.bound, f"curl -sSN --max-time 30 -H '{HDR}' https://{API_HOST}/sse | "
              "while IFS= read -r line; do [ -n \"$line\" ] && echo \"$(date +%s.%N) $line\"; done; true")
    lines = [line.split(" ", 1) for line in out.splitlines()]
    assert [text for _, text in lines] == [f"data: event {i}" for i in range(4)], out
    times = [float(t) for t, _ in lines]
    # the server sends one event a second: unbuffered, they arrive spread over ~3 s, not all at the end
    assert times[-1] - times[0] > 2.0, out


def test_rotation_bind_unbind_and_header_actions_apply_on_the_next_request(setup: Setup, remote: Remote) -> None:
    srv, bound = setup.server, setup.bound
    new = "tok-rotated-" + os.urandom(8).hex()
    remote.accept(new)
    code, _ = _curl(srv, bound, f"https://{API_HOST}/before", "-H", HDR)
    assert code == 401  # the proxy still has the old value
    sec = _set_secret(srv, "apitok", new)
    assert sec["version"] == 2 and len(sec["rules"][0]["hosts"]) == 3  # a rotation keeps the rules
    code, body = _curl(srv, bound, f"https://{API_HOST}/after", "-H", HDR)
    assert code == 200, body
    # a header action, bound to the running sandbox (no restart); the request carries no placeholder at all
    _set_secret(srv, "hdrtok", new, "--host", API_HOST, "--path", "/hdr", "--header", "Authorization: Bearer {secret}")
    code, _ = _curl(srv, setup.plain, f"https://{API_HOST}/hdr", "--cacert", "/tmp/testca.crt")
    assert code == 401
    assert srv.sbx("secret", "bind", setup.plain, "hdrtok", check=True).stdout.split() == ["hdrtok"]
    code, body = _curl(srv, setup.plain, f"https://{API_HOST}/hdr/x")
    assert code == 200, body
    code, body = _curl(srv, setup.plain, f"https://{API_HOST}/elsewhere")
    assert code == 401, "the rule's path prefix is /hdr"
    srv.sbx("secret", "unbind", setup.plain, "hdrtok", check=True)
    code, _ = _curl(srv, setup.plain, f"https://{API_HOST}/hdr/x", "--cacert", "/tmp/testca.crt")
    assert code == 401  # unproxied again: end-to-end TLS with the real server, no header
    # basic auth
    _set_secret(srv, "basictok", new, "--host", API_HOST, "--basic-user", "agent", "--method", "GET")
    srv.sbx("secret", "bind", bound, "basictok", check=True)
    code, body = _curl(srv, bound, f"https://{API_HOST}/basic")
    assert code == 200 and json.loads(body)["basic"], body
    srv.sbx("secret", "rm", "basictok", check=True)
    code, _ = _curl(srv, bound, f"https://{API_HOST}/basic")
    assert code == 401
    statuses = [(u["path"], u["status"]) for u in
                json.loads(srv.sbx("secret", "log", "apitok", "--json", check=True).stdout)["uses"]]
    assert statuses[-2:] == [("/before", 401), ("/after", 200)]
    assert [(u["sandbox"], u["path"]) for u in json.loads(srv.sbx("secret", "log", "hdrtok", "--json",
                                                                  check=True).stdout)["uses"]] == [
        (setup.plain, "/hdr/x")]


def test_an_upstream_tls_error_reaches_the_client(setup: Setup) -> None:
    """A trusted name pointed at another server (whose certificate names another host): the proxy's upstream
    check fails, and the client gets a failed TLS handshake, not a certificate the proxy made for the name; the
    secret goes nowhere."""
    srv = setup.server
    before = len(json.loads(srv.sbx("secret", "log", "apitok", "--json", check=True).stdout)["uses"])
    r = srv.sbx("exec", setup.bound, "--user", "root", f"curl -sS --max-time 20 --resolve {API_HOST}:443:{OTHER_IP} "
                f"-H '{HDR}' https://{API_HOST}/tls-error")
    assert r.returncode != 0
    assert re.search(r"SSL|TLS|certificate", r.stdout + r.stderr, re.I), r.stdout + r.stderr
    after = json.loads(srv.sbx("secret", "log", "apitok", "--json", check=True).stdout)["uses"]
    assert len(after) == before


def test_hostile_sandbox_gets_no_secret_and_no_new_reach(setup: Setup, remote: Remote) -> None:
    """From inside a bound sandbox (root): a Host header naming the rule's host over plain HTTP to another
    address gets no secret; the redirect reaches neither the host's own private address, nor another sandbox,
    nor the proxy's port directly; the control socket is a root-only Unix socket on the host."""
    import http.server
    import threading

    srv, bound = setup.server, setup.bound
    code, body = _curl(srv, bound, f"http://{OTHER_IP}/spoof", "-H", f"Host: {API_HOST}", "-H", HDR)
    assert code == 200 and json.loads(body)["authorization"] == "Bearer sbx-secret:apitok", body

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "6")
            self.end_headers()
            self.wfile.write(b"host!\n")

        def log_message(self, *_a: object) -> None:
            pass

    # another sandbox's web server, on port 80
    _sh(srv, setup.plain, "nohup python3 -m http.server 80 --bind 0.0.0.0 >/dev/null 2>&1 & sleep 1")
    plain_ip = _sh(srv, setup.plain, "ip -4 -o addr show eth0 | awk '{print $4}' | cut -d/ -f1").strip()
    assert _curl(srv, setup.plain, "http://127.0.0.1/")[0] == 200
    api_port = srv.url.rsplit(":", 1)[1]
    httpd = http.server.HTTPServer((remote.host_ip, 80), Hello)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        assert _curl_host(f"http://{remote.host_ip}/") == 200  # it answers the host itself
        for target in (remote.host_ip, plain_ip):
            code, body = _curl(srv, bound, f"http://{target}/", "--max-time", "5")
            assert code == 0, (target, body)
        # an absolute-form request target naming the host's loopback (the API), the host's private address or
        # the other sandbox: the proxy never connects there on the sandbox's behalf
        for target in (f"http://127.0.0.1:{api_port}/healthz", f"http://{remote.host_ip}/", f"http://{plain_ip}/"):
            code, body = _curl(srv, bound, f"http://{OTHER_IP}/", "--request-target", target, "--max-time", "10")
            assert not re.search(r"version|Directory listing|host!", body), (target, code, body)
    finally:
        httpd.shutdown()
        httpd.server_close()
    # the proxy's own port, dialled directly
    gw = _sh(srv, bound, "ip route show default | awk '{print $3}'").strip()
    code, body = _curl(srv, bound, f"http://{gw}:7443/", "--max-time", "5")
    assert code == 0, body
    from sbx.config import load_settings

    folder = load_settings(state_dir=Path(srv.env["SBX_STATE_DIR"])).state_dir / "egress"
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (folder / "control.sock").stat().st_mode & 0o777 == 0o600
    assert (folder / "mitmproxy-ca.pem").stat().st_mode & 0o777 == 0o600
    # the CA's certificate is in the sandbox, its key is not
    ca_in = _sh(srv, bound, "cat /usr/local/share/ca-certificates/sbx-egress.crt")
    assert ca_in == (folder / "ca.crt").read_text() and "PRIVATE KEY" not in ca_in
    assert ca_in.strip() in _sh(srv, bound, "cat /etc/ssl/certs/ca-certificates.crt")


def _curl_host(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return int(r.status)


AGENT = r'''
import json, os, time, urllib.request
key = os.environ["API_KEY"]  # the placeholder, never the secret
notes = open("/root/notes.txt", "w")
notes.write("my key is " + key + "\\n")
notes.close()
os.sync()
replies = []
for i in range(3):
    url = "https://api.sbx-test.example/agent/%d" % i
    req = urllib.request.Request(url, headers={"Authorization": "Bearer " + key})
    with urllib.request.urlopen(req, timeout=20) as r:
        replies.append((r.status, r.read()))
with open("/root/agent.out", "w") as f:
    f.write(json.dumps([s for s, _ in replies]))
while True:
    time.sleep(60)
'''

SCAN = r'''
import json, os, sys
mask = bytes.fromhex(sys.argv[1])
secret = bytes(a ^ b for a, b in zip(bytes.fromhex(sys.argv[2]), mask))  # rebuilt here only: this process is skipped
placeholder = b"sbx-secret:apitok"
found = {"secret": 0, "placeholder": 0}
me = os.getpid()
for pid in [p for p in os.listdir("/proc") if p.isdigit() and int(p) != me]:
    try:
        maps = open(f"/proc/{pid}/maps").read().splitlines()
        mem = open(f"/proc/{pid}/mem", "rb", buffering=0)
    except OSError:
        continue
    for line in maps:
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if "r" not in line.split()[1] or hi - lo > 1 << 31:
            continue
        try:
            mem.seek(lo)
            data = mem.read(hi - lo)
        except (OSError, OverflowError, ValueError):
            continue
        found["secret"] += data.count(secret)
        found["placeholder"] += data.count(placeholder)
def env_of(pid):
    # as for memory above: a process gone meanwhile, or one the node entered the sandbox with (runc's helper, host
    # credentials, not dumpable), can't be read by the sandbox's root; no sandbox process is like that
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""
environ = b"".join(env_of(p) for p in os.listdir("/proc") if p.isdigit())
found["env_secret"] = environ.count(secret)
found["env_placeholder"] = environ.count(placeholder)
print(json.dumps(found))
'''


def _count_in_tree(folder: Path, needles: dict[str, bytes]) -> dict[str, int]:
    """Occurrences of each needle in every file under ``folder`` (holes of sparse files skipped)."""
    counts = {k: 0 for k in needles}
    chunk, keep = 8 << 20, max(len(n) for n in needles.values())
    for path in folder.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            size, off = os.fstat(fd).st_size, 0
            while off < size:
                try:
                    off = os.lseek(fd, off, os.SEEK_DATA)
                    end = os.lseek(fd, off, os.SEEK_HOLE)
                except OSError:  # no data after off
                    break
                tail = b""
                while off < end:
                    data = tail + os.pread(fd, min(chunk, end - off), off)
                    for k, n in needles.items():
                        counts[k] += data.count(n)
                    off += len(data) - len(tail)
                    tail = data[-(keep - 1):]
                    for k, n in needles.items():  # don't count a match inside the kept tail twice
                        counts[k] -= tail.count(n)
        finally:
            os.close(fd)
    return counts


def test_the_secret_never_enters_the_sandbox(setup: Setup, remote: Remote) -> None:
    """After real use: the sandbox's disk image, its memory checkpoint, its environment and every process's
    memory hold the placeholder, never the secret."""
    srv = setup.server
    secret = remote.valid.encode()
    vault = _new(srv, "--secret", "apitok", "--env", "API_KEY=sbx-secret:apitok")
    _sh(srv, vault, f"cat > /root/agent.py <<'EOF'\n{AGENT}EOF\ncat > /root/scan.py <<'EOF'\n{SCAN}EOF")
    srv.sbx("exec", vault, "--user", "root", "--detach", "python3 /root/agent.py", check=True)
    poll(lambda: _sh(srv, vault, "cat /root/agent.out 2>/dev/null || true").strip() == "[200, 200, 200]",
         "the agent's three requests", timeout=60)
    mask = os.urandom(len(secret))
    masked = bytes(a ^ b for a, b in zip(secret, mask, strict=True))
    out = _sh(srv, vault, f"python3 /root/scan.py {mask.hex()} {masked.hex()}")
    found = json.loads(out)
    assert found["secret"] == 0 and found["env_secret"] == 0, found
    assert found["placeholder"] > 0 and found["env_placeholder"] > 0, found

    r = srv.sbx("stop", vault, "--wait", "--json", check=True)
    assert json.loads(r.stdout)["sandbox"]["memorySaved"] is True, r.stdout
    from sbx.config import load_settings

    node_dir = load_settings(node_name=srv.env["SBX_NODE_NAME"]).node_dir / "sandboxes" / vault
    needles = {"secret": secret, "placeholder": b"sbx-secret:apitok"}
    memory = _count_in_tree(node_dir / "memory", needles)
    assert memory["secret"] == 0 and memory["placeholder"] > 0, memory
    disk = _count_in_tree(node_dir, needles)  # the disk image (and everything else of the sandbox's)
    assert disk["secret"] == 0 and disk["placeholder"] > memory["placeholder"], (disk, memory)


def test_a_fork_gets_the_secrets_it_names(setup: Setup) -> None:
    srv = setup.server
    r = srv.sbx("fork", setup.plain, "--secret", "apitok", "--wait", "--json", check=True)
    fork = json.loads(r.stdout.strip().splitlines()[-1])["sandbox"]["id"]
    assert json.loads(srv.sbx("secret", "list", "--json", check=True).stdout)["secrets"][0]["sandboxes"][-1] == fork
    _sh(srv, fork, f"printf '{HOSTS_LINES}' >> /etc/hosts")  # a boot writes a fresh /etc/hosts
    code, body = _curl(srv, fork, f"https://{API_HOST}/fork", "-H", HDR)
    assert code == 200, body
    uses = json.loads(srv.sbx("secret", "log", "apitok", "--json", check=True).stdout)["uses"]
    assert (uses[-1]["sandbox"], uses[-1]["path"]) == (fork, "/fork")
