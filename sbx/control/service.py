"""The control plane's operations on sandboxes, snapshots and jobs, on top of a :class:`NodeAgent`.

Long operations (create, stop, resume, fork, delete) persist their transient state, return at once and run the
node call in a worker thread; the final state (or ``error``) and an event follow. Short ones (snapshot, exec,
jobs) run in the caller's thread. Rules come from the seed guides:

- sizes only grow on resume (``400 invalid_resize``); a resize always cold-boots and reports
  ``memoryRestored: false, resumeReason: "resized"``; ``require_memory`` with a size change is
  ``400 invalid_require_memory``; a resume keeps the sandbox's ttl unless one is given;
- a fork copies type and env unless overridden, is named ``"<source name> (fork)"`` by default, gets
  ``settings.fork_default_ttl`` (one hour) unless given, and reports ``memoryRestored``/``resumeReason`` null;
- a sandbox created with ``no_snapshots`` cannot be resumed, forked or snapshotted (``409 snapshots_disabled``);
  its stop keeps only the disk.

Errors are :class:`sbx.control.errors.ControlError`.
"""

from __future__ import annotations

import base64
import codecs
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sbx.config import Settings, Size
from sbx.control import capacity
from sbx.control.capacity import HostResources
from sbx.control.errors import NODE_CONFLICT_CODES, ControlError, from_node, not_found
from sbx.control.files import Files
from sbx.control.ids import new_sandbox_id, new_subdomain, sandbox_url
from sbx.control.routes import Routes
from sbx.control.state import DEFAULT_WAIT, TRANSIENT, Lifecycle
from sbx.control.store import SandboxRow, SnapshotRow, Store, iso, utcnow
from sbx.control.trim import Trimmer
from sbx.node.types import JobInfo, NodeAgent, NodeError, SandboxSpec, SnapshotInfo, Stats
from sbx.storage.volume import trim_volume

log = logging.getLogger("sbx.control")

DEFAULT_TTL = 3600
"""Seconds of inactivity before a new sandbox stops (keeping memory) when ``create`` gets no ttl."""

DEFAULT_EXEC_TIMEOUT = 30.0
"""Seconds an exec may run when the caller gives no timeout (the seed: "The default is 30 seconds")."""

START_WAIT = 180.0
"""Seconds an exec, a job, a file transfer or a shell waits for a provisioning/resuming sandbox to reach running
before answering 409 busy."""

SNAPSHOT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
NAME_MAX = 200



def _check_name_and_ttl(name: str | None, ttl: int | None) -> None:
    """400 ``invalid_name`` for a blank or over-long name, 400 ``invalid_ttl`` for a negative ttl."""
    if name is not None and (not name.strip() or len(name) > NAME_MAX):
        raise ControlError("invalid_name", f"name must be 1-{NAME_MAX} characters and not blank", 400)
    if ttl is not None and ttl < 0:
        raise ControlError("invalid_ttl", "ttl must be >= 0 seconds (0 = never stop)", 400)

class _Already(Exception):
    """Raised inside a check to end a request early: the sandbox is already where the request wants it."""

    def __init__(self, row: SandboxRow):
        self.row = row


class Activity:
    """When each sandbox was last used, for the TTL reaper. An exec (for its whole run), an attached log stream
    or a job wait counts as activity. Times are ``time.monotonic()`` seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._active: dict[str, int] = {}

    def touch(self, sandbox_id: str) -> None:
        with self._lock:
            self._last[sandbox_id] = time.monotonic()

    def begin(self, sandbox_id: str) -> None:
        """An attached session starts (exec, log follow); the sandbox is active until :meth:`end`."""
        with self._lock:
            self._active[sandbox_id] = self._active.get(sandbox_id, 0) + 1
            self._last[sandbox_id] = time.monotonic()

    def end(self, sandbox_id: str) -> None:
        with self._lock:
            n = self._active.get(sandbox_id, 0) - 1
            if n > 0:
                self._active[sandbox_id] = n
            else:
                self._active.pop(sandbox_id, None)
            self._last[sandbox_id] = time.monotonic()

    def idle_for(self, sandbox_id: str) -> float:
        """Seconds since the last activity; 0 while a session is attached. A sandbox never seen counts from now."""
        now = time.monotonic()
        with self._lock:
            if self._active.get(sandbox_id):
                return 0.0
            return now - self._last.setdefault(sandbox_id, now)

    def forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._last.pop(sandbox_id, None)
            self._active.pop(sandbox_id, None)


def _stats_view(stats: Stats | None) -> dict[str, Any]:
    """The API shape of a stats sample: ``{"memoryTotalMb","memoryUsedMb","cpuPercent","diskUsedMb","oomKills",
    "diskAllocatedBytes","diskUniqueBytes"}``; the last two are the disk image's bytes on the volume (shared ones
    included) and the bytes only it holds (what deleting the sandbox frees). All zero without a sample."""
    if stats is None:
        return {"memoryTotalMb": 0, "memoryUsedMb": 0, "cpuPercent": 0.0, "diskUsedMb": 0, "oomKills": 0,
                "diskAllocatedBytes": 0, "diskUniqueBytes": 0}
    return {
        "memoryTotalMb": stats.memory_total_mb,
        "memoryUsedMb": stats.memory_used_mb,
        "cpuPercent": round(float(stats.cpu_percent), 1),
        "diskUsedMb": stats.disk_used_mb,
        "oomKills": stats.oom_kills,
        "diskAllocatedBytes": stats.disk_allocated_bytes,
        "diskUniqueBytes": stats.disk_unique_bytes,
    }


def job_view(job: JobInfo) -> dict[str, Any]:
    """The API shape of a detached job: ``{"id","command","running","exitCode","startedAt"}``."""
    return {
        "id": job.id,
        "command": job.command,
        "running": job.running,
        "exitCode": job.exit_code,
        "startedAt": job.started_at,
    }


def snapshot_view(row: SnapshotRow, info: SnapshotInfo | None = None) -> dict[str, Any]:
    """The API shape of a snapshot: ``{"name","sandboxId","auto","sizeMB","createdAt","allocatedBytes",
    "uniqueBytes"}``: bytes its image maps on the volume (shared ones included) and bytes only it holds (what
    deleting it frees), from the node's ``info`` (0 when unknown)."""
    return {
        "name": row.name,
        "sandboxId": row.sandbox_id,
        "auto": row.auto,
        "sizeMB": row.size_mib,
        "createdAt": iso(row.created_at),
        "allocatedBytes": info.allocated_bytes if info else 0,
        "uniqueBytes": info.unique_bytes if info else 0,
    }


