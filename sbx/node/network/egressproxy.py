"""The node's egress proxy: sandboxes with secrets bound reach the web through mitmproxy, which injects them.

Pieces (all under ``<state_dir>/egress``, mode 0700):

- **the CA** (:func:`ensure_ca`): a per-installation certificate authority, RSA 2048, made here on first start
  with ``cryptography``. ``mitmproxy-ca.pem`` holds key and certificate and never leaves this folder;
  ``ca.crt`` is the certificate alone, which the node writes into every sandbox's trust store at boot
  (``/usr/local/share/ca-certificates/sbx-egress.crt`` and the system bundle; see :data:`CA_ENV` for the
  runtimes' variables).
- **the proxy process**: ``mitmdump --mode transparent`` from its own virtualenv (``.venv-egress``, made by
  ``scripts/install.sh``: mitmproxy pins versions of h11 and others that clash with the server's), listening on
  the bridge's gateway address at ``settings.egress_proxy_port``, with the addon :mod:`sbx.node.network.egressaddon`.
  A supervisor thread restarts it when it dies; it dies with the server (``PR_SET_PDEATHSIG``).
- **the control socket** ``control.sock`` (a Unix socket, mode 0600, in a root-only folder of the host's
  filesystem): the addon's only way to learn what to inject. Sandboxes can't reach it: they have their own mount
  namespace, and no TCP port carries it. Each line is one JSON question; :class:`EgressProxy` turns the client
  address into the sandbox id (only sandboxes marked with :meth:`EgressProxy.set` count) and passes the question
  to the control plane's handler.
- **the redirect**: the node's nftables table redirects TCP 80/443 from addresses in the set ``egress_proxied``
  to the proxy (:func:`sbx.node.network.bridge.ensure_bridge`), and only towards destinations the egress policy lets
  through; traffic to denied ranges is left to the forward chain, which drops it. Sandboxes without a binding
  are not redirected and keep end-to-end TLS.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import logging
import os
import signal
import socketserver
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sbx.node.network import bridge as network
from sbx.node.network.egress import EgressPolicy

log = logging.getLogger("sbx.node.network.egress")

CA_GUEST_PATH = "usr/local/share/ca-certificates/sbx-egress.crt"
"""Where a sandbox finds the proxy's CA certificate (relative to its root)."""
CA_BUNDLE_GUEST_PATH = "etc/ssl/certs/ca-certificates.crt"
"""The sandbox's system CA bundle (Debian's), which gets the proxy's certificate appended."""
CA_ENV = {
    "REQUESTS_CA_BUNDLE": "/" + CA_BUNDLE_GUEST_PATH,
    "SSL_CERT_FILE": "/" + CA_BUNDLE_GUEST_PATH,
    "NODE_EXTRA_CA_CERTS": "/" + CA_GUEST_PATH,
}
"""Environment of every exec and job when the proxy runs: Python requests, OpenSSL-based tools and Node.js then
trust the proxy's CA (curl and Debian's Python use the system bundle anyway)."""

Handler = Callable[[str, dict[str, Any]], dict[str, Any]]
"""``handler(sandbox_id, question) -> answer`` (the control plane's
:meth:`sbx.control.secrets.vault.Secrets.handle`)."""


def egress_dir(state_dir: Path) -> Path:
    return state_dir / "egress"


def ensure_ca(folder: Path, common_name: str = "sbx egress proxy CA") -> bytes:
    """Make (once) the proxy's CA in ``folder``: ``mitmproxy-ca.pem`` (private key + certificate, 0600, the file
    mitmproxy reads) and ``ca.crt`` (certificate only). Valid 10 years. Returns the certificate PEM."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    both, cert_file = folder / "mitmproxy-ca.pem", folder / "ca.crt"
    if both.is_file() and cert_file.is_file():
        return cert_file.read_bytes()
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "sbx")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=2)).not_valid_after(now + dt.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
    tmp = folder / "mitmproxy-ca.pem.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem + pem)
    tmp.replace(both)
    (folder / "mitmproxy-ca-cert.pem").write_bytes(pem)
    cert_file.write_bytes(pem)
    return pem


def _is_local_address(ip: str) -> bool:
    """True when ``ip`` is an address of this network namespace (a socket can bind to it)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def mitmdump_binary() -> Path:
    """``mitmdump`` of the proxy's virtualenv: ``SBX_EGRESS_MITMDUMP`` or ``<checkout>/.venv-egress/bin``."""
    env = os.environ.get("SBX_EGRESS_MITMDUMP")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / ".venv-egress" / "bin" / "mitmdump"


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    proxy: EgressProxy


