"""Memory templates: :class:`TemplateMixin` (issue 13).

A template is a booted, untouched base sandbox of one size, checkpointed once: ``<node_dir>/templates/<recipe
hash>-<size>/`` holds its disk (``disk.ext4``), its memory image (``memory/``) and ``template.json`` (the uid base
and hostname it was dumped with, the host fingerprint), written last. ``sbx new`` (no ``--from``, no ``--cold``)
restores the template of its size into a reflinked copy of the template's disk and gives it its own identity
(:mod:`sbx.node.memory.memcopy`); it cold boots when there is no complete template for this image, size and host, or
when the restore fails.

When they are built: lazily, in one background thread, after the first cold boot of a size (that first ``new``
pays the cold boot; the template is ready a few seconds later). Nothing is built at server start, so a size nobody
uses costs nothing. ``Settings.templates`` false (``SBX_TEMPLATES=0``) turns the whole mechanism off.

What a template holds: only the pristine base image, booted with the hostname ``sbx-template`` and no environment,
never a user's command; its uid range, lease and folder are given back once it is dumped. Every sandbox made from
it gets its own copy of disk and memory, so nothing one sandbox does reaches the template or another sandbox.
Its SSH host keys are replaced in each sandbox (sbx-identity), never reused.

Crash safety: the build runs as a hidden sandbox ``sb_tpl<hash>`` (so the uid range, lease and veth machinery are
the ordinary ones) and assembles the template in ``<key>.tmp``, renamed to ``<key>`` only when ``template.json``
is in it. A server killed mid-build leaves the hidden sandbox (unknown to the control plane: reconcile removes it
like any unknown folder) and maybe the ``.tmp`` folder (:meth:`TemplateMixin._reconcile_templates` removes it,
with templates of other recipes and folders without ``template.json``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from sbx.config import Size
from sbx.node.agentbase import NodeBase, now
from sbx.node.memory.memcopy import copy_image
from sbx.node.steps import Steps
from sbx.node.types import NodeError, SandboxSpec
from sbx.runtime import criu
from sbx.runtime.base import RuntimeError_
from sbx.runtime.runc import remove_tree
from sbx.storage import disk as disks
from sbx.storage.errors import StorageError

log = logging.getLogger("sbx.node")

TEMPLATE_HOSTNAME = "sbx-template"
BUILD_PREFIX = "sb_tpl"

TEST_HOLD_TEMPLATE_ENV = "SBX_TEST_HOLD_TEMPLATE"
"""Test-only: seconds a template build waits after the dump, with ``<templates>/<key>.tmp`` half assembled (the
disk moved in, no ``template.json``) and a marker ``<templates>/build-hold`` present, so a fault test can kill the
server mid-build every time. Unset in production."""


class TemplateMixin(NodeBase):
    """Build, use and repair memory templates (part of :class:`sbx.node.agent.LocalNode`)."""

    _template_builds: set[str]
    _template_guard: threading.Lock

    @property
    def templates_dir(self) -> Path:
        return self.settings.node_dir / "templates"

    def _template_key(self, size: Size, image: dict[str, Any] | None = None) -> str:
        """``<image key>-<size name>``: the default image's recipe hash, or a user image's key
        (:attr:`sbx.node.types.SandboxSpec.image`)."""
        return f"{self.image.stem if image is None else image['key']}-{size.name}"

    def template_ready(self, size: Size, image: dict[str, Any] | None = None) -> Path | None:
        """The folder of a complete template for ``size`` of ``image`` (None: the default image) on this host (CPU,
        kernel, CRIU), or None. Images booted by sbx's minimal init have none (their sandboxes always cold boot)."""
        if image is not None and image.get("init") != "systemd":
            return None
        d = self.templates_dir / self._template_key(size, image)
        try:
            meta = json.loads((d / "template.json").read_text())
        except (OSError, ValueError):
            return None
        if criu.fingerprint_mismatch(meta.get("host", {}), criu.host_fingerprint(str(self.runtime.criu))):
            return None
        return d

    def templates(self) -> list[dict[str, Any]]:
        """The complete templates on this node: ``[{"key", "size", "image", "createdAt"}]``."""
        out = []
        for meta_file in sorted(self.templates_dir.glob("*/template.json")):
            try:
                meta = json.loads(meta_file.read_text())
            except (OSError, ValueError):
                continue
            out.append({k: meta.get(k) for k in ("key", "size", "image", "createdAt")})
        return out

    def _want_template(self, size: Size, image: dict[str, Any] | None = None) -> None:
        """Start building the template of ``size`` of ``image`` (None: the default image) in a background thread
        unless templates are off, it exists, is being built, or the image has no systemd (minimal init)."""
        if not self.settings.templates or self.template_ready(size, image) is not None:
            return
        if image is not None and image.get("init") != "systemd":
            return
        key = self._template_key(size, image)
        with self._template_guard:
            if key in self._template_builds:
                return
            self._template_builds.add(key)

        def run() -> None:
            try:
                self.build_template(size, image)
                self._pool_fill_later(size, image)
            except Exception as e:  # a background build must never take the server down
                log.warning("template %s: build failed: %s", key, e)
            finally:
                with self._template_guard:
                    self._template_builds.discard(key)

        threading.Thread(target=run, name=f"template-{key}", daemon=True).start()

    def build_template(self, size: Size, image: dict[str, Any] | None = None) -> Path:
        """Build the template of ``size`` of ``image`` (None: the default image) now (see the module docstring)
        and return its folder; an existing complete one is returned as is. Raises ``NodeError`` (``boot_failed``,
        ``template_failed``, ``image_missing``); whatever was half made is removed again."""
        key = self._template_key(size, image)
        with self._lock(f"template-{key}"):  # one build of a template at a time; a second caller finds it made
            return self._build_template(size, key, image)

    def _build_template(self, size: Size, key: str, image: dict[str, Any] | None = None) -> Path:
        ready = self.template_ready(size, image)
        if ready is not None:
            return ready
        final = self.templates_dir / key
        staging = self.templates_dir / f"{key}.tmp"
        sid = BUILD_PREFIX + hashlib.sha256(key.encode()).hexdigest()[:8]
        self.templates_dir.mkdir(parents=True, exist_ok=True)
        self.templates_dir.chmod(0o700)  # root only: templates are sandbox disks and memory
        self.delete(sid)
        remove_tree(staging)
        remove_tree(final)
        try:
            spec = SandboxSpec(id=sid, hostname=TEMPLATE_HOSTNAME, size=size, image=image)
            with self._lock(sid):
                self._new_record(spec, template=key)
                try:
                    disks.create_disk(self._base_for(image), self._disk(sid), size.disk_mib)
                except StorageError as e:
                    raise NodeError("template_failed", f"disk: {e}") from e
                self._set_phase(sid, "stopped")
                self._boot(sid, size, fresh_identity=True)
                state = self._record(sid).get("systemState")
                if state != "running":
                    raise NodeError("template_failed", f"the base sandbox booted {state}, not running")
                base = self._uid_base(sid)
                # No SSH host keys and no sshd in a template: each sandbox makes its own keys after the restore.
                try:
                    self.runtime.run(sid, ["/bin/sh", "-c", "systemctl stop ssh.service; rm -f /etc/ssh/ssh_host_*"])
                except RuntimeError_ as e:
                    raise NodeError("template_failed", e.detail) from e
                try:
                    # right after a boot: a systemd message not read yet may fail the first dump (SETTLING_DUMP_ERRORS)
                    self._checkpoint_settled(sid, self._memory(sid), image_gid=0, frozen=False)
                except RuntimeError_ as e:
                    raise NodeError("template_failed", e.detail) from e
                self._set_phase(sid, "stopped")
                self._cleanup_container(sid)
                self._umount(sid)
                staging.mkdir(mode=0o700)
                os.replace(self._disk(sid), staging / "disk.ext4")
                copy_image(self._memory(sid), staging / "memory", 0)
                disks.test_hold(TEST_HOLD_TEMPLATE_ENV, self.templates_dir / "build-hold")
                meta = {"key": key, "size": size.name, "image": key.rsplit("-", 1)[0], "uidBase": base,
                        "hostname": TEMPLATE_HOSTNAME, "createdAt": now(),
                        "host": criu.host_fingerprint(str(self.runtime.criu))}
                tmp = staging / "template.json.tmp"
                with open(tmp, "w") as f:
                    f.write(json.dumps(meta, indent=1))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, staging / "template.json")
                os.replace(staging, final)
            log.info("template %s built", key)
            return final
        except BaseException:
            remove_tree(staging)
            raise
        finally:
            self.delete(sid)

    def _create_from_template(self, spec: SandboxSpec, identity: bool = True) -> bool:
        """Start the new sandbox ``spec`` (record in phase ``creating``, no disk yet) from its size's template
        (``identity`` false: without its SSH host keys, for a warm sandbox: :mod:`sbx.node.memory.warmpool`). Returns
        False (nothing left behind) when there is no template or its restore failed: cold boot then."""
        tdir = self.template_ready(spec.size, spec.image)
        if tdir is None:
            return False
        meta = json.loads((tdir / "template.json").read_text())
        st = Steps("from-template", spec.id)
        try:
            disks.clone_disk(tdir / "disk.ext4", self._disk(spec.id))
            st.mark("clone-disk")
            copy_image(tdir / "memory", self._memory(spec.id), self._uid_base(spec.id))
            st.mark("copy-image")
            self._restore_as_new(spec.id, spec.size, old_base=int(meta["uidBase"]), clear_tmp=True, identity=identity,
                                 holds_sshd=False)  # a template runs no sshd
        except (StorageError, NodeError) as e:
            log.warning("%s: starting from template %s failed, cold booting: %s", spec.id, tdir.name, e)
            self._discard_memory(spec.id)
            disks.remove_disk(self._disk(spec.id))
            return False
        self._set_phase(spec.id, "running", startedFrom="template")
        st.mark("restore-as-new")
        st.done()
        return True

    def _reconcile_templates(self) -> None:
        """Remove half-built templates (``*.tmp``, folders without ``template.json``, a leftover ``build-hold``)
        and templates of other image recipes. The hidden build sandboxes go with the unknown sandbox folders."""
        if not self.templates_dir.is_dir():
            return
        (self.templates_dir / "build-hold").unlink(missing_ok=True)
        current = self.image.stem
        for d in self.templates_dir.iterdir():
            if not d.is_dir():
                continue
            complete = (d / "template.json").is_file() and not d.name.endswith(".tmp")
            image_key = d.name.rsplit("-", 1)[0]
            known = image_key == current or (self.settings.images_dir / f"{image_key}.ext4").is_file()
            if not complete or not known:
                log.warning("template folder %s is incomplete or of another image: removing it", d.name)
                remove_tree(d)
