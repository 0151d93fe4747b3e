"""Mutual TLS between the server and node agents (issue 35): a real `sbx server` driving a real `sbx node serve` in a
network namespace of its own (tests/nodenet.py), every byte between them passing through a TCP relay in this test
that records what crosses the link.

- while a sandbox on the node runs an exec whose environment and output carry a marker, and a file with another
  marker is copied in and read back, neither marker nor the node token appears in the recorded bytes (a plain
  probe sent through the same relay does: the recording sees clear text when there is some);
- a node agent whose certificate another CA signed is refused by `sbx node add` (its certificate does not verify),
  and so is a node agent without a certificate (plain ``http://`` to a server that has TLS certificates) or one
  reached as ``https://`` that serves plain HTTP;
- the node agent refuses a client without a certificate, or with one of another CA, before any route answers; a
  client with a certificate of the installation CA still needs the node token.
"""

from __future__ import annotations

import json
import secrets
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sbx import tls
from tests.e2e.conftest import Server, start_server
from tests.nodenet import NodeHost, node_netns, run_ca


class Recorder:
    """A TCP relay on ``listen_ip`` (an ephemeral port) to ``target`` that keeps every byte it passes, both ways."""

    def __init__(self, listen_ip: str, target: tuple[str, int]):
        self._srv = socket.create_server((listen_ip, 0))
        self.port = self._srv.getsockname()[1]
        self.target = target
        self._data = bytearray()
        self._lock = threading.Lock()
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def data(self) -> bytes:
        with self._lock:
            return bytes(self._data)

    def _accept(self) -> None:
        while not self._stop:
            try:
                a, _ = self._srv.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(self.target, timeout=10)
            except OSError:
                a.close()
                continue
            b.settimeout(None)
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                with self._lock:
                    self._data += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop = True
        self._srv.close()


@pytest.fixture(scope="module")
def linked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, NodeHost, Recorder, Path]]:
    tmp = tmp_path_factory.mktemp("sbx-node-tls")
    with node_netns(3, tmp) as node:
        # the node is reached at the host end of its veth (where the recorder listens): its certificate names both
        tls.issue(run_ca(), node.tls_dir, node.node_name, [node.node_ip, node.host_ip])
        node.start()
        rec = Recorder(node.host_ip, (node.node_ip, 7700))
        (tmp / "server").mkdir()
        try:
            with start_server(tmp / "server", node="tlsrv", bridge="sbxtlsv", subnet="10.106.0.0/16",
                              SBX_NODE_URL=f"https://{node.host_ip}:{rec.port}", SBX_NODE_TOKEN=node.token,
                              SBX_NODE_HEARTBEAT_SECONDS="1", SBX_NODE_UNREACHABLE_SECONDS="5") as srv:
                yield srv, node, rec, tmp
        finally:
            rec.close()
        assert node.stop() == 0, node.logs()


def ok(srv: Server, *args: str, timeout: float = 300) -> str:
    return srv.sbx(*args, timeout=timeout, check=True).stdout


def test_nothing_secret_crosses_the_link_in_clear(linked: tuple[Server, NodeHost, Recorder, Path]) -> None:
    srv, node, rec, tmp = linked
    sid = ok(srv, "new", "--type", "small").strip()
    env_marker = "envmark-" + secrets.token_hex(12)
    file_marker = "filemark-" + secrets.token_hex(12)
    out = ok(srv, "exec", sid, "--env", f"MARK={env_marker}", "echo seen-$MARK").strip()
    assert out == f"seen-{env_marker}"
    src = tmp / "secret.txt"
    src.write_text(file_marker + "\n")
    ok(srv, "cp", str(src), f"{sid}:/home/user/secret.txt")
    assert ok(srv, "exec", sid, "cat /home/user/secret.txt").strip() == file_marker
    ok(srv, "delete", sid, "--wait")

    # the recording sees clear text when some crosses: a plain probe through the same relay (the node refuses it)
    probe = b"PLAIN-PROBE-" + secrets.token_hex(8).encode()
    with socket.create_connection((node.host_ip, rec.port), timeout=10) as s:
        s.sendall(probe + b"\r\n\r\n")
        s.settimeout(10)
        try:
            s.recv(100)
        except OSError:
            pass
    seen = rec.data()
    assert probe in seen, "the recorder missed bytes it relayed"
    assert len(seen) > 20000, f"only {len(seen)} bytes crossed the link"
    for clear in (env_marker, file_marker, node.token, f"seen-{env_marker}"):
        assert clear.encode() not in seen, f"{clear[:12]}... crossed the link in clear"
    assert b"Authorization" not in seen and b"/v1/node/" not in seen
    assert seen[:3] == b"\x16\x03\x01"  # the first connection opens with a TLS handshake record


