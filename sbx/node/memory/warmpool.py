"""Warm sandboxes: :class:`WarmPoolMixin` (issue 13).

A create from a memory template (:mod:`sbx.node.memory.templates`) spends ~0.4 s here restoring the template, most of it
in CRIU and runc. A warm sandbox is that restore done ahead of time: a sandbox already restored from its size's
template, with its own id, disk copy, uid range, network lease and cgroup, that nobody owns yet. The control plane
asks for one before it writes a new sandbox's row (:meth:`WarmPoolMixin.pool_take`) and uses its id; the node's
:meth:`sbx.node.lifecycle.containers.LifecycleMixin.create` for that id then only gives it its identity (the same as a
template's restore gives: hostname in the UTS namespace and the files, machine-id, ``/etc/sbx/identity`` and so new
SSH host keys) and it is running. Each claim starts making a new one in the background.

- How many: ``Settings.warm_pool`` per size (``SBX_WARM_POOL``, default 2; 0 turns warm sandboxes off), only for
  sizes whose template exists, so a size nobody used costs nothing. A user image (issue 32) has pools of its own,
  per size, keyed ``<size>@<image key>``: made once a sandbox of it was created from its template on this node
  (its facts come with that create), so an image nobody started since the node's start costs nothing. What one
  costs while it waits: the memory of an idle base system (its RSS; the size's limit is not reserved for it) and a
  reflinked disk copy.
- What it holds: the pristine template restored with the hostname ``sbx-pool`` and ``/tmp`` emptied; no user's
  command ever ran in it, and it is given to one create only (taken under a lock).
- Where it is known: only on its node, in memory and in its ``node.json`` (``"pooled": <size>``, phase
  ``pooled``). The control plane never sees it until a create names it, so it is not listed, metered or
  counted in placement. A taken one that no create claims within :data:`TAKE_SECONDS` is deleted.
- Crash safety: warm sandboxes are a cache. A reconcile (server or node start) deletes every one, and so does the
  server's shutdown; a node killed while making one leaves a folder the next reconcile removes like any unknown
  one.
"""

from __future__ import annotations

import logging
import secrets
import socket
import string
import threading
import time
from typing import Any

from sbx.config import Size
from sbx.node.agentbase import NodeBase
from sbx.node.network.nsjoin import CLONE_NEWUTS, in_namespace
from sbx.node.steps import Steps
from sbx.node.types import NodeError, SandboxSpec
from sbx.runtime.base import RuntimeError_

log = logging.getLogger("sbx.node")

POOL_HOSTNAME = "sbx-pool"
FILL_DELAY = 0.3
"""Seconds a fill waits after the take that started it: the create that took the warm sandbox answers its first
exec then (~50 ms), on the same CPUs. It was a second; creates in quick succession then found none."""
TAKE_SECONDS = 60.0
"""Seconds a taken warm sandbox waits for the create that names it; then it is deleted (the create went
elsewhere or failed before it reached the node)."""
_ALPHABET = string.ascii_lowercase + string.digits


def set_hostname(pid: int, hostname: str) -> None:
    """Set the hostname of the UTS namespace of host process ``pid`` (a sandbox's init), as ``nsenter --target
    PID --uts hostname NAME`` does, without its two processes (~10 ms here): sethostname(2) from a thread that
    joined the namespace (:func:`sbx.node.network.nsjoin.in_namespace`). Raises ``OSError``."""
    in_namespace(f"/proc/{pid}/ns/uts", CLONE_NEWUTS, lambda: socket.sethostname(hostname))


def pool_key(size: Size, image: dict[str, Any] | None) -> str:
    """The pool a warm sandbox belongs to: the size's name for the default image, ``<size>@<image key>`` for a user
    image (:attr:`sbx.node.types.SandboxSpec.image`)."""
    return size.name if image is None else f"{size.name}@{image['key']}"


def _new_id() -> str:
    """A sandbox id of the control plane's form (``sb_`` + 10 of ``[a-z0-9]``, :mod:`sbx.control.store.ids`)."""
    return "sb_" + "".join(secrets.choice(_ALPHABET) for _ in range(10))


