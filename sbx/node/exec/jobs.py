"""Running commands in a sandbox: :class:`ExecMixin`.

Attached execs (``runc exec``, output streamed as :class:`sbx.node.types.ExecEvent`), detached jobs (transient
systemd units, output under ``/var/lib/sbx-jobs/<job>/``: list, read, kill), and spawned processes with pipes
or a pty (file transfer, terminals).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import selectors
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sbx.node.agentbase import now
from sbx.node.exec.attached import ChannelMixin
from sbx.node.exec.terminal import set_winsize
from sbx.node.types import ExecEvent, JobInfo, NodeError
from sbx.runtime.base import RuntimeError_
from sbx.runtime.runc import kill_process_group

USER_UID = 1000
USER_GID = 1000
JOBS_DIR = "/var/lib/sbx-jobs"
_JOB_RE = re.compile(r"^job_[a-z0-9]{8}$")


SIZED_TTY = ["/bin/sh", "-c", 'stty cols "$1" rows "$2" 2>/dev/null; shift 2; exec "$@"', "sbx-tty"]
"""The prefix of a terminal command (then columns, rows, the command): runc makes the sandbox's terminal and
copies the size of its own onto it only after the command has started, so a command that reads its size at once
(``stty size``, a full-screen program drawing its first screen) saw 0x0; set inside first, the size is there."""


@dataclass(frozen=True)
class Login:
    """Who an exec runs as: ``name``, ``uid``/``gid``, ``home``, the ``shell`` that runs the command (``-lc``), the
    default working directory ``cwd`` and the image's environment ``image_env`` (Dockerfile ``ENV``)."""

    name: str
    uid: int
    gid: int
    home: str
    shell: str
    cwd: str
    image_env: dict[str, str]


def login_for(image: dict[str, Any] | None, user: str) -> Login:
    """The :class:`Login` of ``user`` (``"user"`` or ``"root"``) in a sandbox of ``image`` (its facts,
    :attr:`sbx.node.types.SandboxSpec.image`; None: sbx's default image, where ``user`` is uid 1000 in
    ``/home/user`` and commands run in bash). In a user image, ``"user"`` is the Dockerfile's ``USER`` when it set
    one (as ``docker run`` would run), else sbx's ``user`` account; the ids and home come from the image's
    ``/etc/passwd`` as read when it was built; the default directory is its ``WORKDIR`` when it set one."""
    if image is None:
        if user == "root":
            return Login("root", 0, 0, "/root", "/bin/bash", "/root", {})
        return Login("user", USER_UID, USER_GID, "/home/user", "/bin/bash", "/home/user", {})
    users: dict[str, Any] = image.get("users") or {}
    name = "root" if user == "root" else (image.get("user") or "user")
    default: list[Any] = [0, 0, "/root"] if name == "root" else [USER_UID, USER_GID, "/home/user"]
    uid, gid, home = (list(users.get(name) or []) or default)[:3]
    env = {str(k): str(v) for k, v in (image.get("env") or {}).items()}
    return Login(name, int(uid), int(gid), str(home), str(image.get("shell") or "/bin/sh"),
                 str(image.get("workdir") or home), env)


def _login_env(login: Login, extra: dict[str, str] | None) -> list[str]:
    env = {
        "HOME": login.home,
        "USER": login.name,
        "LOGNAME": login.name,
        "SHELL": login.shell,
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
        "TERM": "xterm-256color",
    }
    env.update(login.image_env)
    env.update(extra or {})
    return [f"{k}={v}" for k, v in env.items()]