def _node_add(srv: Server, url: str, token: str) -> tuple[int, str]:
    r = srv.sbx("node", "add", url, "--token", token, timeout=120)
    return r.returncode, r.stderr


def test_a_node_with_a_forged_or_no_certificate_is_refused(linked: tuple[Server, NodeHost, Recorder, Path]) -> None:
    srv, _node, _rec, tmp = linked
    with node_netns(6, tmp) as other:
        # a CA nobody installed signs the node's certificate, and the node trusts only that CA
        forger = tmp / "forger-ca"
        tls.make_ca(forger)
        tls.issue(forger, forger, "forger-client")
        tls.issue(forger, other.tls_dir, other.node_name, [other.node_ip])
        ident = tls.identity(forger)
        assert ident is not None
        probe = ident.client_context()
        probe.check_hostname = False
        other.start(probe=probe)
        code, err = _node_add(srv, other.url, other.token)
        assert code == 1 and "node_unreachable" in err and "CERTIFICATE_VERIFY_FAILED" in err, err
        assert other.node_name not in ok(srv, "node", "list")
        assert other.stop() == 0, other.logs()

        # no certificate at all: the node serves plain HTTP, which this server (it has certificates) won't use
        for name in ("cert.pem", "key.pem", "ca.crt"):
            (other.tls_dir / name).unlink()
        other.tls = False
        other.start()
        code, err = _node_add(srv, other.url, other.token)
        assert code == 1 and "node_tls_required" in err, err
        code, err = _node_add(srv, other.url.replace("http://", "https://"), other.token)
        assert code == 1 and "node_unreachable" in err, err
        assert other.node_name not in ok(srv, "node", "list")
        names = [n["name"] for n in json.loads(ok(srv, "node", "list", "--json"))["nodes"]]
        assert names == [_node.node_name]
        assert other.stop() == 0, other.logs()


def test_the_node_refuses_a_client_without_a_valid_certificate(
        linked: tuple[Server, NodeHost, Recorder, Path]) -> None:
    _srv, node, _rec, tmp = linked
    url = f"https://{node.node_ip}:7700/v1/node/health"
    auth = {"Authorization": f"Bearer {node.token}"}
    ca_only = ssl.create_default_context(cafile=str(run_ca() / "ca.crt"))  # checks the node, presents nothing
    with pytest.raises(httpx.HTTPError):
        httpx.get(url, headers=auth, verify=ca_only, timeout=10)
    other = tmp / "other-ca"
    tls.make_ca(other)
    tls.issue(other, tmp / "other-client", "sbx-server")
    forged = tls.Identity(run_ca() / "ca.crt", tmp / "other-client" / "cert.pem", tmp / "other-client" / "key.pem")
    with pytest.raises(httpx.HTTPError):
        httpx.get(url, headers=auth, verify=forged.client_context(), timeout=10)
    # the port relay likewise
    with socket.create_connection((node.node_ip, 7701), timeout=10) as raw, pytest.raises(OSError):
        with forged.client_context().wrap_socket(raw, server_hostname=node.node_ip) as s:
            s.sendall(f"SBXRELAY {node.token} sb_aaaaaaaaaa 22\n".encode())
            if not s.recv(100):
                raise ConnectionResetError("closed")
    # the installation CA's certificate gets through TLS; the node token is still asked for
    good = node.client_context()
    assert good is not None
    assert httpx.get(url, headers=auth, verify=good, timeout=10).status_code == 200
    assert httpx.get(url, verify=good, timeout=10).status_code == 401