class WarmPoolMixin(NodeBase):
    """Keep sandboxes restored from their templates ready for the next create (part of
    :class:`sbx.node.agent.LocalNode`; see the module docstring)."""

    def pool_take(self, size: str) -> str | None:
        """Reserve a warm sandbox of pool ``size`` (a size name, or ``<size>@<image key>``: :func:`pool_key`) for the
        create the caller is about to send, and return its id, or None when there is none (the create then
        restores the template or boots, as before). The id must be the new sandbox's: :meth:`create` with a spec
        of that id claims it."""
        size_name, _, image_key = size.partition("@")
        if size_name not in self.settings.sizes or (image_key and image_key not in self._pool_images):
            return None
        with self._pool_guard:
            ready, taken = self._pool_ready, self._pool_taken
            stale = [old for old, (_, at) in taken.items() if time.monotonic() - at > TAKE_SECONDS]
            for old in stale:
                taken.pop(old)
            ids = ready.get(size, [])
            sid = ids.pop(0) if ids else None
            if sid is not None:
                taken[sid] = (size, time.monotonic())
        for old in stale:
            log.info("%s: a warm sandbox taken %.0f s ago was never claimed: deleting it", old, TAKE_SECONDS)
            self.delete(old)
        if sid is not None:
            self._pool_fill_later(self.settings.sizes[size_name], self._pool_images.get(image_key))
        return sid

    def pool_counts(self) -> dict[str, int]:
        """``{pool key: warm sandboxes ready}`` on this node (a size name, or ``<size>@<image key>``)."""
        with self._pool_guard:
            return {k: len(v) for k, v in self._pool_ready.items() if v}

    def _pool_claim(self, spec: SandboxSpec, use: bool) -> bool:
        """Called by ``create`` with ``spec.id``'s lock held. When ``spec.id`` is a taken warm sandbox and ``use``:
        give it ``spec``'s identity (module docstring) and return True with it running (``startedFrom:
        "pool"``). A warm sandbox that can't be used (``use`` false, another size, dead, or the identity failed)
        is deleted and False returned, as for any id that is not a warm sandbox: the create goes on as before."""
        with self._pool_guard:
            entry = self._pool_taken.pop(spec.id, None)
        if entry is None:
            return False
        st = Steps("from-pool", spec.id)
        try:
            if not use or entry[0] != pool_key(spec.size, spec.image) or not self._is_running(spec.id):
                raise NodeError("restore_failed", "the warm sandbox is not usable for this create")
            rec = self._record(spec.id)
            rec["spec"] = self._spec_dict(spec)
            rec.pop("pooled", None)
            rec["phase"] = "creating"
            self._save(spec.id, rec)
            self._write_identity(spec.id, spec.hostname, fresh=True)
            st.mark("identity")
            pid = self.runtime.init_pid(spec.id)
            if pid is None:
                raise NodeError("restore_failed", "the warm sandbox's init is gone")
            try:
                set_hostname(pid, spec.hostname)
            except OSError as e:
                raise NodeError("restore_failed", f"setting the hostname: {e}") from e
            st.mark("hostname")
            self._apply_egress(spec.id, rec)
            self._after_restore(spec.id, clear_tmp=False, holds_sshd=False)  # restored from a template: no sshd
            st.mark("after-restore")
        except (NodeError, RuntimeError_, OSError) as e:
            log.warning("%s: the warm sandbox could not be used, deleting it: %s", spec.id, e)
            self.delete(spec.id)
            return False
        self._set_phase(spec.id, "running", startedFrom="pool")
        st.done()
        return True

    def _pool_fill_later(self, size: Size, image: dict[str, Any] | None = None) -> None:
        """Make warm sandboxes of ``size`` of ``image`` (its facts; None: the default image) in a background thread
        until ``Settings.warm_pool`` are ready (one thread per pool at a time; nothing when warm sandboxes or
        templates are off, the template is not built, or the server is shutting down). The thread waits
        :data:`FILL_DELAY` first."""
        want = self.settings.warm_pool if self.settings.templates else 0
        if want <= 0 or self._shutdown_at is not None:
            return
        key = pool_key(size, image)
        with self._pool_guard:
            if key in self._pool_filling:
                return
            self._pool_filling.add(key)
            if image is not None:
                self._pool_images[image["key"]] = image

        def run() -> None:
            try:
                time.sleep(FILL_DELAY)
                while self._shutdown_at is None and self.template_ready(size, image) is not None:
                    with self._pool_guard:
                        if len(self._pool_ready.get(key, [])) >= want:
                            return
                    if not self._pool_make(size, image):
                        return
            except Exception as e:  # a background fill must never take the server down
                log.warning("warm sandboxes of %s: %s", key, e)
            finally:
                with self._pool_guard:
                    self._pool_filling.discard(key)

        threading.Thread(target=run, name=f"warm-pool-{key[:24]}", daemon=True).start()

    def _pool_make(self, size: Size, image: dict[str, Any] | None = None) -> bool:
        """Restore one warm sandbox of ``size`` of ``image`` from its template and offer it. Returns False (nothing
        left behind) when the restore failed or the server began to shut down meanwhile."""
        sid = _new_id()
        key = pool_key(size, image)
        spec = SandboxSpec(id=sid, hostname=POOL_HOSTNAME, size=size, image=image)
        with self._lock(sid):
            self._new_record(spec, pooled=key)
            if not self._create_from_template(spec, identity=False):
                self.delete(sid)
                return False
            self._set_phase(sid, "pooled", startedFrom="pool")
        with self._pool_guard:
            if self._shutdown_at is None:
                self._pool_ready.setdefault(key, []).append(sid)
                return True
        self.delete(sid)
        return False

    def _pool_forget(self) -> None:
        """Delete every warm sandbox this process knows (ready or taken) and forget them: at reconcile and at
        shutdown. Those a previous process left are unknown folders to the reconcile, which removes them."""
        with self._pool_guard:
            ids = [sid for ids in self._pool_ready.values() for sid in ids] + list(self._pool_taken)
            self._pool_ready.clear()
            self._pool_taken.clear()
        for sid in ids:
            try:
                self.delete(sid)
            except NodeError as e:
                log.warning("%s: deleting a warm sandbox: %s", sid, e)
