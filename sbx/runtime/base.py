"""The isolation layer's interface: what a node needs from a container or VM runtime.

Today the one implementation is :class:`sbx.runtime.runc.RuncRuntime` (runc + CRIU). A gVisor (``runsc``) class
and a microVM class for hosts with VMX fit the same shape later: boot a bundle, exec in it, checkpoint its
memory to a directory, restore from it, kill it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Literal, Protocol

ContainerState = Literal["creating", "created", "running", "paused", "stopped"]


class RuntimeError_(Exception):
    """A runtime command failed: ``op`` names it (``boot``, ``exec``, ``checkpoint``, ``restore``), ``detail``
    holds the tool's own error text (and the CRIU log tail for checkpoint/restore)."""

    def __init__(self, op: str, detail: str):
        super().__init__(f"{op} failed: {detail}")
        self.op = op
        self.detail = detail


def run_in(cmd: list[str], argv: list[str], *, input: bytes | None = None, timeout: float = 60) -> bytes:
    """Run ``cmd + argv`` (a runtime's exec command line for root in a sandbox, then the command), wait, and return
    its stdout. Raises :class:`RuntimeError_` on a non-zero exit (with its stderr) or after ``timeout`` seconds."""
    try:
        p = subprocess.run([*cmd, *argv], input=input, capture_output=True, timeout=timeout,
                           stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError_("exec", f"{argv[0]} timed out after {timeout} s") from e
    if p.returncode != 0:
        raise RuntimeError_("exec", f"{' '.join(argv)} exited {p.returncode}: "
                                    f"{p.stderr.decode(errors='replace').strip()[-1000:]}")
    return p.stdout


class Runtime(Protocol):
    """Operations on one container, named by ``cid``, whose OCI bundle is a directory with ``config.json``."""

    def boot(self, cid: str, bundle: Path) -> None:
        """Create and start the container detached (``runc run -d``). Raises :class:`RuntimeError_`."""
        ...

    def exec(self, cid: str, argv: list[str], *, uid: int, gid: int, cwd: str, env: list[str],
             pid_file: Path) -> subprocess.Popen[bytes]:
        """Start ``argv`` in the container with stdout/stderr as separate pipes; the process's host PID is written
        to ``pid_file`` (it leads its own process group, so killing ``-pid`` kills the group)."""
        ...

    def checkpoint(self, cid: str, image_dir: Path, work_dir: Path, image_gid: int = 0,
                   leave_running: bool = False, page_server: str | None = None) -> None:
        """Dump the container's processes and memory into ``image_dir`` and stop it (``leave_running``: it goes
        on; ``page_server``: ``"ADDR:PORT"`` that receives the memory pages instead of ``image_dir``)."""
        ...

    def pause(self, cid: str) -> None:
        """Freeze every process of the container."""
        ...

    def unpause(self, cid: str) -> None:
        """Thaw a paused container."""
        ...

    def restore(self, cid: str, bundle: Path, image_dir: Path, work_dir: Path) -> None:
        """Restore the container from ``image_dir`` (same PIDs, same memory), detached."""
        ...

    def state(self, cid: str) -> ContainerState | None:
        """The container's state, or None if the runtime does not know it."""
        ...

    def init_pid(self, cid: str) -> int | None:
        """Host PID of the container's init, or None."""
        ...

    def kill(self, cid: str, signal: int = 9) -> None:
        """Send ``signal`` to the container's init (no error if it is gone)."""
        ...

    def delete(self, cid: str) -> None:
        """Forget the container, killing it first if needed (no error if unknown)."""
        ...

    def list(self) -> list[str]:
        """Ids of the containers this runtime instance knows."""
        ...
