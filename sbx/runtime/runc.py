"""The runc + CRIU runtime: machine-like containers on hosts without hardware virtualization.

Each node uses its own runc state root (``runc --root``), so ``list`` shows only that node's sandboxes and a
restarted node can find and reconcile them. Checkpoint and restore follow runc's ``checkpoint``/``restore`` man
pages and what was measured here (runtime-facts): the image directory is created 0700 beforehand (else restore
fails intermittently with EACCES), the network namespace is left out of the image (``--empty-ns network``) and
rewired by the OCI prestart hook on restore.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal as _signal
import subprocess
import time
from pathlib import Path

from sbx import metrics
from sbx.runtime import kdat
from sbx.runtime.base import ContainerState, RuntimeError_, run_in
from sbx.runtime.criu import log_tail
from sbx.storage import mounts

log = logging.getLogger("sbx.runtime")

# The CRIU configuration file a bundle points at with the ``org.criu.config`` annotation (runc's checkpoint
# docs): established TCP connections come back closed rather than failing the restore when their peer has
# moved on; and no network lock (``network-lock skip``, CRIU 3.19 and later). CRIU's default lock loads iptables
# rules into the sandbox's network namespace at a dump and at a restore and removes them afterwards (about 50 ms
# each way here, through sid's iptables). What it guards is a TCP connection's state between the dump and its
# repaired restore; sbx restores every connection closed (above) and a live migration resets them at the freeze,
# so nothing depends on it. CRIU keeps the method in the image's inventory and a restore uses that one, so an
# image dumped with the lock is restored with it. Measured: resume with memory at 128 MiB 362 → 282 ms median.
# And a ghost limit of GHOST_LIMIT_MIB: an open file whose name was unlinked (a temporary file, a log rotated away)
# has no path left to reopen, so CRIU copies its content into the image; past its default limit of 1 MiB the
# whole dump failed ("Can't dump ghost file ... increase limit"), so the stop saved no memory and a live migration
# left the sandbox on its source. A larger one still fails the dump that way (bounded: the image is on the volume).
GHOST_LIMIT_MIB = 256
CRIU_CONFIG = f"tcp-close\nnetwork-lock skip\nghost-limit {GHOST_LIMIT_MIB}M\n"


class RuncRuntime:
    """:class:`sbx.runtime.base.Runtime` on runc.

    ``state_root``: runc's ``--root`` for this node (e.g. ``/run/sbx/node0/runc``); ``criu``: the CRIU wrapper
    (``/var/lib/sbx/criu/criu``); ``runc``: the runc binary name or path.
    """

    def __init__(self, state_root: Path, criu: Path, runc: str = "runc"):
        self.state_root = state_root
        self.criu = criu
        self.runc = shutil.which(runc) or runc
        state_root.mkdir(parents=True, exist_ok=True)

    def cmd(self, *args: str) -> list[str]:
        """A runc command line on this node's state root: ``runc --root <state_root> ARGS``."""
        return [self.runc, "--root", str(self.state_root), *args]

    def exec_command(self, cid: str, argv: list[str], *, uid: int, gid: int, cwd: str, env: list[str],
                     extra: tuple[str, ...] = ()) -> list[str]:
        """The ``runc exec`` command line running ``argv`` in ``cid`` as ``uid:gid`` in ``cwd`` with ``env``
        (``KEY=VALUE`` strings); ``extra`` are further exec flags (``--tty``, ``--pid-file F``)."""
        args = self.cmd("exec", "--user", f"{uid}:{gid}", "--cwd", cwd, *extra)
        for e in env:
            args += ["--env", e]
        return [*args, cid, *argv]

    def _criu_env(self) -> dict[str, str]:
        """runc's environment for checkpoint/restore: sid's iptables wrappers (``<criu_dir>/bin``) first on PATH,
        for CRIU's network lock when it restores an image dumped with one (sbx's own dumps skip it:
        :data:`CRIU_CONFIG`)."""
        path = f"{self.criu.parent / 'bin'}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        return {**os.environ, "PATH": path}

    def _run(self, op: str, args: list[str], timeout: float = 120, env: dict[str, str] | None = None) -> str:
        """Run a runc command in its own session; on timeout kill the whole session (runc and the CRIU it
        started: a restore from a damaged memory image can spin forever) and raise :class:`RuntimeError_`."""
        p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            try:
                os.killpg(p.pid, _signal.SIGKILL)
            except OSError:
                pass
            # Tasks CRIU was restoring live in sessions of their own and may still hold our pipes: don't drain
            # them; the caller kills what is left in the container's cgroup.
            for pipe in (p.stdout, p.stderr):
                if pipe is not None:
                    pipe.close()
            p.wait()
            raise RuntimeError_(op, f"timed out after {timeout:.0f} s") from e
        if p.returncode != 0:
            raise RuntimeError_(op, (err or out).strip()[-2000:])
        return out

    def boot(self, cid: str, bundle: Path) -> None:
        self._run("boot", self.cmd("run", "-d", "--bundle", str(bundle), cid))

    def exec(self, cid: str, argv: list[str], *, uid: int, gid: int, cwd: str, env: list[str],
             pid_file: Path) -> subprocess.Popen[bytes]:
        args = self.exec_command(cid, argv, uid=uid, gid=gid, cwd=cwd, env=env, extra=("--pid-file", str(pid_file)))
        return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def run(self, cid: str, argv: list[str], *, input: bytes | None = None, timeout: float = 60) -> bytes:
        """Run ``argv`` as root in the container, wait, and return its stdout. Raises :class:`RuntimeError_`
        on a non-zero exit (with its stderr)."""
        return run_in(self.cmd("exec", cid), argv, input=input, timeout=timeout)

    def checkpoint(self, cid: str, image_dir: Path, work_dir: Path, image_gid: int = 0,
                   leave_running: bool = False, page_server: str | None = None) -> None:
        """Dump with ``--tcp-established`` so an open connection (an ssh session, a client of a server inside)
        does not block the stop; the bundle's CRIU config (:data:`CRIU_CONFIG`) restores such connections closed,
        so their processes see a reset while listeners keep answering. ``image_gid``: the sandbox's shifted root
        group; the image directory is made group-owned by it with mode 0750, because restored tasks of a shifted
        map run as that host uid/gid and CRIU opens images from them ("Unable to open tty-info.img: Permission
        denied" otherwise: runtime-facts). ``leave_running``: the container goes on afterwards (``runc checkpoint
        --leave-running``; a paused container stays paused: CRIU leaves a cgroup frozen that it found frozen).
        ``page_server``: ``"ADDR:PORT"`` of a CRIU page server that takes the memory pages as they are dumped
        (``runc checkpoint --page-server``; :mod:`sbx.runtime.pageserver`); the other images stay in
        ``image_dir``."""
        for d in (image_dir, work_dir):
            remove_tree(d)
        image_dir.mkdir(mode=0o700, parents=True)
        if image_gid:
            os.chown(image_dir, 0, image_gid)
            image_dir.chmod(0o750)
        work_dir.mkdir(mode=0o700, parents=True)
        kdat.ensure(str(self.criu))
        t0 = time.monotonic()
        try:
            self._run("checkpoint", self.cmd("--criu", str(self.criu), "checkpoint", "--image-path", str(image_dir),
                                             "--work-path", str(work_dir), "--empty-ns", "network",
                                             "--tcp-established", *(["--leave-running"] if leave_running else []),
                                             *(["--page-server", page_server] if page_server else []), cid),
                      timeout=600, env=self._criu_env())
        except RuntimeError_ as e:
            metrics.CRIU_FAILURES.labels(kind="dump").inc()
            raise RuntimeError_("checkpoint", f"{e.detail}\n{log_tail(work_dir, 'dump.log')}") from e
        finally:
            metrics.CRIU_SECONDS.labels(kind="dump").observe(time.monotonic() - t0)

    def pause(self, cid: str, retries: int = 4) -> None:
        """Freeze every process of the container (``runc pause``: the cgroup freezer). Raises :class:`RuntimeError_`.

        On a cgroup v1 host runc writes ``FROZEN`` and reads the state back 1000 times in a tight loop; when the
        cgroup is still ``FREEZING`` after that (tasks just resumed by CRIU, a busy host) it thaws the cgroup
        back and fails with ``unable to freeze``. That is retried ``retries`` times, after 0.05, 0.1, 0.2 and
        0.4 s: seen once, on a migration's destination freezing the just-restored sandbox under load."""
        for attempt in range(retries + 1):
            try:
                self._run("pause", self.cmd("pause", cid), timeout=30)
                return
            except RuntimeError_ as e:
                if "unable to freeze" not in e.detail or attempt == retries:
                    raise
                log.info("%s: runc could not freeze the cgroup yet (attempt %d), trying again", cid, attempt + 1)
                time.sleep(0.05 * 2 ** attempt)

    def unpause(self, cid: str) -> None:
        """Thaw a paused container (``runc resume``). Raises :class:`RuntimeError_`."""
        self._run("unpause", self.cmd("resume", cid), timeout=30)

    def restore(self, cid: str, bundle: Path, image_dir: Path, work_dir: Path) -> None:
        """Restore detached. Times out after 30 s plus 1 s per 20 MiB of image (a healthy 1 GiB restore takes
        under 2 s here), so a damaged image fails the restore instead of hanging it."""
        image_mib = sum(f.stat().st_size for f in image_dir.iterdir() if f.is_file()) >> 20
        timeout = 30 + image_mib / 20
        remove_tree(work_dir)
        work_dir.mkdir(mode=0o700, parents=True)
        kdat.ensure(str(self.criu))
        t0 = time.monotonic()
        try:
            self._run("restore", self.cmd("--criu", str(self.criu), "restore", "-d", "--image-path", str(image_dir),
                                          "--work-path", str(work_dir), "--bundle", str(bundle), cid),
                      timeout=timeout, env=self._criu_env())
        except RuntimeError_ as e:
            metrics.CRIU_FAILURES.labels(kind="restore").inc()
            raise RuntimeError_("restore", f"{e.detail}\n{log_tail(work_dir, 'restore.log')}") from e
        finally:
            metrics.CRIU_SECONDS.labels(kind="restore").observe(time.monotonic() - t0)

    def _state(self, cid: str) -> dict | None:
        p = subprocess.run(self.cmd("state", cid), capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            return None
        return json.loads(p.stdout)

    def state(self, cid: str) -> ContainerState | None:
        s = self._state(cid)
        return s["status"] if s else None

    def init_pid(self, cid: str) -> int | None:
        s = self._state(cid)
        return int(s["pid"]) if s and s.get("pid") else None

    def kill(self, cid: str, signal: int = _signal.SIGKILL) -> None:
        subprocess.run(self.cmd("kill", cid, str(int(signal))), capture_output=True, stdin=subprocess.DEVNULL)

    def delete(self, cid: str) -> None:
        """``runc delete --force``; then drop runc's state directory for ``cid`` if it is still there (a restore
        killed half-way leaves one that ``runc state`` can't read and ``runc run`` trips over)."""
        # A killed `runc restore` leaves the sandbox's root bind-mounted at <state>/<cid>/criu-root, and
        # `runc delete` removes its state directory recursively: through that mount it would delete the
        # sandbox's files (measured). Detach every mount below the state directory first.
        detach_mounts_below(self.state_root / cid)
        subprocess.run(self.cmd("delete", "--force", cid), capture_output=True, stdin=subprocess.DEVNULL)
        leftover = self.state_root / cid
        if leftover.is_dir():
            remove_tree(leftover)

    def kill_orphans(self) -> int:
        """SIGKILL every runc command still running against this state root (and everything in its session: the
        CRIU it started), e.g. a checkpoint left behind by a node process that died. runc commands run in
        sessions of their own (see :meth:`_run`), so they outlive their caller. Returns how many were killed."""
        marker = ["--root", str(self.state_root)]
        killed = 0
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if not argv or os.path.basename(argv[0]) != "runc":
                continue
            if any(argv[i:i + 2] == marker for i in range(len(argv) - 1)):
                pid = int(proc.name)
                try:
                    pgid = os.getpgid(pid)
                    # Its own group (a checkpoint and its CRIU): kill the group. A `runc exec` shares the group of
                    # the server that started it, which may also hold the server's parent (a shell, a test
                    # runner): kill only that process then.
                    if pgid == pid and pgid != os.getpgrp():
                        os.killpg(pgid, _signal.SIGKILL)
                    else:
                        os.kill(pid, _signal.SIGKILL)
                    killed += 1
                except OSError:
                    pass
        return killed

    def list(self) -> list[str]:
        return list(self.statuses())

    def statuses(self) -> dict[str, str]:
        """``{container id: status}`` (``running``, ``paused``, ``stopped``, ``created``) of every container, from
        one ``runc list``."""
        p = subprocess.run(self.cmd("list", "--format", "json"), capture_output=True, text=True,
                           stdin=subprocess.DEVNULL)
        if p.returncode != 0 or not p.stdout.strip() or p.stdout.strip() == "null":
            return {}
        return {c["id"]: c.get("status", "") for c in json.loads(p.stdout)}


def detach_mounts_below(path: Path) -> None:
    """Lazily unmount every mount point strictly below ``path`` (deepest first)."""
    prefix = os.path.realpath(path) + "/"
    targets = [str(m.mountpoint) for m in mounts.mounts()]
    for target in sorted((t for t in targets if t.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)


def remove_tree(path: Path) -> None:
    """Remove a directory runc or CRIU worked in without ever crossing into another filesystem.

    A killed CRIU leaves its cgroup yard mounted in the work directory and a killed ``runc restore`` leaves the
    sandbox's root bind-mounted at ``<state>/<cid>/criu-root``: a plain recursive delete would walk into those
    mounts and delete the sandbox's files or fight cgroupfs. Here every directory that is a mount point (listed in
    mountinfo, or on another device) is unmounted lazily and never descended into; it is only ``rmdir``-ed."""
    if not path.exists():
        return
    mountpoints = {str(m.mountpoint) for m in mounts.mounts()}
    root_dev = os.lstat(path).st_dev

    def is_mount(p: str, st: os.stat_result) -> bool:
        return p in mountpoints or st.st_dev != root_dev

    def detach(p: str) -> None:
        subprocess.run(["umount", "-R", "-l", p], capture_output=True)
        try:
            os.rmdir(p)
        except OSError:
            pass

    def clear(d: str) -> None:
        with os.scandir(d) as it:
            entries = list(it)
        for e in entries:
            st = e.stat(follow_symlinks=False)
            if e.is_dir(follow_symlinks=False):
                if is_mount(e.path, st):
                    detach(e.path)
                    continue
                clear(e.path)
                try:
                    os.rmdir(e.path)
                except OSError:
                    pass
            else:
                try:
                    os.unlink(e.path)
                except OSError:
                    pass

    top = os.path.realpath(path)
    if is_mount(top, os.lstat(top)):
        detach(top)
        return
    clear(top)
    try:
        os.rmdir(top)
    except OSError:
        pass


def kill_process_group(pid_file: Path, sig: int = _signal.SIGKILL) -> bool:
    """Kill the process group led by the host PID in ``pid_file`` (a ``runc exec`` process leads its own
    session and group). Returns False if the file or the group is gone."""
    try:
        pid = int(pid_file.read_text().strip())
        os.killpg(pid, sig)
        return True
    except (OSError, ValueError):
        return False
