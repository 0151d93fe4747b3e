"""The state every part of the control plane shares, and the parts they all call: :class:`PlaneBase`.

Sandbox views, events, background work (a worker pool whose failures leave the sandbox in ``error``), new rows,
lookups and waits; placement and plan admission come from its base :class:`sbx.control.sandboxes.admission.Admission`.
:class:`sbx.control.service.ControlPlane` combines it with the operation mixins.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sbx import logs
from sbx.config import Settings, Size
from sbx.control.accounts import plans
from sbx.control.accounts.keys import Accounts
from sbx.control.accounts.metering import Meter
from sbx.control.cluster import capacity
from sbx.control.cluster.archive import SealArchive, is_current
from sbx.control.cluster.capacity import HostResources
from sbx.control.cluster.registry import NodeRegistry
from sbx.control.cluster.replicas import ReplicaBook, forget_on_state_change
from sbx.control.cluster.router import NodeRouter
from sbx.control.cluster.trim import Trimmer
from sbx.control.errors import ControlError, from_node, not_found
from sbx.control.images.catalog import Images
from sbx.control.sandboxes.activity import Activity
from sbx.control.sandboxes.admission import Admission
from sbx.control.sandboxes.files import Files
from sbx.control.sandboxes.observe import OpTimer
from sbx.control.sandboxes.routes import Routes
from sbx.control.sandboxes.sampler import Sampler
from sbx.control.sandboxes.views import stats_view
from sbx.control.secrets.vault import Secrets
from sbx.control.store.database import SandboxRow, Store, iso, utcnow
from sbx.control.store.ids import new_sandbox_id, new_subdomain, sandbox_url
from sbx.control.store.locks import AccountLocks
from sbx.control.store.state import DEFAULT_WAIT, TRANSIENT, Lifecycle
from sbx.control.volumes.catalog import Volumes
from sbx.node.types import NodeAgent, NodeError, SandboxSpec, Stats
from sbx.storage.volume import trim_volume

log = logging.getLogger("sbx.control")

START_WAIT = 180.0
"""Seconds an exec, a job, a file transfer or a shell waits for a provisioning/resuming sandbox to reach running
before answering 409 busy."""


class PlaneBase(Admission):
    """What the control plane's parts share: settings, node, store, lifecycle, activity, routes, files, admission
    and the worker pool (see :class:`sbx.control.service.ControlPlane` for the arguments)."""

    routes: Routes
    """Hosted ports (:mod:`sbx.control.sandboxes.routes`)."""
    files: Files
    """Files in and out of running sandboxes (:mod:`sbx.control.sandboxes.files`)."""
    images: Images
    """The account's images a sandbox may start from (:mod:`sbx.control.images.catalog`)."""
    volumes: Volumes
    """The account's persistent volumes and what each sandbox mounts (:mod:`sbx.control.volumes.catalog`)."""
    secrets: Secrets
    """Secrets and their bindings (:mod:`sbx.control.secrets.vault`).

    These three are made by :class:`sbx.control.service.ControlPlane` once the plane is whole: each takes the
    plane as its own narrow protocol, which only the whole plane satisfies."""

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
        self.store = store or Store(settings.db_url)
        # every node call goes through the router: to the node that holds the sandbox (sbx.control.cluster.router)
        self.router = NodeRouter(self.store, settings, node, settings.node_url or "local",
                                 key=lambda: self.secrets.key)
        self.node: NodeRouter = self.router
        self.lifecycle = Lifecycle(self.store, self._on_transition, wait)
        self.activity = Activity()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sbx-op")
        self._snap_lock = threading.Lock()
        self.moving_to: dict[str, tuple[str, int]] = {}
        """Sandboxes on their way to another node (a resume there, a live migration): ``{id: (node, MiB)}``. Until
        the move commits (the row's ``node`` names the destination) or fails, :meth:`_candidates` counts their
        memory against the destination too, so two moves at once can't both take its last room. Changed under
        ``lifecycle.cond``; this replica's own moves only."""
        self._closed = False
        self._host = host or (lambda: capacity.probe_host(settings))
        self.registry = NodeRegistry(self.store, settings, node, settings.node_url or "local", router=self.router)
        self.trimmer = Trimmer(trim or (lambda min_slack: trim_volume(settings, min_slack)), settings.trim_seconds)
        self.plans = plans.load_plans(dict(settings.plans))
        self.accounts = Accounts(self.store, list(self.plans), settings.default_plan)
        self.meter = Meter(self.store, settings)
        self.account_locks = AccountLocks(self.store.engine)  # plan admission across replicas (Admission._admitting)
        self.store.state_hooks.append(self.meter.on_state)
        self.replicas = ReplicaBook(self.store)  # seal replicas on other nodes (sbx.control.cluster.replicas)
        self.store.state_hooks.append(forget_on_state_change)
        # the seal store, when one is set (sbx.control.cluster.archive)
        self.archive = SealArchive(self.store, settings) if settings.seal_store else None
        self.optimer = OpTimer()  # sbx_operation_seconds (sbx.control.sandboxes.observe)
        self.store.state_hooks.append(self.optimer.on_state)
        self.sampler = Sampler(self.router, lambda: [r.id for r in self.store.list_sandboxes() if r.state == "running"],
                               settings.stats_sample_seconds)

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
        if row.state not in ("running", "stopped") or self.registry.status(row.node) == "unreachable":
            return None  # (an unreachable node would hold every view for its connect timeout)
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
        was killed in; null otherwise), ``node`` (the node that holds it) and ``nodeStatus`` (``ready``,
        ``cordoned`` or ``unreachable``: :mod:`sbx.control.cluster.registry`; ``state`` stays what it was while its
        node is unreachable), ``replicaNode`` (a stopped sandbox's node holding a current copy of its disk and memory
        image, where it resumes should its own node be gone: :mod:`sbx.control.cluster.replicas`; null otherwise),
        ``sealStored`` (a stopped sandbox whose current seal is in the seal store: :mod:`sbx.control.cluster.archive`),
        ``sealStoredAt`` (when the newest seal in the seal store was made: a stop's, or a running sandbox's automatic
        snapshot, :mod:`sbx.control.cluster.rescue`; null when none is stored).
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
            "image": (row.image or {}).get("name"),
            "runtime": row.runtime or "container",
            "volumes": self.volumes.of_sandbox(row.id),
            "memorySaved": row.memory_saved,
            "stopReason": row.stop_reason,
            "stopError": row.stop_error,
            "error": {"code": row.error_code, "message": row.error_message or ""} if row.error_code else None,
            "node": row.node or self.registry.name,
            "nodeStatus": self.registry.status(row.node),
            "replicaNode": self._replica_node(row),
            **self._sealed(row),
            "stats": stats_view(self._stats(row, space) if stats else None),
        }

    def _replica_node(self, row: SandboxRow) -> str | None:
        if row.state != "stopped":
            return None
        rep = self.replicas.get(row.id)
        return rep.node if rep is not None else None

    def _spec(self, row: SandboxRow, size: Size | None = None) -> SandboxSpec:
        return SandboxSpec(id=row.id, hostname=row.subdomain, size=size or self._size(row.type), env=dict(row.env),
                           image=dict(row.image) if row.image else None, runtime=row.runtime or "container",
                           volumes=self.volumes.specs(row.id))

    # events ----------------------------------------------------------------------------------------------------
    def _measure_stored(self, sandbox_id: str) -> None:
        """After a stop: measure what the stopped sandbox holds on the volume (its disk's unique bytes plus its
        memory image) for its ``store`` interval (in the worker pool; a failed sample leaves the last figure)."""
        def run() -> None:
            try:
                st = self.node.stats(sandbox_id, space=True)
            except NodeError as e:
                log.info("stored size of %s unknown: %s", sandbox_id, e)
                return
            self.meter.measure(sandbox_id, st.disk_unique_bytes + st.memory_image_bytes)

        if not self._closed:
            try:
                self._pool.submit(run)
            except RuntimeError:  # the pool is shutting down
                pass

    def _on_transition(self, row: SandboxRow, old: str) -> None:
        if row.state == "stopped":
            self._measure_stored(row.id)
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

    def _sealed(self, row: SandboxRow) -> dict[str, Any]:
        """``sealStored`` and ``sealStoredAt`` of :meth:`view`."""
        stored = self.archive.get(row.id) if self.archive is not None else None
        if stored is None:
            return {"sealStored": False, "sealStoredAt": None}
        return {"sealStored": is_current(stored, row), "sealStoredAt": iso(stored.sealed_at)}

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
        # the worker's log lines name the sandbox and the request that began the operation (sbx.logs)
        @logs.carry_to(sandbox_id)
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

    # new rows, lookups and waits -------------------------------------------------------------------------------
    def _add_new_row(self, state: str, size: Size, name: str | None, ttl: int, env: dict[str, str],
                     sandbox_id: str | None = None, **extra: Any) -> SandboxRow:
        """Store a new sandbox row in ``state`` with a fresh unique id (or ``sandbox_id``, a warm sandbox's, when
        no row has it) and subdomain (the name defaults to the subdomain) and publish its first transition.
        ``extra`` sets further columns (``no_snapshots``, ``source_id``...)."""
        if sandbox_id is None or self.store.get_sandbox(sandbox_id) is not None:
            sandbox_id = new_sandbox_id()
        while self.store.get_sandbox(sandbox_id) is not None:
            sandbox_id = new_sandbox_id()
        subdomain = new_subdomain(self.store.subdomain_taken)
        now = utcnow()
        row = SandboxRow(id=sandbox_id, name=subdomain if name is None else name, type=size.name, state=state,
                         subdomain=subdomain, ttl=ttl, env=env, memory_restored=None, resume_reason=None,
                         has_memory=False, created_at=now, updated_at=now, **extra)
        self.lifecycle.ops.claim(sandbox_id)  # a new id: nobody else holds it
        try:
            self.store.add_sandbox(row)
        except BaseException:
            self.lifecycle.ops.release(sandbox_id)
            raise
        self._on_transition(row, "")
        return row

    def get(self, sandbox_id: str) -> SandboxRow:
        """The sandbox row; 404 ``not_found`` if unknown or deleted."""
        return self.lifecycle.get(sandbox_id)

    def list_sandboxes(self, labels: dict[str, str] | None = None, account_id: str | None = None
                       ) -> list[SandboxRow]:
        """Every sandbox that is not deleted (only ``account_id``'s when given), oldest first; with ``labels``,
        only those carrying every one of them (same key, same value)."""
        rows = self.store.list_sandboxes(account_id=account_id)
        if labels:
            rows = [r for r in rows if all((r.labels or {}).get(k) == v for k, v in labels.items())]
        return rows

    def wait_running(self, sandbox_id: str, row: SandboxRow | None = None) -> SandboxRow:
        """Wait (up to :data:`START_WAIT` seconds, or the lifecycle's own wait if longer) for a provisioning or
        resuming sandbox to run; return its row. Raises 404, 409 ``not_running`` (stopped, error...) or 409
        ``busy`` (still starting). What exec, jobs, files and shells call before they touch the node.

        A sandbox created with ``autoResume`` that is stopped (or stopping) is resumed first (issue 9, as the proxy
        does for hosted ports: :meth:`sbx.control.sandboxes.routes.Routes.ensure_running`). ``row``: the sandbox's
        row as the request read it a moment ago (its ownership check), used when it says ``running``."""
        if row is None or row.id != sandbox_id or row.state != "running":
            row = self.get(sandbox_id)
        if row.state == "running":  # the common case: no second read of the row (each is ~0.3 ms of an exec)
            return row
        if row.auto_resume:
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
