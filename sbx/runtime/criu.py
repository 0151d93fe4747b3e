"""CRIU as installed by host setup, and the host fingerprint a memory image is tied to.

CRIU 4.2.1 from Debian sid runs through sid's own dynamic loader (a wrapper script ``<criu_dir>/criu``,
written by :mod:`sbx.node.host.criuinstall`); runc is pointed at it with its global ``--criu`` flag and talks to it with
``criu swrk`` (runtime-facts). A memory image can only be restored on a host with the same CPU model and flags,
kernel and CRIU version: :func:`host_fingerprint` captures those and is stored beside each image.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path


def criu_binary(criu_dir: Path) -> Path:
    """Path of the ``criu`` wrapper under ``criu_dir``."""
    return criu_dir / "criu"


@lru_cache(maxsize=4)
def criu_version(criu_binary: str) -> str:
    """``criu --version``'s version string (``"4.2.1"``), or ``"missing"`` when it can't run."""
    try:
        out = subprocess.run([criu_binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return "missing"
    for line in out.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _cpuinfo() -> tuple[str, str]:
    model, flags = "unknown", ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = value.strip()
    return model, flags


FAKE_FINGERPRINT_ENV = "SBX_TEST_FAKE_FINGERPRINT"
"""Test knob (issue 10): when set on a node agent, the node's ``cpuModel`` gets `` (fake: <value>)`` appended, so
memory images made on other nodes don't match it (``cpu_mismatch``) and its own don't match theirs."""


def host_fingerprint(criu_binary: str) -> dict[str, str]:
    """``{"cpuModel", "cpuFlagsSha256", "kernel", "criu"}`` of this host. Two hosts with equal fingerprints can
    restore each other's memory images."""
    model, flags = _cpuinfo()
    fake = os.environ.get(FAKE_FINGERPRINT_ENV, "").strip()
    if fake:  # a test knob: this node claims another CPU, so images of other nodes mismatch here
        model = f"{model} (fake: {fake})"
    return {
        "cpuModel": model,
        "cpuFlagsSha256": hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest(),
        "kernel": platform.release(),
        "criu": criu_version(criu_binary),
    }


def fingerprint_mismatch(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """Names of the fingerprint fields that differ (empty when the image is restorable here)."""
    return [k for k in ("cpuModel", "cpuFlagsSha256", "kernel", "criu") if recorded.get(k) != current.get(k)]


def write_fingerprint(image_dir: Path, fingerprint: dict[str, str]) -> None:
    """Store ``fingerprint`` as ``image_dir/host.json``."""
    (image_dir / "host.json").write_text(json.dumps(fingerprint, indent=1))


def read_fingerprint(image_dir: Path) -> dict[str, str] | None:
    """The fingerprint stored with a memory image, or None if there is none."""
    p = image_dir / "host.json"
    return json.loads(p.read_text()) if p.is_file() else None


def log_tail(work_dir: Path, name: str, lines: int = 15) -> str:
    """The last error lines of CRIU's ``dump.log``/``restore.log`` in ``work_dir`` (for error reports)."""
    p = work_dir / name
    if not p.is_file():
        return ""
    text = p.read_text(errors="replace").splitlines()
    errors = [ln for ln in text if "Error" in ln]
    return "\n".join((errors or text)[-lines:])
