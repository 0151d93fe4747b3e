"""Crash-safety pieces of the node agent: thawing a frozen sandbox root, memory image generations.

A server killed while a sandbox's root filesystem is frozen (``fsfreeze -f`` for the reflink copy of a fork or a
snapshot) leaves it frozen: every write inside hangs in D state until someone runs ``fsfreeze -u``. The node
records a ``freezing`` intent (the mount point) in ``node.json`` before it freezes, and reconcile thaws every
mounted sandbox root with :func:`thaw` before it touches anything else (a frozen disk blocks unmount, CRIU and
the container's shutdown).

Memory images carry the **generation** of the disk they belong to (``memory/generation``, an integer). The
record's ``diskGen`` is bumped when a stop starts (the state it seals) and again when a resume starts (the disk
moves on from there), so an image restores only over the exact disk state it was taken with: an interrupted
resume, a cold boot or any other start in between makes it stale, and it is discarded instead of restored
(``resumeReason: "stale_checkpoint"``). Images written before generations existed count as generation 0, as do
records without ``diskGen``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from sbx.runtime.base import RuntimeError_
from sbx.storage.disk import test_hold as test_hold  # the restore hold is the freeze hold's mechanism

GENERATION_FILE = "generation"

TEST_HOLD_STOP_ENV = "SBX_TEST_HOLD_STOP"
"""Test-only: seconds a stop waits after recording phase ``stopping`` and before it checkpoints or halts, with a
marker file ``<sandbox dir>/stop-hold`` present meanwhile, so tests can kill a server replica while its stop is
in flight on a node agent every time. Unset (the default) in production."""

TEST_HOLD_RESTORE_ENV = "SBX_TEST_HOLD_RESTORE"
"""Test-only: seconds a resume waits after CRIU restored the container (it runs on the restored memory) and before
the memory image is discarded, with a marker file ``<sandbox dir>/restore-hold`` present meanwhile, so fault tests
can kill the server in that window every time (the case where an old image used to survive and later be restored
over a newer disk). Unset (the default) in production."""


def thaw(mountpoint: Path | str) -> bool:
    """``fsfreeze -u`` the filesystem at ``mountpoint``. Returns True when it was frozen (and now is not), False
    when it was not frozen or nothing is mounted there (``fsfreeze`` then fails with EINVAL; ignored). Never
    raises for a missing ``fsfreeze`` either (returns False)."""
    try:
        p = subprocess.run(["fsfreeze", "-u", str(mountpoint)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0


def memory_generation(memory_dir: Path) -> int:
    """The disk generation a memory image was taken at (0 for an image without a generation file)."""
    try:
        return int((memory_dir / GENERATION_FILE).read_text().strip())
    except (OSError, ValueError):
        return 0


def write_memory_generation(memory_dir: Path, generation: int) -> None:
    """Record ``generation`` in the image folder (written and fsync'd before the image is marked complete)."""
    path = memory_dir / GENERATION_FILE
    with open(path, "w") as f:
        f.write(f"{generation}\n")
        f.flush()
        os.fsync(f.fileno())

TEST_FAIL_CHECKPOINT_ENV = "SBX_TEST_FAIL_CHECKPOINT"
"""Test-only: when set to ``1``, every memory save of a stop fails before CRIU runs (as when CRIU is killed
mid-dump and its work folder is gone), so the node falls back to halting the container. Unset in production."""


def test_fail_checkpoint() -> None:
    """Test-only: raise :class:`RuntimeError_` (op ``checkpoint``) when ``SBX_TEST_FAIL_CHECKPOINT`` is ``1``;
    otherwise (production) do nothing."""
    if os.environ.get(TEST_FAIL_CHECKPOINT_ENV) == "1":
        raise RuntimeError_("checkpoint", f"failed on purpose ({TEST_FAIL_CHECKPOINT_ENV}=1)")


