"""A sandbox's life from disk to running container and back to nothing: :class:`LifecycleMixin`.

Create (disk from the base image or a snapshot), the OCI bundle (``config.json``, lease, CRIU config), the
identity files written into the disk, the cold boot (runc + waiting for systemd), delete, the sandbox's address,
and :meth:`LifecycleMixin.mounted_root` for tests and tools. Stop and resume are in :mod:`sbx.node.memory.stopresume`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sbx.config import Size
from sbx.guest import minimal
from sbx.node.agentbase import NodeBase
from sbx.node.container import guestfs, lxcfs, rootfs
from sbx.node.lifecycle import gvisor
from sbx.node.lifecycle.gvisor import GVISOR
from sbx.node.network import bridge as network
from sbx.node.network import resolver
from sbx.node.types import NodeError, SandboxSpec
from sbx.runtime import oci
from sbx.runtime.base import RuntimeError_
from sbx.runtime.oci import ContainerSpec, build_config
from sbx.runtime.runc import CRIU_CONFIG
from sbx.storage import disk as disks
from sbx.storage.errors import StorageError

READY_TIMEOUT = 90.0
log = logging.getLogger("sbx.node")


class LifecycleMixin(NodeBase):
    """Create, boot, delete (part of :class:`sbx.node.agent.LocalNode`)."""

    def create(self, spec: SandboxSpec, from_snapshot: str | None = None, cold: bool = False) -> str:
        """See :meth:`sbx.node.types.NodeAgent.create`. Without ``from_snapshot`` and ``cold``, a warm sandbox
        taken for ``spec.id`` (:meth:`sbx.node.memory.warmpool.WarmPoolMixin.pool_take`) becomes the sandbox, else the
        size's memory template is restored when one is ready (:mod:`sbx.node.memory.templates`); a cold boot asks for
        the template to be built. Returns how it started: ``"pool"``, ``"template"`` or ``"boot"``."""
        gvisor = spec.runtime == GVISOR  # booted by runsc: no runc memory template or warm sandbox fits it
        if gvisor and not self.runtime.runsc.available():
            raise NodeError("runtime_unavailable", f"the gvisor runtime class needs runsc at {self.runtime.runsc.runsc}"
                            " on this node: run `sbx setup`")
        with self._lock(spec.id):
            base = self._base_for(spec.image) if from_snapshot is None else self._snapshot_path(from_snapshot)
            if not base.is_file():
                raise NodeError("not_found", f"snapshot {from_snapshot!r} does not exist")
            use_template = from_snapshot is None and not cold and self.settings.templates and not gvisor
            if self._pool_claim(spec, use=use_template):
                self._write_env(spec)
                return "pool"
            self._new_record(spec)
            if use_template and self._create_from_template(spec):
                self._write_env(spec)
                self._pool_fill_later(spec.size, spec.image)
                return "template"
            try:
                disks.create_disk(base, self._disk(spec.id), spec.size.disk_mib)
            except StorageError as e:
                raise NodeError("boot_failed", f"disk: {e}") from e
            self._set_phase(spec.id, "stopped", startedFrom="boot")
            self._boot(spec.id, spec.size, fresh_identity=True)
            self._write_env(spec)
        if from_snapshot is None and not gvisor:
            self._want_template(spec.size, spec.image)
        return "boot"

    def _write_env(self, spec: SandboxSpec) -> None:
        """The sandbox's environment (``spec.env``, the variables sbx adds to each of its commands) as a JSON object
        in its ``/etc/sbx/env.json``, for programs that sbx does not start (the code-interpreter image's server
        reads it); written at every create, warm sandbox, memory template and boot alike. A failure is logged: the
        sandbox's commands get the variables anyway."""
        try:
            guestfs.write_file(self._hostroot(spec.id), "etc/sbx/env.json", json.dumps(spec.env).encode())
        except (OSError, guestfs.UnsafePath) as e:
            log.warning("could not write /etc/sbx/env.json into %s: %s", spec.id, e)

    def _write_bundle(self, sid: str, rec: dict[str, Any], size: Size) -> Path:
        bundle = self._bundle(sid)
        bundle.mkdir(parents=True, exist_ok=True)
        for folder in (bundle, self._dir(sid)):  # again on every boot: a crash may have come before the first
            rootfs.make_private(folder, rec.get("uidBase", 0))
        lxcfs_dir = lxcfs.ensure_lxcfs()  # a probe when it lives; restarts it when its daemon died
        self._rootfs(sid).mkdir(parents=True, exist_ok=True)
        (bundle / "lease.json").write_text(json.dumps(rec["lease"]))
        # pinned here, for boot and restore alike, before the prestart hook plugs the port into the bridge
        network.pin_sandbox(network.lease_from_json(json.dumps(rec["lease"])), self.settings.bridge,
                            self.settings.node_name)
        self._apply_egress(sid, rec)
        self._install_ca(self._hostroot(sid))  # every start: a sandbox that moved here trusts this node's proxy
        cpus = min(size.vcpus, os.cpu_count() or 1)
        cspec = ContainerSpec(
            hostname=rec["spec"]["hostname"],
            memory_bytes=size.memory_mib * 1024 * 1024,
            vcpus=size.vcpus,
            cpuset_cpus=f"0-{cpus - 1}" if cpus > 1 else "0",
            cgroup_path=self._cgroup_path(sid),
            pids_limit=size.pids_limit,
            cpu_shares=size.cpu_shares,
            lxcfs_dir=str(lxcfs_dir) if lxcfs_dir else None,
            uid_base=rec.get("uidBase", 0),
            mask_dir=str(_mask_dir(self.run_dir)),
            init_args=list(minimal.MINIMAL_INIT_ARGS) if _minimal(self._image_of(rec)) else None,
            # a stdlib-only client: the node's hook server does the work (sbx.node.network.hookd; ~0.25 s less
            # per restore)
            hook_argv=[sys.executable, "-I", "-S",
                       str(Path(__file__).resolve().parents[1] / "network" / "hookclient.py"),
                       str(self.run_dir / "hookd" / "hook.sock"), str(bundle / "lease.json"), self.settings.bridge,
                       self.settings.node_name, self._cgroup_path(sid), str(rec.get("uidBase", 0))],
            hook_env=[
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                f"PYTHONPATH={Path(__file__).resolve().parents[3]}",
            ],
        )
        (bundle / "criu.conf").write_text(CRIU_CONFIG)
        cspec.annotations["org.criu.config"] = str(bundle / "criu.conf")
        config = build_config(cspec)
        # Legacy cgroup mode for systemd: no inotify watches on cgroup2 `cgroup.events` files, which CRIU
        # cannot reopen on restore (measured here: "fsnotify: Unable to open .../cgroup.events").
        config["process"]["env"].append("SYSTEMD_PROC_CMDLINE=systemd.legacy_systemd_cgroup_controller=1")
        try:
            rootfs.precreate_mount_targets(self._hostroot(sid), config)
        except (guestfs.UnsafePath, OSError) as e:
            raise NodeError("boot_failed", f"mount targets: {e}") from e
        if self.runtime.gvisor(sid):  # runsc: its own config, a named network namespace wired before it starts
            config = gvisor.gvisor_config(config, str(self._hostroot(sid)), str(self._gvisor_netns(sid, rec)))
        (bundle / "config.json").write_text(json.dumps(config, indent=1))
        return bundle

    def _gvisor_netns(self, sid: str, rec: dict[str, Any]) -> Path:
        """A fresh network namespace for gvisor sandbox ``sid`` with its lease's ``eth0`` and default route on the
        bridge (as the container class's prestart hook wires it). Made again before every boot and restore: runsc
        took the address and routes out of the last one. Raises ``NodeError`` ``boot_failed``."""
        runsc = self.runtime.runsc
        try:
            path = runsc.fresh_netns(sid)
            with runsc.netns_holder(sid) as pid:
                network.wire_sandbox(pid, network.lease_from_json(json.dumps(rec["lease"])), self.settings.bridge,
                                     self.settings.node_name)
        except (RuntimeError_, OSError) as e:
            raise NodeError("boot_failed", f"network namespace: {e}") from e
        return path

    def _write_identity(self, sid: str, hostname: str, fresh: bool) -> None:
        """Write hostname, hosts, resolv.conf (and, for a new identity, machine-id and /etc/sbx/identity) into
        the mounted disk, never following the guest's symlinks (:mod:`sbx.node.container.guestfs`)."""
        root = self._hostroot(sid)
        guestfs.write_file(root, "etc/hostname", f"{hostname}\n".encode())
        guestfs.write_file(
            root, "etc/hosts", f"127.0.0.1 localhost\n127.0.1.1 {hostname}\n::1 localhost ip6-localhost\n".encode()
        )
        guestfs.write_file(root, "etc/resolv.conf", _resolv_conf(self._record(sid)["lease"]["gateway"]).encode())
        if fresh:
            guestfs.write_file(root, "etc/machine-id", (uuid.uuid4().hex + "\n").encode(), mode=0o444)
            guestfs.write_file(root, "etc/sbx/identity", f"{sid} {secrets.token_hex(8)}\n".encode())

    def _boot(self, sid: str, size: Size, fresh_identity: bool) -> None:
        """Cold boot from the disk: mount, write identity, start runc, wait for systemd. A sandbox made before
        shifted maps gets its own uid range here (nothing on disk changes; only a memory restore needed the identity
        map). A record with ``freshIdentity`` (a fork made stopped to move:
        :meth:`sbx.node.lifecycle.snapshots.SnapshotMixin.fork_stopped`) gets a new identity, as ``fresh_identity``
        asks."""
        self._discard_memory(sid)
        self._cleanup_container(sid)
        self._umount(sid)  # a fresh mount: a killed restore can leave the old one detached from the bundle
        if "uidBase" not in self._record(sid):
            try:
                with self._lease_lock, rootfs.uid_range(self.settings.home, self.settings.volume) as base:
                    self._set_phase(sid, self._record(sid)["phase"], uidBase=base)
            except StorageError as e:
                raise NodeError(e.code, str(e)) from e
        rec = self._record(sid)
        self._mount(sid)
        self._write_identity(sid, rec["spec"]["hostname"], fresh_identity or bool(rec.get("freshIdentity")))
        self._write_shutdown_hook(sid)
        self._identity_written(sid)
        if self.runtime.gvisor(sid):
            gvisor.install_init(self._hostroot(sid))
        bundle = self._write_bundle(sid, rec, size)
        self._set_phase(sid, "booting")
        try:
            self.runtime.boot(sid, bundle)
            self._mark_started(sid)
            self._attach_volumes(sid)
            self._wait_ready(sid)
        except (RuntimeError_, NodeError) as e:
            self._cleanup_container(sid)
            self._umount(sid)
            self._set_phase(sid, "stopped")
            raise NodeError("boot_failed", str(e)) from e
        self._set_phase(sid, "running", size=size.name)

    def _wait_ready(self, sid: str) -> str:
        """Poll ``systemctl is-system-running`` until ``running`` or ``degraded`` (runtime-facts: ``--wait``
        too early fails with "Failed to connect to bus"); for an image booted by sbx's minimal init
        (:mod:`sbx.guest.minimal`), until its ready file exists (state ``running``). Returns the state; raises
        ``NodeError`` on timeout."""
        deadline = time.monotonic() + READY_TIMEOUT
        state = ""
        probe = ["systemctl", "is-system-running"]
        if _minimal(self._image_of(self._record(sid))) or self.runtime.gvisor(sid):
            probe = ["/bin/sh", "-c", f"test -e {minimal.MINIMAL_READY_FILE} && echo running || echo starting"]
        while time.monotonic() < deadline:
            p = subprocess.run(
                self.runtime.cmd("exec", sid, *probe),
                capture_output=True,
                text=True,
                stdin=subprocess.DEVNULL,
            )
            state = p.stdout.strip()
            if state in ("running", "degraded"):
                rec = self._record(sid)
                rec["systemState"] = state
                self._save(sid, rec)
                return state
            if self.runtime.state(sid) not in ("running", "created"):
                raise NodeError("boot_failed", f"container exited during boot ({state or p.stderr.strip()})")
            time.sleep(0.1)
        raise NodeError("boot_failed", f"systemd did not finish booting in {READY_TIMEOUT:.0f} s ({state})")

    def delete(self, id: str) -> None:
        with self._lock(id):
            if not self._dir(id).exists():
                return
            self._detach_volumes(id)
            for old in (self.settings.volumes_dir / "logs").glob(f"{id}-*.log"):  # its volume daemons' logs
                old.unlink(missing_ok=True)
            if self.runtime.state(id) is not None:
                self.runtime.kill(id, signal.SIGKILL)
            self._cleanup_container(id)
            self.set_egress_proxy(id, False)
            # no wait for the loop device to let go: the disk file is removed next, and one that detaches late
            # holds only the unlinked file (seen after a live migration's source delete at 1 GiB: the loop device
            # stayed past the 15 s wait in one move of three, which the caller then waited out)
            self._umount(id, wait=0.0)
            shutil.rmtree(self._bundle(id), ignore_errors=True)
            shutil.rmtree(self._dir(id), ignore_errors=True)
            # nothing of its exec channel stays: a migration's quiesce (the copy it leaves is deleted) would
            # otherwise keep the agent off for the same id when it moves back here
            self._channel_resume(id)
            self.runtime.forget(id)

    def address(self, id: str) -> str:
        """The sandbox's IPv4 address on the node's bridge (``10.88.0.7``), where its ports answer."""
        return self._lease(id).address.split("/")[0]

    @contextmanager
    def mounted_root(self, sid: str) -> Iterator[Path]:
        """The host path of a running sandbox's root filesystem, unshifted (owners as on disk: the sandbox's root
        is 0 there); read and write it with :mod:`sbx.node.container.guestfs` only."""
        self._require_running(sid)
        yield self._hostroot(sid)


def _minimal(image: dict[str, Any] | None) -> bool:
    """Whether a sandbox of ``image`` (its facts; None: the default image) boots with sbx's minimal init rather
    than systemd."""
    return image is not None and image.get("init") == "minimal"


def _mask_dir(run_dir: Path) -> Path:
    """``<run_dir>/masked``: the node's empty read-only tmpfs the sandbox's masks of ``/sys`` directories bind
    (:func:`sbx.runtime.oci.ensure_mask_dir`). Raises ``NodeError("boot_failed")`` when it can't be mounted."""
    try:
        return oci.ensure_mask_dir(run_dir / "masked")
    except OSError as e:
        raise NodeError("boot_failed", str(e)) from e


def _resolv_conf(gateway: str) -> str:
    """The sandbox's ``resolv.conf``: the node's resolver on its bridge gateway ``gateway`` only
    (:func:`sbx.node.network.resolver.resolv_conf`); the host's nameservers are out of its reach. After a move to a
    node of another subnet the old gateway still answers: the node redirects DNS to denied addresses to its own
    resolver (:func:`sbx.node.network.ruleset.inet_ruleset`)."""
    return resolver.resolv_conf(gateway)
