"""The egress proxy figure (``python -m bench --only egress``): request latency through the credential proxy vs
direct, plain HTTP and HTTPS.

An upstream on this host: a network namespace (``sbxbenchegns``) the host routes a TEST-NET-3 address to
(:data:`UPSTREAM_IP`, ``SBX_BENCH_EGRESS_IP`` overrides it), serving ``GET /`` (a few bytes) on 80 and, with a
certificate from a CA of the run's own, on 443. The benchmark server trusts that CA upstream
(:func:`bench.server.upstream_ca`, set as ``SBX_EGRESS_UPSTREAM_CA`` when it starts). Two small sandboxes: one
with a secret bound (its 80/443 traffic is redirected to the proxy, which replaces the placeholder in the
Authorization header), one without (straight out through NAT). In each, Python's ``http.client`` makes
``max(40, 10 x repeats)`` requests one after another, each on a new connection (a TCP connect, for HTTPS a full
handshake: what a command-line tool pays per call), and the in-sandbox time from connect to the last byte of each
is a sample.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.context import Ctx, cli_new, tracked
from bench.registry import figure
from bench.report import Row
from bench.server import UPSTREAM_HOST, sbx_binary
from tests.outside import outside_netns

UPSTREAM_IP = os.environ.get("SBX_BENCH_EGRESS_IP", "203.0.113.250")
LINK = "172.31.247.0/30"  # the host takes .1, the namespace .2
NETNS_TAG = "sbxbencheg"  # namespace sbxbenchegns, veths sbxbenchegh / sbxbenchegp (tests/outside.py)

SERVER = r'''
import http.server, socketserver, ssl, sys, threading
ip, cert, key = sys.argv[1:4]

class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        body = b"ok\n"
        self.send_response(200 if self.headers.get("Authorization", "").startswith("Bearer ") else 401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass

class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

plain, tls = S((ip, 80), H), S((ip, 443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
threading.Thread(target=plain.serve_forever, daemon=True).start()
print("ready", flush=True)
tls.serve_forever()
'''

CLIENT = r'''
import http.client, json, ssl, sys, time
scheme, host, n, cafile = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
ctx = ssl.create_default_context(cafile=cafile) if scheme == "https" else None
out = []
for i in range(n + 1):
    t0 = time.perf_counter()
    c = (http.client.HTTPSConnection(host, context=ctx, timeout=20) if ctx else
         http.client.HTTPConnection(host, timeout=20))
    c.request("GET", "/", headers={"Authorization": "Bearer sbx-secret:benchtok"})
    r = c.getresponse()
    r.read()
    c.close()
    if r.status != 200:
        sys.exit(f"status {r.status}")
    if i:  # the first request warms the proxy's certificate cache
        out.append((time.perf_counter() - t0) * 1000)
print(json.dumps(out))
'''


@contextmanager
def upstream(folder: Path) -> Iterator[None]:
    """The upstream namespace and its server for the figure's duration; removed afterwards."""
    (folder / "server.py").write_text(SERVER)
    server = [sys.executable, str(folder / "server.py"), UPSTREAM_IP, str(folder / "server.crt"),
              str(folder / "server.key")]
    with outside_netns(NETNS_TAG, LINK, [UPSTREAM_IP], [server], ready_line=True):
        yield


@figure("egress", order=90)
def fig_egress(ctx: Ctx) -> list[Row]:
    """``egress``: per-request latency (new connection each) from a sandbox to an upstream on this host, through
    the egress proxy (secret bound, placeholder replaced) and direct (no binding), for HTTP and HTTPS."""
    srv = ctx.srv
    folder = Path(srv.env["SBX_EGRESS_UPSTREAM_CA"]).parent
    n = max(40, 10 * ctx.repeats)
    rows: list[Row] = []
    with upstream(folder), tracked(ctx) as ids:
        r = subprocess.run([sbx_binary(), "secret", "set", "benchtok", "--host",
                            UPSTREAM_HOST], input="bench-token\n", env=srv.env, capture_output=True, text=True,
                           timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"sbx secret set: {r.stdout}{r.stderr}")
        proxied = cli_new(ctx, ids, "small", "bench-egress-proxied")
        direct = cli_new(ctx, ids, "small", "bench-egress-direct")
        srv.sbx("secret", "bind", proxied, "benchtok")
        ca = (folder / "ca.crt").read_text()
        for sid in (proxied, direct):
            srv.sbx("exec", sid, "--user", "root", f"echo '{UPSTREAM_IP} {UPSTREAM_HOST}' >> /etc/hosts && "
                    f"cat > /tmp/client.py <<'PYEOF'\n{CLIENT}PYEOF\ncat > /tmp/up.crt <<'PYEOF'\n{ca}PYEOF")
        samples: dict[tuple[str, str], list[float]] = {}
        for scheme in ("http", "https"):
            for label, sid, cafile in (("direct", direct, "/tmp/up.crt"),
                                       ("proxy", proxied, "/etc/ssl/certs/ca-certificates.crt")):
                out = srv.sbx("exec", sid, "--timeout", "600",
                              f"python3 /tmp/client.py {scheme} {UPSTREAM_HOST} {n} {cafile}").stdout
                samples[(scheme, label)] = json.loads(out)
        for scheme in ("http", "https"):
            d, p = samples[(scheme, "direct")], samples[(scheme, "proxy")]
            med = sorted(p)[len(p) // 2] / sorted(d)[len(d) // 2]
            rows.append(Row("egress", f"{scheme.upper()} request, direct (no secret bound)", "ms", d,
                            note=f"new connection per request, {n} requests"))
            what = ("placeholder replaced" if scheme == "https" else
                    "secret looked up, not sent: the name does not resolve on this host (plain HTTP needs DNS)")
            rows.append(Row("egress", f"{scheme.upper()} request through the egress proxy", "ms", p,
                            note=f"median {med:.1f}x direct; {what}"))
    return rows
