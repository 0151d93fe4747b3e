"""Stop and resume: :class:`StopResumeMixin`.

A stop checkpoints the container with CRIU (memory kept) or halts it, then unmounts and seals the disk; a resume
restores the memory image when it is usable and matches this host, else cold boots from the disk. Crash safety
of both rests on the record's ``phase``, ``diskGen`` and ``haltBegun`` (:mod:`sbx.node.container.recovery`).
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

from sbx.config import Size
from sbx.node.agentbase import NodeBase
from sbx.node.container import cgroup, recovery
from sbx.node.steps import Steps
from sbx.node.types import NodeError, ResumeResult, SandboxSpec, StopResult
from sbx.runtime import criu
from sbx.runtime.base import RuntimeError_
from sbx.runtime.oci import STOP_SIGNAL
from sbx.runtime.runc import remove_tree
from sbx.storage import disk as disks
from sbx.storage.errors import StorageError

log = logging.getLogger("sbx.node")

SETTLING_DUMP_ERRORS = ("Control messages in queue, not supported", "Unseizable non-zombie",
                        "Non-empty write queue on an in-flight socket")
"""CRIU dump errors that a moment of running clears: a message with control data the receiver had not read yet
(criu/sk-queue.c); a task CRIU could not seize within its timeout because it sat in uninterruptible sleep
("state D", compel/src/lib/infect.c; seen in CI while the data volume was being trimmed); and a unix connection
its listener had not accepted yet that already wrote bytes, which CRIU has no way to read back (criu/sk-unix.c;
seen in CI right after ``systemd-run`` started a detached job)."""
SETTLE_SECONDS = (0.3, 1.0, 2.0)
"""How long the sandbox runs before each new dump attempt after such an error (seconds)."""


def settling(detail: str) -> bool:
    """Whether CRIU's error output ``detail`` is one of :data:`SETTLING_DUMP_ERRORS`."""
    return any(m in detail for m in SETTLING_DUMP_ERRORS)


