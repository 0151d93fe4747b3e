"""envd's processes, made of sbx's detached jobs (:meth:`sbx.control.service.ControlPlane.exec_detached`).

A process started through ``process.Process/Start`` must outlive the stream that started it, be found again by its
pid (``Connect``, ``SendSignal``, ``List``) and survive a pause (= a stop with memory) with the same pid: exactly
what an sbx job is (a transient unit of the sandbox's own systemd, output in ``/var/lib/sbx-jobs/<job>/``, kept by
CRIU). So each process is a job whose command is::

    printf '%s\\n' "$$" >&2          # its pid, as seen inside the sandbox, as the first line of stderr
    exec CMD ARGS...                  # the process itself takes over that pid
    # sbx-e2b:<base64 of {"cmd","args","cwd","tag"}>

and its output is followed by an attached exec as root (:mod:`sbx.api.e2b.follower`): it prints the pid line,
then the job's stdout and stderr (all at once for a job that ends within 0.3 s, else streamed by ``tail -f`` from a
byte offset until the job's ``exit`` file appears) and exits with the job's exit code. How a ``Start`` gets its
job, a ready one or a new one, is :mod:`sbx.api.e2b.starts`'s. The follower is the only thing a stop kills; a later
``Connect`` starts a new one. Nothing runs in the sandbox that sbx does not already run (no envd of its own).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sbx.api.e2b.pool as pool
from sbx.api.e2b.connect import ConnectError
from sbx.api.e2b.follower import JOBS_DIR, NONCE_MARK, follower_script
from sbx.control.errors import ControlError

if TYPE_CHECKING:
    from sbx.control.service import ControlPlane

STDIN_DIR = "/tmp/.sbx-e2b-stdin-"
MARK = "# sbx-e2b:"
_JOB = re.compile(r"^job_[a-z0-9]{8}$")
SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, 9: 9, 15: 15}
"""Signals of envd's ``Signal`` enum (JSON names or numbers) and their numbers."""


@dataclass
class Proc:
    """A running envd process: its job, its pid inside the sandbox, and its start request's config and tag."""

    job: str
    pid: int
    cmd: str
    args: list[str]
    cwd: str | None
    tag: str | None
    pty: bool = False


def control_to_connect(e: ControlError) -> ConnectError:
    """The Connect error for a control-plane error: 404 ``not_found``; a sandbox that is not running (409
    ``not_running``/``busy``/``invalid_state``) ``unavailable``, which the SDK reports as a sandbox past its end of
    life; other 4xx ``invalid_argument`` or ``permission_denied``; 5xx ``unavailable``."""
    if e.status == 404:
        return ConnectError("not_found", e.message)
    if e.status == 403:
        return ConnectError("permission_denied", e.message)
    if e.status == 409 or e.status >= 500:
        return ConnectError("unavailable", e.message)
    return ConnectError("invalid_argument", e.message)


def stdin_dir(pid: int) -> str:
    """The folder of the stdin pipe of the process with ``pid`` (started with ``stdin``)."""
    return f"{STDIN_DIR}{pid}"


def job_command(cmd: str, args: list[str], cwd: str | None, tag: str | None, stdin: bool = False,
                pty: tuple[int, int] | None = None, nonce: str | None = None) -> str:
    """The job command for a process running ``cmd`` with ``args`` (see the module's doc). With ``stdin`` its
    standard input is a named pipe in :func:`stdin_dir` held open by a ``sleep`` (pid in ``holder`` there; started
    from a subshell, so it is no child of the process, which may wait for any child) until ``CloseStdin``;
    :func:`send_input` writes to it. With ``pty`` (``(cols, rows)``) it runs in a terminal of that size made by
    util-linux ``script``, whose pid is the process's (input goes through the same pipe, closed when the program
    ends: ``script`` waits for the end of its input). A ``nonce`` is written in a last comment line, for a
    follower started before the job's id is known (:func:`sbx.api.e2b.follower.follower_script`)."""
    if pty is not None:
        stdin = True
    meta = meta_line(cmd, args, cwd, tag, pty is not None)
    argv = " ".join(shlex.quote(a) for a in [cmd, *args])
    if pty is not None:  # script ends at the end of its input: close the pipe when the program has ended
        inner = (f'stty cols {int(pty[0])} rows {int(pty[1])} 2>/dev/null; {argv}; c=$?; '
                 'kill "$(cat "$SBX_E2B_STDIN/holder")" 2>/dev/null; exit $c')
        argv = f"script -qfec {shlex.quote(inner)} /dev/null"
    pipe = ""
    if stdin:
        pipe = (f's={STDIN_DIR}$$; mkdir -m 700 "$s" && mkfifo "$s/stdin" && '
                '( sleep infinity > "$s/stdin" & echo $! > "$s/holder" ); export SBX_E2B_STDIN="$s"\n')
        argv += ' < "$s/stdin"'
    started_by = f"\n{NONCE_MARK}{nonce}" if nonce else ""
    return f"printf '%s\\n' \"$$\" >&2\n{pipe}exec {argv}\n{meta}{started_by}"


