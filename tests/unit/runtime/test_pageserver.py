"""The live migration's page receiver (sbx.runtime.pageserver) with the real CRIU: a dump's pages arrive through
it, and a connection from any other address than the source's is refused."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from sbx.runtime import pageserver
from sbx.runtime.base import RuntimeError_
from sbx.runtime.pageserver import PageReceiver

CRIU = Path("/var/lib/sbx/criu/criu")
HOLD = "import os, time\nb = bytearray(16 << 20)\nb[:] = os.urandom(16 << 20)\nopen('ready', 'w').close()\n" \
       "while True: time.sleep(1)"

pytestmark = pytest.mark.skipif(not CRIU.exists(), reason="needs the host's CRIU (scripts/install.sh)")


def test_a_dump_sends_its_pages_through_the_receiver(tmp_path: Path) -> None:
    """``criu dump --page-server`` of a process holding 16 MiB: the pages land in the receiver's folder, the other
    images in the dump's own, and wait() returns once the page server exited."""
    holder = subprocess.Popen(["setsid", "python3", "-c", HOLD], cwd=tmp_path, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline, "the holder did not start"
            time.sleep(0.05)
        rx = PageReceiver(CRIU, tmp_path / "pages", tmp_path / "ps-work", "127.0.0.1", "127.0.0.1")
        images = tmp_path / "images"
        images.mkdir()
        subprocess.run([str(CRIU), "dump", "-t", str(holder.pid), "-D", str(images), "-o", "dump.log",
                        "--shell-job", "--leave-running", "--page-server", "--address", rx.address, "--port",
                        str(rx.port)], check=True, timeout=120)
        rx.wait(60)
    finally:
        holder.kill()
        holder.wait()
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
