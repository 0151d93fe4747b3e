"""What every part of the node agent (:class:`sbx.node.agent.LocalNode`) shares: :class:`NodeBase`.

It holds the node's state (settings, folders, the runc runtime, per-sandbox locks), host preparation, where a
sandbox's files live (disk, memory image, bundle, mounts), its record ``node.json`` (read, saved atomically,
phase changes, network lease, uid range), and the helpers several mechanisms use: mounting and unmounting the
disk, tearing a container down, discarding or judging a memory image, sealing the disk, and the running check.

The mixins of :mod:`sbx.node.lifecycle`, :mod:`sbx.node.memory`, :mod:`sbx.node.exec` and :mod:`sbx.node.migration`
build on it and call each other only through the methods declared at the end of :class:`NodeBase`. It is built from
the mechanisms below it (:mod:`sbx.node.network`, :mod:`sbx.node.host`, :mod:`sbx.node.container`), which know no node
object (the layers contract in ``pyproject.toml``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sbx.config import Settings, Size
from sbx.node.container import cgdelegate, cgroup, lxcfs, recovery, rootfs, watch
from sbx.node.host import aptsources
from sbx.node.network import bridge as network
from sbx.node.network import egress, hookd, resolver, ruleset
from sbx.node.network.egressproxy import EgressProxy
from sbx.node.types import NodeError, SandboxSpec, StopResult
from sbx.node.volumes import mounts as volume_mounts
from sbx.runtime import criu
from sbx.runtime.classes import ClassRuntime
from sbx.runtime.pageserver import PageReceiver
from sbx.runtime.runc import RuncRuntime, remove_tree
from sbx.runtime.runsc import RunscRuntime
from sbx.storage import seals
from sbx.storage.errors import StorageError

if TYPE_CHECKING:
    from sbx.node.steps import Steps

log = logging.getLogger("sbx.node")

SEALS_KEPT = 2


def now() -> str:
    """The current UTC time as ``2026-01-31T12:00:00Z`` (records, jobs, snapshots)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class NodeBase:
    """State and shared helpers of :class:`sbx.node.agent.LocalNode` (see the module docstring)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.run_dir = Path("/run/sbx") / settings.node_name
        self.sandboxes_dir = settings.node_dir / "sandboxes"
        self.snapshots_dir = settings.node_dir / "snapshots"
        # each sandbox's runtime class (its record's spec.runtime) picks runc or runsc (sbx.runtime.classes)
        self.runtime = ClassRuntime(RuncRuntime(self.run_dir / "runc", criu.criu_binary(settings.criu_dir)),
                                    RunscRuntime(self.run_dir / "runsc"), self._runtime_class)
        self._locks: dict[str, threading.RLock] = {}
        self._locks_guard = threading.Lock()
        self._lease_lock = threading.Lock()
        self._image: Path | None = None
        self._image_hold: int | None = None  # the descriptor of its shared lock (_use_image)
        self._hookd: hookd.HookServer | None = None
        self._watcher: watch.Watcher | None = None
        self._on_exit: Callable[[str, str, str | None], None] | None = None
        self._kernel_ooms = watch.KernelOoms()
        self._shutdown_at: float | None = None  # monotonic time attached execs are ended at (server shutdown)
        self._fingerprint: dict[str, str] | None = None  # this host's CRIU fingerprint, measured on first use
        self._nested_ooms: dict[str, int] = {}  # kills in a sandbox's child cgroups not yet saved in its record
        self._cpu_samples: dict[str, tuple[float, int]] = {}
        self._page_receivers: dict[str, PageReceiver] = {}  # arrivals' page servers (sbx.node.migration.incoming)
        self._cpu_percent: dict[str, float] = {}
        # the exec channel (sbx.node.exec.jobs): open agent connections, sandboxes being stopped, misbehaving agents
        self._channel_socks: dict[str, set[Any]] = {}
        self._channel_quiet: set[str] = set()
        self._channel_why: dict[str, tuple[str, str]] = {}  # (code, message) a quiesce ends open commands with
        self._channel_suspect: dict[str, float] = {}
        self._env_cache: dict[str, tuple[int, list[str]]] = {}
        self._template_builds: set[str] = set()  # keys of memory templates being built (sbx.node.memory.templates)
        self._template_guard = threading.Lock()
        # warm sandboxes (sbx.node.memory.warmpool): ready ids by size name, taken ids (size, monotonic time
        # taken), sizes being filled; all under _pool_guard
        self._pool_ready: dict[str, list[str]] = {}
        self._pool_taken: dict[str, tuple[str, float]] = {}
        self._pool_images: dict[str, dict[str, Any]] = {}  # facts of user images with pools, by key (warmpool)
        self._pool_filling: set[str] = set()
        self._pool_guard = threading.Lock()
        # copies a live migration left here, being deleted in the background (sbx.node.migration.outgoing), by id
        self._departing: dict[str, threading.Thread] = {}
        self._departing_guard = threading.Lock()
        self._egress: EgressProxy | None = None  # the credential proxy, once prepare started it
        self._egress_ids: set[str] = set()  # sandboxes whose traffic goes through it
        self._resolver: resolver.Resolver | None = None  # the sandboxes' DNS resolver, once prepare started it

    # ----------------------------------------------------------------- setup

    def prepare(self, progress: Callable[[str], None] | None = None) -> None:
        """Make the host ready to run sandboxes: the reflink volume, the base image (built once, cached by its
        recipe hash), the node's folders, the bridge with its nftables rules and the sandboxes' DNS resolver on the
        bridge's gateway (:mod:`sbx.node.network.resolver`). Idempotent. Raises
        :class:`sbx.node.network.resolver.ResolverConfigError` for bad DNS settings,
        :class:`sbx.node.network.ruleset.ConnectionLimitError` for bad connection limits, ``OSError`` when the
        resolver can't bind the gateway's port 53."""
        from sbx.node.host.image import ensure_image
        from sbx.storage.volume import ensure_volume

        say = progress or (lambda _m: None)
        egress.parse_allow(self.settings.egress_allow)  # a bad setting fails the start before any slow step
        upstreams = resolver.parse_upstreams(self.settings.dns_upstreams)
        resolver.check_limits(self.settings.sandbox_dns_rate, self.settings.sandbox_dns_burst)
        ruleset.check_connection_limits(self.settings.sandbox_max_connections, self.settings.sandbox_connection_rate)
        say("data volume")
        ensure_volume(self.settings)
        say("sandbox image")
        self._use_image(ensure_image(self.settings, progress))
        for d in (self.sandboxes_dir, self.snapshots_dir, self.run_dir / "bundles"):
            d.mkdir(parents=True, exist_ok=True)
        self.snapshots_dir.chmod(0o700)  # snapshots are sandbox disks: no sandbox's host uid may read them
        lxcfs.ensure_lxcfs()
        cgdelegate.set_node_limits(self.settings.node_name, self.settings.memory_reserve_mib)
        if self._hookd is None:
            self._hookd = hookd.HookServer(self.run_dir / "hookd" / "hook.sock")
        say("network")
        policy = egress.egress_policy(self.settings.egress_allow, aptsources.mirror_lines_if_any(),
                                      dns_upstreams=[host for host, _port in upstreams])
        network.ensure_bridge(self.settings.bridge, self.settings.subnet, self.settings.node_name, policy,
                              proxy_port=self.settings.egress_proxy_port,
                              max_connections=self.settings.sandbox_max_connections,
                              connection_rate=self.settings.sandbox_connection_rate,
                              dns_rate=self.settings.sandbox_dns_rate, dns_burst=self.settings.sandbox_dns_burst)
        say("dns resolver")  # on the gateway, which the bridge holds from here on
        self._resolver = resolver.ensure_resolver(str(network.gateway_of(self.settings.subnet).ip), 53, upstreams,
                                                  self.settings.sandbox_dns_rate, self.settings.sandbox_dns_burst)
        if self.settings.egress_proxy_port and self._egress is None:
            say("egress proxy")
            proxy = EgressProxy(self.settings, policy, self.settings.egress_upstream_ca)
            try:
                proxy.start()
            except OSError as e:
                log.warning("egress proxy off: %s", e)
            else:
                self._egress = proxy

    @property
    def image(self) -> Path:
        if self._image is None or not self._image.is_file():  # a newer sbx on this host may have replaced it
            from sbx.node.host.image import ensure_image

            self._use_image(ensure_image(self.settings))
        assert self._image is not None
        return self._image

    def _use_image(self, path: Path) -> None:
        """Make ``path`` the node's base image and hold it while the node runs (:func:`sbx.node.host.image.hold_image`:
        another sbx on this host that builds its own image won't delete it), releasing the one held before."""
        from sbx.node.host.image import hold_image

        if self._image_hold is not None and path == self._image:
            return
        fd = hold_image(path)
        if self._image_hold is not None:
            os.close(self._image_hold)
        self._image, self._image_hold = path, fd

    # ----------------------------------------------------------------- paths and records

    def _lock(self, sid: str) -> threading.RLock:
        with self._locks_guard:
            return self._locks.setdefault(sid, threading.RLock())

    def _dir(self, sid: str) -> Path:
        return self.sandboxes_dir / sid

    def _disk(self, sid: str) -> Path:
        return self._dir(sid) / "disk.ext4"

    def _memory(self, sid: str) -> Path:
        return self._dir(sid) / "memory"

    def _bundle(self, sid: str) -> Path:
        return self.run_dir / "bundles" / sid

    def _rootfs(self, sid: str) -> Path:
        """The container's root: the idmapped view of the disk (host root can't write through it: EOVERFLOW)."""
        return self._bundle(sid) / "rootfs"

    def _hostroot(self, sid: str) -> Path:
        """The disk's plain mount: the host's unshifted view, for every write the host makes."""
        return self._bundle(sid) / "disk"

    def _uid_base(self, sid: str) -> int:
        """First host uid/gid of the sandbox's map (0: identity map of a sandbox made before shifted maps)."""
        return int(self._record(sid).get("uidBase", 0))

    def _cgroup_path(self, sid: str) -> str:
        return f"/sbx/{self.settings.node_name}/{sid}"

    def _record(self, sid: str) -> dict[str, Any]:
        p = self._dir(sid) / "node.json"
        if not p.is_file():
            raise NodeError("not_found", f"sandbox {sid} is not on this node")
        return json.loads(p.read_text())

    def _save(self, sid: str, rec: dict[str, Any]) -> None:
        p = self._dir(sid) / "node.json"
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=1))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, p)

    def _set_phase(self, sid: str, phase: str, **extra: Any) -> dict[str, Any]:
        rec = self._record(sid)
        rec["phase"] = phase
        rec.update(extra)
        self._save(sid, rec)
        return rec

    def _identity_written(self, sid: str) -> None:
        """Drop the record's ``freshIdentity`` (a fork made stopped to move: its new identity is on its disk
        now)."""
        rec = self._record(sid)
        if rec.pop("freshIdentity", None) is not None:
            self._save(sid, rec)

    def _lease(self, sid: str) -> network.Lease:
        return network.lease_from_json(json.dumps(self._record(sid)["lease"]))

    def _new_lease(self, sid: str) -> dict[str, str]:
        """A free address on the bridge (none a sandbox's record or a build's claim holds); call with ``_lease_lock``
        held until the record holding it is saved."""
        taken = set()
        # sandboxes' records, and image builds' claims (sbx.node.images.reserve: their RUN steps' namespace)
        for rec in [*self.sandboxes_dir.glob("*/node.json"), *(self.settings.node_dir / "builds").glob("*.json")]:
            try:
                taken.add(json.loads(rec.read_text())["lease"]["address"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
        addr = network.allocate(self.settings.subnet, taken)
        gw = str(network.gateway_of(self.settings.subnet).ip)
        return {"address": addr, "gateway": gw, "host_veth": network.veth_name(sid)}

    def _new_record(self, spec: SandboxSpec, **extra: Any) -> None:
        """Make the sandbox's folder and its first ``node.json`` (phase ``creating``, a fresh network lease, a uid
        range of its own)."""
        self._dir(spec.id).mkdir(parents=True, exist_ok=True)
        with self._lease_lock:  # two creates at once must not pick the same address
            try:
                with rootfs.uid_range(self.settings.home, self.settings.volume) as base:
                    rec = {"spec": self._spec_dict(spec), "lease": self._new_lease(spec.id), "phase": "creating",
                           "size": spec.size.name, "oomKills": 0, "uidBase": base, **extra}
                    self._save(spec.id, rec)
            except StorageError as e:
                raise NodeError(e.code, str(e)) from e
        rootfs.make_private(self._dir(spec.id), base)

    @staticmethod
    def _spec_dict(spec: SandboxSpec) -> dict[str, Any]:
        out: dict[str, Any] = {"id": spec.id, "hostname": spec.hostname, "size": spec.size.name, "env": spec.env}
        if spec.image is not None:
            out["image"] = spec.image
        if spec.runtime != "container":
            out["runtime"] = spec.runtime
        if spec.volumes:
            out["volumes"] = [dict(v) for v in spec.volumes]
        return out

    def _runtime_class(self, sid: str) -> str:
        """The runtime class of sandbox ``sid`` (:attr:`sbx.node.types.SandboxSpec.runtime`) from its record.
        Raises ``NodeError`` ``not_found`` when it has none."""
        return str(self._record(sid).get("spec", {}).get("runtime") or "container")

    def _image_of(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        """The facts of the image a sandbox's record names (:attr:`sbx.node.types.SandboxSpec.image`), None for the
        default image."""
        img = rec.get("spec", {}).get("image")
        return img if isinstance(img, dict) and img.get("key") else None

    def _base_for(self, image: dict[str, Any] | None) -> Path:
        """The base image file a new disk of ``image`` is a copy of: the default image for None, else
        ``images_dir/<key>.ext4``. Raises ``NodeError("image_missing")`` when that file is not on this node."""
        if image is None:
            return self.image
        path = self.settings.images_dir / f"{image['key']}.ext4"
        if not path.is_file():
            raise NodeError("image_missing", f"image {image['key'][:12]} is not on node {self.settings.node_name}")
        return path

    # ----------------------------------------------------------------- helpers shared by the mixins

    def _mount(self, sid: str) -> None:
        """Mount the disk plainly at :meth:`_hostroot` and its idmapped view (shifted to the sandbox's uid range)
        at :meth:`_rootfs`; nothing to do when both are there. After a host reboot or a crash between the two
        mounts, whatever is left is unmounted and both are made again."""
        try:
            rootfs.mount_root(self._disk(sid), self._hostroot(sid), self._rootfs(sid), self._uid_base(sid))
        except StorageError as e:
            raise NodeError("boot_failed", f"mounting the disk: {e}") from e

    def _umount(self, sid: str, wait: float = 15.0) -> None:
        """Unmount the sandbox's disk and wait up to ``wait`` seconds until no loop device holds the image
        (:func:`sbx.node.container.rootfs.unmount_disk`)."""
        rootfs.unmount_disk(self._disk(sid), self._rootfs(sid), sid, wait)

    def _cleanup_container(self, sid: str, wait: float = 15.0) -> None:
        """Delete the container and wait until its cgroup holds no process, then remove its veth and cgroups."""
        self.runtime.delete(sid)
        deadline = time.monotonic() + wait
        while cgroup.has_processes(self._cgroup_path(sid)) and time.monotonic() < deadline:
            cgroup.kill_all(self._cgroup_path(sid))
            time.sleep(0.05)
        try:
            network.unwire_sandbox(self._lease(sid), self.settings.bridge, self.settings.node_name)
        except NodeError:
            pass
        cgroup.remove_tree(self._cgroup_path(sid))

    def _discard_memory(self, sid: str) -> None:
        remove_tree(self._memory(sid))
        remove_tree(self._dir(sid) / "criu-work")

    def _memory_usable(self, sid: str) -> bool:
        """True when the sandbox has a complete memory image (``host.json`` written) of its disk's current
        generation (:mod:`sbx.node.container.recovery`)."""
        mem = self._memory(sid)
        if criu.read_fingerprint(mem) is None:
            return False
        try:
            gen = int(self._record(sid).get("diskGen", 0))
        except NodeError:
            return False
        return recovery.memory_generation(mem) == gen

    def _seal(self, sid: str) -> None:
        seal_dir = self._dir(sid) / "seals"
        try:
            seals.seal(self._disk(sid), seal_dir)
            for old in seals.list_seals(seal_dir)[:-SEALS_KEPT]:
                seals.delete_seal(seal_dir, old.seq)
        except StorageError as e:
            log.warning("sealing the disk of %s failed: %s", sid, e)

    def _mark_started(self, sid: str) -> None:
        """Take a CPU mark of the sandbox's cgroup as it starts (boot, restore): its first stats sample (the ready
        event, the API's answer) measures CPU since then instead of sleeping a 0.1 s window."""
        self._cpu_samples[sid] = cgroup.cpu_mark(self._cgroup_path(sid))
        self._cpu_percent.pop(sid, None)

    def _attach_volumes(self, sid: str) -> None:
        """Mount the volumes of the sandbox's spec into its just started container (:mod:`sbx.node.volumes.mounts`);
        no-op without volumes. Raises ``NodeError("volume_mount_failed")``."""
        rec = self._record(sid)
        if not volume_mounts.volumes_of(rec):
            return
        pid = self.runtime.init_pid(sid)
        if pid is None:
            raise NodeError("volume_mount_failed", f"sandbox {sid} has no running init to mount its volumes into")
        volume_mounts.attach(rec, sid, pid, self.settings.volumes_dir / "logs", self._dir(sid) / "volumes.json")

    def _detach_volumes(self, sid: str) -> None:
        """Unmount the sandbox's volumes from its container (before a checkpoint: CRIU must not see them) and end
        their daemons. Never raises."""
        try:
            rec = self._record(sid)
        except NodeError:
            return
        state = self._dir(sid) / "volumes.json"
        if not volume_mounts.volumes_of(rec) and not state.exists():
            return
        volume_mounts.detach(rec, self.runtime.init_pid(sid), state)

    def _is_running(self, sid: str) -> bool:
        """True when the container runs: its init recorded in runc's state file is alive (same pid and start time,
        no runc started for it: ~0.1 ms against ~5 ms), else as ``runc state`` says."""
        if watch.init_alive(self.runtime.state_root / sid / "state.json"):
            return True
        return self.runtime.state(sid) == "running"

    def _require_running(self, sid: str) -> None:
        """Raise ``not_found`` / ``not_running`` unless the container runs (:meth:`_is_running`)."""
        if not self._is_running(sid):
            self._record(sid)  # raises not_found for an unknown id
            raise NodeError("not_running", f"sandbox {sid} is not running")

    if TYPE_CHECKING:  # defined by the mixins that sbx.node.agent.LocalNode combines; declared here for mypy

        def _write_bundle(self, sid: str, rec: dict[str, Any], size: Size) -> Path: ...

        def _boot(self, sid: str, size: Size, fresh_identity: bool) -> None: ...

        def _write_identity(self, sid: str, hostname: str, fresh: bool) -> None: ...

        def _clone_live(self, sid: str, dst: Path, fresh_uuid: bool = True, mode: int = 0o644,
                        mounted: bool = False) -> None: ...

        def _restore_as_new(self, sid: str, size: Size, *, old_base: int, clear_tmp: bool,
                            identity: bool = True, holds_sshd: bool = True) -> None: ...

        def _create_from_template(self, spec: SandboxSpec, identity: bool = True) -> bool: ...

        def template_ready(self, size: Size, image: dict[str, Any] | None = None) -> Path | None: ...

        def _pool_claim(self, spec: SandboxSpec, use: bool) -> bool: ...

        def _pool_fill_later(self, size: Size, image: dict[str, Any] | None = None) -> None: ...

        def _pool_forget(self) -> None: ...

        def _want_template(self, size: Size, image: dict[str, Any] | None = None) -> None: ...

        def _reconcile_templates(self) -> None: ...

        def fork_memory(self, source_id: str, spec: SandboxSpec) -> None: ...

        def _copy_running(self, source_id: str, spec: SandboxSpec, st: Steps) -> int: ...

        def _seal_fork_memory(self, sid: str, old_base: int) -> None: ...

        def _after_restore(self, sid: str, clear_tmp: bool, identity: bool = True,
                           holds_sshd: bool = True) -> None: ...

        def _finish_identity(self, sid: str, queued: bool = False) -> None: ...

        def _apply_egress(self, sid: str, rec: dict[str, Any]) -> None: ...

        def _exec_env(self, rec: dict[str, Any], env: dict[str, str] | None) -> dict[str, str]: ...

        def _install_ca(self, root: Path) -> None: ...

        def set_egress_proxy(self, id: str, enabled: bool) -> None: ...

        def egress_ready(self) -> bool: ...

        def _write_shutdown_hook(self, sid: str) -> None: ...

        def _quiesce_channel(self, sid: str, wait: float = 3.0, why: tuple[str, str] | None = None) -> None: ...

        def _run_root(self, sid: str, argv: list[str], timeout: float = 60.0) -> bytes: ...

        def _channel_resume(self, sid: str) -> None: ...

        def _snapshot_path(self, name: str) -> Path: ...

        def _all_images(self, exclude: Path) -> list[Path]: ...

        def stop(self, id: str, keep_memory: bool = True) -> StopResult: ...

        def _checkpoint_settled(self, id: str, mem: Path, *, image_gid: int, frozen: bool) -> bool: ...

        def delete(self, id: str) -> None: ...

        def _reconcile_migration(self, sid: str, rec: dict[str, Any]) -> str | None: ...

        def departed(self, id: str, timeout: float = 60.0) -> None: ...