def meta_line(cmd: str, args: list[str], cwd: str | None, tag: str | None, pty: bool = False) -> str:
    """The marker line of a process's job, ``# sbx-e2b:<base64 of {"cmd","args","cwd","tag"[,"pty"]}>``, that
    :data:`LIST_SCRIPT` reads."""
    info: dict[str, Any] = {"cmd": cmd, "args": args, "cwd": cwd, "tag": tag}
    if pty:
        info["pty"] = True
    return MARK + base64.b64encode(json.dumps(info).encode()).decode()


LIST_SCRIPT = (
    f'for d in {JOBS_DIR}/job_*; do [ -d "$d" ] && [ ! -e "$d/exit" ] || continue; '
    f'm=$(sed -n "s/^{MARK}//p" "$d/cmd" "$d/e2b-meta" 2>/dev/null); [ -n "$m" ] || continue; '
    'p=$(head -n1 "$d/stderr" 2>/dev/null); case "$p" in ""|*[!0-9]*) continue;; esac; '
    'kill -0 "$p" 2>/dev/null || continue; printf "%s %s %s\\n" "${d##*/}" "$p" "$m"; done'
)
"""Root command printing ``<job> <pid> <meta>`` for each running envd process (a job with the marker in its
command, or in ``e2b-meta`` for a ready job's: :mod:`sbx.api.e2b.pool`)."""


def run_root(cp: ControlPlane, sandbox_id: str, command: str) -> tuple[int, bytes, bytes]:
    """Run ``command`` as root in the sandbox (an attached exec, 30 s at most): ``(exit code, stdout, stderr)``.
    Raises :class:`ConnectError` (``unavailable`` when the sandbox is not running)."""
    out, err = bytearray(), bytearray()
    try:
        for line in cp.exec(sandbox_id, command, 30.0, "root", None, None, "base64"):
            if "stream" in line:
                (out if line["stream"] == "stdout" else err).extend(base64.b64decode(line["data"]))
            elif "exitCode" in line:
                return int(line["exitCode"]), bytes(out), bytes(err)
            elif "error" in line:
                raise ConnectError("unavailable", str(line["error"].get("message", "the command failed")))
    except ControlError as e:
        raise control_to_connect(e) from None
    raise ConnectError("unavailable", "the command ended without an exit status")


def running(cp: ControlPlane, sandbox_id: str) -> list[Proc]:
    """The envd processes running in the sandbox, oldest job first."""
    _code, out, _err = run_root(cp, sandbox_id, LIST_SCRIPT)
    procs = []
    for line in out.decode("utf-8", "replace").splitlines():
        parts = line.split(" ")
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        try:
            meta = json.loads(base64.b64decode(parts[2]))
        except (ValueError, binascii.Error):
            continue
        if not isinstance(meta, dict):
            continue
        args = meta.get("args")
        procs.append(Proc(job=parts[0], pid=int(parts[1]), cmd=str(meta.get("cmd", "")),
                          args=[str(a) for a in args] if isinstance(args, list) else [],
                          cwd=meta.get("cwd"), tag=meta.get("tag"), pty=meta.get("pty") is True))
    return procs


