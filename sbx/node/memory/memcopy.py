"""A sandbox started from another one's memory: :class:`MemoryCopyMixin`.

Two things start a new sandbox from a memory image that was not its own: a memory template
(:mod:`sbx.node.memory.templates`) and a fork with memory (:meth:`MemoryCopyMixin.fork_memory`). Both restore into a new
record (its own network lease, uid range and id, phase ``creating`` until it runs, so a crash leaves nothing a
reconcile would keep) from the sandbox's own reflinked copy of the image, and give it its own identity:

- before the restore: the disk is a reflink copy with a new ext4 UUID; hostname, ``/etc/hosts``, machine-id and
  ``/etc/sbx/identity`` are written into it; the image is retargeted (:func:`sbx.runtime.criuimages.retarget`:
  the user namespace's maps move to the new uid range, the UTS namespace gets the new hostname); the prestart hook
  wires the fresh network namespace with the new IPv4 address and MAC (CRIU dumps with ``--empty-ns network``);
- after the restore: the guest's ``sbx-identity.service`` runs again (new SSH host keys, since ``/etc/sbx/identity``
  changed) and sshd restarts with them (it held the old keys in memory), in the background.

The clock needs nothing: CRIU restores no time namespace, so the sandbox reads the host's clocks.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sbx.config import Size
from sbx.node.agentbase import NodeBase
from sbx.node.container import cgroup, recovery
from sbx.node.memory.stopresume import SETTLE_SECONDS, settling
from sbx.node.steps import Beside, Steps
from sbx.node.types import NodeError, SandboxSpec
from sbx.runtime import criu, criuimages
from sbx.runtime.base import RuntimeError_
from sbx.runtime.runc import remove_tree
from sbx.storage import disk as disks
from sbx.storage.errors import StorageError

log = logging.getLogger("sbx.node")

TEST_HOLD_IDENTITY_ENV = "SBX_TEST_HOLD_IDENTITY"
"""Test-only: seconds the identity thread of a sandbox restored from a template (:meth:`MemoryCopyMixin.
_restart_identity`) waits before it runs, with ``<sandbox dir>/identity-hold`` present meanwhile, so a fault test
can kill the node process before the sandbox has its SSH host keys. Unset (the default) in production."""
RESTART_IDENTITY = ("systemctl", "--no-block", "restart", "sbx-identity.service", "ssh.service")
"""New SSH host keys (``sbx-identity``) and sshd restarted with them, queued without waiting for either."""
IDENTITY_SETTLED = ("systemctl", "start", "sbx-identity.service", "ssh.service")
"""Wait until the restarts of :data:`RESTART_IDENTITY` ended: a start job merges into a unit's queued or running
restart job and ``systemctl`` waits for it; with none left it returns at once (both units active). No polling
process runs in the sandbox meanwhile."""


def copy_image(src: Path, dst: Path, gid: int) -> None:
    """Copy the memory image folder ``src`` to ``dst`` (reflinked file by file on the XFS volume: constant time)
    and make ``dst`` group-owned by the sandbox's shifted ``gid``, mode 0750 (restored tasks open it as that gid).
    Raises ``NodeError("restore_failed")``."""
    remove_tree(dst)
    p = subprocess.run(["cp", "-a", "--reflink=auto", str(src), str(dst)], capture_output=True, text=True)
    if p.returncode != 0:
        remove_tree(dst)
        raise NodeError("restore_failed", f"copying the memory image: {p.stderr.strip()}")
    os.chown(dst, 0, gid)
    dst.chmod(0o750 if gid else 0o700)


class MemoryCopyMixin(NodeBase):
    """Restore another sandbox's memory under a new identity (part of :class:`sbx.node.agent.LocalNode`)."""

    def _prepare_restore(self, sid: str, size: Size) -> Path:
        """What a restore of sandbox ``sid`` (record in phase ``creating``, disk in place) needs that does not
        depend on its memory image: the disk mounted, the identity files written into it (module docstring), the
        shutdown hook and the OCI bundle. Returns the bundle. A fork with memory runs this while the source is
        still being dumped (:meth:`fork_memory`). Raises ``NodeError`` (``boot_failed``...), ``RuntimeError_``."""
        rec = self._record(sid)
        self._mount(sid)
        self._write_identity(sid, rec["spec"]["hostname"], fresh=True)
        self._write_shutdown_hook(sid)
        return self._write_bundle(sid, rec, size)

    def _restore_as_new(self, sid: str, size: Size, *, old_base: int, clear_tmp: bool, identity: bool = True,
                        bundle: Path | None = None, holds_sshd: bool = True) -> None:
        """Restore the image already copied to the sandbox's memory folder (dumped at uid base ``old_base``) into
        the sandbox ``sid`` (record in phase ``creating``, disk in place) with its own identity (module
        docstring); ``clear_tmp`` empties ``/tmp`` afterwards but for what systemd made there at boot
        (``systemd-private-*``, ``.X11-unix``...; a cold boot has them too); ``identity`` false skips the new SSH
        host keys (a warm sandbox gets them when it is claimed: :mod:`sbx.node.memory.warmpool`); ``bundle``: what
        :meth:`_prepare_restore` returned when it already ran (else it runs here); ``holds_sshd``: as for
        :meth:`_after_restore`. On success the phase is ``running``.
        Raises ``NodeError("restore_failed")`` with the container removed, the disk unmounted and the image gone."""
        rec = self._record(sid)
        hostname = rec["spec"]["hostname"]
        st = Steps("restore-as-new", sid)
        try:
            if bundle is None:
                bundle = self._prepare_restore(sid, size)
                st.mark("mount+identity+bundle")
            criuimages.retarget(self._memory(sid), old_base=old_base, new_base=self._uid_base(sid), hostname=hostname)
            criuimages.drop_time_namespace(self._memory(sid))
            st.mark("retarget")
            self.runtime.restore(sid, bundle, self._memory(sid), self._dir(sid) / "criu-work")
            st.mark("criu-restore")
            self._mark_started(sid)
            self._attach_volumes(sid)
            self._discard_memory(sid)
            st.mark("discard")
            self._after_restore(sid, clear_tmp, identity, holds_sshd=holds_sshd)
            st.mark("after-restore")
        except (RuntimeError_, NodeError) as e:
            self._cleanup_container(sid)
            self._umount(sid)
            self._discard_memory(sid)
            raise NodeError("restore_failed", e.detail if isinstance(e, RuntimeError_) else e.message) from e
        self._set_phase(sid, "running", size=size.name, systemState="running")
        st.mark("phase")
        st.done()

    def _after_restore(self, sid: str, clear_tmp: bool, identity: bool = True, holds_sshd: bool = True) -> None:
        """In the restored sandbox: ``/tmp`` emptied when ``clear_tmp`` (but for what systemd made there at boot:
        the PrivateTmp folders of running services are bound from there); then, with ``identity``,
        ``sbx-identity.service`` and ``ssh.service`` restarted without waiting (``--no-block``): new SSH host keys
        (``ssh-keygen -A`` takes ~0.4 s here, mostly RSA) and sshd running with them a moment after the sandbox
        answers. ``holds_sshd``: the restored memory holds a running sshd with another sandbox's host keys (a
        fork's, from its source): the restart is queued before this returns, so neither the operation's answer nor a
        crash right after it leaves a running sandbox whose sshd serves another sandbox's key. A template holds no host
        keys and no running sshd (:mod:`sbx.node.memory.templates`): with ``holds_sshd`` false the restart is asked for
        by a thread of its own (:meth:`_restart_identity`) and the answer does not wait for systemctl (~25 ms here).
        Either way that thread then waits, under the sandbox's lock, until the restarts ended. Commands go through the
        sandbox's exec agent (restored with its memory, listening at once: ~5 ms) or, when it does not answer, ``runc
        exec`` (~35 ms here). Raises ``RuntimeError_``."""
        clear = (r"find /tmp -mindepth 1 -maxdepth 1 ! -name 'systemd-private-*' ! -name '.*-unix' "
                 r"-exec rm -rf {} +")
        if identity and holds_sshd:
            script = f"{clear}; {' '.join(RESTART_IDENTITY)}" if clear_tmp else " ".join(RESTART_IDENTITY)
            self._run_root(sid, ["/bin/sh", "-c", script], timeout=60)
        elif clear_tmp:
            self._run_root(sid, ["/bin/sh", "-c", clear], timeout=60)
        if identity:
            rec = self._record(sid)
            rec["identityPending"] = True  # until the thread has run: a node restarted before it runs it then
            self._save(sid, rec)
            threading.Thread(target=self._restart_identity, args=(sid, holds_sshd), name=f"identity-{sid}",
                             daemon=True).start()

    def _restart_identity(self, sid: str, queued: bool = False) -> None:
        """The rest of :meth:`_after_restore`'s identity work, under the sandbox's lock, so it runs once the
        operation that restored it has returned (it holds the lock): the restarts of ``sbx-identity`` and ``ssh``
        (a sandbox from a template), or, when they were ``queued`` already (a fork), the wait for them to end.
        A fork, stop or migration that comes next waits for the lock, so none dumps the sandbox while
        ``ssh-keygen`` runs (a fork's copy would carry the job half done and its random state). Nothing when the
        sandbox no longer runs by then. The record's ``identityPending`` stays set until they ended: a node process
        killed before that finishes them when it reconciles (:meth:`_finish_identity`); a failure is logged (the
        sandbox then has no sshd until its next boot or reconcile)."""
        recovery.test_hold(TEST_HOLD_IDENTITY_ENV, self._dir(sid) / "identity-hold")
        with self._lock(sid):
            if self._is_running(sid):
                self._finish_identity(sid, queued)

    def _finish_identity(self, sid: str, queued: bool = False) -> None:
        """Restart ``sbx-identity`` and ``ssh`` in the running sandbox ``sid`` (lock held) and wait for both to
        end (``queued``: they were asked for already; only the wait, :data:`IDENTITY_SETTLED`), then clear the
        record's ``identityPending``; a failure is logged and leaves it set."""
        try:
            if not queued:
                self._run_root(sid, list(RESTART_IDENTITY), timeout=60)
            self._run_root(sid, list(IDENTITY_SETTLED), timeout=70)
        except RuntimeError_ as e:
            log.warning("%s: restarting sbx-identity and ssh after its restore failed: %s", sid, e.detail)
            return
        rec = self._record(sid)
        if rec.pop("identityPending", None):
            self._save(sid, rec)

    def fork_memory(self, source_id: str, spec: SandboxSpec) -> None:
        """Fork the running sandbox ``source_id`` with its memory: :meth:`_copy_running` (the source pauses for a
        ``--leave-running`` dump, its disk copied beside it, then goes on with the same PIDs), then ``spec`` is
        restored from that dump on the copy, with its own identity (module docstring). Disk and memory are of the
        same instant, since no task of the source runs between the two. What the restore needs besides the image
        (the copy mounted, its identity, the bundle: :meth:`_prepare_restore`) is made while CRIU still dumps.

        A dump that fails for a passing reason (:data:`sbx.node.memory.stopresume.SETTLING_DUMP_ERRORS`, e.g. a unix
        connection in the source not accepted yet) is made again, copy and all, after the source ran
        :data:`~sbx.node.memory.stopresume.SETTLE_SECONDS`.

        Raises ``NodeError``: ``not_found``, ``not_running`` (the source is not running), ``fork_failed`` (the copy
        or the dump failed; the source runs on), ``restore_failed``."""
        self._record(source_id)
        st = Steps("fork-memory", spec.id)
        with self._lock(spec.id):
            self._new_record(spec, forkedFrom=source_id, startedFrom="memory")
            st.mark("record")
            bundle: list[Path] = []
            for wait in (*SETTLE_SECONDS, None):
                try:
                    old_base = self._copy_running(
                        source_id, spec, st, then=lambda: bundle.append(self._prepare_restore(spec.id, spec.size)))
                    break
                except BaseException as e:
                    self._umount(spec.id)
                    if not (wait is not None and isinstance(e, NodeError) and e.code == "fork_failed"
                            and settling(e.message)):
                        raise
                # a dump that failed for a passing reason (as a stop's may): the source runs a moment, then the
                # disk is copied and dumped again from scratch
                log.info("fork of %s: the dump failed for a passing reason; letting the source run %.1f s",
                         source_id, wait)
                self._disk(spec.id).unlink(missing_ok=True)
                time.sleep(wait)
            self._restore_as_new(spec.id, spec.size, old_base=old_base, clear_tmp=False, bundle=bundle[-1])
            st.mark("restore-as-new")
            st.done()

    def _copy_running(self, source_id: str, spec: SandboxSpec, st: Steps,
                      then: Callable[[], object] | None = None) -> int:
        """Into the new record of ``spec`` (its lock held): the running source's disk (:meth:`_copy_frozen_disk`)
        and memory (``checkpoint --leave-running``, image group-owned by the fork's uid base), both taken while the
        source is paused (cgroup freezer; CRIU leaves a cgroup it found frozen frozen, and it is thawed here after
        the dump) so they are of the same instant. The disk is copied in a thread beside CRIU's dump, which then
        gives the copy its new ext4 UUID, grows it to ``spec.size`` and calls ``then()`` (all on the copy only).
        Returns the source's uid base (the image's ids are still in its range). Raises ``NodeError``:
        ``not_found``, ``not_running``, ``fork_failed`` (the source runs on), ``restore_failed`` (``then``
        failed)."""
        mem = self._memory(spec.id)
        with self._lock(source_id):
            self._require_running(source_id)
            old_base = self._uid_base(source_id)
            self._detach_volumes(source_id)  # CRIU must not see them (sbx.storage.juicefs); mounted again below
            # CRIU can't dump a connection to the host: shut the exec channel's ones first (sbx.node.exec.attached)
            self._quiesce_channel(source_id)
            # the freezer written directly (~1 ms; sbx.node.container.cgroup.freeze, as a stop does) rather than through
            # `runc pause`/`runc resume` (a runc process each, 5-40 ms here); runc's own pause when that fails
            by_runc = not cgroup.freeze(self._cgroup_path(source_id))
            if by_runc:
                try:
                    self.runtime.pause(source_id)
                except RuntimeError_ as e:
                    self._channel_resume(source_id)
                    raise NodeError("fork_failed", e.detail) from e
            st.mark("quiesce+pause")
            beside: Beside | None = None
            try:
                beside = Beside(lambda: self._copy_frozen_disk(source_id, spec, then))
                self.runtime.checkpoint(source_id, mem, self._dir(spec.id) / "criu-work",
                                        image_gid=self._uid_base(spec.id), leave_running=True)
                criuimages.mark_own_time_namespace(mem, self.runtime.init_pid(source_id))  # a resumed source
                st.mark("checkpoint")
            except (StorageError, RuntimeError_) as e:
                if beside is not None:
                    beside.join(quiet=True)
                self._discard_memory(spec.id)
                raise NodeError("fork_failed", e.detail if isinstance(e, RuntimeError_) else str(e)) from e
            finally:
                try:
                    if by_runc:
                        self.runtime.unpause(source_id)
                    else:
                        cgroup.thaw(self._cgroup_path(source_id))
                except RuntimeError_ as e:
                    log.error("%s stays paused after the fork's dump: %s", source_id, e.detail)
                self._channel_resume(source_id)
                try:
                    self._attach_volumes(source_id)
                except NodeError as e:
                    log.error("%s lost its volumes after the fork's dump: %s", source_id, e.message)
                st.mark("unpause")
        try:
            beside.join()
        except BaseException:
            self._discard_memory(spec.id)
            raise
        st.mark("wait-beside")
        st.add("disk+uuid+grow+prepare (beside the dump)", beside.seconds)
        return old_base

    def _copy_frozen_disk(self, source_id: str, spec: SandboxSpec, then: Callable[[], object] | None) -> None:
        """Beside the dump of :meth:`_copy_running`, with every task of the source frozen: the source's disk
        (:func:`sbx.storage.disk.clone_synced`; the ``tune2fs`` of :meth:`_finish_copy` replays the copy's journal,
        ~15 ms), then :meth:`_finish_copy`. Raises ``NodeError("fork_failed")``."""
        try:
            disks.clone_synced(self._disk(source_id), self._disk(spec.id))
        except StorageError as e:
            raise NodeError("fork_failed", f"copying the source's disk: {e}") from e
        self._finish_copy(spec, then)

    def _finish_copy(self, spec: SandboxSpec, then: Callable[[], object] | None) -> None:
        """The fork's disk copy gets a new ext4 UUID and is grown to ``spec.size`` (``fork_failed``), then
        ``then()`` runs (its errors become ``restore_failed``). Raises ``NodeError``."""
        try:
            disks.new_uuid(self._disk(spec.id))
            if spec.size.disk_mib > self._disk(spec.id).stat().st_size >> 20:
                disks.grow(self._disk(spec.id), spec.size.disk_mib)
        except StorageError as e:
            raise NodeError("fork_failed", f"preparing the fork's disk: {e}") from e
        if then is not None:
            try:
                then()
            except (RuntimeError_, NodeError) as e:
                raise NodeError("restore_failed", e.detail if isinstance(e, RuntimeError_) else e.message) from e

    def _seal_fork_memory(self, sid: str, old_base: int) -> None:
        """Make the dump :meth:`_copy_running` left in ``sid``'s memory folder the fork's own stopped memory image:
        retargeted to its uid range and hostname, without a time namespace, with the generation of its disk and
        this host's fingerprint, phase ``checkpointed`` (it restores like any stopped sandbox's, on this node or,
        moved, on another: :mod:`sbx.node.migration.transfer`). Raises ``NodeError("fork_failed")``."""
        mem = self._memory(sid)
        rec = self._record(sid)
        try:
            criuimages.retarget(mem, old_base=old_base, new_base=self._uid_base(sid), hostname=rec["spec"]["hostname"])
            criuimages.drop_time_namespace(mem)
        except RuntimeError_ as e:
            raise NodeError("fork_failed", f"retargeting the fork's memory image: {e.detail}") from e
        recovery.write_memory_generation(mem, int(rec.get("diskGen", 0)))
        criu.write_fingerprint(mem, criu.host_fingerprint(str(self.runtime.criu)))
        self._set_phase(sid, "checkpointed")
