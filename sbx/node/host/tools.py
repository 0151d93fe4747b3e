"""Run a host tool (mmdebstrap, apt-get, dpkg-deb, mkfs, chroot ...) for the node's set-up steps and turn a
missing binary or a non-zero exit into the caller's error type, with the tool's last output."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Mapping, Sequence


def run_checked(
    argv: Sequence[str],
    what: str,
    error: type[Exception],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (no shell, text output captured, stdin closed) and return the finished process.

    Raises ``error("<what>: <tool> is not installed ...")`` when the binary is missing, and
    ``error("<what> failed (exit N): <last 2000 chars of stderr or stdout>")`` on a non-zero exit."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, env=env, cwd=cwd,
                              stdin=subprocess.DEVNULL, check=False)
    except FileNotFoundError as e:
        raise error(f"{what}: {argv[0]} is not installed ({e})") from e
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip())[-2000:]
        raise error(f"{what} failed (exit {proc.returncode}): {tail}")
    return proc


def hang_up(proc: subprocess.Popen[bytes]) -> None:
    """End a session whose client went away (a terminal, a spawned process): SIGHUP, which runc passes to the
    command, then SIGKILL after 5 s; waits for it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGHUP)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