def find(cp: ControlPlane, sandbox_id: str, selector: Any) -> Proc:
    """The running process a ``ProcessSelector`` (``{"pid": N}`` or ``{"tag": "..."}``) names; ``not_found``
    when none runs, ``invalid_argument`` for a selector of neither form."""
    if not isinstance(selector, dict):
        raise ConnectError("invalid_argument", "process: a selector {pid} or {tag} is required")
    pid, tag = selector.get("pid"), selector.get("tag")
    if isinstance(pid, str) and pid.isdigit():
        pid = int(pid)
    if not (isinstance(pid, int) and not isinstance(pid, bool)) and not isinstance(tag, str):
        raise ConnectError("invalid_argument", "process: a selector {pid} or {tag} is required")
    for proc in running(cp, sandbox_id):
        if (pid is not None and proc.pid == pid) or (pid is None and proc.tag == tag):
            return proc
    raise ConnectError("not_found", f"process with {'pid ' + str(pid) if pid is not None else 'tag ' + str(tag)} "
                       "not found")


class NoReadyJob(Exception):
    """A claiming follower found no ready job (:mod:`sbx.api.e2b.pool`)."""


@dataclass
class Launch:
    """A checked ``StartRequest``: the job command (carrying ``nonce``), its user, env and cwd."""

    command: str
    user: str
    env: dict[str, str] | None
    cwd: str | None
    nonce: str
    pty: bool
    ready: tuple[str, str] | None = None
    """For a command a ready job may run (:mod:`sbx.api.e2b.pool`): its snippet and meta line."""


def start(cp: ControlPlane, sandbox_id: str, request: dict[str, Any], user: str) -> str:
    """Start the process of a ``StartRequest`` as ``user``; returns its job id (:func:`launch_spec`, then
    :func:`launch`)."""
    return launch(cp, sandbox_id, launch_spec(request, user))


def launch(cp: ControlPlane, sandbox_id: str, spec: Launch) -> str:
    """Start the job of ``spec``; its id. ``unavailable`` when the sandbox does not run, ``invalid_argument``
    for a ``cwd`` that is not a directory."""
    try:
        job = cp.exec_detached(sandbox_id, spec.command, user=spec.user, env=spec.env, cwd=spec.cwd)
    except ControlError as e:
        raise control_to_connect(e) from None
    return job.id


def launch_spec(request: dict[str, Any], user: str) -> Launch:
    """The :class:`Launch` of a ``StartRequest`` as ``user``, with a fresh nonce. Raises :class:`ConnectError`
    ``invalid_argument`` for a missing ``process.cmd`` or wrong types."""
    process = request.get("process")
    if not isinstance(process, dict) or not isinstance(process.get("cmd"), str) or not process["cmd"]:
        raise ConnectError("invalid_argument", "process.cmd is required")
    size = pty_size(request.get("pty")) if request.get("pty") else None
    args = process.get("args") or []
    envs = process.get("envs") or {}
    cwd = process.get("cwd") or None
    tag = request.get("tag") or None
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConnectError("invalid_argument", "process.args must be a list of strings")
    if not isinstance(envs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in envs.items()):
        raise ConnectError("invalid_argument", "process.envs must map strings to strings")
    if cwd is not None and not isinstance(cwd, str) or tag is not None and not isinstance(tag, str):
        raise ConnectError("invalid_argument", "process.cwd and tag must be strings")
    stdin = request.get("stdin", False)
    if not isinstance(stdin, bool):
        raise ConnectError("invalid_argument", "stdin must be true or false")
    if any("\0" in s for s in [process["cmd"], *args, *envs, *envs.values()]):
        raise ConnectError("invalid_argument", "NUL bytes are not allowed in a command, its arguments or env")
    nonce = secrets.token_hex(12)
    ready = None
    if user == "user" and cwd is None and not stdin and size is None:
        text = pool.snippet(" ".join(shlex.quote(a) for a in [process["cmd"], *args]), dict(envs))
        line = meta_line(process["cmd"], args, cwd, tag)
        ready = (text, line) if len(text) + len(line) < pool.SNIPPET_MAX else None
    return Launch(job_command(process["cmd"], args, cwd, tag, stdin, size, nonce), user, dict(envs) or None, cwd,
                  nonce, size is not None, ready)


