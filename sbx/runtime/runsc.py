"""The gVisor runtime class: ``runsc`` (Debian trixie's static build, :data:`RUNSC_PATH`) with the systrap platform.

A gvisor sandbox's processes talk to gVisor's own kernel (the Sentry), never to the host's: what the host kernel
sees is the Sentry and its file proxy (the gofer), each confined by runsc's own seccomp filters and namespaces.
Same :class:`sbx.runtime.base.Runtime` shape as :class:`sbx.runtime.runc.RuncRuntime`; what differs, measured here
(``shared/notes/runtime-facts.md``, gVisor section):

- runsc's check "network enabled in the root network namespace" misfires on this kernel; every runsc that creates
  or restores a sandbox runs in a private mount namespace with an empty tmpfs over ``/proc/sys/net``
  (:func:`start_argv`);
- the network namespace is made beforehand (``ip netns add``, :meth:`RunscRuntime.fresh_netns`) and wired by the
  node before ``run``/``restore``: runsc takes the interfaces it finds there at start (and strips their address
  and routes from the host's view), so a restore needs them put back first (the node rewires);
- the container's stdio are ``/dev/null``: a host file the Sentry holds can't be saved and restored (restore fails
  ``no host FD available for :host:1``); runsc's own errors go to a log file (``--log``) whose last line is quoted;
- ``--net-disconnect-ok``: open TCP connections are reset by a checkpoint instead of failing it;
- a checkpoint leaves the sandbox listed ``running``: it is deleted with ``--force`` afterwards;
- processes started by ``runsc exec`` are not restored (gVisor's restore leaves exec'd process trees out, by design);
  the init's process tree (sshd, the exec agent and what they start) is;
- ``runsc exec`` has no ``--tty``: a terminal's process goes in a process file with ``terminal: true``;
- ``runsc exec --pid-file`` names the host ``runsc exec`` client, not the guest process: killing it leaves the guest
  command running (and the Sentry holds the output pipes open), so :meth:`RunscRuntime.exec` kills the guest
  command's process group (its guest pid, ``--internal-pid-file``, leads one) when the client was killed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal as _signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from sbx.runtime.base import ContainerState, RuntimeError_, run_in

log = logging.getLogger("sbx.runtime")

#: Where ``sbx setup`` puts runsc (:mod:`sbx.node.host.runscinstall`).
RUNSC_PATH = Path("/usr/local/lib/sbx/runsc")
#: The platform: systrap works without KVM (runtime-facts); ptrace is the slow fallback.
PLATFORM = "systrap"
#: Flags every runsc command gets: the platform, the sandbox's root written through to the disk (no overlay in
#: memory: the disk is the sandbox's, as in the container class) and checkpoints that reset open connections.
GLOBAL_FLAGS = ("--platform", PLATFORM, "--overlay2", "none", "--net-disconnect-ok")
#: The shell line that hides ``/proc/sys/net`` behind an empty tmpfs, then runs its arguments (see module doc).
_NET_CHECK_WORKAROUND = 'mount -t tmpfs -o size=4k,mode=0555 sbx-runsc /proc/sys/net && exec "$@"'
#: The TCP port of the exec agent's relay in a gvisor sandbox (``sbx/guest/gvisor/sbx-relay``).
AGENT_RELAY_PORT = 7422
#: The relay in the sandbox (the node writes it into the disk at every start) and the file of its token.
AGENT_RELAY = "/usr/lib/sbx/sbx-relay"
AGENT_RELAY_TOKEN = "/etc/sbx/relay-token"
#: The prefix of sbx's network namespaces (``/run/netns/<prefix><id>``).
NETNS_PREFIX = "sbx-"
NETNS_DIR = Path("/run/netns")


def start_argv(argv: list[str]) -> list[str]:
    """``argv`` (a runsc ``run``/``restore`` command) wrapped to run in a private mount namespace where
    ``/proc/sys/net`` is an empty tmpfs (runsc's root-netns check misfires on this kernel otherwise)."""
    return ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", _NET_CHECK_WORKAROUND, "runsc", *argv]


def last_log_error(path: Path) -> str:
    """The message of the last line of runsc's JSON log at ``path`` (``{"msg": ..., "level": "error"}``), or its
    raw last line; empty when there is none."""
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        try:
            doc = json.loads(line)
        except ValueError:
            return line.strip()[-2000:]
        if isinstance(doc, dict) and doc.get("msg"):
            return str(doc["msg"])[-2000:]
    return ""


def netns_name(cid: str) -> str:
    """The network namespace name of sandbox ``cid`` (``sbx-<cid>``)."""
    return f"{NETNS_PREFIX}{cid}"


class RunscRuntime:
    """:class:`sbx.runtime.base.Runtime` on runsc.

    ``state_root``: runsc's ``--root`` for this node (e.g. ``/run/sbx/node0/runsc``); ``runsc``: the binary."""

    def __init__(self, state_root: Path, runsc: Path = RUNSC_PATH):
        self.state_root = state_root
        self.runsc = runsc
        state_root.mkdir(parents=True, exist_ok=True)

    def available(self) -> bool:
        """Whether the runsc binary is there and executable."""
        return os.access(self.runsc, os.X_OK)

    def cmd(self, *args: str) -> list[str]:
        """A runsc command line on this node's state root with :data:`GLOBAL_FLAGS`."""
        return [str(self.runsc), "--root", str(self.state_root), *GLOBAL_FLAGS, *args]

    def exec_command(self, cid: str, argv: list[str], *, uid: int, gid: int, cwd: str, env: list[str],
                     extra: tuple[str, ...] = ()) -> list[str]:
        """The ``runsc exec`` command line running ``argv`` in ``cid`` as ``uid:gid`` in ``cwd`` with ``env``
        (``KEY=VALUE``); ``extra`` are further exec flags. runsc exec has no ``--tty``: with ``--tty`` in ``extra`` the
        process is described in a process file (``--process``, ``terminal: true``), and runsc gives it the terminal
        its own stdin is (the command is a session leader without a controlling terminal: ``tty`` answers "not a
        tty", ``stty`` and ``test -t`` work)."""
        if "--tty" in extra:
            process = self._process_file(cid, argv, uid=uid, gid=gid, cwd=cwd, env=env)
            rest = tuple(x for x in extra if x != "--tty")
            return self.cmd("exec", *rest, "--process", str(process), cid)
        args = self.cmd("exec", "--user", f"{uid}:{gid}", "--cwd", cwd, *extra)
        for e in env:
            args += ["--env", e]
        return [*args, cid, *argv]

    def _process_file(self, cid: str, argv: list[str], *, uid: int, gid: int, cwd: str, env: list[str]) -> Path:
        """Write an OCI process (``terminal: true``) for ``runsc exec --process`` under ``<root>/<cid>.exec/`` (files
        older than a minute there are removed: runsc read them at its start). Root gets the capabilities of the
        sandbox's own process, as ``runsc exec`` gives them without a process file."""
        folder = self.state_root / f"{cid}.exec"
        folder.mkdir(mode=0o700, exist_ok=True)
        now = time.time()
        for old in folder.glob("*.json"):
            with contextlib.suppress(OSError):
                if now - old.stat().st_mtime > 60:
                    old.unlink()
        doc = self._state_file(cid) or {}
        spec = doc.get("spec") if isinstance(doc.get("spec"), dict) else {}
        caps = (spec or {}).get("process", {}).get("capabilities") if uid == 0 else None
        process: dict[str, object] = {"terminal": True, "user": {"uid": uid, "gid": gid}, "args": list(argv),
                                      "env": list(env), "cwd": cwd}
        if caps:
            process["capabilities"] = caps
        path = folder / f"{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}.json"
        path.write_text(json.dumps(process))
        return path

    def _log(self, cid: str) -> Path:
        return self.state_root / f"{cid}.log"

    def _run(self, op: str, args: list[str], cid: str, timeout: float = 120, start: bool = False) -> str:
        """Run a runsc command (``start``: wrapped by :func:`start_argv`, stdio ``/dev/null`` so the sandbox holds
        no host file); raise :class:`RuntimeError_` with runsc's error (its log's last message) on failure."""
        logf = self._log(cid)
        with contextlib.suppress(OSError):
            logf.unlink()
        argv = [str(self.runsc), "--root", str(self.state_root), "--log", str(logf), *GLOBAL_FLAGS, *args]
        if start:
            argv = start_argv(argv)
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL if start else subprocess.PIPE,
                             stderr=subprocess.DEVNULL if start else subprocess.PIPE, text=True,
                             start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, _signal.SIGKILL)
            p.wait()
            raise RuntimeError_(op, f"runsc {args[0]} timed out after {timeout:.0f} s") from e
        if p.returncode != 0:
            detail = last_log_error(logf) or (err or out or "").strip()[-2000:] or f"runsc exited {p.returncode}"
            raise RuntimeError_(op, detail)
        return out or ""

    # ------------------------------------------------------------------------------------------- network namespace

    def netns_path(self, cid: str) -> Path:
        """The bind-mounted network namespace of ``cid`` (``/run/netns/sbx-<cid>``)."""
        return NETNS_DIR / netns_name(cid)

    def fresh_netns(self, cid: str) -> Path:
        """A new, empty network namespace for ``cid`` (an old one is removed first: runsc scraped its interfaces).
        Returns its path. Raises :class:`RuntimeError_`."""
        self.remove_netns(cid)
        p = subprocess.run(["ip", "netns", "add", netns_name(cid)], capture_output=True, text=True,
                           stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            raise RuntimeError_("boot", f"ip netns add {netns_name(cid)}: {p.stderr.strip()}")
        return self.netns_path(cid)

    def remove_netns(self, cid: str) -> None:
        """Remove ``cid``'s network namespace if there is one (its interfaces go with it)."""
        if self.netns_path(cid).exists():
            subprocess.run(["ip", "netns", "delete", netns_name(cid)], capture_output=True, stdin=subprocess.DEVNULL)

    @contextlib.contextmanager
    def netns_holder(self, cid: str) -> Iterator[int]:
        """A host process inside ``cid``'s network namespace while the block runs: its PID, for code that
        configures a namespace by PID (``/proc/PID/ns/net``). Raises :class:`RuntimeError_` when it can't start."""
        path = self.netns_path(cid)
        want = os.stat(path).st_ino
        p = subprocess.Popen(["nsenter", f"--net={path}", "sleep", "60"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 5
            while True:
                with contextlib.suppress(OSError):
                    if os.stat(f"/proc/{p.pid}/ns/net").st_ino == want:
                        break
                if p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError_("boot", f"could not enter {path}")
                time.sleep(0.002)
            yield p.pid
        finally:
            p.kill()
            p.wait()

    # ------------------------------------------------------------------------------------------------- lifecycle

    def boot(self, cid: str, bundle: Path) -> None:
        """``runsc run --detach`` (see the module doc for the wrapping); the bundle's network namespace must exist
        and be wired."""
        self._run("boot", ["run", "--detach", "--bundle", str(bundle), cid], cid, start=True)

    def exec(self, cid: str, argv: list[str], *, uid: int, gid: int, cwd: str, env: list[str],
             pid_file: Path) -> subprocess.Popen[bytes]:
        """Start ``runsc exec`` (its own session; ``pid_file`` gets the client's host PID). When the client is
        killed (a timeout, a caller gone), the guest process it ran is killed too, by its guest PID."""
        inner = pid_file.with_name(pid_file.name + ".guest")
        args = self.exec_command(cid, argv, uid=uid, gid=gid, cwd=cwd, env=env,
                                 extra=("--pid-file", str(pid_file), "--internal-pid-file", str(inner)))
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)

        def reap_guest() -> None:
            proc.wait()
            try:
                if proc.returncode < 0:  # its process group inside (it leads one, as runc exec's command does)
                    gpid = int(inner.read_text().strip())
                    subprocess.run(self.cmd("exec", cid, "/bin/sh", "-c", f"kill -9 -{gpid}"), capture_output=True,
                                   stdin=subprocess.DEVNULL, timeout=30)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
            finally:
                inner.unlink(missing_ok=True)

        threading.Thread(target=reap_guest, name=f"runsc-exec-{cid}", daemon=True).start()
        return proc

    def run(self, cid: str, argv: list[str], *, input: bytes | None = None, timeout: float = 60) -> bytes:
        """Run ``argv`` as root in the sandbox, wait, and return its stdout. Raises :class:`RuntimeError_` on a
        non-zero exit (with its stderr)."""
        return run_in(self.cmd("exec", cid), argv, input=input, timeout=timeout)

    def checkpoint(self, cid: str, image_dir: Path, work_dir: Path, image_gid: int = 0,
                   leave_running: bool = False, page_server: str | None = None) -> None:
        """``runsc checkpoint`` into a fresh ``image_dir`` (uncompressed, direct I/O: 0.17-0.28 s at 128 MiB here
        against 0.7-1.0 s compressed), then delete the stopped sandbox (runsc leaves it listed as running).
        ``work_dir`` and ``image_gid`` are unused (no CRIU); ``page_server`` is refused: runsc has no page server."""
        if page_server is not None:
            raise RuntimeError_("checkpoint", "runsc can't send memory pages to a page server")
        if image_dir.exists():
            shutil.rmtree(image_dir)
        image_dir.mkdir(mode=0o700, parents=True)
        self._run("checkpoint", ["checkpoint", "--image-path", str(image_dir), "--compression=none", "--direct",
                                 *(["--leave-running"] if leave_running else []), cid], cid, timeout=600)
        if not leave_running:
            self.delete(cid)

    def pause(self, cid: str) -> None:
        """``runsc pause``. Raises :class:`RuntimeError_`."""
        self._run("pause", ["pause", cid], cid, timeout=30)

    def unpause(self, cid: str) -> None:
        """``runsc resume``. Raises :class:`RuntimeError_`."""
        self._run("unpause", ["resume", cid], cid, timeout=30)

    def restore(self, cid: str, bundle: Path, image_dir: Path, work_dir: Path) -> None:
        """``runsc restore --detach`` from ``image_dir`` (same PIDs and memory; processes of ``runsc exec`` are not
        restored). The bundle's network namespace must be wired again first. Times out after 30 s plus 1 s per
        20 MiB of image."""
        image_mib = sum(f.stat().st_size for f in image_dir.iterdir() if f.is_file()) >> 20
        self.delete(cid)
        self._run("restore", ["restore", "--detach", "--image-path", str(image_dir), "--bundle", str(bundle), cid],
                  cid, timeout=30 + image_mib / 20, start=True)

    def _state_file(self, cid: str) -> dict | None:
        """runsc's own state file (``<root>/<cid>_sandbox:<cid>.state``), or None when missing or unreadable."""
        try:
            doc = json.loads((self.state_root / f"{cid}_sandbox:{cid}.state").read_text())
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def state(self, cid: str) -> ContainerState | None:
        """The sandbox's status. Fast path: runsc's state file says ``running`` and the Sandbox process lives (no
        runsc started: ~0.1 ms against ~20 ms); else ``runsc state``."""
        doc = self._state_file(cid)
        if doc is None:
            return None
        pid = self._sandbox_pid(doc)
        if doc.get("status") == "running" and pid and _alive(pid):
            return "running"
        p = subprocess.run(self.cmd("state", cid), capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            return None
        try:
            status = json.loads(p.stdout).get("status")
        except ValueError:
            return None
        return status if status in ("creating", "created", "running", "paused", "stopped") else None

    @staticmethod
    def _sandbox_pid(doc: dict) -> int | None:
        sandbox = doc.get("sandbox")
        pid = sandbox.get("pid") if isinstance(sandbox, dict) else None
        return pid if isinstance(pid, int) and pid > 0 else None

    def init_pid(self, cid: str) -> int | None:
        """Host PID of the Sandbox process (the Sentry: the guest's processes have no host PIDs of their own)."""
        doc = self._state_file(cid)
        return self._sandbox_pid(doc) if doc else None

    def kill(self, cid: str, signal: int = 9) -> None:
        """Send ``signal`` to the sandbox's init (no error if it is gone)."""
        subprocess.run(self.cmd("kill", cid, str(signal)), capture_output=True, stdin=subprocess.DEVNULL, timeout=30)

    def delete(self, cid: str, wait: float = 10.0) -> None:
        """``runsc delete --force`` (kills it first; no error if unknown), then wait up to ``wait`` seconds until its
        Sandbox and gofer processes are gone: the gofer's root is the sandbox's disk, and a disk still mounted
        there keeps its loop device busy (an unmount right after the delete then waited 16 s, seen)."""
        doc = self._state_file(cid)
        if doc is None and not any(self.state_root.glob(f"{cid}_sandbox*")):
            return
        pids = [p for p in (self._sandbox_pid(doc) if doc else None, (doc or {}).get("goferPid"))
                if isinstance(p, int) and p > 0]
        subprocess.run(self.cmd("delete", "--force", cid), capture_output=True, stdin=subprocess.DEVNULL,
                       timeout=60)
        t0 = time.monotonic()
        while any(_alive(p) for p in pids) and time.monotonic() < t0 + wait:
            time.sleep(0.01)
        left = [p for p in pids if _alive(p)]
        if left or time.monotonic() - t0 > 1:
            log.warning("%s: runsc processes %s took %.1f s to end after the delete%s", cid, pids,
                        time.monotonic() - t0, f"; still there: {left}" if left else "")

    def destroy(self, cid: str) -> None:
        """:meth:`delete` and remove the network namespace and the log: nothing of ``cid`` stays."""
        self.delete(cid)
        self.remove_netns(cid)
        with contextlib.suppress(OSError):
            self._log(cid).unlink()
        shutil.rmtree(self.state_root / f"{cid}.exec", ignore_errors=True)

    def list(self) -> list[str]:
        """Ids of the sandboxes in this state root."""
        return sorted({p.name.split("_sandbox:", 1)[0] for p in self.state_root.glob("*_sandbox:*.state")})

    def statuses(self) -> dict[str, str]:
        """``{id: status}`` of every sandbox in this state root."""
        return {cid: self.state(cid) or "stopped" for cid in self.list()}


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")
