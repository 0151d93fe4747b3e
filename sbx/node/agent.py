"""The node agent for this machine: sandboxes as runc containers on reflink-cloned ext4 disks.

:class:`LocalNode` implements :class:`sbx.node.types.NodeAgent`. Where things live (``settings`` from
:mod:`sbx.config`):

- ``<node_dir>/sandboxes/<id>/disk.ext4``: the sandbox's root disk (sparse ext4 on the reflink XFS volume);
- ``<node_dir>/sandboxes/<id>/memory/``: the CRIU image of a stop that kept memory, with ``host.json`` (the host
  fingerprint) written last, so an image without it is incomplete and never restored;
- ``<node_dir>/sandboxes/<id>/seals/``: sealed disk checkpoints (one per stop), for incremental export;
- ``<node_dir>/sandboxes/<id>/node.json``: the node's record (spec, lease, phase) written before and after every
  side effect, so :meth:`LocalNode.reconcile` can put a sandbox back in a consistent state after a crash;
- ``<node_dir>/snapshots/<name>.ext4`` (+ ``.json``): named snapshots;
- ``/run/sbx/<node>/``: runc's state root and the OCI bundles: ``config.json``, the disk's plain mount
  ``bundles/<id>/disk`` (the host's view, where every host-side write goes) and its idmapped view
  ``bundles/<id>/rootfs`` (the container's root: owners shifted into the sandbox's own host uid range).

uid/gid map (issue 17): each sandbox maps its uids/gids 0..65535 to a host range of its own (``uidBase`` in
``node.json``; :mod:`sbx.node.rootfs`). Records made before shifted maps have no ``uidBase``: they keep the
identity map while their memory image is restored and get a range of their own at their next cold boot.

Memory: a stop checkpoints with CRIU (runc ``checkpoint``), a resume restores (runc ``restore``). A memory image
is used once: after a restore or any cold boot it is deleted, because the disk moves on from the state it
matches.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sbx.config import Settings, Size
from sbx.node import cgdelegate, cgroup, egress, guestfs, lxcfs, network, recovery, rootfs, watch
from sbx.node.types import (
    ExecEvent,
    JobInfo,
    NodeError,
    NodeStatus,
    ResumeResult,
    SandboxSpec,
    SnapshotInfo,
    Stats,
    StopResult,
)
from sbx.runtime import criu
from sbx.runtime.base import RuntimeError_
from sbx.runtime.oci import STOP_SIGNAL, ContainerSpec, build_config
from sbx.runtime.runc import CRIU_CONFIG, RuncRuntime, kill_process_group, remove_tree
from sbx.storage import disk as disks
from sbx.storage import mounts, space
from sbx.storage.errors import StorageError

log = logging.getLogger("sbx.node")

USER_UID = 1000
USER_GID = 1000
JOBS_DIR = "/var/lib/sbx-jobs"
READY_TIMEOUT = 90.0
SEALS_KEPT = 2
_JOB_RE = re.compile(r"^job_[a-z0-9]{8}$")
_SNAPSHOT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _login_env(user: str, extra: dict[str, str] | None) -> list[str]:
    home = "/root" if user == "root" else "/home/user"
    env = {
        "HOME": home,
        "USER": user,
        "LOGNAME": user,
        "SHELL": "/bin/bash",
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
        "TERM": "xterm-256color",
    }
    env.update(extra or {})
    return [f"{k}={v}" for k, v in env.items()]


class LocalNode:
    """Sandboxes on this host (runc + CRIU + reflink disks). Thread-safe: each sandbox has its own lock, and
    operations on different sandboxes run in parallel."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.run_dir = Path("/run/sbx") / settings.node_name
        self.sandboxes_dir = settings.node_dir / "sandboxes"
        self.snapshots_dir = settings.node_dir / "snapshots"
        self.runtime = RuncRuntime(self.run_dir / "runc", criu.criu_binary(settings.criu_dir))
        self._locks: dict[str, threading.RLock] = {}
        self._locks_guard = threading.Lock()
        self._lease_lock = threading.Lock()
        self._image: Path | None = None
        self._watcher: watch.Watcher | None = None
        self._on_exit: Callable[[str, str, str | None], None] | None = None
        self._kernel_ooms = watch.KernelOoms()
        self._shutdown_at: float | None = None  # monotonic time attached execs are ended at (server shutdown)
        self._nested_ooms: dict[str, int] = {}  # kills in a sandbox's child cgroups not yet saved in its record
        self._cpu_samples: dict[str, tuple[float, int]] = {}

    # ----------------------------------------------------------------- setup

    def prepare(self, progress: Callable[[str], None] | None = None) -> None:
        """Make the host ready to run sandboxes: the reflink volume, the base image (built once, cached by its
        recipe hash), the node's folders and the bridge with its nftables rules. Idempotent."""
        from sbx.node.image import ensure_image
        from sbx.storage.volume import ensure_volume

        say = progress or (lambda _m: None)
        egress.parse_allow(self.settings.egress_allow)  # a bad setting fails the start before any slow step
        say("data volume")
        ensure_volume(self.settings)
        say("sandbox image")
        self._image = ensure_image(self.settings, progress)
        for d in (self.sandboxes_dir, self.snapshots_dir, self.run_dir / "bundles"):
            d.mkdir(parents=True, exist_ok=True)
        self.snapshots_dir.chmod(0o700)  # snapshots are sandbox disks: no sandbox's host uid may read them
        lxcfs.ensure_lxcfs()
        cgdelegate.set_node_limits(self.settings.node_name, self.settings.memory_reserve_mib)
        say("network")
        network.ensure_bridge(self.settings.bridge, self.settings.subnet, self.settings.node_name,
                              egress.egress_policy(self.settings.egress_allow))

    @property
    def image(self) -> Path:
        if self._image is None or not self._image.is_file():  # a newer sbx on this host may have replaced it
            from sbx.node.image import ensure_image

            self._image = ensure_image(self.settings)
        return self._image

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

    def _lease(self, sid: str) -> network.Lease:
        return network.lease_from_json(json.dumps(self._record(sid)["lease"]))

    def _new_lease(self, sid: str) -> dict[str, str]:
        """A free address on the bridge; call with ``_lease_lock`` held until the record holding it is saved."""
        taken = set()
        for rec in self.sandboxes_dir.glob("*/node.json"):
            try:
                taken.add(json.loads(rec.read_text())["lease"]["address"])
            except (OSError, ValueError, KeyError):
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
        return {"id": spec.id, "hostname": spec.hostname, "size": spec.size.name, "env": spec.env}

    # ----------------------------------------------------------------- boot

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
        cpus = min(size.vcpus, os.cpu_count() or 1)
        cspec = ContainerSpec(
            hostname=rec["spec"]["hostname"],
            memory_bytes=size.memory_mib * 1024 * 1024,
            vcpus=size.vcpus,
            cpuset_cpus=f"0-{cpus - 1}" if cpus > 1 else "0",
            cgroup_path=self._cgroup_path(sid),
            lxcfs_dir=str(lxcfs_dir) if lxcfs_dir else None,
            uid_base=rec.get("uidBase", 0),
            hook_argv=[sys.executable, "-m", "sbx.node.nethook", str(bundle / "lease.json"), self.settings.bridge,
                       self.settings.node_name, self._cgroup_path(sid), str(rec.get("uidBase", 0))],
            hook_env=[
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                f"PYTHONPATH={Path(__file__).resolve().parents[2]}",
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
        (bundle / "config.json").write_text(json.dumps(config, indent=1))
        return bundle

    def _mount(self, sid: str) -> None:
        """Mount the disk plainly at :meth:`_hostroot` and its idmapped view (shifted to the sandbox's uid range)
        at :meth:`_rootfs`; nothing to do when both are there. After a host reboot or a crash between the two
        mounts, whatever is left is unmounted and both are made again."""
        try:
            rootfs.mount_root(self._disk(sid), self._hostroot(sid), self._rootfs(sid), self._uid_base(sid))
        except StorageError as e:
            raise NodeError("boot_failed", f"mounting the disk: {e}") from e

    def _umount(self, sid: str, wait: float = 15.0) -> None:
        """Unmount the sandbox's disk (the idmapped view first, then the plain mount, then any other mount of it)
        and wait until no loop device holds the image any more, so the next e2fsck/resize2fs/reflink sees a quiet
        file (a dying container's mount namespace can keep the filesystem alive for a moment after the host's
        unmount, and the loop device then detaches lazily)."""
        rootfs.umount_root(self._disk(sid), self._rootfs(sid))
        deadline = time.monotonic() + wait
        while mounts.loop_devices_for(self._disk(sid)) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _write_identity(self, sid: str, hostname: str, fresh: bool) -> None:
        """Write hostname, hosts, resolv.conf (and, for a new identity, machine-id and /etc/sbx/identity) into
        the mounted disk, never following the guest's symlinks (:mod:`sbx.node.guestfs`)."""
        root = self._hostroot(sid)
        guestfs.write_file(root, "etc/hostname", f"{hostname}\n".encode())
        guestfs.write_file(
            root, "etc/hosts", f"127.0.0.1 localhost\n127.0.1.1 {hostname}\n::1 localhost ip6-localhost\n".encode()
        )
        guestfs.write_file(root, "etc/resolv.conf", _resolv_conf().encode())
        if fresh:
            guestfs.write_file(root, "etc/machine-id", (uuid.uuid4().hex + "\n").encode(), mode=0o444)
            guestfs.write_file(root, "etc/sbx/identity", f"{sid} {secrets.token_hex(8)}\n".encode())

    def _boot(self, sid: str, size: Size, fresh_identity: bool) -> None:
        """Cold boot from the disk: mount, write identity, start runc, wait for systemd. A sandbox made before
        shifted maps gets its own uid range here (nothing on disk changes; only a memory restore needed the
        identity map)."""
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
        self._write_identity(sid, rec["spec"]["hostname"], fresh_identity)
        self._write_shutdown_hook(sid)
        bundle = self._write_bundle(sid, rec, size)
        self._set_phase(sid, "booting")
        try:
            self.runtime.boot(sid, bundle)
            self._wait_ready(sid)
        except (RuntimeError_, NodeError) as e:
            self._cleanup_container(sid)
            self._umount(sid)
            self._set_phase(sid, "stopped")
            raise NodeError("boot_failed", str(e)) from e
        self._set_phase(sid, "running", size=size.name)

    def _wait_ready(self, sid: str) -> str:
        """Poll ``systemctl is-system-running`` until ``running`` or ``degraded`` (runtime-facts: ``--wait``
        too early fails with "Failed to connect to bus"). Returns the state; raises ``NodeError`` on timeout."""
        deadline = time.monotonic() + READY_TIMEOUT
        state = ""
        while time.monotonic() < deadline:
            p = subprocess.run(
                self.runtime.cmd("exec", sid, "systemctl", "is-system-running"),
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

    # ----------------------------------------------------------------- NodeAgent

    def create(self, spec: SandboxSpec, from_snapshot: str | None = None) -> None:
        with self._lock(spec.id):
            base = self.image if from_snapshot is None else self._snapshot_path(from_snapshot)
            if not base.is_file():
                raise NodeError("not_found", f"snapshot {from_snapshot!r} does not exist")
            self._new_record(spec)
            try:
                disks.create_disk(base, self._disk(spec.id), spec.size.disk_mib)
            except StorageError as e:
                raise NodeError("boot_failed", f"disk: {e}") from e
            self._set_phase(spec.id, "stopped")
            self._boot(spec.id, spec.size, fresh_identity=True)

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
        self._require_running(id)
        rec = self._record(id)
        uid, gid = (0, 0) if user == "root" else (USER_UID, USER_GID)
        home = "/root" if user == "root" else "/home/user"
        pid_file = self._bundle(id) / f"exec-{secrets.token_hex(4)}.pid"
        proc = self.runtime.exec(
            id,
            ["/bin/bash", "-lc", command],
            uid=uid,
            gid=gid,
            cwd=cwd or home,
            env=_login_env(user, {**rec["spec"].get("env", {}), **(env or {})}),
            pid_file=pid_file,
        )
        return self._stream(proc, pid_file, timeout, stop)

    def _stream(self, proc: subprocess.Popen[bytes], pid_file: Path, timeout: float | None,
                stop: Callable[[], bool] | None = None) -> Iterator[ExecEvent]:
        sel = selectors.DefaultSelector()
        assert proc.stdout is not None and proc.stderr is not None
        sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
        sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
        # a timeout is bounded (select() overflows past ~24 days); a kill that finds no pid file yet (runc has not
        # written it) is tried again every 10 ms until it lands or the command has ended
        deadline = None if timeout is None else time.monotonic() + min(max(timeout, 0.0), 1e6)
        timed_out = False
        try:
            open_streams = 2
            while open_streams:
                if self._shutdown_at is not None and time.monotonic() >= self._shutdown_at:
                    raise NodeError("server_shutdown", "the server is shutting down; the command was ended")
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                if deadline is not None and wait == 0.0:
                    if kill_process_group(pid_file):
                        timed_out, deadline = True, None
                        continue
                    if proc.poll() is not None:  # it ended by itself before the kill could land
                        deadline = None
                        continue
                    deadline, wait = time.monotonic() + 0.01, 0.01
                if stop is not None and stop():  # the caller went away: the command is killed below
                    return
                # wake at least twice a second to notice a caller gone or a server shutdown (:meth:`begin_shutdown`)
                for key, _ in sel.select(0.5 if wait is None else min(wait, 0.5)):
                    chunk = os.read(key.fileobj.fileno(), 65536)  # type: ignore[union-attr]
                    if not chunk:
                        sel.unregister(key.fileobj)
                        open_streams -= 1
                        continue
                    yield ExecEvent(kind=key.data, data=chunk)
            code = proc.wait()
        finally:
            sel.close()
            if proc.poll() is None:  # the consumer went away: kill the command's process group
                kill_process_group(pid_file)
                proc.kill()
                proc.wait()
            pid_file.unlink(missing_ok=True)
        if timed_out:
            yield ExecEvent(kind="exit", exit_code=124, timed_out=True)
        else:
            yield ExecEvent(kind="exit", exit_code=code if code >= 0 else 128 - code)

    def _require_running(self, sid: str) -> None:
        if self.runtime.state(sid) != "running":
            self._record(sid)  # raises not_found for an unknown id
            raise NodeError("not_running", f"sandbox {sid} is not running")

    def _root(self, sid: str, script: str, *args: str, input: bytes | None = None) -> bytes:
        try:
            return self.runtime.run(sid, ["/bin/bash", "-c", script, "sbx", *args], input=input)
        except RuntimeError_ as e:
            raise NodeError("exec_failed", e.detail) from e

    def exec_detached(self, id: str, command: str, *, user: str = "user", env: dict[str, str] | None = None,
                      cwd: str | None = None, timeout: float | None = None, stdin: str | None = None) -> JobInfo:
        """Start ``command`` as a transient systemd unit (``systemd-run``) inside the sandbox. A process that
        ``runc exec`` starts is reparented outside the container's process tree when runc exits, so CRIU would not
        dump it (measured); a unit of the sandbox's own systemd is a child of PID 1 and survives stop/resume with
        memory. Output goes to ``/var/lib/sbx-jobs/<job>/{stdout,stderr}``, the exit code to ``exit``. ``env`` is
        added to the sandbox's, ``cwd`` (absolute) replaces the home directory, ``timeout`` seconds runs it under
        coreutils ``timeout`` (exit 124 when it fires), ``stdin`` is saved beside it and fed to it."""
        self._require_running(id)
        job = "job_" + "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(8))
        rec = self._record(id)
        uid = "0" if user == "root" else str(USER_UID)
        home = cwd or ("/root" if user == "root" else "/home/user")
        env_args = [f"--setenv={e}" for e in _login_env(user, {**rec["spec"].get("env", {}), **(env or {})})]
        limit = f"timeout -k 5 {min(float(timeout), 1e7):.3f} " if timeout else ""
        script = (
            'set -e; d="$1"; shift; mkdir -p "$d"; chmod 0755 "$(dirname "$d")"; printf "%s" "$CMD" > "$d/cmd"; '
            'printf "%s" "$STDIN" > "$d/stdin"; '
            'date -u +%Y-%m-%dT%H:%M:%SZ > "$d/started"; chown -R "$UIDN:$UIDN" "$d"; '
            'systemd-run --quiet --collect --unit="sbx-$JOB" --uid="$UIDN" --gid="$UIDN" '
            '--working-directory="$HOMED" "$@" /bin/bash -c '
            f'\'{limit}bash -lc "$(cat "$0/cmd")" <"$0/stdin" >"$0/stdout" 2>"$0/stderr"; echo $? > "$0/exit"\' "$d"'
        )
        full = (f"CMD={shlex.quote(command)} STDIN={shlex.quote(stdin or '')} JOB={job} UIDN={uid} "
                f"HOMED={shlex.quote(home)}; " + script)
        self._root(id, full, f"{JOBS_DIR}/{job}", *env_args)
        return JobInfo(id=job, command=command, running=True, exit_code=None, started_at=_now())

    def kill_job(self, id: str, job: str) -> None:
        """SIGKILL every process of job ``job`` (its systemd unit's cgroup) and record exit 137 for it unless it
        had already ended. Raises ``not_found`` for an unknown job."""
        if not _JOB_RE.match(job):
            raise NodeError("not_found", f"no job {job!r}")
        self._require_running(id)
        script = (f'd={JOBS_DIR}/{job}; [ -d "$d" ] || exit 3; '
                  f'systemctl kill --signal=SIGKILL sbx-{job} 2>/dev/null || true; '
                  f'[ -e "$d/exit" ] || echo 137 > "$d/exit"')
        try:
            self.runtime.run(id, ["/bin/bash", "-c", script])
        except RuntimeError_ as e:
            raise NodeError("not_found", f"no job {job!r} in {id}") from e

    def jobs(self, id: str) -> list[JobInfo]:
        self._require_running(id)
        script = (
            f'for d in {JOBS_DIR}/job_*; do [ -d "$d" ] || continue; j=$(basename "$d"); '
            'e=$(cat "$d/exit" 2>/dev/null || true); s=$(cat "$d/started" 2>/dev/null || true); '
            'a=$(systemctl is-active "sbx-$j" 2>/dev/null || true); '
            'jq -cn --arg id "$j" --rawfile cmd "$d/cmd" --arg exit "$e" --arg started "$s" --arg active "$a" '
            "'{id:$id,cmd:$cmd,exit:$exit,started:$started,active:$active}'; done"
        )
        out = self._root(id, script).decode()
        jobs = []
        for line in out.splitlines():
            d = json.loads(line)
            code = int(d["exit"]) if d["exit"].strip().lstrip("-").isdigit() else None
            jobs.append(
                JobInfo(
                    id=d["id"],
                    command=d["cmd"],
                    running=code is None and d["active"] in ("active", "activating"),
                    exit_code=code,
                    started_at=d["started"],
                )
            )
        return sorted(jobs, key=lambda j: j.started_at)

    def job_output(self, id: str, job: str, stream: str, offset: int = 0) -> bytes:
        if not _JOB_RE.match(job) or stream not in ("stdout", "stderr"):
            raise NodeError("not_found", f"no job {job!r} with stream {stream!r}")
        self._require_running(id)
        script = (
            f"f={JOBS_DIR}/{job}/{stream}; [ -e {JOBS_DIR}/{job} ] || exit 3; "
            f'[ -f "$f" ] && tail -c +{int(offset) + 1} "$f" || true'
        )
        try:
            return self.runtime.run(id, ["/bin/bash", "-c", script])
        except RuntimeError_ as e:
            raise NodeError("not_found", f"no job {job!r} in {id}") from e

    def spawn(self, id: str, argv: list[str], *, user: str = "user", stdin: bool = False,
              tty: bool = False, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` in the sandbox as ``user`` in its home, with pipes for stdout/stderr (and stdin when
        ``stdin``), and return the process. Everything it touches is resolved inside the sandbox's own mount
        namespace, so files moved this way can never follow a sandbox symlink onto the host. With ``tty`` the
        process gets a pseudo-terminal: the returned process's stdin/stdout are the host side of a pty pair
        (runc ``exec --tty`` relays it into the container), stderr is merged into it."""
        self._require_running(id)
        rec = self._record(id)
        uid, gid = (0, 0) if user == "root" else (USER_UID, USER_GID)
        home = "/root" if user == "root" else "/home/user"
        envs = _login_env(user, {**rec["spec"].get("env", {}), **(env or {})})
        if tty:
            import pty

            master, slave = pty.openpty()
            args = self.runtime.exec_command(id, argv, uid=uid, gid=gid, cwd=home, env=envs, extra=("--tty",))
            proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
            os.close(slave)
            proc.pty_master = master  # type: ignore[attr-defined]
            return proc
        args = self.runtime.exec_command(id, argv, uid=uid, gid=gid, cwd=home, env=envs)
        return subprocess.Popen(args, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def address(self, id: str) -> str:
        """The sandbox's IPv4 address on the node's bridge (``10.88.0.7``), where its ports answer."""
        return self._lease(id).address.split("/")[0]

    # ----------------------------------------------------------------- stop / resume

    def stop(self, id: str, keep_memory: bool = True) -> StopResult:
        """Checkpoint (``keep_memory``) or halt the container, then unmount and seal the disk.

        Crash safety: the record gets phase ``stopping`` and a bumped ``diskGen`` (the generation this stop
        seals, which the memory image records; :mod:`sbx.node.recovery`) before CRIU starts, and ``haltBegun``
        before a halt starts, so reconcile never checkpoints a container that is half shut down."""
        with self._lock(id):
            rec = self._record(id)
            state = self.runtime.state(id)
            if state is None:
                self._umount(id)
                saved = rec["phase"] == "checkpointed" and self._memory_usable(id)
                self._set_phase(id, "checkpointed" if saved else "stopped")
                return StopResult(saved, None if saved or not keep_memory else "the sandbox was not running")
            rec["oomKills"] = rec.get("oomKills", 0) + cgroup.oom_kills(self._cgroup_path(id))
            # No CRIU log may be left from earlier: reconcile reads its presence as "CRIU touched this stop".
            remove_tree(self._dir(id) / "criu-work")
            rec["phase"] = "stopping"
            rec["stopKeepMemory"] = keep_memory
            rec["haltBegun"] = False
            rec["diskGen"] = int(rec.get("diskGen", 0)) + 1
            self._save(id, rec)
            saved = False
            error: str | None = None
            if keep_memory:
                mem = self._memory(id)
                try:
                    recovery.test_fail_checkpoint()
                    self.runtime.checkpoint(id, mem, self._dir(id) / "criu-work", image_gid=self._uid_base(id))
                    recovery.write_memory_generation(mem, rec["diskGen"])
                    criu.write_fingerprint(mem, criu.host_fingerprint(str(self.runtime.criu)))
                    saved = True
                except RuntimeError_ as e:
                    log.warning("checkpoint of %s failed, stopping without memory: %s", id, e.detail)
                    error = e.detail
                    self._discard_memory(id)
                    self._set_phase(id, "stopping", lastError=e.detail)
            if not saved:
                self._set_phase(id, "stopping", haltBegun=True)
                self._halt(id)
            self._cleanup_container(id)
            self._umount(id)
            self._seal(id)
            if saved:
                self._set_phase(id, "checkpointed", lastError=None)
            else:
                self._set_phase(id, "stopped")
            return StopResult(saved, error)

    def _memory_usable(self, sid: str) -> bool:
        """True when the sandbox has a complete memory image (``host.json`` written) of its disk's current
        generation (:mod:`sbx.node.recovery`)."""
        mem = self._memory(sid)
        if criu.read_fingerprint(mem) is None:
            return False
        try:
            gen = int(self._record(sid).get("diskGen", 0))
        except NodeError:
            return False
        return recovery.memory_generation(mem) == gen

    def _begin_start(self, sid: str) -> None:
        """Mark that the disk moves on from its sealed state (a resume starts): bump ``diskGen``, so the memory
        image no longer matches and can never be restored again once this start has begun."""
        rec = self._record(sid)
        rec["diskGen"] = int(rec.get("diskGen", 0)) + 1
        self._save(sid, rec)

    def _halt(self, sid: str, grace: float = 10.0) -> None:
        """Ask systemd to halt (SIGRTMIN+3), then SIGKILL after ``grace`` seconds."""
        self.runtime.kill(sid, STOP_SIGNAL)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.runtime.state(sid) == "running":
            time.sleep(0.1)
        self.runtime.kill(sid, signal.SIGKILL)

    def _seal(self, sid: str) -> None:
        seal_dir = self._dir(sid) / "seals"
        try:
            disks.seal(self._disk(sid), seal_dir)
            for old in disks.list_seals(seal_dir)[:-SEALS_KEPT]:
                disks.delete_seal(seal_dir, old.seq)
        except StorageError as e:
            log.warning("sealing the disk of %s failed: %s", sid, e)

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
            self._begin_start(id)
            if resized or cold:
                try:
                    disks.grow(self._disk(id), spec.size.disk_mib)
                except StorageError as e:
                    raise NodeError(e.code, str(e)) from e
            self._boot(id, spec.size, fresh_identity=False)
            if error:
                self._set_phase(id, "running", lastError=error)
            return ResumeResult(memory_restored=False, reason=reason, error=error)

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
        self._begin_start(sid)  # from here on the image is stale: an interrupted restore never repeats
        rec = self._record(sid)
        self._cleanup_container(sid)
        self._mount(sid)
        bundle = self._write_bundle(sid, rec, size)
        self._set_phase(sid, "restoring")
        try:
            self.runtime.restore(sid, bundle, self._memory(sid), self._dir(sid) / "criu-work")
        except RuntimeError_ as e:
            self._cleanup_container(sid)
            self._set_phase(sid, "checkpointed")
            raise NodeError("restore_failed", e.detail) from e
        recovery.test_hold(recovery.TEST_HOLD_RESTORE_ENV, self._dir(sid) / "restore-hold")
        self._discard_memory(sid)
        self._set_phase(sid, "running", size=size.name)

    # ----------------------------------------------------------------- fork and snapshots

    def fork(self, source_id: str, spec: SandboxSpec) -> None:
        self._record(source_id)  # raises not_found for an unknown source
        with self._lock(spec.id):
            self._new_record(spec, forkedFrom=source_id)
            with self._lock(source_id):
                try:
                    self._clone_live(source_id, self._disk(spec.id))
                except StorageError as e:
                    raise NodeError("fork_failed", str(e)) from e
            if spec.size.disk_mib > self._disk_mib(spec.id):
                try:
                    disks.grow(self._disk(spec.id), spec.size.disk_mib)
                except StorageError as e:
                    raise NodeError("fork_failed", f"growing the fork's disk: {e}") from e
            self._set_phase(spec.id, "stopped")
            self._boot(spec.id, spec.size, fresh_identity=True)

    def _clone_live(self, sid: str, dst: Path) -> None:
        """Reflink-copy the sandbox's disk to ``dst``, freezing its filesystem for the copy when it is mounted.
        A ``freezing`` intent (the mount point) is in the record while it may be frozen, so a reconcile after a
        crash in that window thaws it (:mod:`sbx.node.recovery`). Raises ``StorageError``."""
        mp = disks.mounted_at(self._disk(sid))
        if mp is not None:
            rec = self._record(sid)
            rec["freezing"] = str(mp)
            self._save(sid, rec)
        try:
            disks.clone_disk(self._disk(sid), dst, mountpoint=mp)
        finally:
            if mp is not None:
                rec = self._record(sid)
                rec.pop("freezing", None)
                self._save(sid, rec)

    def _disk_mib(self, sid: str) -> int:
        return self._disk(sid).stat().st_size // (1024 * 1024)

    def _snapshot_path(self, name: str) -> Path:
        if not _SNAPSHOT_RE.match(name):
            raise NodeError("invalid_snapshot_name", f"bad snapshot name {name!r}")
        return self.snapshots_dir / f"{name}.ext4"

    def snapshot(self, id: str, name: str) -> SnapshotInfo:
        path = self._snapshot_path(name)
        if path.exists():
            raise NodeError("snapshot_exists", f"snapshot {name!r} already exists")
        with self._lock(id):
            self._record(id)
            tmp = path.with_suffix(".tmp")
            try:
                self._clone_live(id, tmp)
            except StorageError as e:
                raise NodeError("snapshot_failed", str(e)) from e
            os.chmod(tmp, 0o444)
            meta = {"name": name, "sourceId": id, "createdAt": _now()}
            path.with_suffix(".json").write_text(json.dumps(meta))
            os.replace(tmp, path)
        return self._snapshot_info(name)

    def _snapshot_info(self, name: str) -> SnapshotInfo:
        path = self.snapshots_dir / f"{name}.ext4"
        meta = json.loads(path.with_suffix(".json").read_text())
        return SnapshotInfo(
            name=name,
            source_id=meta["sourceId"],
            size_mib=path.stat().st_size >> 20,
            allocated_bytes=space.allocated_bytes(path),
            unique_bytes=space.unique_bytes(
                path, self._all_images(exclude=path) + list(self.settings.images_dir.glob("*.ext4"))
            ),
        )

    def _all_images(self, exclude: Path) -> list[Path]:
        paths = list(self.sandboxes_dir.glob("*/disk.ext4")) + list(self.snapshots_dir.glob("*.ext4"))
        paths += list(self.sandboxes_dir.glob("*/seals/*.ext4"))
        return [p for p in paths if p != exclude]

    def snapshots(self) -> list[SnapshotInfo]:
        return [self._snapshot_info(p.stem) for p in sorted(self.snapshots_dir.glob("*.ext4"))]

    def delete_snapshot(self, name: str) -> None:
        path = self._snapshot_path(name)
        if not path.exists():
            raise NodeError("not_found", f"snapshot {name!r} does not exist")
        path.unlink()
        path.with_suffix(".json").unlink(missing_ok=True)

    # ----------------------------------------------------------------- delete, stats, status, reconcile

    def delete(self, id: str) -> None:
        with self._lock(id):
            if not self._dir(id).exists():
                return
            if self.runtime.state(id) is not None:
                self.runtime.kill(id, signal.SIGKILL)
            self._cleanup_container(id)
            self._umount(id)
            shutil.rmtree(self._bundle(id), ignore_errors=True)
            shutil.rmtree(self._dir(id), ignore_errors=True)

    def _disk_space(self, sid: str) -> tuple[int, int]:
        """``(allocated, unique)`` bytes of the sandbox's disk image on the volume: what the image maps (shared
        blocks included), and how much of that no other image maps — other sandboxes' disks and seals, named
        snapshots, and the cached base images in ``settings.images_dir`` — i.e. what deleting the sandbox gives
        back. The sandbox's own seals are not counted as sharers (they go with it); blocks only its seals still
        hold are not included. ``(0, 0)`` when the disk is missing. From FIEMAP (:mod:`sbx.storage.space`)."""
        disk = self._disk(sid)
        own = self._dir(sid) / "seals"
        others = [p for p in self._all_images(exclude=disk) if p.parent != own]
        others += list(self.settings.images_dir.glob("*.ext4"))
        try:
            return space.allocated_bytes(disk), space.unique_bytes(disk, others)
        except (StorageError, OSError):
            return 0, 0

    def stats(self, id: str, space: bool = True) -> Stats:
        """A fresh sample: memory, CPU and in-sandbox disk use while running (zeros otherwise), OOM kills, and
        the disk image's allocated and unique bytes on the volume (running or not, see :meth:`_disk_space`; with
        ``space=False`` unique bytes are 0 and no other image is read). CPU percent is measured since this node's
        previous sample of the sandbox (a 0.1 s window the first time).
        Raises ``NodeError("not_found")`` for a sandbox this node does not have."""
        rec = self._record(id)
        if space:
            alloc, unique = self._disk_space(id)
        else:
            disk = self._disk(id)
            alloc, unique = (_allocated(disk), 0)
        ooms = rec.get("oomKills", 0) + rec.get("oomKillsNested", 0) + self._nested_ooms.get(id, 0)
        if self.runtime.state(id) != "running":
            return Stats(0, 0, 0.0, 0, ooms, alloc, unique)
        s = cgroup.sample(self._cgroup_path(id), previous=self._cpu_samples.get(id))
        self._cpu_samples[id] = s.cpu_mark
        st = os.statvfs(self._rootfs(id))
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        return Stats(
            memory_total_mb=s.memory_limit >> 20,
            memory_used_mb=s.memory_used >> 20,
            cpu_percent=s.cpu_percent,
            disk_used_mb=used >> 20,
            oom_kills=ooms + s.oom_kills,
            disk_allocated_bytes=alloc,
            disk_unique_bytes=unique,
        )

    def status(self, id: str) -> NodeStatus:
        if not (self._dir(id) / "node.json").is_file():
            return "absent"
        if self.runtime.state(id) == "running":
            return "running"
        return "checkpointed" if self._memory_usable(id) else "stopped"

    def reconcile(self, known: dict[str, str]) -> dict[str, NodeStatus]:
        """Bring every sandbox on this node to a consistent state after a (possibly crashed) start:

        - containers, mounts, veths and sandbox folders of ids the control plane doesn't know are removed;
        - runc commands a dead node process left running (a checkpoint, say) are killed first;
        - a stop the crash interrupted is finished: if CRIU had not started yet (no ``dump.log``) the container
          is intact and is checkpointed again; if it had, the container is not trusted (a CRIU killed while its
          parasite code runs in the tasks leaves them damaged: measured, they die moments later) and is killed;
        - a known sandbox whose container still runs (and no stop was interrupted) stays running: it survived the
          server restart;
        - otherwise any half-made container is removed, the disk unmounted, and the sandbox is ``checkpointed``
          when a complete memory image (with ``host.json``) exists, else ``stopped`` (disk only).
        """
        result: dict[str, NodeStatus] = {}
        self._thaw_all()  # first: a frozen root blocks CRIU, unmounts and the container's own shutdown
        # A node that died mid-operation leaves its runc commands running (they have sessions of their own):
        # stop them before looking at what they were working on.
        if self.runtime.kill_orphans():
            time.sleep(0.2)
        self._kill_leftover_execs()
        for cid in self.runtime.list():
            if cid not in known:
                self.runtime.delete(cid)
        if self.sandboxes_dir.is_dir():
            for d in self.sandboxes_dir.iterdir():
                if d.name not in known:
                    self.delete(d.name)
        for veth in network.host_veths("v"):
            sid = "sb_" + veth[1:]
            if sid not in known and self._owns_veth(veth):
                network.unwire_sandbox(network.Lease("", "", veth))
        for sid in known:
            with self._lock(sid):
                if not (self._dir(sid) / "node.json").is_file():
                    result[sid] = "absent"
                    continue
                rec = self._record(sid)
                if self._half_made(sid, rec):
                    log.warning("%s was interrupted before its disk was complete: removing it", sid)
                    self.delete(sid)
                    result[sid] = "absent"
                    continue
                running = self.runtime.state(sid) == "running"
                if rec["phase"] == "stopping":
                    untouched = not (self._dir(sid) / "criu-work" / "dump.log").exists()
                    if running and untouched:
                        keep = rec.get("stopKeepMemory", True) and not rec.get("haltBegun", False)
                        saved = self.stop(sid, keep_memory=keep).memory_saved
                        result[sid] = "checkpointed" if saved else "stopped"
                        continue
                elif running:
                    self._discard_memory(sid)  # whatever image is left, the disk has moved on since
                    self._set_phase(sid, "running")
                    result[sid] = "running"
                    continue
                self._cleanup_container(sid)
                self._umount(sid)
                mem_ok = self._memory_usable(sid)
                if not mem_ok:
                    self._discard_memory(sid)
                self._set_phase(sid, "checkpointed" if mem_ok else "stopped")
                result[sid] = "checkpointed" if mem_ok else "stopped"
        live = [self._lease(sid) for sid, st in result.items() if st == "running"]
        network.sync_pins(self.settings.bridge, self.settings.node_name, live)
        return result

    def _thaw_all(self) -> None:
        """Thaw every mounted sandbox root and any recorded ``freezing`` mount point ("not frozen" is ignored),
        drop the ``freezing`` intents, and remove half-written snapshot copies (``snapshots/*.tmp``)."""
        if not self.sandboxes_dir.is_dir():
            return
        for d in self.sandboxes_dir.iterdir():
            points: set[str] = set()
            mp = disks.mounted_at(d / "disk.ext4")
            if mp is not None:
                points.add(str(mp))
            try:
                rec = json.loads((d / "node.json").read_text())
            except (OSError, ValueError):
                rec = None
            if rec and rec.get("freezing"):
                points.add(str(rec["freezing"]))
            for point in sorted(points):
                if recovery.thaw(point):
                    log.warning("%s: thawed its root filesystem at %s (left frozen by a crash)", d.name, point)
            if rec and "freezing" in rec:
                rec.pop("freezing")
                self._save(d.name, rec)
        for tmp in self.snapshots_dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)

    def _half_made(self, sid: str, rec: dict[str, Any]) -> bool:
        """True for a sandbox whose disk was never completed: a create or fork interrupted while its record was
        still ``creating``, or any record whose disk is missing."""
        return rec.get("phase") == "creating" or not self._disk(sid).is_file()

    def _owns_veth(self, veth: str) -> bool:
        """True if ``veth`` is a port of this node's bridge (so another node's sandboxes are left alone)."""
        p = Path(f"/sys/class/net/{veth}/master")
        try:
            return p.resolve().name == self.settings.bridge
        except OSError:
            return False

    # ----------------------------------------------------------------- watching running sandboxes (sbx.node.watch)

    def _write_shutdown_hook(self, sid: str) -> None:
        """Install the guest's shutdown hook (it tells a reboot from a power-off) and clear the last word."""
        root = self._hostroot(sid)  # host writes go through the plain mount (EOVERFLOW through the idmapped one)
        guestfs.write_file(root, watch.HOOK_PATH, watch.HOOK_SCRIPT.encode(), mode=0o755)
        guestfs.write_file(root, watch.KIND_FILE, b"")

    def watch(self, on_exit: Callable[[str, str, str | None], None]) -> None:
        """Start noticing running sandboxes whose init ended on its own (checked about once a second, see
        :mod:`sbx.node.watch`). For each, the node removes the container, its veth and cgroups, unmounts the disk
        (kept, no memory image) and calls ``on_exit(id, kind, detail)`` with ``kind`` ``"poweroff"`` (power-off
        or halt inside), ``"reboot"`` (reboot inside: the caller should boot it again) or ``"crashed"`` (init
        killed or died; ``detail`` says so). Idempotent; :meth:`unwatch` stops it."""
        self._on_exit = on_exit
        if self._watcher is None:
            self._kernel_ooms.open()
            self._watcher = watch.Watcher(self._watch_pass)
            self._watcher.start()

    def unwatch(self) -> None:
        """Stop the watcher thread (at shutdown)."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
            self._kernel_ooms.close()

    def _count_nested_ooms(self) -> None:
        """Add OOM kills the kernel logged in a sandbox's child cgroups (its own cgroup's kills are in its
        ``memory.oom_control`` counter already) to the sandbox's count, saved in ``node.json`` (``oomKillsNested``)
        as soon as no operation holds the sandbox."""
        prefix = f"/sbx/{self.settings.node_name}/"
        for memcg in self._kernel_ooms.read():
            if memcg.startswith(prefix):
                sid, _, below = memcg.removeprefix(prefix).partition("/")
                if below:
                    self._nested_ooms[sid] = self._nested_ooms.get(sid, 0) + 1
        for sid, n in list(self._nested_ooms.items()):
            lock = self._lock(sid)
            if not lock.acquire(blocking=False):
                continue
            try:
                rec = self._record(sid)
                rec["oomKillsNested"] = rec.get("oomKillsNested", 0) + n
                self._save(sid, rec)
            except NodeError:
                pass
            finally:
                lock.release()
            self._nested_ooms.pop(sid, None)

    def _watch_pass(self) -> None:
        if not self.sandboxes_dir.is_dir():
            return
        self._count_nested_ooms()
        for d in sorted(self.sandboxes_dir.iterdir()):
            try:
                if json.loads((d / "node.json").read_text()).get("phase") != "running":
                    continue
            except (OSError, ValueError):
                continue
            if watch.init_alive(self.run_dir / "runc" / d.name / "state.json"):
                continue
            lock = self._lock(d.name)
            if not lock.acquire(blocking=False):  # an operation is working on it: it decides
                continue
            try:
                ended = self._settle_ended(d.name)
            finally:
                lock.release()
            if ended is not None and self._on_exit is not None:
                self._on_exit(d.name, *ended)

    def _settle_ended(self, sid: str) -> tuple[str, str | None] | None:
        """With the sandbox's lock held: if its init really ended, clean up and return ``(kind, detail)``."""
        try:
            rec = self._record(sid)
        except NodeError:
            return None
        if rec.get("phase") != "running" or watch.init_alive(self.run_dir / "runc" / sid / "state.json"):
            return None
        try:
            word = guestfs.read_file(self._hostroot(sid), watch.KIND_FILE, limit=64).decode(errors="replace")
        except (OSError, guestfs.UnsafePath):
            word = ""
        kind = watch.exit_kind(word)
        detail = None if kind != "crashed" else "the sandbox's init ended without a shutdown (killed or crashed)"
        log.warning("%s ended on its own: %s", sid, kind)
        rec["oomKills"] = rec.get("oomKills", 0) + cgroup.oom_kills(self._cgroup_path(sid))
        rec["phase"] = "stopping"
        rec["haltBegun"] = True
        rec["diskGen"] = int(rec.get("diskGen", 0)) + 1
        self._save(sid, rec)
        self._cleanup_container(sid)
        self._umount(sid)
        self._discard_memory(sid)
        self._seal(sid)
        self._set_phase(sid, "stopped", stopReason=kind, lastError=detail)
        return kind, detail

    # ----------------------------------------------------------------- server shutdown and leftovers

    def begin_shutdown(self, grace: float) -> None:
        """The server is going away: attached execs still running after ``grace`` seconds are killed and their
        streams end with ``NodeError("server_shutdown")`` (the API sends it as the stream's error line)."""
        self._shutdown_at = time.monotonic() + grace

    def cleanup_host(self) -> bool:
        """After the server stopped: when no sandbox container of this node runs any more, remove the bridge,
        the node's nftables table, ``/run/sbx/<node>`` and the node's cgroup folders. Returns True when it did
        (with sandboxes still running, everything stays: they need it)."""
        if any(self.runtime.state(cid) == "running" for cid in self.runtime.list()):
            return False
        network.remove_bridge(self.settings.bridge, self.settings.node_name)
        for d in self.sandboxes_dir.glob("*") if self.sandboxes_dir.is_dir() else []:
            self._umount(d.name, wait=5.0)
        cgroup.remove_tree(f"/sbx/{self.settings.node_name}")
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return True

    def _kill_leftover_execs(self) -> None:
        """Kill commands that attached execs of a killed server left running (their ``exec-*.pid`` files are
        still in the bundles): nobody can read their output any more. A pid is killed only while it is still in
        that sandbox's cgroup (never a reused pid)."""
        for pid_file in (self.run_dir / "bundles").glob("*/exec-*.pid"):
            sid = pid_file.parent.name
            try:
                pid = int(pid_file.read_text().strip())
                in_sandbox = self._cgroup_path(sid) in Path(f"/proc/{pid}/cgroup").read_text()
            except (OSError, ValueError):
                in_sandbox = False
            if in_sandbox:
                log.warning("%s: killing exec pid %d left running by a killed server", sid, pid)
                kill_process_group(pid_file)
            pid_file.unlink(missing_ok=True)

    # ----------------------------------------------------------------- helpers for tests and tools

    @contextmanager
    def mounted_root(self, sid: str) -> Iterator[Path]:
        """The host path of a running sandbox's root filesystem, unshifted (owners as on disk: the sandbox's root
        is 0 there); read and write it with :mod:`sbx.node.guestfs` only."""
        self._require_running(sid)
        yield self._hostroot(sid)


def _allocated(disk: Path) -> int:
    """Bytes the image maps on the volume (0 when it is missing)."""
    try:
        return space.allocated_bytes(disk)
    except (StorageError, OSError):
        return 0


def _resolv_conf() -> str:
    """Nameservers for sandboxes: the host's IPv4 ones, minus loopback ones (a sandbox can't reach the host's own
    services); the egress policy lets sandboxes reach exactly these on port 53 (:mod:`sbx.node.egress`)."""
    servers = egress.host_nameservers()
    return "".join(f"nameserver {s}\n" for s in servers) or "# no nameserver reachable from sandboxes\n"
