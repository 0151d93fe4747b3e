"""Runtime classes on one node: :class:`ClassRuntime` hands each sandbox's operations to the runtime of its class.

A node runs sandboxes of two classes side by side (:data:`sbx.node.types.RUNTIME_CLASSES`): ``container``
(:class:`sbx.runtime.runc.RuncRuntime`) and ``gvisor`` (:class:`sbx.runtime.runsc.RunscRuntime`). The node keeps
one runtime object (``self.runtime``); this one looks up each sandbox's class (``class_of``: the node reads it from
the sandbox's record) and forwards the call. What is not about one sandbox (``state_root``, ``criu``, ``list``,
``kill_orphans``) is the container runtime's, with the gvisor sandboxes added to the lists.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sbx.runtime.base import ContainerState
from sbx.runtime.runc import RuncRuntime
from sbx.runtime.runsc import RunscRuntime

GVISOR = "gvisor"
CONTAINER = "container"

#: runc subcommands whose second word is the container id (for :meth:`ClassRuntime.cmd`).
_CID_SUBCOMMANDS = {"exec", "state", "kill", "delete", "pause", "resume", "events", "ps"}


class ClassRuntime:
    """:class:`sbx.runtime.base.Runtime` over a :class:`RuncRuntime` and a :class:`RunscRuntime`; ``class_of(cid)``
    names a sandbox's class (``"container"`` or ``"gvisor"``; it raises or returns ``"container"`` for an unknown
    one). A sandbox's class never changes, so the answer is kept."""

    def __init__(self, runc: RuncRuntime, runsc: RunscRuntime, class_of: Callable[[str], str]):
        self.runc = runc
        self.runsc = runsc
        self._class_of = class_of
        self._known: dict[str, str] = {}

    # what is the node's, not one sandbox's
    @property
    def state_root(self) -> Path:
        """runc's state root (a gvisor sandbox has no runc state file: checks through it find nothing)."""
        return self.runc.state_root

    @property
    def criu(self) -> Path:
        """The CRIU wrapper of the container class."""
        return self.runc.criu

    def class_of(self, cid: str) -> str:
        """The runtime class of sandbox ``cid`` (``container`` when its record can't say)."""
        known = self._known.get(cid)
        if known is not None:
            return known
        try:
            cls = self._class_of(cid) or CONTAINER
        except Exception:  # no record (yet): the container class, not remembered
            return CONTAINER
        self._known[cid] = cls
        return cls

    def forget(self, cid: str) -> None:
        """Drop what is remembered of ``cid`` (it was deleted; the id may come back, e.g. a sandbox moved back)."""
        self._known.pop(cid, None)

    def gvisor(self, cid: str) -> bool:
        """Whether ``cid`` is of the gvisor class."""
        return self.class_of(cid) == GVISOR

    def of(self, cid: str) -> Any:
        """The runtime that runs ``cid``."""
        return self.runsc if self.gvisor(cid) else self.runc

    def cmd(self, *args: str) -> list[str]:
        """The command line of ``args`` for the runtime of the container it names (``exec CID ...``,
        ``state CID``...); others are runc's."""
        if len(args) >= 2 and args[0] in _CID_SUBCOMMANDS and self.gvisor(args[1]):
            return self.runsc.cmd(*args)
        return self.runc.cmd(*args)

    def exec_command(self, cid: str, argv: list[str], **kw: Any) -> list[str]:
        """See :meth:`RuncRuntime.exec_command`."""
        return list(self.of(cid).exec_command(cid, argv, **kw))

    def boot(self, cid: str, bundle: Path) -> None:
        """See :meth:`sbx.runtime.base.Runtime.boot`."""
        self.of(cid).boot(cid, bundle)

    def exec(self, cid: str, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        """See :meth:`sbx.runtime.base.Runtime.exec`."""
        proc: subprocess.Popen[bytes] = self.of(cid).exec(cid, argv, **kw)
        return proc

    def run(self, cid: str, argv: list[str], **kw: Any) -> bytes:
        """See :meth:`RuncRuntime.run`."""
        return bytes(self.of(cid).run(cid, argv, **kw))

    def checkpoint(self, cid: str, image_dir: Path, work_dir: Path, image_gid: int = 0,
                   leave_running: bool = False, page_server: str | None = None) -> None:
        """See :meth:`sbx.runtime.base.Runtime.checkpoint`."""
        self.of(cid).checkpoint(cid, image_dir, work_dir, image_gid=image_gid, leave_running=leave_running,
                                page_server=page_server)

    def pause(self, cid: str) -> None:
        """See :meth:`sbx.runtime.base.Runtime.pause`."""
        self.of(cid).pause(cid)

    def unpause(self, cid: str) -> None:
        """See :meth:`sbx.runtime.base.Runtime.unpause`."""
        self.of(cid).unpause(cid)

    def restore(self, cid: str, bundle: Path, image_dir: Path, work_dir: Path) -> None:
        """See :meth:`sbx.runtime.base.Runtime.restore`."""
        self.of(cid).restore(cid, bundle, image_dir, work_dir)

    def state(self, cid: str) -> ContainerState | None:
        """See :meth:`sbx.runtime.base.Runtime.state`."""
        state: ContainerState | None = self.of(cid).state(cid)
        return state

    def init_pid(self, cid: str) -> int | None:
        """See :meth:`sbx.runtime.base.Runtime.init_pid` (for gvisor: the Sentry's host PID)."""
        pid: int | None = self.of(cid).init_pid(cid)
        return pid

    def kill(self, cid: str, signal: int = 9) -> None:
        """See :meth:`sbx.runtime.base.Runtime.kill`."""
        self.of(cid).kill(cid, signal)

    def delete(self, cid: str) -> None:
        """See :meth:`sbx.runtime.base.Runtime.delete`; for gvisor also its network namespace."""
        if self.gvisor(cid) or cid in self.runsc.list():
            self.runsc.destroy(cid)
        else:
            self.runc.delete(cid)

    def list(self) -> list[str]:
        """Ids of every sandbox either runtime knows."""
        return [*self.runc.list(), *self.runsc.list()]

    def statuses(self) -> dict[str, str]:
        """``{id: status}`` of every sandbox either runtime knows."""
        return {**self.runc.statuses(), **self.runsc.statuses()}

    def kill_orphans(self) -> int:
        """See :meth:`RuncRuntime.kill_orphans`."""
        return self.runc.kill_orphans()
