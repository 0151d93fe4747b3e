"""The live migration's page receiver (sbx.runtime.pageserver) with the real CRIU: a dump's pages arrive through
it, and a connection from any other address than the source's is refused. Inside mutual TLS (issue 35): a dump sent
to a PageSender arrives through a PageReceiver that demands a certificate of the installation CA, and a sender whose
certificate another CA signed is refused (the receiver's wait fails, no pages land)."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbx import tls
from sbx.runtime import pageserver
from sbx.runtime.base import RuntimeError_
from sbx.runtime.pageserver import PageReceiver, PageSender

CRIU = Path("/var/lib/sbx/criu/criu")
HOLD = "import os, time\nb = bytearray(16 << 20)\nb[:] = os.urandom(16 << 20)\nopen('ready', 'w').close()\n" \
       "while True: time.sleep(1)"

pytestmark = pytest.mark.skipif(not CRIU.exists(), reason="needs the host's CRIU (scripts/install.sh)")


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process holding 16 MiB of random bytes (ready when it answers)."""
    proc = subprocess.Popen(["setsid", "python3", "-c", HOLD], cwd=tmp_path, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline, "the holder did not start"
            time.sleep(0.05)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _dump(pid: int, images: Path, address: str, port: int | str) -> subprocess.CompletedProcess[bytes]:
    images.mkdir()
    return subprocess.run([str(CRIU), "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "--shell-job",
                           "--leave-running", "--page-server", "--address", address, "--port", str(port)],
                          timeout=120, capture_output=True)


def test_a_dump_sends_its_pages_through_the_receiver(tmp_path: Path, holder: subprocess.Popen[bytes]) -> None:
    """``criu dump --page-server`` of a process holding 16 MiB: the pages land in the receiver's folder, the other
    images in the dump's own, and wait() returns once the page server exited."""
    rx = PageReceiver(CRIU, tmp_path / "pages", tmp_path / "ps-work", "127.0.0.1", "127.0.0.1")
    images = tmp_path / "images"
    assert _dump(holder.pid, images, rx.address, rx.port).returncode == 0
    rx.wait(60)
    pages = sum(f.stat().st_size for f in (tmp_path / "pages").glob("pages-*.img"))
    assert pages >= 16 << 20
    assert list((tmp_path / "pages").glob("pagemap-*.img"))
    assert not list(images.glob("pages-*.img")) and list(images.glob("core-*.img"))


def test_a_connection_from_another_address_is_refused(tmp_path: Path) -> None:
    """The receiver waits for the source (127.0.0.2 here): a connection from 127.0.0.1 is closed at once, and it
    still listens for the source afterwards."""
    rx = PageReceiver(CRIU, tmp_path / "pages", tmp_path / "ps-work", "127.0.0.1", "127.0.0.2")
    try:
        with socket.create_connection((rx.address, rx.port), timeout=5) as other:
            other.settimeout(5)
            assert other.recv(1) == b""  # closed by the receiver, not handed to CRIU
        with socket.socket() as source:
            source.bind(("127.0.0.2", 0))
            source.settimeout(5)
            source.connect((rx.address, rx.port))
    finally:
        rx.stop()
    with pytest.raises(RuntimeError_):  # stopped: the half-begun transfer counts as failed
        rx.wait(5)


def test_no_source_within_the_timeout_fails_the_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pageserver, "ACCEPT_TIMEOUT", 0.3)
    rx = PageReceiver(CRIU, tmp_path / "pages", tmp_path / "ps-work", "127.0.0.1", "127.0.0.1")
    with pytest.raises(RuntimeError_, match="did not connect"):
        rx.wait(5)


# --- the page stream inside mutual TLS (issue 35): PageSender on the source, PageReceiver with a context -------
def _identity(ca: Path, out: Path, name: str) -> tls.Identity:
    tls.issue(ca, out, name, ["127.0.0.1"])
    ident = tls.identity(out)
    assert ident is not None
    return ident


def test_a_dump_crosses_in_tls(tmp_path: Path, holder: subprocess.Popen[bytes]) -> None:
    ca = tmp_path / "ca"
    tls.make_ca(ca)
    node_a, node_b = _identity(ca, tmp_path / "a", "a"), _identity(ca, tmp_path / "b", "b")
    rx = PageReceiver(CRIU, tmp_path / "pages", tmp_path / "ps-work", "127.0.0.1", "127.0.0.1",
                      tls=node_b.server_context())
    sender = PageSender(rx.address, rx.port, "127.0.0.1", node_a.client_context())
    try:
        assert sender.address.startswith("127.0.0.1:") and sender.address != f"{rx.address}:{rx.port}"
        assert _dump(holder.pid, tmp_path / "images", *sender.address.split(":")).returncode == 0
    finally:
        sender.close()
    rx.wait(60)
    assert sender.error is None
    pages = sum(f.stat().st_size for f in (tmp_path / "pages").glob("pages-*.img"))
    assert pages >= 16 << 20
    assert not list((tmp_path / "images").glob("pages-*.img"))


def test_a_sender_of_another_ca_is_refused(tmp_path: Path, holder: subprocess.Popen[bytes]) -> None:
    ca, other = tmp_path / "ca", tmp_path / "other"
    tls.make_ca(ca)
    tls.make_ca(other)
    node_b = _identity(ca, tmp_path / "b", "b")
    forged = _identity(other, tmp_path / "f", "a")
    rx = PageReceiver(CRIU, tmp_path / "pages", tmp_path / "ps-work", "127.0.0.1", "127.0.0.1",
                      tls=node_b.server_context())
    # the forger trusts the real CA, so only the receiver's check of its certificate can stop it
    sender = PageSender(rx.address, rx.port, "127.0.0.1",
                        tls.Identity(ca / "ca.crt", forged.cert, forged.key).client_context())
    try:
        assert _dump(holder.pid, tmp_path / "images", *sender.address.split(":")).returncode != 0
    finally:
        sender.close()
    with pytest.raises(RuntimeError_):
        rx.wait(30)
    assert not list((tmp_path / "pages").glob("pages-*.img"))