class StopResumeMixin(NodeBase):
    """Stop, resume and memory restore (part of :class:`sbx.node.agent.LocalNode`)."""

    def stop(self, id: str, keep_memory: bool = True) -> StopResult:
        """Checkpoint (``keep_memory``) or halt the container, then unmount and seal the disk.

        Crash safety: the record gets phase ``stopping`` and a bumped ``diskGen`` (the generation this stop
        seals, which the memory image records; :mod:`sbx.node.container.recovery`) before CRIU starts, and ``haltBegun``
        before a halt starts, so reconcile never checkpoints a container that is half shut down."""
        st = Steps("stop", id)
        with self._lock(id):
            st.mark("lock")
            rec = self._record(id)
            state = "running" if self._is_running(id) else self.runtime.state(id)
            st.mark("state")
            if state is None:
                self._detach_volumes(id)
                self._umount(id)
                saved = rec["phase"] == "checkpointed" and self._memory_usable(id)
                self._set_phase(id, "checkpointed" if saved else "stopped")
                return StopResult(saved, None if saved or not keep_memory else "the sandbox was not running")
            rec["oomKills"] = rec.get("oomKills", 0) + cgroup.oom_kills(self._cgroup_path(id))
            st.mark("oom")
            # No CRIU log may be left from earlier: reconcile reads its presence as "CRIU touched this stop".
            remove_tree(self._dir(id) / "criu-work")
            st.mark("rm-work")
            rec["phase"] = "stopping"
            rec["stopKeepMemory"] = keep_memory
            rec["haltBegun"] = False
            rec["diskGen"] = int(rec.get("diskGen", 0)) + 1
            self._save(id, rec)
            st.mark("save")
            self._detach_volumes(id)  # CRIU must not see them: a resume mounts them again (sbx.storage.juicefs)
            recovery.test_hold(recovery.TEST_HOLD_STOP_ENV, self._dir(id) / "stop-hold")
            saved = False
            error: str | None = None
            if keep_memory:
                mem = self._memory(id)
                self._quiesce_channel(id)  # CRIU can't dump a connection to the host
                st.mark("quiesce")
                # frozen here in ~1 ms instead of by CRIU, which polls the freezer in 100 ms steps
                # (sbx.node.container.cgroup)
                # (not a gvisor sandbox: runsc saves it with its Sentry running, which pauses the guest itself)
                frozen = False if self.runtime.gvisor(id) else cgroup.freeze(self._cgroup_path(id))
                st.mark("freeze")
                try:
                    recovery.test_fail_checkpoint()
                    frozen = self._checkpoint_settled(id, mem, image_gid=self._uid_base(id), frozen=frozen)
                    st.mark("checkpoint")
                    recovery.write_memory_generation(mem, rec["diskGen"])
                    criu.write_fingerprint(mem, criu.host_fingerprint(str(self.runtime.criu)))
                    st.mark("fingerprint")
                    saved = True
                except RuntimeError_ as e:
                    if frozen:  # CRIU freezes again a cgroup it found frozen when its dump fails: thaw it to halt
                        cgroup.thaw(self._cgroup_path(id))
                    log.warning("checkpoint of %s failed, stopping without memory: %s", id, e.detail)
                    error = e.detail
                    self._discard_memory(id)
                    self._set_phase(id, "stopping", lastError=e.detail)
            if not saved:
                self._set_phase(id, "stopping", haltBegun=True)
                self._halt(id)
            self._cleanup_container(id)
            st.mark("cleanup")
            self._channel_resume(id)
            self._umount(id)
            st.mark("umount")
            self._seal(id)
            st.mark("seal")
            if saved:
                self._set_phase(id, "checkpointed", lastError=None)
            else:
                self._set_phase(id, "stopped")
            st.mark("phase")
            st.done()
            return StopResult(saved, error)

    def _begin_start(self, sid: str, boot: bool = False) -> None:
        """Mark that the disk moves on from its sealed state (a resume starts): bump ``diskGen``, so the memory
        image no longer matches and can never be restored again once this start has begun. ``boot``: a cold boot,
        which runs ``sbx-identity`` and ``ssh`` itself (no ``identityPending`` left to finish)."""
        rec = self._record(sid)
        rec["diskGen"] = int(rec.get("diskGen", 0)) + 1
        if boot:
            rec.pop("identityPending", None)  # a cold boot starts sbx-identity and ssh itself
        self._save(sid, rec)

    def _halt(self, sid: str, grace: float = 10.0) -> None:
        """Ask systemd to halt (SIGRTMIN+3), then SIGKILL after ``grace`` seconds."""
        self.runtime.kill(sid, STOP_SIGNAL)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.runtime.state(sid) == "running":
            time.sleep(0.1)
        self.runtime.kill(sid, signal.SIGKILL)

    def resume(self, id: str, spec: SandboxSpec, *, cold: bool = False, require_memory: bool = False) -> ResumeResult:
        with self._lock(id):
            rec = self._record(id)
            if self.runtime.state(id) == "running":
                return ResumeResult(memory_restored=False, reason="already_running")
            old_size = rec.get("size", spec.size.name)
            resized = old_size != spec.size.name
            rec["spec"] = self._spec_dict(spec)
            self._save(id, rec)
            mem = self._memory(id)
            recorded = criu.read_fingerprint(mem)
            reason: str | None = None
            error: str | None = None
            if cold or resized:
                reason = "resized" if resized else "cold"
            elif recorded is None:
                reason = "no_checkpoint"
            elif not self._memory_usable(id):
                reason = "stale_checkpoint"
                if require_memory:
                    self._discard_memory(id)
                    self._set_phase(id, "stopped")
            else:
                wait = self.settings.require_memory_wait if require_memory else 0.0
                diff = self._host_mismatch(mem, wait)
                if diff and require_memory:
                    raise NodeError(
                        "cpu_mismatch",
                        "the memory image was made on a host with a different "
                        f"{', '.join(diff)}; no matching host came up within {wait:.0f} s",
                    )
                if diff:
                    reason = "cpu_mismatch"
                else:
                    try:
                        self._restore(id, spec.size)
                        return ResumeResult(memory_restored=True)
                    except NodeError as e:
                        if require_memory:
                            raise
                        reason, error = "restore_failed", e.message
                        log.warning("restore of %s failed, cold booting: %s", id, e.message)
            if require_memory:  # nothing was restored: refuse rather than boot from disk
                raise NodeError("no_checkpoint", f"memory can't be restored ({reason}); the sandbox stays stopped")
            self._begin_start(id, boot=True)
            if resized or cold:
                try:
                    disks.grow(self._disk(id), spec.size.disk_mib)
                except StorageError as e:
                    raise NodeError(e.code, str(e)) from e
            self._boot(id, spec.size, fresh_identity=False)
            if error:
                self._set_phase(id, "running", lastError=error)
            return ResumeResult(memory_restored=False, reason=reason, error=error)

    def _checkpoint_settled(self, id: str, mem: Path, *, image_gid: int, frozen: bool) -> bool:
        """Checkpoint sandbox ``id`` into ``mem`` (work files in its ``criu-work``, images readable by
        ``image_gid``); ``frozen`` says whether we froze its cgroup first. A dump that failed only for a passing reason
        (:data:`SETTLING_DUMP_ERRORS`: a unix socket holding a message with control data CRIU can't save, e.g. a
        systemd notification not read yet when the freezer stopped the guest, typical right after a boot; a task in
        uninterruptible sleep CRIU could not seize; a connection not accepted yet that already wrote) is tried again
        after the sandbox ran :data:`SETTLE_SECONDS`, at most ``len(SETTLE_SECONDS)`` more times, frozen again before
        each try when it was frozen at first. Returns whether the cgroup is frozen by us; raises the last
        :class:`RuntimeError_`."""
        path = self._cgroup_path(id)
        for wait in (*SETTLE_SECONDS, None):
            try:
                self.runtime.checkpoint(id, mem, self._dir(id) / "criu-work", image_gid=image_gid)
                return frozen
            except RuntimeError_ as e:
                if wait is None or not settling(e.detail):
                    raise
                log.info("checkpoint of %s failed for a passing reason; letting it run %.1f s: %s", id, wait,
                         e.detail.strip().rsplit("\n", 1)[-1])
                cgroup.thaw(path)  # CRIU freezes again a cgroup it found frozen when its dump fails
                time.sleep(wait)
                if frozen:
                    frozen = cgroup.freeze(path)
        raise AssertionError("unreachable")

    def _host_mismatch(self, mem: Path, wait: float) -> list[str]:
        """What differs between the host the memory image in ``mem`` was made on and this one (``cpuModel``,
        ``cpuFlagsSha256``, ``kernel``, ``criu``; see :mod:`sbx.runtime.criu`); empty when they match. With ``wait``
        > 0, checks again every 2 s for up to ``wait`` seconds until they match."""
        deadline = time.monotonic() + wait
        while True:
            recorded = criu.read_fingerprint(mem) or {}
            diff = criu.fingerprint_mismatch(recorded, criu.host_fingerprint(str(self.runtime.criu)))
            left = deadline - time.monotonic()
            if not diff or left <= 0:
                return diff
            time.sleep(min(2.0, left))

    def _restore(self, sid: str, size: Size) -> None:
        st = Steps("restore", sid)
        self._begin_start(sid)  # from here on the image is stale: an interrupted restore never repeats
        st.mark("begin")
        rec = self._record(sid)
        self._cleanup_container(sid)
        st.mark("cleanup")
        self._mount(sid)
        st.mark("mount")
        fresh = bool(rec.get("freshIdentity"))  # a fork with memory made to move (SnapshotMixin.fork_stopped)
        if fresh:
            self._write_identity(sid, rec["spec"]["hostname"], fresh=True)
            self._write_shutdown_hook(sid)
            st.mark("identity")
        bundle = self._write_bundle(sid, rec, size)
        st.mark("bundle")
        self._set_phase(sid, "restoring")
        st.mark("phase")
        try:
            self.runtime.restore(sid, bundle, self._memory(sid), self._dir(sid) / "criu-work")
        except RuntimeError_ as e:
            self._cleanup_container(sid)
            self._set_phase(sid, "checkpointed")
            raise NodeError("restore_failed", e.detail) from e
        st.mark("criu-restore")
        self._mark_started(sid)
        recovery.test_hold(recovery.TEST_HOLD_RESTORE_ENV, self._dir(sid) / "restore-hold")
        self._discard_memory(sid)
        st.mark("discard")
        self._attach_volumes(sid)  # in the restored user namespace (sbx.storage.juicefs: why not kept by CRIU)
        self._set_phase(sid, "running", size=size.name)
        st.mark("phase2")
        if not fresh and rec.get("identityPending"):  # stopped from a template before its new SSH keys and sshd
            self._after_restore(sid, clear_tmp=False, holds_sshd=False)
        if fresh:
            self._identity_written(sid)
            try:  # new SSH host keys, sshd restarted with them (as after a fork with memory)
                self._after_restore(sid, clear_tmp=False)
            except RuntimeError_ as e:
                self._cleanup_container(sid)
                self._umount(sid)
                self._set_phase(sid, "stopped")
                raise NodeError("restore_failed", f"giving the restored fork its identity: {e.detail}") from e
            st.mark("after-restore")
        st.done()

