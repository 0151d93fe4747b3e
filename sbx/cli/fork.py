"""Verbs for copies of a sandbox's disk: ``fork``, ``snapshot``, ``snapshots``, ``snapshot-delete``."""

from __future__ import annotations

from typing import Any

import typer

from sbx.cli.common import JSON_OPT, client, fail, handle_errors, out, parse_env, print_json, print_table, spinner
from sbx.sdk import protocol as P


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _line(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k != "seq"}


@handle_errors
def fork(
    sandbox_id: str = typer.Argument(..., help="The sandbox to fork (running or stopped)."),
    type: str = typer.Option(None, "--type", "-t", help="Size of the fork (default: the source's)."),
    ttl: int = typer.Option(None, "--ttl", help="Inactivity timeout of the fork (default 3600 s)."),
    name: str = typer.Option(None, "--name", "-n", help="Name of the fork (default: '<source name> (fork)')."),
    env: list[str] = typer.Option(None, "--env", "-e", help="KEY=VALUE replacing the source's env (repeatable)."),
    wait: bool = typer.Option(False, "--wait", help="Return once the fork runs."),
    memory: bool = typer.Option(False, "--memory", help="Fork with memory: the running source's processes and "
                                "memory go along (it pauses for the dump only); the fork gets a new identity."),
    secret: list[str] = typer.Option(None, "--secret", "-s", help="A secret the fork may use (repeatable; a fork "
                                     "does not inherit its source's)."),
    json_: bool = JSON_OPT,
) -> None:
    """Fork a sandbox: a new sandbox on a copy of its disk, booted fresh (memory and processes are not copied;
    with --memory they are).

    With --json, prints event lines: {"event":"forking",...}, then (with --wait) {"event":"state",...} and
    {"event":"ready",...}."""
    with client() as c:
        with spinner(f"forking {sandbox_id}", wait and not json_):
            sb = c.run(P.fork(sandbox_id, type, ttl, name, parse_env(env), wait=False, memory=memory,
                              secrets=secret))
            fork_id = sb["id"]
            if not wait:
                if json_:
                    first = c.run(P.events(fork_id))
                    print_json(_line(first[0]) if first else {"event": "forking", "id": fork_id,
                                                               "source": sandbox_id, "sandbox": sb})
                else:
                    out.print(fork_id, markup=False)
                return
            events = c.run(P.events(fork_id, until_settled=True,
                                    on_event=(lambda e: print_json(_line(e))) if json_ else None))
    last = events[-1] if events else {}
    if last.get("event") == "error":
        e = last.get("error") or {}
        raise fail(str(e.get("code", "error")), str(e.get("message", "fork failed")))
    if not json_:
        out.print(fork_id, markup=False)


@handle_errors
def snapshot(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    name: str = typer.Argument(..., help="Snapshot name: 1-63 of A-Z a-z 0-9 . _ -"),
    json_: bool = JSON_OPT,
) -> None:
    """Save a named snapshot of a sandbox's disk (start copies with `sbx new --from NAME`)."""
    with client() as c:
        snap = c.run(P.snapshot(sandbox_id, name))
    print_json({"snapshot": snap}) if json_ else out.print(snap["name"], markup=False)


@handle_errors
def snapshots(
    sandbox_id: str = typer.Argument(None, help="Only this sandbox's snapshots."),
    json_: bool = JSON_OPT,
) -> None:
    """List snapshots (automatic ones are named auto-<id>-<time>) with the bytes each maps on the volume
    (ALLOCATED) and holds alone (UNIQUE: what deleting it frees)."""
    with client() as c:
        items = c.run(P.snapshots(sandbox_id))
    if json_:
        print_json({"snapshots": items})
        return
    print_table(("NAME", "SANDBOX", "AUTO", "CREATED", "ALLOCATED", "UNIQUE"),
                ((s["name"], s["sandboxId"], "yes" if s["auto"] else "", s["createdAt"],
                  _mib(s.get("allocatedBytes", 0)), _mib(s.get("uniqueBytes", 0))) for s in items))


@handle_errors
def snapshot_delete(name: str = typer.Argument(..., help="Snapshot name.")) -> None:
    """Delete a snapshot."""
    with client() as c:
        c.run(P.delete_snapshot(name))
    out.print(f"deleted {name}", markup=False)
