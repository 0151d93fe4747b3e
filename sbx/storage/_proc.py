"""Run the real tools (mount, losetup, mkfs.xfs, e2fsprogs, fsfreeze) and turn failures into StorageError."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from sbx.storage.errors import StorageError


def run(
    argv: Sequence[str],
    *,
    code: str = "command_failed",
    ok_codes: Sequence[int] = (0,),
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (no shell), capture text output, and return the finished process.

    Raises ``StorageError(code)`` when the exit status is not in ``ok_codes``, when the tool is missing, or
    after ``timeout`` seconds; the message names the command and carries its stderr.
    """
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError as e:
        raise StorageError(code, f"{argv[0]} is not installed: {e}") from e
    except subprocess.TimeoutExpired as e:
        raise StorageError(code, f"{' '.join(argv)} took longer than {timeout:.0f} s") from e
    if proc.returncode not in ok_codes:
        detail = (proc.stderr.strip() or proc.stdout.strip())[-2000:]
        raise StorageError(code, f"{' '.join(argv)} exited {proc.returncode}: {detail}")
    return proc
