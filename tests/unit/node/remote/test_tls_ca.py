"""The installation CA and mutual TLS between servers and node agents (issue 35, :mod:`sbx.tls`): what the CA
writes and with which modes, what a certificate names, and that the node API served with the CA's certificates
answers only a client whose certificate chains to it (another CA's, or none, fails the handshake), over HTTP calls,
the spawn WebSocket and the port relay; a roll keeps old and new certificates valid until it is finished."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from sbx import tls
from sbx.config import load_settings
from sbx.node.remote.client import RemoteNode
from sbx.node.remote.relay import open_relay
from sbx.node.remote.server import create_node_app
from sbx.node.types import NodeError
from tests.fakes import FakeNode, wait_until

TOKEN = "sbxn_tls-test-token"


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    folder = tmp_path / "ca"
    tls.make_ca(folder)
    tls.issue(folder, folder, "sbx-server")
    return folder


def test_the_ca_and_an_issued_certificate(ca: Path, tmp_path: Path) -> None:
    assert _mode(ca / "ca.key") == 0o600 and _mode(ca / "key.pem") == 0o600 and _mode(ca) == 0o700
    ca_cert = x509.load_pem_x509_certificate((ca / "ca.crt").read_bytes())
    assert ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True

    out = tmp_path / "node1"
    cert = tls.issue(ca, out, "node1", ["10.0.0.2", "node1.example", "10.0.0.2"])
    assert sorted(p.name for p in out.iterdir()) == ["ca.crt", "cert.pem", "key.pem"]
    assert _mode(out / "key.pem") == 0o600
    assert (out / "ca.crt").read_bytes() == (ca / "ca.crt").read_bytes()
    assert "ca.key" not in {p.name for p in out.iterdir()}
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.2")]
    assert san.get_values_for_type(x509.DNSName) == ["node1.example"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert cert.issuer == ca_cert.subject
    cert.verify_directly_issued_by(ca_cert)
    assert tls.identity(out) == tls.Identity(out / "ca.crt", out / "cert.pem", out / "key.pem")
    assert tls.identity(tmp_path / "nothing") is None
    assert [d["hosts"] for d in tls.describe(out / "cert.pem")] == ["10.0.0.2,node1.example"]


def test_issue_refuses_without_a_ca_or_with_a_bad_name(tmp_path: Path, ca: Path) -> None:
    with pytest.raises(tls.TLSError):
        tls.issue(tmp_path / "empty", tmp_path / "out", "node1")
    for bad in ("", "  ", "a/b", "x\ny"):
        with pytest.raises(ValueError):
            tls.issue(ca, tmp_path / "out", bad)
    assert not (tmp_path / "out").exists()


class _Fake(FakeNode):
    """A FakeNode with the relay's one question: it holds no sandbox."""

    def address(self, id: str) -> str:
        raise NodeError("not_found", f"no sandbox {id} here")


class Served:
    """A FakeNode's API on a real port with mutual TLS (``node``: the node's TLS folder), and its port relay."""

    def __init__(self, tmp: Path, node: Path):
        import uvicorn

        ident = tls.identity(node)
        assert ident is not None
        self.fake = _Fake(tmp / "fakenode")
        self.port, self.relay_port = _port(), _port()
        app = create_node_app(self.fake, TOKEN, "fake", relay=("127.0.0.1", self.relay_port),
                              relay_tls=ident.server_context())
        self.server = uvicorn.Server(uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on", ssl_certfile=str(ident.cert),
            ssl_keyfile=str(ident.key), ssl_ca_certs=str(ident.ca), ssl_cert_reqs=ssl.CERT_REQUIRED))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, timeout=30)
        self.url = f"https://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.fake.close()


@pytest.fixture
def served(ca: Path, tmp_path: Path) -> Iterator[Served]:
    tls.issue(ca, tmp_path / "node", "fake", ["127.0.0.1"])
    s = Served(tmp_path, tmp_path / "node")
    try:
        yield s
    finally:
        s.close()


def _other_ca_identity(tmp_path: Path) -> tls.Identity:
    """A certificate of another CA, trusting the real one (a forged client)."""
    other = tmp_path / "other-ca"
    tls.make_ca(other)
    tls.issue(other, tmp_path / "forged", "sbx-server")
    ident = tls.identity(tmp_path / "forged")
    assert ident is not None
    return tls.Identity(tmp_path / "ca" / "ca.crt", ident.cert, ident.key)


def test_a_server_with_the_cas_certificate_reaches_the_node(served: Served, ca: Path) -> None:
    remote = RemoteNode(served.url, TOKEN, identity=tls.identity(ca))
    try:
        assert remote.info().name == served.fake.info().name
        remote.prepare(wait=5)
    finally:
        remote.close()
    # the node token is still checked inside TLS
    wrong = RemoteNode(served.url, "sbxn_wrong", identity=tls.identity(ca))
    with pytest.raises(NodeError) as e:
        wrong.info()
    assert e.value.code == "node_unauthorized"
    wrong.close()


