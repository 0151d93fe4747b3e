"""A throwaway PostgreSQL cluster for tests of the shared store (issue 10), from Debian's ``postgresql`` package.

:func:`pg_cluster` runs ``initdb`` as the ``postgres`` user into a fresh temp folder and ``pg_ctl start`` with a unix
socket in that folder and no TCP listener, yields a :class:`PgCluster`, and stops it (``pg_ctl stop -m immediate``)
and removes the folder afterwards. The server binaries are found under ``/usr/lib/postgresql/<version>/bin`` (the
newest version installed); they refuse to run as root, so they run through ``runuser -u postgres``.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest


def pg_bin() -> Path:
    """The ``bin`` folder of the newest PostgreSQL server installed; fails the test when there is none."""
    versions = sorted(
        (p for p in Path("/usr/lib/postgresql").glob("*/bin") if (p / "initdb").exists()),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    if not versions:
        pytest.fail("PostgreSQL server binaries missing: run `bash scripts/install.sh --dev` (apt package postgresql)")
    return versions[-1]


@dataclass
class PgCluster:
    """A running cluster: ``socket_dir`` holds its unix socket; ``url(db)`` is a SQLAlchemy URL for a database."""

    root: Path
    socket_dir: Path
    bin: Path

    def psql(self, sql: str, db: str = "postgres") -> str:
        """Run ``sql`` through ``psql`` as ``postgres``; returns its unaligned output."""
        r = subprocess.run(
            ["runuser", "-u", "postgres", "--", str(self.bin / "psql"), "-h", str(self.socket_dir), "-d", db,
             "-XAtq", "-v", "ON_ERROR_STOP=1", "-c", sql],
            capture_output=True, text=True, timeout=60,
        )
        if r.returncode != 0:
            raise AssertionError(f"psql {sql!r}: {r.stderr}")
        return r.stdout.strip()

    def create_db(self, name: str) -> str:
        """Create database ``name`` and return its URL (user ``postgres`` over the unix socket)."""
        self.psql(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def url(self, db: str) -> str:
        return f"postgresql+psycopg://postgres@/{db}?host={self.socket_dir}"


@contextmanager
def pg_cluster() -> Iterator[PgCluster]:
    """Start a throwaway cluster (see the module docstring); stop it and delete its files on exit."""
    bindir = pg_bin()
    root = Path(tempfile.mkdtemp(prefix="sbx-pg-"))
    root.chmod(0o755)
    data, sock = root / "data", root / "sock"
    for d in (data, sock):
        d.mkdir()
        shutil.chown(d, "postgres", "postgres")
    run = ["runuser", "-u", "postgres", "--"]

    def sh(*args: str, timeout: float = 120) -> None:
        r = subprocess.run([*run, *args], capture_output=True, text=True, timeout=timeout, cwd=root)
        if r.returncode != 0:
            raise AssertionError(f"{' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")

    try:
        sh(str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
           "--locale=C.UTF-8")
        opts = f"-c listen_addresses='' -c unix_socket_directories='{sock}' -c fsync=off -c max_connections=200"
        sh(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(sock / "log"), "-o", opts, "-w", "-t", "120",
           "start", timeout=180)
        yield PgCluster(root=root, socket_dir=sock, bin=bindir)
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([*run, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                           capture_output=True, timeout=120, cwd=root)
        shutil.rmtree(root, ignore_errors=True)