class ExecMixin(ChannelMixin):
    """Exec, jobs and spawn (part of :class:`sbx.node.agent.LocalNode`); attached execs use the exec channel of
    :class:`sbx.node.exec.attached.ChannelMixin` when the sandbox's agent answers."""

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
        """Run ``command`` with ``bash -lc`` as ``user`` (``user`` or ``root``) in ``cwd`` (default: the user's
        home) with the sandbox's env plus ``env``; yields :class:`ExecEvent` output pieces, then one ``exit``
        (124 and ``timed_out`` after ``timeout`` seconds, the command's process group killed). ``stop``: polled
        while it runs; True ends the stream and kills the command. Through the sandbox's exec agent when it
        answers (:mod:`sbx.node.exec.channel`), else ``runc exec``; the two give the same events. Raises
        ``NodeError`` ``not_running``/``not_found`` before anything runs. In a sandbox of a user image, the
        image's user, shell, ``WORKDIR`` and ``ENV`` apply (:func:`login_for`)."""
        self._require_running(id)
        rec = self._record(id)
        login = login_for(self._image_of(rec), user)
        uid, gid = login.uid, login.gid
        argv = [login.shell, "-lc", command]
        envs = _login_env(login, self._exec_env(rec, env))
        if self.settings.exec_channel:
            started = self._channel_start(id, argv, uid, gid, cwd or login.cwd, envs)
            if started is not None:
                return self._channel_stream(id, *started, timeout, stop)
        pid_file = self._bundle(id) / f"exec-{secrets.token_hex(4)}.pid"
        proc = self.runtime.exec(id, argv, uid=uid, gid=gid, cwd=cwd or login.cwd, env=envs, pid_file=pid_file)
        events = self._stream(proc, pid_file, timeout, stop)
        return self._gvisor_killed(id, events) if self.runtime.gvisor(id) else events

    def _gvisor_killed(self, sid: str, events: Iterator[ExecEvent]) -> Iterator[ExecEvent]:
        """``events`` of a ``runsc exec``, with exit 128 (runsc lost its sandbox) made 137 when the sandbox's kernel
        is gone: the memory cgroup killed it whole, as it kills a program over the limit in the container class."""
        for ev in events:
            if ev.kind == "exit" and ev.exit_code == 128 and self.runtime.state(sid) != "running":
                ev = ExecEvent(kind="exit", exit_code=137)
            yield ev

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

    def _root(self, sid: str, script: str, *args: str, input: bytes | None = None) -> bytes:
        shell = login_for(self._image_of(self._record(sid)), "root").shell
        try:
            return self.runtime.run(sid, [shell, "-c", script, "sbx", *args], input=input)
        except RuntimeError_ as e:
            raise NodeError("exec_failed", e.detail) from e

    def exec_detached(self, id: str, command: str, *, user: str = "user", env: dict[str, str] | None = None,
                      cwd: str | None = None, timeout: float | None = None, stdin: str | None = None) -> JobInfo:
        """Start ``command`` as a transient systemd unit (``systemd-run``) inside the sandbox. A process that
        ``runc exec`` starts is reparented outside the container's process tree when runc exits, so CRIU would not
        dump it (measured); a unit of the sandbox's own systemd is a child of PID 1 and survives stop/resume with
        memory. Output goes to ``/var/lib/sbx-jobs/<job>/{stdout,stderr}``, the exit code to ``exit``. ``env`` is
        added to the sandbox's, ``cwd`` (absolute) replaces the home directory, ``timeout`` seconds runs it under
        coreutils ``timeout`` (exit 124 when it fires), ``stdin`` is saved beside it and fed to it.

        The unit has ``OOMPolicy=continue``: systemd's default (``stop``, systemd.service(5)) stops the whole unit
        when the kernel OOM-kills one of its processes, which could kill the wrapper before it wrote the exit
        code (a job killed that way then looked like a success)."""
        self._require_running(id)
        job = "job_" + "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(8))
        rec = self._record(id)
        image = self._image_of(rec)
        if self.runtime.gvisor(id):  # sbx's minimal init there: no systemd-run, and runsc exec trees aren't restored
            raise NodeError("not_supported", "detached commands (jobs) are not supported for sandboxes of the gvisor "
                                             "runtime class (no systemd inside): run the command attached")
        if image is not None and image.get("init") != "systemd":
            raise NodeError("not_supported", "detached commands need systemd, and this sandbox's image has none "
                                             "(it runs sbx's minimal init): run the command attached")
        login = login_for(image, user)
        uid = str(login.uid)
        home = cwd or login.cwd
        env_args = [f"--setenv={e}" for e in _login_env(login, self._exec_env(rec, env))]
        limit = f"timeout -k 5 {min(float(timeout), 1e7):.3f} " if timeout else ""
        script = (
            'set -e; d="$1"; shift; mkdir -p "$d"; chmod 0755 "$(dirname "$d")"; printf "%s" "$CMD" > "$d/cmd"; '
            'printf "%s" "$STDIN" > "$d/stdin"; '
            'date -u +%Y-%m-%dT%H:%M:%SZ > "$d/started"; chown -R "$UIDN:$GIDN" "$d"; '
            'systemd-run --quiet --collect --unit="sbx-$JOB" --uid="$UIDN" --gid="$GIDN" --property=OOMPolicy=continue '
            '--working-directory="$HOMED" "$@" /bin/bash -c '
            f'\'{limit}bash -lc "$(cat "$0/cmd")" <"$0/stdin" >"$0/stdout" 2>"$0/stderr"; echo $? > "$0/exit"\' "$d"'
        )
        full = (f"CMD={shlex.quote(command)} STDIN={shlex.quote(stdin or '')} JOB={job} UIDN={uid} GIDN={login.gid} "
                f"HOMED={shlex.quote(home)}; " + script)
        self._root(id, full, f"{JOBS_DIR}/{job}", *env_args)
        return JobInfo(id=job, command=command, running=True, exit_code=None, started_at=now())

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
            '[ -n "$e" ] || e=$(cat "$d/exit" 2>/dev/null || true); '  # it may have ended between the two reads
            'jq -cn --arg id "$j" --rawfile cmd "$d/cmd" --arg exit "$e" --arg started "$s" --arg active "$a" '
            "'{id:$id,cmd:$cmd,exit:$exit,started:$started,active:$active}'; done"
        )
        out = self._root(id, script).decode()
        jobs = []
        for line in out.splitlines():
            d = json.loads(line)
            code = int(d["exit"]) if d["exit"].strip().lstrip("-").isdigit() else None
            active = d["active"] in ("active", "activating", "deactivating")
            if code is None and not active:
                code = 137  # its unit ended before the wrapper could record a code: it was killed (SIGKILL)
            jobs.append(
                JobInfo(
                    id=d["id"],
                    command=d["cmd"],
                    running=code is None,
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
              tty: bool = False, env: dict[str, str] | None = None,
              size: tuple[int, int] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` in the sandbox as ``user`` in its home, with pipes for stdout/stderr (and stdin when
        ``stdin``), and return the process. Everything it touches is resolved inside the sandbox's own mount
        namespace, so files moved this way can never follow a sandbox symlink onto the host. With ``tty`` the
        process gets a pseudo-terminal: the returned process's stdin/stdout are the host side of a pty pair
        (runc ``exec --tty`` relays it into the container), stderr is merged into it. The sandbox's terminal has
        ``size`` (``(columns, rows)``) before ``argv`` starts (:data:`SIZED_TTY`)."""
        self._require_running(id)
        rec = self._record(id)
        login = login_for(self._image_of(rec), user)
        uid, gid, home = login.uid, login.gid, login.home
        envs = _login_env(login, self._exec_env(rec, env))
        if tty:
            import pty

            cols, rows = size or (80, 24)
            master, slave = pty.openpty()
            set_winsize(slave, cols, rows)
            argv = [*SIZED_TTY, str(cols), str(rows), *argv]
            args = self.runtime.exec_command(id, argv, uid=uid, gid=gid, cwd=home, env=envs, extra=("--tty",))
            proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
            os.close(slave)
            proc.pty_master = master  # type: ignore[attr-defined]
            return proc
        args = self.runtime.exec_command(id, argv, uid=uid, gid=gid, cwd=home, env=envs)
        return subprocess.Popen(args, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
