"""Verbs for a sandbox's life: ``new``, ``list``, ``info``, ``stop``, ``resume``, ``delete``."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.table import Table

from sbx.cli.common import JSON_OPT, client, err, handle_errors, out, parse_env, print_json, print_table, spinner
from sbx.sdk import protocol as P
from sbx.sdk.accounts import usage
from sbx.sdk.volumes import parse_mount


def _summary(sb: dict[str, Any]) -> str:
    return f"{sb['id']} {sb['state']}"


@handle_errors
def new(
    type: str = typer.Option("small", "--type", "-t", help="Size: small, default, large or xlarge."),
    name: str = typer.Option(None, "--name", "-n", help="A name (default: the subdomain)."),
    from_snapshot: str = typer.Option(None, "--from", help="Start from this snapshot's disk."),
    ttl: int = typer.Option(None, "--ttl", help="Seconds of inactivity before it stops (0 = never)."),
    no_snapshots: bool = typer.Option(
        False, "--no-snapshots", help="Never save memory or snapshots (cannot be resumed, forked or snapshotted)."
    ),
    env: list[str] = typer.Option(None, "--env", "-e", help="KEY=VALUE for every command (repeatable)."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Return once it runs (default) or once accepted."),
    auto_resume: bool = typer.Option(
        False, "--auto-resume", help="An exec, a file copy, a shell or a request on a hosted port resumes it when "
        "it is stopped."
    ),
    label: list[str] = typer.Option(None, "--label", "-l", help="KEY=VALUE metadata, for `sbx list --label` "
                                    "(repeatable)."),
    cold: bool = typer.Option(False, "--cold", help="Boot it, even when a memory template of its size is ready "
                              "(by default it is restored from the template, with its own identity)."),
    secret: list[str] = typer.Option(None, "--secret", "-s", help="A secret it may use through the egress proxy "
                                     "(see `sbx secret`; repeatable). It never sees the value."),
    image: str = typer.Option(None, "--image", "-i", help="Start from this image (`sbx image list`) instead of "
                              "sbx's default Debian image."),
    runtime: str = typer.Option(None, "--runtime", "-r", help="Runtime class: container (runc, the host's kernel; "
                                "default) or gvisor (gVisor's own kernel; no fork with memory, live migration or "
                                "detached jobs)."),
    volume: list[str] = typer.Option(None, "--volume", "-v", help="NAME:/path[:ro]: mount this volume of yours "
                                     "(`sbx volume list`; repeatable)."),
    json_: bool = JSON_OPT,
) -> None:
    """Create a sandbox and print its id."""
    labels = parse_env(label, "--label")
    with client() as c, spinner(f"creating {type} sandbox", not json_):
        sb = c.run(P.create(type, name, ttl, from_snapshot, no_snapshots, parse_env(env), wait, auto_resume,
                            labels, cold, secret, image=image, runtime=runtime,
                            volumes=[parse_mount(v) for v in volume or []]))
    if json_:
        print_json({"sandbox": sb})
    else:
        out.print(sb["id"], markup=False)


@handle_errors
def list_(
    label: list[str] = typer.Option(None, "--label", "-l", help="Only sandboxes with this KEY=VALUE label "
                                    "(repeatable: all must match)."),
    json_: bool = JSON_OPT,
) -> None:
    """List sandboxes."""
    labels = parse_env(label, "--label")
    with client() as c:
        boxes = c.list(labels)
    if json_:
        print_json({"sandboxes": boxes})
        return
    print_table(("ID", "NAME", "TYPE", "STATE", "MEM", "URL"),
                ((sb["id"], sb["name"], sb["type"], sb["state"], f"{sb['memoryGB']} GB", sb["url"]) for sb in boxes))


@handle_errors
def info(sandbox_id: str = typer.Argument(..., help="Sandbox id."), json_: bool = JSON_OPT) -> None:
    """Show a sandbox (its state, size, memoryRestored/resumeReason, fresh stats and its cost so far)."""
    with client() as c:
        sb = c.run(P.get(sandbox_id))
        if json_:
            print_json({"sandbox": sb})
            return
        cost = c.run(usage(sandbox_id=sandbox_id))["total"]
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key in ("id", "name", "type", "state", "memoryGB", "vcpus", "diskGB", "memoryRestored", "resumeReason",
                "memorySaved", "stopReason", "stopError", "ttl", "autoResume", "noSnapshots", "subdomain", "url",
                "node", "nodeStatus", "replicaNode", "sealStored", "sealStoredAt", "createdAt", "updatedAt"):
        value = sb.get(key)
        table.add_row(key, json.dumps(value) if value is None or isinstance(value, bool) else str(value))
    for vol in sb.get("volumes") or []:
        table.add_row("volume", f"{vol['name']} at {vol['path']}{' (read-only)' if vol['readOnly'] else ''}")
    if sb.get("error"):
        table.add_row("error", f"{sb['error']['code']}: {sb['error']['message']}")
    st = sb.get("stats") or {}
    table.add_row("memory", f"{st.get('memoryUsedMb', 0)} / {st.get('memoryTotalMb', 0)} MB")
    table.add_row("cpu", f"{st.get('cpuPercent', 0)} %")
    table.add_row("disk used", f"{st.get('diskUsedMb', 0)} MB")
    table.add_row("disk allocated", f"{st.get('diskAllocatedBytes', 0) / 2**20:.1f} MiB on the volume")
    table.add_row("disk unique", f"{st.get('diskUniqueBytes', 0) / 2**20:.1f} MiB (freed by a delete)")
    table.add_row("oom kills", str(st.get("oomKills", 0)))
    table.add_row("cost so far", f"${cost['cost']:.6f} ({cost['runningSeconds']:.0f} s running, "
                  f"{cost['storedGiBHours']:.4f} GiB-hours stored)")
    out.print(table)


@handle_errors
def stop(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    wait: bool = typer.Option(False, "--wait", help="Return once it has stopped."),
    no_memory: bool = typer.Option(False, "--no-memory", help="Do not save memory (the next resume cold-boots)."),
    json_: bool = JSON_OPT,
) -> None:
    """Stop a sandbox, saving its memory so a resume brings its processes back.

    With ``--wait``, a stop whose memory save failed still exits 0 (the sandbox did stop and its disk is kept) but
    prints ``warning: memory was not saved: <reason>`` on stderr; ``--json`` shows ``memorySaved: false`` and
    ``stopError``."""
    with client() as c, spinner(f"stopping {sandbox_id}", wait and not json_):
        sb = c.run(P.stop(sandbox_id, not no_memory, wait))
    if json_:
        print_json({"sandbox": sb})
        return
    out.print(_summary(sb), markup=False)
    if sb.get("state") == "stopped" and not no_memory and sb.get("memorySaved") is False and sb.get("stopError"):
        err.print(f"warning: memory was not saved: {sb['stopError']}\nThe next resume boots from the disk "
                  "(files are kept; running processes are not).", markup=False)
    if sb.get("noSnapshots"):
        err.print(f"note: {sb['id']} was created with --no-snapshots: it cannot be resumed. Its disk stays until "
                  f"`sbx delete {sb['id']}`.", markup=False)


@handle_errors
def resume(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    type: str = typer.Option(None, "--type", "-t", help="Grow to this size (a cold boot from disk)."),
    require_memory: bool = typer.Option(False, "--require-memory", help="Fail rather than boot from disk."),
    ttl: int = typer.Option(None, "--ttl", help="New inactivity timeout in seconds."),
    wait: bool = typer.Option(False, "--wait", help="Return once it runs."),
    json_: bool = JSON_OPT,
) -> None:
    """Resume a stopped sandbox, optionally at a bigger size."""
    with client() as c, spinner(f"resuming {sandbox_id}", wait and not json_):
        sb = c.run(P.resume(sandbox_id, type, require_memory, ttl, wait))
    print_json({"sandbox": sb}) if json_ else out.print(_summary(sb), markup=False)


@handle_errors
def delete(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    wait: bool = typer.Option(False, "--wait", help="Return once it is gone."),
    json_: bool = JSON_OPT,
) -> None:
    """Delete a sandbox and its disk (named snapshots stay)."""
    with client() as c, spinner(f"deleting {sandbox_id}", wait and not json_):
        sb = c.run(P.delete(sandbox_id, wait))
    print_json({"sandbox": sb}) if json_ else out.print(_summary(sb), markup=False)