def pty_size(value: Any) -> tuple[int, int]:
    """``(cols, rows)`` of a ``PTY`` message ``{"size": {"cols","rows"}}``; ``invalid_argument`` unless both are
    1..1000."""
    size = value.get("size") if isinstance(value, dict) else None
    cols, rows = (size.get("cols"), size.get("rows")) if isinstance(size, dict) else (None, None)
    if not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1000 for n in (cols, rows)):
        raise ConnectError("invalid_argument", "pty.size needs cols and rows from 1 to 1000")
    return int(cols), int(rows)  # type: ignore[arg-type]


def follow(cp: ControlPlane, sandbox_id: str, job: str | Callable[[], str], from_now: bool,
           gone: Callable[[], bool], pty: bool = False, nonce: str | None = None, locate: str | None = None
           ) -> Iterator[dict[str, Any]]:
    """The ``ProcessEvent`` messages of job ``job``: ``{"start": {"pid"}}``, then ``{"data": {"stdout"|"stderr":
    base64}}`` pieces (a ``pty`` process's output is ``{"data": {"pty": base64}}``), then ``{"end": {"exitCode",
    "exited","status"}}``. ``gone()`` True ends the follower (the client left; the process goes on). Raises
    :class:`ConnectError`: ``not_found`` for an unknown job, ``unavailable`` when the sandbox stops meanwhile
    (the process is kept, with its memory, when it paused). With ``nonce`` the job is the one whose command carries
    it, and ``job`` a function that gives its id once it has started; with ``locate`` (a ready job's claim),
    :class:`NoReadyJob` when there was none (:func:`sbx.api.e2b.follower.follower_script`)."""
    label = nonce if callable(job) else job
    try:
        lines = cp.exec(sandbox_id, follower_script("" if callable(job) else job, from_now, nonce, locate), 0,
                        "root", None, None, "base64", gone)
    except ControlError as e:
        raise control_to_connect(e) from None
    head = bytearray()
    started = False
    found: str | None = None
    code: int | None = None
    for line in lines:
        if "error" in line:
            raise ConnectError("unavailable", str(line["error"].get("message", "the sandbox stopped")))
        if "exitCode" in line:
            code = int(line["exitCode"])
            break
        data = base64.b64decode(line["data"])
        if line["stream"] == "stdout" and not started:
            head.extend(data)
            if b"\n" not in head:
                continue
            first, _, data = bytes(head).partition(b"\n")
            if first == pool.NO_CLAIM:
                raise NoReadyJob()
            pid, _, named = first.partition(b" ")
            if not pid.isdigit():
                raise ConnectError("not_found", f"process of job {label} not found")
            found = named.decode() if _JOB.match(named.decode("ascii", "replace")) else None
            started = True
            yield {"start": {"pid": int(pid)}}
            if not data:
                continue
        if data:
            kind = "pty" if pty and line["stream"] == "stdout" else line["stream"]
            yield {"data": {kind: base64.b64encode(data).decode()}}
    if gone():
        return
    if code is None:
        raise ConnectError("unavailable", "the sandbox stopped while the process ran")
    if not started:
        raise ConnectError("not_found", f"process of job {label} not found")
    if code >= 128:  # the follower itself may have been killed (a stop): believe only the job's own exit file
        job_id = found or (job() if callable(job) else job)
        rc, out, _ = run_root(cp, sandbox_id, f"cat {shlex.quote(f'{JOBS_DIR}/{job_id}/exit')}")
        if rc != 0 or not out.strip().lstrip(b"-").isdigit():
            raise ConnectError("unavailable", "the process's output stream ended before the process did")
        code = int(out.strip())
    yield {"end": {"exitCode": code, "exited": True, "status": f"exit status {code}"}}


def signal(cp: ControlPlane, sandbox_id: str, request: dict[str, Any]) -> None:
    """``SendSignal``: SIGKILL ends the process's whole job (exit 137); SIGTERM goes to its pid. ``not_found``
    for a process that does not run, ``invalid_argument`` for another signal."""
    sig = SIGNALS.get(request.get("signal"))  # type: ignore[arg-type]
    if sig is None:
        raise ConnectError("invalid_argument", "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM")
    proc = find(cp, sandbox_id, request.get("process"))
    if sig == 9:
        try:
            cp.kill_job(sandbox_id, proc.job)
        except ControlError as e:
            raise control_to_connect(e) from None
        return
    run_root(cp, sandbox_id, f"kill -s {sig} {proc.pid}")