class ControlPlane:
    """All sandbox operations for one node. Thread-safe.

    ``settings`` gives sizes, domain and defaults; ``node`` does the work; ``store`` defaults to a
    :class:`Store` at ``settings.db_url``; ``wait`` bounds how long a conflicting request waits for an operation in
    flight (seconds). ``host`` measures the host for admission (default :func:`sbx.control.capacity.probe_host`);
    ``trim`` gives freed volume space back to the host (default :func:`sbx.storage.volume.trim_volume`, run by a
    :class:`Trimmer`). Call :meth:`start` once (reconciles with the node), :meth:`close` at shutdown.
    """

    def __init__(
        self,
        settings: Settings,
        node: NodeAgent,
        store: Store | None = None,
        wait: float = DEFAULT_WAIT,
        workers: int = 8,
        host: Callable[[], HostResources] | None = None,
        trim: Callable[[int | None], int | None] | None = None,
    ):
        self.settings = settings
        self.node = node
        self.store = store or Store(settings.db_url)
        self.lifecycle = Lifecycle(self.store, self._on_transition, wait)
        self.activity = Activity()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sbx-op")
        self._snap_lock = threading.Lock()
        self._closed = False
        self.routes = Routes(self)
        self.files = Files(self)
        self._host = host or (lambda: capacity.probe_host(settings))
        self.trimmer = Trimmer(trim or (lambda min_slack: trim_volume(settings, min_slack)), settings.trim_seconds)

    # views -----------------------------------------------------------------------------------------------------
    def _size(self, name: str) -> Size:
        try:
            return self.settings.size(name)
        except KeyError:
            known = ", ".join(self.settings.sizes)
            raise ControlError("invalid_type", f"unknown type {name!r}; use one of: {known}", 400) from None

    def _stats(self, row: SandboxRow, space: bool = True) -> Stats | None:
        """A node sample for a running sandbox; for a stopped one too (the node then reports disk space only).
        ``space=False`` skips the disk's unique bytes (a scan of the whole volume)."""
        if row.state not in ("running", "stopped"):
            return None
        try:
            return self.node.stats(row.id, space=space)
        except NodeError as e:
            if row.state == "running":
                log.warning("stats of %s failed: %s", row.id, e)
            return None

    def view(self, row: SandboxRow, stats: bool = True, space: bool = True) -> dict[str, Any]:
        """The API shape of a sandbox (the seed's fields): id, name, type, state, memoryGB, vcpus, diskGB,
        memoryRestored, resumeReason, createdAt, updatedAt, subdomain, url, ttl, autoResume, noSnapshots, labels, stats,
        and the last stop's ``memorySaved`` (bool, null before any stop), ``stopReason`` (``requested``, ``idle``,
        ``poweroff``, ``crashed``...) and ``stopError`` (why a memory save failed, or a crash's detail), and
        ``error`` (``{"code","message"}`` of the last failed operation, e.g. ``interrupted`` for a fork the server
        was killed in; null otherwise).
        ``stats`` is a fresh node sample while running (while stopped: disk space only), zeros otherwise;
        ``space=False`` leaves ``diskUniqueBytes`` at 0 (list views and events: it costs a scan of every image on
        the volume)."""
        size = self.settings.sizes.get(row.type)
        return {
            "id": row.id,
            "name": row.name,
            "type": row.type,
            "state": row.state,
            "memoryGB": size.memory_gb if size else None,
            "vcpus": size.vcpus if size else None,
            "diskGB": size.disk_gb if size else None,
            "memoryRestored": row.memory_restored,
            "resumeReason": row.resume_reason,
            "createdAt": iso(row.created_at),
            "updatedAt": iso(row.updated_at),
            "subdomain": row.subdomain,
            "url": sandbox_url(row.subdomain, self.settings.domain),
            "ttl": row.ttl,
            "autoResume": bool(row.auto_resume),
            "noSnapshots": bool(row.no_snapshots),
            "labels": dict(row.labels or {}),
            "memorySaved": row.memory_saved,
            "stopReason": row.stop_reason,
            "stopError": row.stop_error,
            "error": {"code": row.error_code, "message": row.error_message or ""} if row.error_code else None,
            "stats": _stats_view(self._stats(row, space) if stats else None),
        }

    def _spec(self, row: SandboxRow, size: Size | None = None) -> SandboxSpec:
        return SandboxSpec(id=row.id, hostname=row.subdomain, size=size or self._size(row.type), env=dict(row.env))

    def _admit(self, size: Size, what: str, exclude: str | None = None) -> None:
        """Raise ``507 insufficient_capacity`` when the node cannot take ``what`` at ``size`` (see
        :mod:`sbx.control.capacity`), not counting sandbox ``exclude``. The caller holds ``self.lifecycle.cond`` and
        writes the new state before releasing it, so the check and the state change are one step."""
        committed = capacity.committed_memory_mib(self.store.list_sandboxes(), self.settings, exclude)
        err = capacity.refusal(self.settings, self._host(), committed, size, what)
        if err is not None:
            log.info("refused %s: %s", what, err.message)
            raise err

    # events ----------------------------------------------------------------------------------------------------
    def _on_transition(self, row: SandboxRow, old: str) -> None:
        payload: dict[str, Any]
        if row.state == "forking":
            payload = {"event": "forking", "id": row.id, "source": row.source_id, "sandbox": self.view(row, False)}
        elif row.state == "running":
            payload = {
                "event": "ready",
                "id": row.id,
                "state": "ready",
                "url": sandbox_url(row.subdomain, self.settings.domain),
                "subdomain": row.subdomain,
                "sandbox": self.view(row, space=False),
            }
        elif row.state == "error":
            payload = {
                "event": "error",
                "id": row.id,
                "state": "error",
                "error": {"code": row.error_code or "error", "message": row.error_message or ""},
            }
        else:
            payload = {"event": "state", "id": row.id, "state": row.state}
        self.add_event(row.id, payload)

    def add_event(self, sandbox_id: str, payload: dict[str, Any]) -> None:
        """Append an event line for the sandbox and wake event streams."""
        self.store.add_event(sandbox_id, payload)
        self.lifecycle.notify()

    def events(
        self, sandbox_id: str, after: int = 0, follow: bool = False, until_settled: bool = False,
        poll: float = 1.0, stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[dict[str, Any]]:
        """Event lines of a sandbox after ``seq`` ``after``: each is a dict with ``event`` and ``id`` (see
        :meth:`_on_transition`), plus ``seq``. With ``follow``, waits for new ones; with ``until_settled`` the stream
        ends once the sandbox is in a stable state (running, stopped, error, deleted) after replaying. Raises 404
        for an unknown sandbox (deleted ones can still be read). A follower re-reads the events table at least
        every ``poll`` seconds (at once on this process's own events), so it also sees events that another server
        replica on the same PostgreSQL database wrote."""
        if self.store.get_sandbox(sandbox_id) is None:
            raise not_found(f"sandbox {sandbox_id}")
        return self._events(sandbox_id, after, follow, until_settled, poll, stop)

    def _events(
        self, sandbox_id: str, after: int, follow: bool, until_settled: bool, poll: float, stop: Callable[[], bool]
    ) -> Iterator[dict[str, Any]]:
        seq = after
        while True:
            for ev in self.store.events(sandbox_id, seq):
                seq = ev.seq
                yield {**ev.payload, "seq": ev.seq}
            if not follow or stop():
                return
            with self.lifecycle.cond:
                row = self.store.get_sandbox(sandbox_id)
                if row is None or row.state == "deleted":
                    if not self.store.events(sandbox_id, seq):
                        return
                    continue
                if until_settled and row.state not in TRANSIENT and not self.store.events(sandbox_id, seq):
                    return
                if not self.store.events(sandbox_id, seq):
                    self.lifecycle.cond.wait(poll)

    # background work -------------------------------------------------------------------------------------------
    def _submit(self, sandbox_id: str, fn: Callable[[], None], on_error: Callable[[str, str], None]) -> None:
        def run() -> None:
            try:
                fn()
            except NodeError as e:
                log.warning("%s: node error %s: %s", sandbox_id, e.code, e.message)
                on_error(e.code, e.message)
            except ControlError as e:
                log.warning("%s: %s: %s", sandbox_id, e.code, e.message)
                on_error(e.code, e.message)
            except Exception as e:  # a bug; keep the sandbox in a reportable state
                log.exception("%s: operation failed", sandbox_id)
                on_error("internal", f"{type(e).__name__}: {e}")

        self._pool.submit(run)

    def _fail(self, sandbox_id: str) -> Callable[[str, str], None]:
        def on_error(code: str, message: str) -> None:
            try:
                self.lifecycle.transition(sandbox_id, "error", error_code=code, error_message=message)
            except ControlError:
                log.exception("could not record error for %s", sandbox_id)

        return on_error

    # lifecycle operations --------------------------------------------------------------------------------------
    def get(self, sandbox_id: str) -> SandboxRow:
        """The sandbox row; 404 ``not_found`` if unknown or deleted."""
        return self.lifecycle.get(sandbox_id)

    def list_sandboxes(self, labels: dict[str, str] | None = None) -> list[SandboxRow]:
        """Every sandbox that is not deleted, oldest first; with ``labels``, only those carrying every one of
        them (same key, same value)."""
        rows = self.store.list_sandboxes()
        if labels:
            rows = [r for r in rows if all((r.labels or {}).get(k) == v for k, v in labels.items())]
        return rows

    def create(
        self,
        type: str = "small",
        name: str | None = None,
        ttl: int | None = None,
        from_snapshot: str | None = None,
        no_snapshots: bool = False,
        env: dict[str, str] | None = None,
        auto_resume: bool = False,
        labels: dict[str, str] | None = None,
    ) -> SandboxRow:
        """Create a sandbox of size ``type`` (a disk from the base image, or a copy of snapshot
        ``from_snapshot``) and boot it in the background; returns the row in ``provisioning``.

        ``ttl``: seconds of inactivity before it stops keeping memory (default :data:`DEFAULT_TTL`; 0 = never).
        ``auto_resume``: an exec, a file call, a shell or a request on one of its hosted ports resumes it when it
        is stopped. ``labels``: string metadata, filtered on by :meth:`list_sandboxes`.
        Raises 400 ``invalid_type``/``invalid_name``/``invalid_ttl``, 404 ``not_found`` for an unknown snapshot,
        507 ``insufficient_capacity`` (nothing is created)."""
        size = self._size(type)
        _check_name_and_ttl(name, ttl)
        if from_snapshot is not None and self.store.get_snapshot(from_snapshot) is None:
            raise not_found(f"snapshot {from_snapshot}")
        with self.lifecycle.cond:
            self._admit(size, f"a new {size.name} sandbox")
            row = self._add_new_row(
                "provisioning", size, name, DEFAULT_TTL if ttl is None else ttl, dict(env or {}),
                no_snapshots=no_snapshots, auto_resume=auto_resume, from_snapshot=from_snapshot,
                labels=dict(labels or {}),
            )
        sandbox_id = row.id
        spec = self._spec(row, size)

        def work() -> None:
            self.node.create(spec, from_snapshot=from_snapshot)
            self.activity.touch(sandbox_id)
            self.lifecycle.transition(sandbox_id, "running")

        self._submit(sandbox_id, work, self._fail(sandbox_id))
        return row

    def _add_new_row(self, state: str, size: Size, name: str | None, ttl: int, env: dict[str, str],
                     **extra: Any) -> SandboxRow:
        """Store a new sandbox row in ``state`` with a fresh unique id and subdomain (the name defaults to the
        subdomain) and publish its first transition. ``extra`` sets further columns (``no_snapshots``,
        ``source_id``...)."""
        sandbox_id = new_sandbox_id()
        while self.store.get_sandbox(sandbox_id) is not None:
            sandbox_id = new_sandbox_id()
        subdomain = new_subdomain(self.store.subdomain_taken)
        now = utcnow()
        row = SandboxRow(id=sandbox_id, name=subdomain if name is None else name, type=size.name, state=state,
                         subdomain=subdomain, ttl=ttl, env=env, memory_restored=None, resume_reason=None,
                         has_memory=False, created_at=now, updated_at=now, **extra)
        self.store.add_sandbox(row)
        self._on_transition(row, "")
        return row

    def stop(
        self, sandbox_id: str, keep_memory: bool = True, wait: float | None = None, reason: str = "requested"
    ) -> SandboxRow:
        """Stop a running sandbox in the background, checkpointing its memory when ``keep_memory`` (and the
        sandbox allows snapshots). A stopped sandbox is returned as is. The stopped row records ``memory_saved``,
        ``stop_reason`` = ``reason`` (``requested``; the reaper passes ``idle``) and ``stop_error`` (why a memory
        save that was asked for failed), and clears ``memory_restored`` (it described the run that ended).
        Raises 404, 409 ``busy``/``invalid_state``."""

        def check(row: SandboxRow) -> ControlError | None:
            if row.state == "stopped":
                raise _Already(row)
            return None

        try:
            before, after = self.lifecycle.begin(
                sandbox_id, "stopping", check, wait, error_code=None, error_message=None
            )
        except _Already as done:
            return done.row
        memory = keep_memory and not before.no_snapshots

        def work() -> None:
            result = self.node.stop(sandbox_id, keep_memory=memory)
            self.lifecycle.transition(
                sandbox_id, "stopped", has_memory=result.memory_saved, memory_saved=result.memory_saved,
                stop_reason=reason, stop_error=result.error, memory_restored=None, resume_reason=None,
            )

        self._submit(sandbox_id, work, self._fail(sandbox_id))
        return after

    def _resume_check(self, row: SandboxRow, size: Size | None, require_memory: bool) -> bool:
        """Validate a resume against ``row``; returns True for a resize. Raises the rule errors."""
        if row.no_snapshots:
            raise ControlError(
                "snapshots_disabled", f"sandbox {row.id} was created with --no-snapshots and cannot be resumed", 409
            )
        current = self._size(row.type)
        target = size or current
        if target.rank() < current.rank():
            raise ControlError(
                "invalid_resize",
                f"cannot resize {row.id} from {current.name} to {target.name}: sizes only grow; "
                "create a new sandbox of the smaller size (or fork) instead",
                400,
            )
        resize = target.name != current.name
        if require_memory and resize:
            raise ControlError(
                "invalid_require_memory",
                "require_memory cannot be combined with a size change: a resized sandbox always boots from disk",
                400,
            )
        if row.state == "running":
            if resize:
                raise ControlError(
                    "invalid_state", f"sandbox {row.id} is running; stop it before resizing", 409, row.state
                )
            raise _Already(row)
        if require_memory and row.state == "stopped" and not row.has_memory:
            raise ControlError(
                "memory_unavailable", f"sandbox {row.id} has no memory image (it was stopped without memory)", 409
            )
        return resize

    def resume(
        self,
        sandbox_id: str,
        type: str | None = None,
        require_memory: bool = False,
        ttl: int | None = None,
        wait: float | None = None,
    ) -> SandboxRow:
        """Resume a stopped sandbox in the background, at size ``type`` if given (a resize: cold boot from disk,
        ``memoryRestored`` false, ``resumeReason`` "resized"). A running sandbox at the same size is returned as is.
        ``ttl`` replaces the sandbox's ttl when given. Raises 400 ``invalid_type``/``invalid_resize``/
        ``invalid_require_memory``/``invalid_ttl``, 404, 409 ``snapshots_disabled``/``busy``/``invalid_state``/
        ``memory_unavailable``, 507 ``insufficient_capacity`` (the sandbox stays as it was)."""
        size = self._size(type) if type is not None else None
        if ttl is not None and ttl < 0:
            raise ControlError("invalid_ttl", "ttl must be >= 0 seconds (0 = never stop)", 400)
        current = self.get(sandbox_id)
        if current.state not in TRANSIENT:
            try:
                self._resume_check(current, size, require_memory)
            except _Already as done:
                return done.row
        flags: dict[str, bool] = {}

        def check(row: SandboxRow) -> ControlError | None:  # runs under the lifecycle lock, before the change
            flags["resize"] = self._resume_check(row, size, require_memory)
            target = size or self._size(row.type)
            self._admit(target, f"resuming {row.id} as {target.name}", exclude=row.id)
            return None

        fields: dict[str, Any] = {"error_code": None, "error_message": None}
        if ttl is not None:
            fields["ttl"] = ttl
        try:
            before, _ = self.lifecycle.begin(sandbox_id, "resuming", check, wait, **fields)
        except _Already as done:
            return done.row
        resize = flags["resize"]
        target = size or self._size(before.type)
        if resize:
            after = self.store.update_sandbox(
                sandbox_id, type=target.name, memory_restored=False, resume_reason="resized"
            )
        else:
            after = self.store.update_sandbox(sandbox_id, memory_restored=None, resume_reason=None)
        spec = self._spec(after, target)

        def work() -> None:
            try:
                result = self.node.resume(sandbox_id, spec, cold=resize, require_memory=require_memory)
            except NodeError as e:
                if e.code in NODE_CONFLICT_CODES:  # refused before anything ran: still stopped
                    self.lifecycle.transition(
                        sandbox_id, "stopped", error_code=e.code, error_message=e.message, type=before.type,
                        memory_restored=before.memory_restored, resume_reason=before.resume_reason,
                    )
                    self.add_event(
                        sandbox_id,
                        {"event": "error", "id": sandbox_id, "state": "stopped",
                         "error": {"code": e.code, "message": e.message}},
                    )
                    return
                raise
            self.activity.touch(sandbox_id)
            self.lifecycle.transition(
                sandbox_id,
                "running",
                has_memory=False,
                memory_restored=False if resize else result.memory_restored,
                resume_reason="resized" if resize else (None if result.memory_restored else result.reason),
            )

        self._submit(sandbox_id, work, self._fail(sandbox_id))
        return after

    def fork(
        self,
        source_id: str,
        type: str | None = None,
        ttl: int | None = None,
        name: str | None = None,
        env: dict[str, str] | None = None,
        wait: float | None = None,
    ) -> SandboxRow:
        """Fork ``source_id`` (running or stopped) into a new sandbox: its disk copied copy-on-write, booted fresh
        at ``type`` (default the source's). Returns the new row in ``forking``; the source is left as it is.
        Raises 400 ``invalid_type``/``invalid_resize`` (smaller than the source)/``invalid_name``/``invalid_ttl``,
        404, 409 ``snapshots_disabled``/``busy``/``invalid_state``, 507 ``insufficient_capacity`` (nothing is
        created)."""
        source = self.get(source_id)
        if source.no_snapshots:
            raise ControlError(
                "snapshots_disabled", f"sandbox {source_id} was created with --no-snapshots and cannot be forked", 409
            )
        size = self._size(type or source.type)
        if size.disk_mib < self._size(source.type).disk_mib:
            raise ControlError(
                "invalid_resize",
                f"a fork can't be smaller than its source ({source.type}): its disk is a copy of the source's "
                f"and disks only grow; fork at {source.type} or bigger",
                400,
            )
        _check_name_and_ttl(name, ttl)
        source = self.lifecycle.acquire_hold(source_id, {"running", "stopped"}, wait, "fork it")
        try:
            with self.lifecycle.cond:
                self._admit(size, f"a {size.name} fork of {source_id}")
                row = self._add_new_row(
                    "forking", size, f"{source.name} (fork)" if name is None else name,
                    self.settings.fork_default_ttl if ttl is None else ttl,
                    dict(source.env if env is None else env), no_snapshots=False, source_id=source_id,
                    labels=dict(source.labels or {}),
                )
            fork_id = row.id
        except BaseException:
            self.lifecycle.release_hold(source_id)
            raise
        spec = self._spec(row, size)

        def work() -> None:
            try:
                self.lifecycle.transition(fork_id, "provisioning")
                self.node.fork(source_id, spec)
            finally:
                self.lifecycle.release_hold(source_id)
            self.activity.touch(fork_id)
            self.lifecycle.transition(fork_id, "running")

        self._submit(fork_id, work, self._fail(fork_id))
        return row

    def delete(self, sandbox_id: str, wait: float | None = None) -> SandboxRow:
        """Delete a sandbox (and its automatic snapshots) in the background; returns the row in ``deleting``.
        Named snapshots made from it stay. Raises 404, 409 ``busy``."""
        _, after = self.lifecycle.begin(sandbox_id, "deleting", None, wait, error_code=None, error_message=None)

        def work() -> None:
            self.node.delete(sandbox_id)
            self.routes.drop_all(sandbox_id)
            for snap in self.store.list_snapshots(sandbox_id, auto=True):
                try:
                    self.node.delete_snapshot(snap.name)
                except NodeError as e:
                    log.warning("could not delete snapshot %s: %s", snap.name, e)
                self.store.delete_snapshot(snap.name)
            self.activity.forget(sandbox_id)
            self.lifecycle.transition(sandbox_id, "deleted")
            self.trimmer.request()

        self._submit(sandbox_id, work, self._fail(sandbox_id))
        return after

    def wait_running(self, sandbox_id: str) -> SandboxRow:
        """Wait (up to :data:`START_WAIT` seconds, or the lifecycle's own wait if longer) for a provisioning or
        resuming sandbox to run; return its row. Raises 404, 409 ``not_running`` (stopped, error...) or 409
        ``busy`` (still starting). What exec, jobs, files and shells call before they touch the node.

        A sandbox created with ``autoResume`` that is stopped (or stopping) is resumed first (issue 9, as the proxy
        does for hosted ports: :meth:`sbx.control.routes.Routes.ensure_running`)."""
        row = self.get(sandbox_id)
        if row.auto_resume and row.state != "running":
            return self.routes.ensure_running(sandbox_id)
        return self.lifecycle.wait_for(sandbox_id, {"running"}, max(START_WAIT, self.lifecycle.wait))

    def wait_settled(self, sandbox_id: str, timeout: float = 600.0) -> SandboxRow:
        """Block until the sandbox leaves its transient state (at most ``timeout`` seconds); return the row.

        Raises the operation's error when it failed (the row's ``error_code``), 409 ``busy`` on timeout, 404 if
        unknown. A deleted sandbox is returned (state ``deleted``)."""
        deadline = time.monotonic() + timeout
        with self.lifecycle.cond:
            while True:
                row = self.store.get_sandbox(sandbox_id)
                if row is None:
                    raise not_found(f"sandbox {sandbox_id}")
                if row.state not in TRANSIENT:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ControlError("busy", f"sandbox {sandbox_id} is still {row.state}", 409, row.state)
                self.lifecycle.cond.wait(min(remaining, 1.0))
        if row.error_code:
            raise from_node(row.error_code, row.error_message or row.error_code)
        return row

    # snapshots -------------------------------------------------------------------------------------------------
    def snapshot(self, sandbox_id: str, name: str, auto: bool = False, wait: float | None = None) -> SnapshotRow:
        """Seal a named copy of the sandbox's disk (running or stopped). Raises 400 ``invalid_snapshot_name``
        (blank, over 63 characters, or characters outside ``A-Z a-z 0-9 . _ -``), 404, 409 ``snapshot_exists``/
        ``snapshots_disabled``/``busy``/``invalid_state``."""
        if not SNAPSHOT_NAME_RE.match(name or ""):
            raise ControlError(
                "invalid_snapshot_name",
                "snapshot names are 1-63 characters: letters, digits, '.', '_' or '-', starting with a letter or digit",
                400,
            )
        row = self.get(sandbox_id)
        if row.no_snapshots:
            raise ControlError(
                "snapshots_disabled", f"sandbox {sandbox_id} was created with --no-snapshots", 409
            )
        with self.lifecycle.hold(sandbox_id, {"running", "stopped"}, wait, "snapshot it"), self._snap_lock:
            if self.store.get_snapshot(name) is not None:
                raise ControlError("snapshot_exists", f"a snapshot named {name!r} already exists", 409)
            try:
                info = self.node.snapshot(sandbox_id, name)
            except NodeError as e:
                raise from_node(e.code, e.message) from None
            return self.store.add_snapshot(
                SnapshotRow(name=name, sandbox_id=sandbox_id, auto=auto, size_mib=info.size_mib, created_at=utcnow())
            )

    def snapshots(self, sandbox_id: str | None = None) -> list[SnapshotRow]:
        """Snapshots, oldest first, optionally only those of ``sandbox_id`` (404 if that sandbox is unknown)."""
        if sandbox_id is not None and self.store.get_sandbox(sandbox_id) is None:
            raise not_found(f"sandbox {sandbox_id}")
        return self.store.list_snapshots(sandbox_id)

    def snapshot_views(self, rows: list[SnapshotRow]) -> list[dict[str, Any]]:
        """API views of ``rows`` (see :func:`snapshot_view`) with the node's current space figures for each."""
        try:
            infos = {i.name: i for i in self.node.snapshots()}
        except NodeError as e:
            log.warning("snapshot space figures unavailable: %s", e)
            infos = {}
        return [snapshot_view(r, infos.get(r.name)) for r in rows]

    def delete_snapshot(self, name: str) -> None:
        """Remove snapshot ``name``; 404 ``not_found`` if there is none."""
        with self._snap_lock:
            if self.store.get_snapshot(name) is None:
                raise not_found(f"snapshot {name}")
            try:
                self.node.delete_snapshot(name)
            except NodeError as e:
                if e.code != "not_found":
                    raise from_node(e.code, e.message) from None
            self.store.delete_snapshot(name)
        self.trimmer.request()

    # exec and jobs ---------------------------------------------------------------------------------------------
    def exec(
        self,
        sandbox_id: str,
        command: str,
        timeout: float | None = DEFAULT_EXEC_TIMEOUT,
        user: str = "user",
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        encoding: str = "utf-8",
        stop: Callable[[], bool] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Run ``command`` in the sandbox (waiting for a provisioning/resuming one to be running, resuming a stopped
        ``autoResume`` one). Checks happen now (404, 409 ``not_running``/``busy``, 400 ``invalid_cwd`` when ``cwd``
        is not a directory in the sandbox); the returned iterator then yields ``{"stream": "stdout"|"stderr",
        "data": text}`` pieces and finally ``{"exitCode": N, "timedOut": bool}`` (or ``{"error": {"code",
        "message"}}`` if the node fails mid-way). ``encoding`` ``"utf-8"``: text, invalid bytes replaced;
        ``"base64"``: ``data`` is base64 of the exact bytes and the piece carries ``"encoding": "base64"``.
        ``timeout`` in seconds (0 or None: none). ``stop``: polled while the command runs; True (the client went
        away) kills it. The run counts as activity."""
        if not command:
            raise ControlError("invalid_command", "command must not be empty", 400, field="command")
        self.wait_running(sandbox_id)
        cwd_path = self.files.check_dir(sandbox_id, cwd, user, field="cwd") if cwd is not None else None
        return self._exec(sandbox_id, command, timeout if timeout else None, user, env, cwd_path, encoding, stop)

    def _exec(
        self, sandbox_id: str, command: str, timeout: float | None, user: str, env: dict[str, str] | None,
        cwd: str | None, encoding: str = "utf-8", stop: Callable[[], bool] | None = None,
    ) -> Iterator[dict[str, Any]]:
        decoders = {k: codecs.getincrementaldecoder("utf-8")("replace") for k in ("stdout", "stderr")}
        raw = encoding == "base64"
        # begin/end both run inside this generator: a response the client dropped before its first chunk never
        # starts it, and then neither runs (an eager begin would leave the sandbox "active" for ever).
        self.activity.begin(sandbox_id)
        try:
            for ev in self.node.exec(sandbox_id, command, user=user, timeout=timeout, env=env, cwd=cwd, stop=stop):
                self.activity.touch(sandbox_id)
                if ev.kind == "exit":
                    for kind, dec in decoders.items():
                        tail = "" if raw else dec.decode(b"", final=True)
                        if tail:
                            yield {"stream": kind, "data": tail}
                    yield {"exitCode": ev.exit_code, "timedOut": ev.timed_out}
                    return
                if raw:
                    if ev.data:
                        yield {"stream": ev.kind, "data": base64.b64encode(ev.data).decode(), "encoding": "base64"}
                    continue
                text = decoders[ev.kind].decode(ev.data)
                if text:
                    yield {"stream": ev.kind, "data": text}
            yield {"error": {"code": "exec_failed", "message": "the command ended without an exit status"}}
        except NodeError as e:
            yield {"error": {"code": e.code, "message": e.message}}
        finally:
            self.activity.end(sandbox_id)

    def exec_detached(
        self, sandbox_id: str, command: str, user: str = "user", env: dict[str, str] | None = None,
        cwd: str | None = None, timeout: float | None = None, stdin: str | None = None,
    ) -> JobInfo:
        """Start ``command`` as a detached job; returns its :class:`JobInfo`. ``env`` adds variables, ``cwd`` is
        its working directory (checked as for :meth:`exec`), ``timeout`` seconds after which it is killed (None or
        0: never; a job killed so ends with exit 124, as an exec does), ``stdin`` text fed to it. Raises 404, 409
        ``not_running``, 400 ``invalid_cwd``."""
        if not command:
            raise ControlError("invalid_command", "command must not be empty", 400, field="command")
        self.wait_running(sandbox_id)
        cwd_path = self.files.check_dir(sandbox_id, cwd, user, field="cwd") if cwd is not None else None
        self.activity.touch(sandbox_id)
        try:
            return self.node.exec_detached(sandbox_id, command, user=user, env=env, cwd=cwd_path,
                                           timeout=timeout or None, stdin=stdin)
        except NodeError as e:
            raise from_node(e.code, e.message) from None

    def kill_job(self, sandbox_id: str, job_id: str) -> JobInfo:
        """Kill a detached job (SIGKILL to its whole process tree); answers the job as it is afterwards. A job
        that has already ended is answered as is. Raises 404 for an unknown sandbox or job."""
        job = self.job(sandbox_id, job_id)
        if not job.running:
            return job
        try:
            self.node.kill_job(sandbox_id, job_id)
        except NodeError as e:
            raise from_node(e.code, e.message) from None
        return self.job_wait(sandbox_id, job_id, timeout=10.0, poll=0.1)

    def jobs(self, sandbox_id: str) -> list[JobInfo]:
        """The sandbox's detached jobs, oldest first (empty when it is not running)."""
        row = self.get(sandbox_id)
        if row.state != "running":
            return []
        try:
            return self.node.jobs(sandbox_id)
        except NodeError as e:
            raise from_node(e.code, e.message) from None

    def job(self, sandbox_id: str, job_id: str) -> JobInfo:
        """One job; 404 ``not_found`` if the sandbox or job is unknown."""
        for job in self.jobs(sandbox_id):
            if job.id == job_id:
                return job
        raise not_found(f"job {job_id}")

    def job_logs(
        self, sandbox_id: str, job_id: str, follow: bool = False, poll: float = 0.25,
        stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[dict[str, Any]]:
        """A job's output as exec-style lines (``{"stream","data"}``), then ``{"exitCode": N, "timedOut":
        false}`` once it has ended. With ``follow``, keeps streaming until the job ends (this counts as activity).
        Raises 404 for an unknown sandbox or job."""
        self.job(sandbox_id, job_id)
        return self._job_logs(sandbox_id, job_id, follow, poll, stop)

    def _job_logs(
        self, sandbox_id: str, job_id: str, follow: bool, poll: float, stop: Callable[[], bool]
    ) -> Iterator[dict[str, Any]]:
        offsets = {"stdout": 0, "stderr": 0}
        decoders = {k: codecs.getincrementaldecoder("utf-8")("replace") for k in offsets}
        if follow:
            self.activity.begin(sandbox_id)
        try:
            while True:
                try:
                    job = self.job(sandbox_id, job_id)
                except ControlError:
                    return
                for kind in offsets:
                    try:
                        data = self.node.job_output(sandbox_id, job_id, kind, offsets[kind])
                    except NodeError as e:
                        yield {"error": {"code": e.code, "message": e.message}}
                        return
                    offsets[kind] += len(data)
                    text = decoders[kind].decode(data, final=not job.running)
                    if text:
                        yield {"stream": kind, "data": text}
                if not job.running:
                    yield {"exitCode": job.exit_code, "timedOut": False}
                    return
                if not follow or stop():
                    return
                self.activity.touch(sandbox_id)
                time.sleep(poll)
        finally:
            if follow:
                self.activity.end(sandbox_id)

    def job_wait(self, sandbox_id: str, job_id: str, timeout: float = 300.0, poll: float = 0.25) -> JobInfo:
        """Wait until the job ends (at most ``timeout`` seconds; the job may still be running then)."""
        deadline = time.monotonic() + timeout
        self.activity.begin(sandbox_id)
        try:
            while True:
                job = self.job(sandbox_id, job_id)
                if not job.running or time.monotonic() >= deadline:
                    return job
                time.sleep(poll)
        finally:
            self.activity.end(sandbox_id)

    # start / stop ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Reconcile the store with what the node has (call once, after ``node.prepare``): sandboxes left in a
        transient state by a crash settle to what the node reports; a deletion in flight is finished."""
        rows = self.store.list_sandboxes()
        found = self.node.reconcile({r.id: r.state for r in rows})
        for row in rows:
            status = found.get(row.id, "absent")
            if row.state == "deleting":
                self.store.update_sandbox(row.id, state="error", error_code=None, error_message=None)
                self.delete(row.id, wait=0)
                continue
            target = {"running": "running", "checkpointed": "stopped", "stopped": "stopped"}.get(status)
            if target is None:
                if row.state in ("forking", "provisioning"):  # the node removed the half-made disk
                    self.store.update_sandbox(
                        row.id, state="error", error_code="interrupted",
                        error_message="the server stopped before the sandbox's disk was complete; delete it "
                                      "and create (or fork) again",
                    )
                    self._on_transition(self.store.get_sandbox(row.id) or row, row.state)
                elif row.state != "error":
                    self.store.update_sandbox(
                        row.id, state="error", error_code="lost", error_message="the node has no trace of it"
                    )
                    self._on_transition(self.store.get_sandbox(row.id) or row, row.state)
                continue
            if row.state != target:
                fields: dict[str, Any] = {"has_memory": status == "checkpointed"}
                if target == "stopped":
                    fields.update(memory_saved=status == "checkpointed", memory_restored=None, resume_reason=None,
                                  stop_reason="requested" if row.state == "stopping" else "interrupted")
                updated = self.store.update_sandbox(row.id, state=target, **fields)
                self._on_transition(updated, row.state)
            if target == "running":
                self.activity.touch(row.id)
        self.node.watch(self._on_node_exit)
        self.trimmer.start()

    def _on_node_exit(self, sandbox_id: str, kind: str, detail: str | None) -> None:
        """The node noticed that a running sandbox ended on its own (called from the node's watcher thread).
        ``poweroff``/``crashed``: the sandbox is ``stopped`` with ``stopReason`` = kind (``stopError`` = the
        crash's detail), disk kept, no memory. ``reboot``: it boots again from its disk and reports
        ``resumeReason: "reboot"``. An ``exited`` event with the reason comes first."""
        row = self.store.get_sandbox(sandbox_id)
        if row is None or row.state != "running":
            return
        self.add_event(sandbox_id, {"event": "exited", "id": sandbox_id, "reason": kind, "detail": detail})
        try:
            row = self.lifecycle.transition(
                sandbox_id, "stopped", has_memory=False, memory_saved=False, stop_reason=kind, stop_error=detail,
                memory_restored=None, resume_reason=None,
            )
            if kind != "reboot":
                return
            row = self.lifecycle.transition(sandbox_id, "resuming")
        except ControlError as e:  # an operation got there first
            log.info("%s ended (%s) but is %s: %s", sandbox_id, kind, e.state, e.message)
            return
        spec = self._spec(row)

        def work() -> None:
            self.node.resume(sandbox_id, spec, cold=False)
            self.activity.touch(sandbox_id)
            self.lifecycle.transition(sandbox_id, "running", has_memory=False, memory_restored=False,
                                      resume_reason="reboot")

        self._submit(sandbox_id, work, self._fail(sandbox_id))

    def close(self) -> None:
        """Finish operations in flight and release the database."""
        if self._closed:
            return
        self._closed = True
        self.node.unwatch()
        self._pool.shutdown(wait=True)
        self.trimmer.stop()
        self.store.close()
