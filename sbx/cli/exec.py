"""Verbs for running commands: ``exec`` (streamed or ``--detach``), ``jobs``, ``logs``, ``wait``."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from typing import TextIO

import typer

from sbx.cli.common import JSON_OPT, client, err, handle_errors, out, parse_env, print_json, print_table
from sbx.sdk import protocol as P


def _write(stream: TextIO) -> Callable[[str], None]:
    def write(text: str) -> None:
        stream.write(text)
        stream.flush()

    return write


def _write_bytes(stream: TextIO) -> Callable[[bytes], None]:
    """A callback writing raw bytes to ``stream``'s binary buffer (exec output is carried exactly)."""
    buf = stream.buffer

    def write(data: bytes) -> None:
        buf.write(data)
        buf.flush()

    return write


@handle_errors
def exec_(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    command: list[str] = typer.Argument(..., help="The command (one quoted string, run with bash)."),
    timeout: float | None = typer.Option(None, "--timeout", min=0, max=7 * 86400,
                                  help="Seconds before it is killed, exit 124 (default 30; with --detach none; "
                                  "0 = none)."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Run as a background job and print its id."),
    user: str = typer.Option("user", "--user", "-u", help="Run as this user (e.g. root)."),
    env: list[str] = typer.Option(None, "--env", "-e", help="KEY=VALUE for this command (repeatable)."),
    cwd: str = typer.Option(None, "--cwd", help="Working directory."),
    tty: bool = typer.Option(False, "--tty", "-t", help="Run in a terminal (interactive; no --timeout)."),
    json_: bool = JSON_OPT,
) -> None:
    """Run a command in a sandbox, streaming its output; exits with the command's own exit code (124 after
    --timeout). Waits for a sandbox that is still starting or resuming. With --tty it runs in a pseudo-terminal
    (stdout and stderr merged), for interactive programs."""
    cmd = " ".join(command)
    if timeout is None and not detach:
        timeout = 30.0
    if tty:
        from sbx.cli.ssh import run_pty

        env_map = parse_env(env) or {}
        prefix = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env_map.items())
        if cwd:
            prefix += f"cd {shlex.quote(cwd)} && "
        raise typer.Exit(run_pty(sandbox_id, prefix + cmd, user))
    with client() as c:
        if detach:
            job = c.run(P.exec_detached(sandbox_id, cmd, user, parse_env(env), cwd, timeout or None))
            print_json({"job": job}) if json_ else out.print(job["id"], markup=False)
            return
        if json_:
            res = c.run(P.exec_(sandbox_id, cmd, timeout or None, user, parse_env(env), cwd))
            print_json({"stdout": res.stdout, "stderr": res.stderr, "exitCode": res.exit_code,
                        "timedOut": res.timed_out})
        else:
            res = c.run(P.exec_(sandbox_id, cmd, timeout or None, user, parse_env(env), cwd,
                                _write_bytes(sys.stdout), _write_bytes(sys.stderr), binary=True))
    if res.timed_out:
        err.print(f"sbx: command timed out after {timeout or 0:g} s (exit 124); use --timeout or --detach",
                  markup=False)
    raise typer.Exit(res.exit_code)


@handle_errors
def jobs(sandbox_id: str = typer.Argument(..., help="Sandbox id."), json_: bool = JSON_OPT) -> None:
    """List a sandbox's detached jobs."""
    with client() as c:
        items = c.run(P.jobs(sandbox_id))
    if json_:
        print_json({"jobs": items})
        return
    print_table(("JOB", "STATUS", "STARTED", "COMMAND"),
                ((j["id"], "running" if j["running"] else f"exit {j['exitCode']}", j["startedAt"], j["command"])
                 for j in items))


@handle_errors
def kill(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    job_id: str = typer.Argument(..., help="Job id (from exec --detach)."),
    json_: bool = JSON_OPT,
) -> None:
    """Kill a detached job (all its processes); it then reports exit 137."""
    with client() as c:
        job = c.run(P.kill_job(sandbox_id, job_id))
    print_json({"job": job}) if json_ else out.print(f"{job_id} exit {job['exitCode']}", markup=False)


@handle_errors
def logs(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    job_id: str = typer.Argument(..., help="Job id (from exec --detach)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep streaming until the job ends."),
) -> None:
    """Print a job's output (stdout and stderr)."""
    with client() as c:
        c.run(P.job_logs(sandbox_id, job_id, follow, _write(sys.stdout), _write(sys.stderr)))


@handle_errors
def wait(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    job_id: str = typer.Argument(..., help="Job id."),
    timeout: float = typer.Option(300.0, "--timeout", min=0, help="Seconds to wait at most."),
    json_: bool = JSON_OPT,
) -> None:
    """Wait for a job to end and exit with its exit code (124 if it is still running after --timeout)."""
    with client() as c:
        job = c.run(P.job_wait(sandbox_id, job_id, timeout))
    if json_:
        print_json({"job": job})
    if job["running"]:
        err.print(f"sbx: job {job_id} still running after {timeout:g} s", markup=False)
        raise typer.Exit(124)
    raise typer.Exit(int(job["exitCode"] or 0))