def send_input(cp: ControlPlane, sandbox_id: str, request: dict[str, Any]) -> None:
    """``SendInput``: the bytes of ``input.stdin`` or ``input.pty`` (base64) to the process's stdin pipe (a pty
    process's terminal reads it). ``not_found`` for a process that does not run, ``failed_precondition`` when it
    was started without ``stdin`` or its stdin is closed."""
    data = input_bytes(request.get("input"))
    write_input(cp, sandbox_id, find(cp, sandbox_id, request.get("process")), data)


def input_bytes(given: Any) -> bytes:
    """The bytes of a ``ProcessInput`` (``{"stdin": base64}`` or ``{"pty": base64}``); ``invalid_argument``
    otherwise."""
    if not isinstance(given, dict) or not isinstance(given.get("stdin", given.get("pty")), str):
        raise ConnectError("invalid_argument", "input must be {stdin: base64} or {pty: base64}")
    try:
        return base64.b64decode(given.get("stdin", given.get("pty")), validate=True)
    except (binascii.Error, ValueError):
        raise ConnectError("invalid_argument", "input.stdin must be base64") from None


def write_input(cp: ControlPlane, sandbox_id: str, proc: Proc, data: bytes) -> None:
    """Write ``data`` to the stdin pipe of ``proc``; ``failed_precondition`` when it has none open."""
    d = stdin_dir(proc.pid)
    code, _out, _err = run_root(cp, sandbox_id, f'd={d}; [ -p "$d/stdin" ] && [ -s "$d/holder" ] || exit 44; '
                                f'kill -0 "$(cat "$d/holder")" 2>/dev/null || exit 44; '
                                f'printf %s {shlex.quote(base64.b64encode(data).decode())} | base64 -d > "$d/stdin"')
    if code == 44:
        raise ConnectError("failed_precondition", f"process {proc.pid} has no open stdin (start it with stdin)")
    if code != 0:
        raise ConnectError("unavailable", f"writing to the stdin of process {proc.pid} failed (exit {code})")


def resize(cp: ControlPlane, sandbox_id: str, request: dict[str, Any]) -> None:
    """``Update``: give a pty process's terminal the size in ``pty`` (its programs get SIGWINCH); ``not_found``,
    ``failed_precondition`` for a process without a terminal."""
    cols, rows = pty_size(request.get("pty"))
    proc = find(cp, sandbox_id, request.get("process"))
    if not proc.pty:
        raise ConnectError("failed_precondition", f"process {proc.pid} has no terminal")
    code, _out, err = run_root(cp, sandbox_id, f'c=$(pgrep -o -P {proc.pid}) || exit 44; '
                               't=$(readlink "/proc/$c/fd/0") || exit 44; '
                               f'stty -F "$t" cols {cols} rows {rows}')
    if code != 0:
        raise ConnectError("failed_precondition", f"could not resize the terminal of process {proc.pid}: "
                           f"{err.decode('utf-8', 'replace').strip()[:200] or code}")


def close_stdin(cp: ControlPlane, sandbox_id: str, request: dict[str, Any]) -> None:
    """``CloseStdin``: end the process's stdin (its reader then sees end of file); ``not_found``."""
    proc = find(cp, sandbox_id, request.get("process"))
    d = stdin_dir(proc.pid)
    run_root(cp, sandbox_id, f'd={d}; [ -s "$d/holder" ] && kill "$(cat "$d/holder")" 2>/dev/null; '
                             f'rm -f "$d/holder"; true')


def listed(cp: ControlPlane, sandbox_id: str) -> dict[str, Any]:
    """``ListResponse``: ``{"processes": [{"config": {"cmd","args","envs","cwd"}, "pid", "tag"?}]}`` (``envs``
    is always empty: it is not kept)."""
    out = []
    for proc in running(cp, sandbox_id):
        config: dict[str, Any] = {"cmd": proc.cmd, "args": proc.args, "envs": {}}
        if proc.cwd:
            config["cwd"] = proc.cwd
        item: dict[str, Any] = {"config": config, "pid": proc.pid}
        if proc.tag:
            item["tag"] = proc.tag
        out.append(item)
    return {"processes": out}
