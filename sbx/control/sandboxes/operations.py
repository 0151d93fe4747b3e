"""Sandbox lifecycle operations: create, stop, resume (and resize), fork and delete (:class:`LifecycleOps`).

Each persists its transient state under the lifecycle lock (with the admission check in the same critical
section), returns at once and finishes in a worker thread.
"""

from __future__ import annotations

import logging
from typing import Any

from sbx.config import Size
from sbx.control.accounts.keys import DEFAULT_ACCOUNT
from sbx.control.errors import NODE_CONFLICT_CODES, ControlError, not_found
from sbx.control.sandboxes.forking import ForkOps
from sbx.control.store.database import SandboxRow
from sbx.control.store.ids import ID_RE
from sbx.control.store.state import TRANSIENT
from sbx.node.types import RUNTIME_CLASSES, NodeError

log = logging.getLogger("sbx.control")

DEFAULT_TTL = 3600
"""Seconds of inactivity before a new sandbox stops (keeping memory) when ``create`` gets no ttl."""
NAME_MAX = 200
"""Longest sandbox name, in characters."""
MOVE_CODES = {"node_unreachable", "node_unknown", "transfer_failed", "transfer_corrupt"}
"""Node errors of a failed move to another node: the sandbox stays stopped where it was."""


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


class LifecycleOps(ForkOps):
    """create, stop, resume, fork, delete."""

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
        account_id: str = DEFAULT_ACCOUNT,
        cold: bool = False,
        egress: bool = False,
        image: str | None = None,
        runtime: str | None = None,
        volumes: list[dict[str, Any]] | None = None,
    ) -> SandboxRow:
        """Create a sandbox of size ``type`` for account ``account_id`` (a disk from the base image, from the
        account's image named ``image`` (:mod:`sbx.control.images.catalog`), or a copy of snapshot
        ``from_snapshot``) and boot it in the background; returns the row in ``provisioning``.

        ``ttl``: seconds of inactivity before it stops keeping memory (default :data:`DEFAULT_TTL`; 0 = never).
        ``auto_resume``: an exec, a file call, a shell or a request on one of its hosted ports resumes it when it
        is stopped. ``labels``: string metadata, filtered on by :meth:`list_sandboxes`. ``cold``: boot even when the
        size's memory template is ready (:mod:`sbx.node.memory.templates`). ``egress``: it is to get secrets, so only a
        node that runs an egress proxy may take it.
        Raises 400 ``invalid_type``/``invalid_name``/``invalid_ttl``, 404 ``not_found`` for an unknown snapshot
        (the API answers the same for another account's), 403 ``plan_limit``, 507 ``insufficient_capacity``, 409
        ``egress_proxy_unavailable`` (nothing is created); 400 ``invalid_image_name``, 404 ``image_not_found``, 400
        ``invalid_image`` (both ``image`` and ``from_snapshot``), 400 ``image_too_large`` (the image's file is larger
        than the size's disk); 400 ``invalid_runtime`` (not one of :data:`sbx.node.types.RUNTIME_CLASSES`). ``runtime``:
        the sandbox's runtime class (None: that of the snapshot's sandbox, else the server's ``default_runtime`` when
        the account's plan allows it, else the plan's first class; 403 ``plan_limit`` for a class the plan does not
        allow). ``volumes``: ``[{"name", "path", "readOnly"}]`` of the account's volumes to mount (the errors of
        :meth:`sbx.control.volumes.catalog.Volumes.plan`; container class only, 400 ``invalid_volume``)."""
        size = self._size(type)
        planned = self.volumes.plan(account_id, volumes)
        if runtime is not None and runtime not in RUNTIME_CLASSES:
            raise ControlError("invalid_runtime", f"runtime {runtime!r} is not one of {', '.join(RUNTIME_CLASSES)}",
                               400, field="runtime")
        _check_name_and_ttl(name, ttl)
        snap = self.store.get_snapshot(from_snapshot) if from_snapshot is not None else None
        if from_snapshot is not None and snap is None:
            raise not_found(f"snapshot {from_snapshot}")
        if image is not None and from_snapshot is not None:
            raise ControlError("invalid_image", "a sandbox comes from an image or from a snapshot, not both "
                               "(a snapshot keeps the image it was taken of)", 400, field="image")
        img_row = self.images.resolve(account_id, image) if image is not None else None
        if img_row is not None and int((img_row.facts or {}).get("size_bytes") or 0) > size.disk_mib << 20:
            need = -(-int(img_row.facts["size_bytes"]) // (1 << 30))
            raise ControlError("image_too_large", f"image {image!r} needs a disk of at least {need} GiB; a "
                               f"{size.name} sandbox has {size.disk_mib // 1024} GiB: pick a larger type", 400,
                               field="type")
        image_fields = _image_fields(self, img_row, snap)
        if runtime is None:  # a snapshot's sandbox keeps its class
            source = self.store.get_sandbox(snap.sandbox_id) if snap is not None else None
            runtime = source.runtime if source is not None and source.runtime else self._default_runtime(account_id)
        if planned and runtime != RUNTIME_CLASSES[0]:
            raise ControlError("invalid_volume", "volumes mount in the container runtime class only", 400,
                               field="volumes")
        only: str | None = None
        what_new = f"a new {size.name} sandbox"
        if img_row is not None and len(self.router.agents()) > 1:
            only = img_row.node  # an image's file lives where it was built
        if from_snapshot is not None and len(self.router.agents()) > 1:
            only = self.router.snapshot_node(from_snapshot)  # a snapshot lives where it was sealed
            if only is None:
                raise ControlError("insufficient_capacity", f"no node can take {what_new}: no node that answers "
                                   f"holds snapshot {from_snapshot}", 507)
        proxied = self.router.egress_nodes() if egress else None  # asked outside the lock
        warm = (self._warm_sandbox(account_id, size, proxied, img_row.key if img_row is not None else None)
                if not planned and from_snapshot is None and not cold and runtime == RUNTIME_CLASSES[0]
                else None)  # warm ones: the container class's (of the default image or the user image's own pool)
        with self._admitting(account_id), self.lifecycle.cond:
            what = f"a new {size.name} sandbox"
            self._plan_admit(account_id, size, "create", what, runtime=runtime)
            node = self._place(size, what, only=only, among=proxied)
            row = self._add_new_row(
                "provisioning", size, name, DEFAULT_TTL if ttl is None else ttl, dict(env or {}),
                no_snapshots=no_snapshots, auto_resume=auto_resume, from_snapshot=from_snapshot,
                labels=dict(labels or {}), account_id=account_id, node=node,
                sandbox_id=warm[1] if warm is not None and warm[0] == node else None, runtime=runtime,
                **image_fields,
            )
            self.volumes.record(row.id, planned)
            self.meter.record_start(account_id, row.id, "create")
        sandbox_id = row.id
        spec = self._spec(row, size)

        def work() -> None:
            self.node.create(spec, from_snapshot=from_snapshot, cold=cold)
            self.activity.touch(sandbox_id)
            self.lifecycle.transition(sandbox_id, "running")

        self._submit(sandbox_id, work, self._fail(sandbox_id))
        return row

    def _warm_sandbox(self, account_id: str, size: Size, among: set[str] | None,
                      image_key: str | None = None) -> tuple[str, str] | None:
        """``(node, id)`` of a warm sandbox of ``size`` reserved on the node a create would be placed on now
        (:mod:`sbx.node.memory.warmpool`), or None. Asked before the lifecycle lock is taken (a remote node answers over
        the network), so the plan's check and the placement here are a first look: the create checks both again
        under the lock and uses the id only when its placement picks the same node (a reserved one left unused is
        deleted by its node a minute later). A create the plan refuses takes none."""
        try:
            self._plan_admit(account_id, size, "create", f"a new {size.name} sandbox", count=False)
            node = self._place(size, f"a new {size.name} sandbox", among=among, count=False)
        except ControlError:
            return None  # the create itself will say why, after the plan's check
        sid = self.router.pool_take_on(node, size.name if image_key is None else f"{size.name}@{image_key}")
        return (node, sid) if sid is not None and ID_RE.match(sid) else None

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
        ``invalid_require_memory``/``invalid_ttl``, 403 ``plan_limit``, 404, 409 ``snapshots_disabled``/``busy``/
        ``invalid_state``/``memory_unavailable``, 507 ``insufficient_capacity`` (the sandbox stays as it was)."""
        size = self._size(type) if type is not None else None
        if ttl is not None and ttl < 0:
            raise ControlError("invalid_ttl", "ttl must be >= 0 seconds (0 = never stop)", 400)
        current = self.get(sandbox_id)
        if current.state not in TRANSIENT:
            try:
                self._resume_check(current, size, require_memory)
            except _Already as done:
                return done.row
        flags: dict[str, Any] = {}

        def check(row: SandboxRow) -> ControlError | None:  # runs under the lifecycle lock, before the change
            flags["resize"] = self._resume_check(row, size, require_memory)
            target = size or self._size(row.type)
            what = f"resuming {row.id} as {target.name}"
            self._plan_admit(row.account_id, target, "resume", what, row.id, runtime=row.runtime)
            # its own node, or another with room (sbx.control.sandboxes.moving); None: wait for a matching node
            flags["place"] = place = self._resume_place(row, target, flags["resize"], require_memory)
            if place is not None and place.moves:
                self.moving_to[row.id] = (place.node, target.memory_mib)
            self.meter.record_start(row.account_id, row.id, "resume")
            return None

        fields: dict[str, Any] = {"error_code": None, "error_message": None}
        if ttl is not None:
            fields["ttl"] = ttl
        try:
            with self._admitting(current.account_id):  # the check's admission and the state it writes
                before, _ = self.lifecycle.begin(sandbox_id, "resuming", check, wait, **fields)
        except _Already as done:
            return done.row
        except BaseException:
            self._unreserve(sandbox_id)
            raise
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
                place = flags["place"] or self._wait_memory_place(before, target)
                if place.moves:
                    try:
                        self._move(sandbox_id, before.node or self.router.default_name, place.node,
                                   replica=place.replica, archive=place.archive)
                    finally:  # moved: the row names the destination now; or not moved
                        self._unreserve(sandbox_id)
                flags["resuming"] = True
                result = self.node.resume(sandbox_id, spec, cold=resize, require_memory=require_memory)
            except NodeError as e:
                moving = e.code in MOVE_CODES and not flags.get("resuming")
                if e.code in NODE_CONFLICT_CODES or moving:  # refused before anything ran: still stopped
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
        memory: bool = False,
    ) -> SandboxRow:
        """Fork ``source_id`` (running or stopped) into a new sandbox: its disk copied copy-on-write, booted fresh
        at ``type`` (default the source's), owned by the source's account. ``memory``: the source must run; its
        processes and memory go along (the source pauses for the dump only) and the fork's ``memoryRestored`` is
        true. It goes to the source's node, or when that one is full or cordoned to another with room, copied
        there as a disk delta (:mod:`sbx.control.sandboxes.forking`; the row's ``node`` names it from the start).
        Returns the new row in ``forking``; the source is left as it is. Raises 400 ``invalid_type``/
        ``invalid_resize`` (smaller than the source)/``invalid_name``/``invalid_ttl``, 403 ``plan_limit``, 404, 409
        ``snapshots_disabled``/``busy``/``invalid_state``, 507 ``insufficient_capacity`` (no node may take it, with
        ``memory`` none whose fingerprint matches the source node's: nothing is created)."""
        source = self.get(source_id)
        if memory and (source.runtime or RUNTIME_CLASSES[0]) != RUNTIME_CLASSES[0]:
            raise ControlError("not_supported", f"sandbox {source_id} is of the {source.runtime} runtime class, which "
                               "can't fork with memory; fork without memory (its disk) instead", 409)
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
        states = {"running"} if memory else {"running", "stopped"}
        source = self.lifecycle.acquire_hold(source_id, states, wait, "fork it with memory" if memory else "fork it")
        try:
            with self._admitting(source.account_id), self.lifecycle.cond:
                what = f"a {size.name} fork of {source_id}"
                self._plan_admit(source.account_id, size, "fork", what, runtime=source.runtime)
                # the source's node (a reflink copy) unless it is full or cordoned (sbx.control.sandboxes.forking)
                home = source.node or self.router.default_name
                node = self._fork_place(size, what, home, memory).node
                row = self._add_new_row(
                    "forking", size, f"{source.name} (fork)" if name is None else name,
                    self.settings.fork_default_ttl if ttl is None else ttl,
                    dict(source.env if env is None else env), no_snapshots=False, source_id=source_id,
                    labels=dict(source.labels or {}), account_id=source.account_id, node=node,
                    image_id=source.image_id, image=source.image,  # a fork is of its source's image
                    runtime=source.runtime or RUNTIME_CLASSES[0],  # and of its class
                )
                self.meter.record_start(source.account_id, row.id, "fork")
            fork_id = row.id
            self.volumes.copy(source_id, fork_id)  # a fork mounts its source's volumes
        except BaseException:
            self.lifecycle.release_hold(source_id)
            raise
        spec = self._spec(row, size)
        if node != home:
            self._submit(fork_id, lambda: self._fork_elsewhere(fork_id, source_id, home, node, spec, memory),
                         self._fail(fork_id))
            return row

        def work() -> None:
            try:
                self.lifecycle.transition(fork_id, "provisioning")
                self.node.fork(source_id, spec, memory=memory)
            finally:
                self.lifecycle.release_hold(source_id)
            self.activity.touch(fork_id)
            if memory:
                self.lifecycle.transition(fork_id, "running", memory_restored=True)
            else:
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
            self.secrets.forget_sandbox(sandbox_id)
            for snap in self.store.list_snapshots(sandbox_id, auto=True):
                try:
                    self.node.delete_snapshot(snap.name)
                except NodeError as e:
                    log.warning("could not delete snapshot %s: %s", snap.name, e)
                self.store.delete_snapshot(snap.name, self.meter.snapshot_removed(snap.name))
            self.activity.forget(sandbox_id)
            self.sampler.forget(sandbox_id)
            self.lifecycle.transition(sandbox_id, "deleted")
            self.trimmer.request()

        self._submit(sandbox_id, work, self._fail(sandbox_id))
        return after



def _image_fields(plane: Any, img_row: Any, snap: Any) -> dict[str, Any]:
    """The ``image_id``/``image`` columns of a new sandbox: those of image row ``img_row``, or, for one made from
    snapshot row ``snap``, of the sandbox the snapshot was taken of (its disk is of that image); empty for sbx's
    default image."""
    if img_row is not None:
        return {"image_id": img_row.id, "image": plane.images.for_sandbox(img_row)}
    if snap is not None:
        source = plane.store.get_sandbox(snap.sandbox_id)
        if source is not None and source.image is not None:
            return {"image_id": source.image_id, "image": source.image}
    return {}