class _Conn(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        server: _Server = self.server  # type: ignore[assignment]
        line = self.rfile.readline(1 << 20)
        try:
            question = json.loads(line)
            answer = server.proxy.answer(question)
        except Exception as e:  # a bad line or a failing store: the request passes without secrets
            log.warning("egress control: %s", e)
            answer = {"error": str(e)[:200]}
        self.wfile.write(json.dumps(answer).encode() + b"\n")


class EgressProxy:
    """The proxy of one node (see the module docstring). ``policy`` is the node's egress policy (passed on to
    the addon's own check); ``upstream_ca`` a CA file the proxy trusts for upstream servers instead of its
    default bundle (tests)."""

    def __init__(self, settings: Any, policy: EgressPolicy, upstream_ca: str = ""):
        self.settings = settings
        self.policy = policy
        self.upstream_ca = upstream_ca
        self.folder = egress_dir(settings.state_dir)
        self.socket_path = self.folder / "control.sock"
        self.ca_pem = b""
        self._handler: Handler | None = None
        self._by_ip: dict[str, str] = {}
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._closing = threading.Event()
        self._supervisor: threading.Thread | None = None

    @property
    def gateway(self) -> str:
        return str(network.gateway_of(self.settings.subnet).ip)

    def start(self) -> None:
        """Make the CA, open the control socket and start the supervised ``mitmdump``. Raises ``OSError`` when
        the binary is missing (``scripts/install.sh`` makes it)."""
        binary = mitmdump_binary()
        if not binary.is_file():
            raise OSError(f"{binary} is missing: run scripts/install.sh (it makes the egress proxy's virtualenv)")
        self.ca_pem = ensure_ca(self.folder)
        self.socket_path.unlink(missing_ok=True)
        old = os.umask(0o177)
        try:
            self._server = _Server(str(self.socket_path), _Conn)
        finally:
            os.umask(old)
        self._server.proxy = self
        threading.Thread(target=self._server.serve_forever, name="sbx-egress-control", daemon=True).start()
        config = {"socket": str(self.socket_path), "deny": list(self.policy.deny), "allow": list(self.policy.allow),
                  "services": [list(s) for s in self.policy.services]}
        (self.folder / "addon.json").write_text(json.dumps(config))
        self._supervisor = threading.Thread(target=self._supervise, args=(binary,), name="sbx-egress-proxy",
                                            daemon=True)
        self._supervisor.start()

    def _argv(self, binary: Path) -> list[str]:
        argv = [str(binary), "--mode", "transparent", "--listen-host", self.gateway,
                "--listen-port", str(self.settings.egress_proxy_port), "--set", f"confdir={self.folder}",
                "-s", str(Path(__file__).with_name("egressaddon.py")),
                "--set", f"sbx_config={self.folder / 'addon.json'}", "--set", "flow_detail=0",
                "--set", "termlog_verbosity=warn"]
        if self.upstream_ca:
            argv += ["--set", f"ssl_verify_upstream_trusted_ca={self.upstream_ca}"]
        return argv

    def _supervise(self, binary: Path) -> None:
        """Run ``mitmdump`` until :meth:`close`. It listens on the bridge's gateway address, which exists only
        while the node's bridge does (the node removes it when no sandbox runs): while the address is missing
        nothing is started, and a proxy that keeps exiting is restarted after 1, 2, 4 … at most 30 s."""
        logfile = self.folder / "mitmdump.log"
        delay = 1.0
        while not self._closing.is_set():
            if not _is_local_address(self.gateway):
                self._closing.wait(0.2)
                continue
            started = time.monotonic()
            with logfile.open("ab") as out:
                self._proc = subprocess.Popen(self._argv(binary), stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
            code = self._proc.wait()
            if self._closing.is_set():
                return
            delay = 1.0 if time.monotonic() - started > 60 else min(delay * 2, 30.0)
            if _is_local_address(self.gateway):
                log.warning("egress proxy exited with %s; restarting in %.0f s (log: %s)", code, delay, logfile)
            self._closing.wait(delay)

    def ready(self, timeout: float = 30.0) -> bool:
        """True once the proxy accepts connections on its port (within ``timeout`` seconds)."""
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.gateway, self.settings.egress_proxy_port), timeout=1):
                    return True
            except OSError:
                time.sleep(0.1)
        return False

    def close(self) -> None:
        """Stop the proxy and the control socket."""
        self._closing.set()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        self.socket_path.unlink(missing_ok=True)

    def serve(self, handler: Handler) -> None:
        """Answer the addon's questions with ``handler`` from now on."""
        self._handler = handler

    def answer(self, question: dict[str, Any]) -> dict[str, Any]:
        """Route one question from the addon: its ``client`` address must belong to a sandbox marked with
        :meth:`set`, else nothing is injected."""
        with self._lock:
            sid = self._by_ip.get(str(question.get("client", "")))
        if sid is None or self._handler is None:
            return {"actions": []}
        return self._handler(sid, question)

    def set(self, sandbox_id: str, address: str, on: bool) -> None:
        """Send ``address``'s (``10.88.0.7``) outbound 80/443 through the proxy (``on``) or not, at once: the
        element of the nftables set ``egress_proxied`` and the address-to-sandbox map."""
        ipaddress.IPv4Address(address)
        with self._lock:
            if on:
                self._by_ip[address] = sandbox_id
            elif self._by_ip.get(address) == sandbox_id:
                del self._by_ip[address]
        network.set_proxied(self.settings.node_name, address, on)