def test_a_client_without_a_valid_certificate_is_refused(served: Served, ca: Path, tmp_path: Path) -> None:
    forged = RemoteNode(served.url, TOKEN, identity=_other_ca_identity(tmp_path))
    with pytest.raises(NodeError) as e:
        forged.info()
    assert e.value.code == "node_unreachable"
    forged.close()
    # no certificate at all, only the CA to check the node with
    bare = ssl.create_default_context(cafile=str(ca / "ca.crt"))
    with pytest.raises(httpx.HTTPError):
        httpx.get(served.url + "/v1/node/health", headers={"Authorization": f"Bearer {TOKEN}"}, verify=bare,
                  timeout=10)
    # nor the port relay
    relay_ctx = bare

    async def hello() -> None:
        await open_relay("127.0.0.1", served.relay_port, TOKEN, relay_ctx, "sb_aaaaaaaaaa", 22, timeout=10)

    with pytest.raises(NodeError) as e:
        asyncio.run(hello())
    assert e.value.code == "node_unreachable"


def test_a_node_with_a_forged_certificate_is_refused(ca: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-ca"
    tls.make_ca(other)
    tls.issue(other, tmp_path / "forged-node", "fake", ["127.0.0.1"])
    s = Served(tmp_path, tmp_path / "forged-node")
    try:
        remote = RemoteNode(s.url, TOKEN, identity=tls.identity(ca))
        with pytest.raises(NodeError) as e:
            remote.info()
        assert e.value.code == "node_unreachable" and "CERTIFICATE_VERIFY_FAILED" in e.value.message
        remote.close()
    finally:
        s.close()


def test_the_relay_and_spawn_cross_tls(served: Served, ca: Path) -> None:
    remote = RemoteNode(served.url, TOKEN, identity=tls.identity(ca))
    try:
        host, port, token, ctx = remote.relay_target()
        assert (host, port, token) == ("127.0.0.1", served.relay_port, TOKEN) and ctx is not None

        async def hello() -> None:
            await open_relay(host, port, token, ctx, "sb_aaaaaaaaaa", 22, timeout=10)

        with pytest.raises(NodeError) as e:  # through TLS to the relay, which answers (no such sandbox here)
            asyncio.run(hello())
        assert e.value.code == "not_found"
    finally:
        remote.close()


def test_plain_and_tls_urls_follow_the_servers_folder(ca: Path, tmp_path: Path) -> None:
    ident = tls.identity(ca)
    with pytest.raises(NodeError) as e:
        RemoteNode("http://10.0.0.2:7700", TOKEN, identity=ident)
    assert e.value.code == "node_tls_required"
    RemoteNode("http://127.0.0.1:7700", TOKEN, identity=ident).close()  # loopback stays allowed
    with pytest.raises(NodeError) as e:
        RemoteNode("https://10.0.0.2:7700", TOKEN, settings=load_settings(state_dir=tmp_path / "none"))
    assert e.value.code == "node_tls_missing"
    RemoteNode("http://10.0.0.2:7700", TOKEN, settings=load_settings(state_dir=tmp_path / "none")).close()


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> None:
    """One TLS handshake over a socket pair; raises ``ssl.SSLError`` when either side refuses."""
    a, b = socket.socketpair()
    errors: list[Exception] = []

    def serve() -> None:
        try:
            with server.wrap_socket(a, server_side=True) as s:
                s.recv(1)
        except (ssl.SSLError, OSError) as e:
            errors.append(e)

    t = threading.Thread(target=serve)
    t.start()
    try:
        with client.wrap_socket(b, server_hostname="127.0.0.1") as c:
            c.sendall(b"x")
            c.recv(1)  # the server's verdict on our certificate (TLS 1.3 sends it after the handshake)
    except OSError:
        pass
    t.join(10)
    if errors:
        raise errors[0]


def test_a_ca_roll_keeps_both_until_it_is_finished(ca: Path, tmp_path: Path) -> None:
    # the steps of docs/nodes-tls.md: rotate, reissue each node (it then trusts both), finish (the server is
    # reissued), the new ca.crt to every node
    tls.issue(ca, tmp_path / "old-node", "n", ["127.0.0.1"])
    old_node = tls.identity(tmp_path / "old-node")
    server_before = tls.identity(ca)
    assert old_node is not None and server_before is not None
    tls.rotate_ca(ca)
    assert _mode(ca / "ca.key") == 0o600 and (ca / "ca-old.key").is_file()
    assert len(tls.describe(ca / "ca.crt")) == 2
    server = tls.Identity(ca / "ca.crt", server_before.cert, server_before.key)  # a restarted server: both trusted
    # a node not reissued yet still takes the server (its certificate is the old CA's)
    _handshake(old_node.server_context(), server.client_context())
    tls.issue(ca, tmp_path / "new-node", "n", ["127.0.0.1"])
    new_node = tls.identity(tmp_path / "new-node")
    assert new_node is not None and len(tls.describe(new_node.ca)) == 2
    _handshake(new_node.server_context(), server.client_context())
    tls.finish_rotation(ca)
    tls.issue(ca, ca, "sbx-server")
    server = tls.identity(ca)
    assert server is not None
    assert len(tls.describe(ca / "ca.crt")) == 1 and not (ca / "ca-old.key").exists()
    _handshake(new_node.server_context(), server.client_context())
    with pytest.raises(ssl.SSLError):  # the old node's certificate is no longer trusted by the server
        _handshake(old_node.server_context(), server.client_context())
