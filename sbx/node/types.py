"""The node agent's interface: what the control plane may ask of a machine that runs sandboxes.

The control plane (``sbx.control``) calls a :class:`NodeAgent`; ``sbx.node.agent.LocalNode`` is the real one
(runc + CRIU on this host) and unit tests use a fake with the same methods. All calls block; the API runs them in
worker threads. Sizes are :class:`sbx.config.Size`; times are seconds; byte counts are bytes.

Errors: every method raises :class:`NodeError` (with a stable ``code``) for a failure it understands; anything
else is a bug.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from sbx.config import RUNTIME_CLASSES as CONFIG_RUNTIME_CLASSES
from sbx.config import Size


class NodeError(Exception):
    """A node operation failed in a way the caller can report: ``code`` is stable (``not_found``,
    ``exec_failed``, ``checkpoint_failed``, ``restore_failed``, ``boot_failed``, ``cpu_mismatch``, ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class SandboxSpec:
    """What a node needs to boot a sandbox.

    - ``id``: ``sb_`` + 10 lowercase alphanumerics; names the container, disk, cgroup and veth.
    - ``hostname``: the sandbox's hostname (its 3-word subdomain).
    - ``size``: limits (vCPUs, memory MiB, disk MiB).
    - ``env``: extra environment for every exec (per-sandbox env, copied by fork).
    - ``image``: the facts of the image the sandbox's disk came from (``sbx.node.images.facts.ImageFacts.to_json()``:
      ``key``, ``init``, ``shell``, ``env``, ``workdir``, ``user``, ``users``, ...), or None for sbx's default
      image. The node boots, execs and names templates by it; it travels with the spec so a node that never had
      the image file can still run a sandbox that moved there.
    - ``runtime``: the sandbox's runtime class, one of :data:`RUNTIME_CLASSES`: ``"container"`` (runc + CRIU, the
      host's kernel behind seccomp and a shifted uid map) or ``"gvisor"`` (runsc: gVisor's own kernel;
      :mod:`sbx.runtime.runsc`).
    - ``volumes``: the persistent volumes to mount (issue 34), each ``{"id", "name", "path", "readOnly", "meta"}``
      (``meta``: the volume's JuiceFS metadata URL; :mod:`sbx.node.volumes.mounts`). Container class only.
    """

    id: str
    hostname: str
    size: Size
    env: dict[str, str] = field(default_factory=dict)
    image: dict[str, Any] | None = None
    runtime: str = "container"
    volumes: list[dict[str, Any]] = field(default_factory=list)


RUNTIME_CLASSES = CONFIG_RUNTIME_CLASSES
"""The runtime classes a sandbox can have (:attr:`SandboxSpec.runtime`, :data:`sbx.config.RUNTIME_CLASSES`)."""


@dataclass
class ResumeResult:
    """Outcome of :meth:`NodeAgent.resume`.

    ``memory_restored`` is True when CRIU restored the processes; otherwise the sandbox cold-booted from its
    disk and ``reason`` says why (``"resized"``, ``"cpu_mismatch"``, ``"restore_failed"``, ``"no_checkpoint"``,
    ``"stale_checkpoint"``: the image belongs to an older disk generation, see :mod:`sbx.node.container.recovery`);
    ``error`` keeps the restore error text when there was one.
    """

    memory_restored: bool
    reason: str | None = None
    error: str | None = None


@dataclass
class StopResult:
    """Outcome of :meth:`NodeAgent.stop`: ``memory_saved`` is True when a complete memory image was written;
    ``error`` keeps why a requested memory save failed (CRIU's message), None when it succeeded or was not
    asked for."""

    memory_saved: bool
    error: str | None = None


@dataclass
class ExecEvent:
    """One piece of a running exec: ``kind`` is ``stdout``/``stderr`` (``data`` holds the bytes) or ``exit``
    (``exit_code`` holds the command's own code; 124 after ``timed_out``; 137 for an OOM or other SIGKILL)."""

    kind: Literal["stdout", "stderr", "exit"]
    data: bytes = b""
    exit_code: int | None = None
    timed_out: bool = False


@dataclass
class JobInfo:
    """A detached exec (``sbx exec --detach``): ``id`` (``job_`` + 8 chars), the ``command`` string,
    ``running``, ``exit_code`` (None while running), ``started_at`` (ISO 8601 UTC)."""

    id: str
    command: str
    running: bool
    exit_code: int | None
    started_at: str


@dataclass
class Stats:
    """A fresh sample of a sandbox's use: memory limit and use (MiB), CPU use since the last sample
    (percent of one CPU), disk used inside the sandbox (MiB, from statfs of its root), OOM kills counted by
    its memory cgroup and its child cgroups (services, jobs; from the kernel log), disk bytes allocated on
    the volume / unique to this sandbox, and (while it is not running) the bytes its saved memory image holds on
    the volume (0 without one; metered as stored data, issue 12)."""

    memory_total_mb: int
    memory_used_mb: int
    cpu_percent: float
    disk_used_mb: int
    oom_kills: int
    disk_allocated_bytes: int = 0
    disk_unique_bytes: int = 0
    memory_image_bytes: int = 0


@dataclass
class SnapshotInfo:
    """A sealed, read-only copy of a sandbox's disk: ``name``, ``source_id``, ``size_mib`` of the disk image,
    ``allocated_bytes`` and ``unique_bytes`` on the volume."""

    name: str
    source_id: str
    size_mib: int
    allocated_bytes: int = 0
    unique_bytes: int = 0


@dataclass
class NodeInfo:
    """A node's heartbeat (issue 10): ``name``; capacity: ``memory_mib`` (host RAM, ``MemTotal``),
    ``disk_free_bytes`` and ``disk_path`` (room where the data volume runs out first, as admission measures it),
    ``vcpus`` (online CPUs); load: ``load1`` (1-minute load average), ``running`` (sandbox containers running);
    ``fingerprint``: what a memory image made here is tied to (``cpuModel``, ``cpuFlagsSha256``, ``kernel``,
    ``criu``; :func:`sbx.runtime.criu.host_fingerprint`); ``egress``: its egress proxy runs (secrets can be bound to
    its sandboxes)."""

    name: str
    memory_mib: int
    disk_free_bytes: int
    disk_path: str
    vcpus: int
    load1: float
    running: int
    fingerprint: dict[str, str] = field(default_factory=dict)
    egress: bool = False


NodeStatus = Literal["running", "checkpointed", "stopped", "absent"]


class NodeAgent(Protocol):
    """The operations a node offers. ``id`` arguments are sandbox ids the node has been told about."""

    def build_image(self, dockerfile: Path, context: Path, progress: Callable[[str], None] | None = None,
                    bases: dict[str, str] | None = None) -> Any:
        """Build a sandbox image from ``dockerfile`` with build context ``context`` (``bases``: ``{name: key}`` of
        images a ``FROM`` may name) and return its :class:`sbx.node.images.facts.ImageFacts`. ``progress`` gets
        one-line messages. Raises ``NodeError`` (the codes of :mod:`sbx.node.images.errors`)."""
        ...

    def import_image(self, archive: Path, progress: Callable[[str], None] | None = None) -> Any:
        """Make a sandbox image of ``archive`` (docker-archive, OCI archive or layout, or a flat rootfs tar) and
        return its :class:`sbx.node.images.facts.ImageFacts`. Raises ``NodeError`` as :meth:`build_image`."""
        ...

    def delete_image(self, key: str) -> None:
        """Remove the image files of ``key`` and its memory templates from this node (nothing when absent). Raises
        ``NodeError("image_in_use")`` when a running node holds the file."""
        ...

    def pool_take(self, size: str) -> str | None:
        """Reserve a warm sandbox of size ``size`` (a size name, or ``<size>@<image key>`` for one of a user image: one
        already restored from its memory template, :mod:`sbx.node.memory.warmpool`) and return its id, or None when
        there is none. A :meth:`create` whose spec has
        that id then only gives it its identity; one that never comes leaves it deleted after a minute."""
        ...

    def create(self, spec: SandboxSpec, from_snapshot: str | None = None, cold: bool = False) -> str:
        """Make the sandbox's disk (from the base image, or a copy of snapshot ``from_snapshot``), grow it to
        ``spec.size.disk_mib``, give it a fresh identity, boot it and wait until exec works. Without
        ``from_snapshot`` and ``cold`` it restores the size's memory template instead when one is ready (the
        sandbox still gets its own identity; :mod:`sbx.node.memory.templates`), or takes over the warm sandbox
        :meth:`pool_take` gave for ``spec.id``. Returns ``"pool"``, ``"template"`` or ``"boot"``.
        Raises ``NodeError("boot_failed")``, ``NodeError("not_found")`` for an unknown snapshot."""
        ...

    def exec(
        self,
        id: str,
        command: str,
        *,
        user: str = "user",
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> Iterator[ExecEvent]:
        """Run ``command`` with ``bash -lc`` in the sandbox; yield output as it comes, then one ``exit`` event.
        On ``timeout`` (seconds) the whole process group is killed and the exit event has code 124. ``stop`` is
        polled at least twice a second: once it returns True (the caller went away) the command is killed and the
        iterator ends without an exit event."""
        ...

    def exec_detached(self, id: str, command: str, *, user: str = "user", env: dict[str, str] | None = None,
                      cwd: str | None = None, timeout: float | None = None, stdin: str | None = None) -> JobInfo:
        """Start ``command`` as a job that outlives the caller (and a stop/resume with memory): extra ``env``,
        absolute ``cwd`` (default the user's home), ``timeout`` seconds (then killed, exit 124), ``stdin`` text."""
        ...

    def kill_job(self, id: str, job: str) -> None:
        """SIGKILL every process of a job; it then reports exit 137 (unless it had ended). ``not_found`` if
        unknown."""
        ...

    def jobs(self, id: str) -> list[JobInfo]:
        """The sandbox's detached jobs, oldest first."""
        ...

    def job_output(self, id: str, job: str, stream: str, offset: int = 0) -> bytes:
        """Bytes of a job's ``stream`` (``stdout``/``stderr``) from byte ``offset``."""
        ...

    def stop(self, id: str, keep_memory: bool = True) -> StopResult:
        """Stop the sandbox. With ``keep_memory`` checkpoint it with CRIU first; the result says whether a memory
        image was written and, if a save was asked for and failed, why. Always seals a disk checkpoint. Never
        loses the disk."""
        ...

    def resume(self, id: str, spec: SandboxSpec, *, cold: bool = False, require_memory: bool = False) -> ResumeResult:
        """Bring a stopped sandbox back at ``spec.size``. Restores memory when a usable image exists and
        ``cold`` is False (``cold`` is set for a resize: the disk is grown first); otherwise cold-boots.

        With ``require_memory`` it never cold-boots: when the memory image was made on a host with another CPU
        model/flags, kernel or CRIU, it waits up to ``settings.require_memory_wait`` seconds (120 by default)
        for a matching host, then raises ``cpu_mismatch``; with no usable image it raises ``no_checkpoint``;
        a failed restore raises ``restore_failed``."""
        ...

    def fork(self, source_id: str, spec: SandboxSpec, memory: bool = False) -> None:
        """Copy the source's disk copy-on-write (freezing its filesystem for the copy when it runs) and cold
        boot ``spec`` on the copy with a new identity. The source is not otherwise touched. With ``memory`` the
        running source's processes and memory go along: it is paused for the copy and a ``--leave-running`` dump,
        and ``spec`` is restored from the dump with a new identity. Raises ``NodeError`` (``not_running`` for a
        memory fork of a source that doesn't run, ``fork_failed``, ``restore_failed``)."""
        ...

    def snapshot(self, id: str, name: str) -> SnapshotInfo:
        """Seal a read-only copy of the sandbox's disk under ``name`` (constant time)."""
        ...

    def delete_snapshot(self, name: str) -> None:
        """Remove snapshot ``name``; blocks shared with disks stay."""
        ...

    def snapshots(self) -> list[SnapshotInfo]:
        """Every snapshot on this node."""
        ...

    def delete(self, id: str) -> None:
        """Kill the sandbox if it runs and remove its disk, checkpoints and network."""
        ...

    def stats(self, id: str, space: bool = True) -> Stats:
        """A fresh sample (never a cached one). ``space=False`` leaves out the disk's unique bytes, which take a
        scan of every image on the volume (list views and events don't need them)."""
        ...

    def status(self, id: str, settled: bool = False) -> NodeStatus:
        """What the node finds for ``id`` now; with ``settled``, once no operation is in flight on it (it waits
        for one that is: a server replica that died mid-stop left the node finishing it)."""
        ...

    def info(self) -> NodeInfo:
        """The node's capacity, load and memory-image fingerprint now (its heartbeat)."""
        ...

    def spawn(self, id: str, argv: list[str], *, user: str = "user", stdin: bool = False,
              tty: bool = False, env: dict[str, str] | None = None,
              size: tuple[int, int] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` in the running sandbox and return the process (pipes for stdout/stderr, stdin when
        asked; with ``tty``, ``proc.pty_master`` is the host end of its pseudo-terminal, of ``size`` =
        ``(columns, rows)`` from the start, default 80x24). Used for file transfer and interactive shells."""
        ...

    def address(self, id: str) -> str:
        """The sandbox's IPv4 address on the node's bridge, where its listening ports answer."""
        ...

    def egress_ready(self) -> bool:
        """True when the node's egress proxy runs (secrets can be bound to its sandboxes)."""
        ...

    def serve_egress(self, handler: Callable[[str, dict[str, Any]], dict[str, Any]]) -> None:
        """Answer the egress proxy's questions with ``handler(sandbox_id, question) -> answer`` (see
        :mod:`sbx.node.network.egressproxy`)."""
        ...

    def set_egress_proxy(self, id: str, enabled: bool) -> None:
        """Send the sandbox's outbound TCP 80/443 through the egress proxy or not, from its next connection on.
        Raises ``NodeError("egress_proxy_unavailable")`` when enabling it on a node without a proxy."""
        ...

    def close_egress(self) -> None:
        """Stop the egress proxy (server shutdown)."""
        ...

    def watch(self, on_exit: Callable[[str, str, str | None], None]) -> None:
        """Start calling ``on_exit(id, kind, detail)`` (from a node thread) for each running sandbox whose init
        ended on its own, after the node cleaned it up (disk kept, no memory): ``kind`` is ``"poweroff"``,
        ``"reboot"`` or ``"crashed"``."""
        ...

    def unwatch(self) -> None:
        """Stop watching (at shutdown)."""
        ...

    def reconcile(self, known: dict[str, str]) -> dict[str, NodeStatus]:
        """On start: given the control plane's ``{id: state}``, remove orphans (containers, mounts, loop
        devices, veths of unknown ids), thaw frozen roots, remove half-made sandboxes (a fork or create killed
        before its disk was complete: reported ``absent``) and return what is actually there for each known id."""
        ...
