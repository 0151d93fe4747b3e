"""``sbx volume``: persistent volumes, shared by sandboxes and kept after them.

::

    sbx volume create NAME [--size GiB]
    sbx volume list | show NAME | delete NAME
    sbx new --volume NAME:/path[:ro]          a sandbox that mounts it (repeatable)
"""

from __future__ import annotations

from typing import Any

import typer

from sbx.cli.common import JSON_OPT, client, handle_errors, out, print_json, print_table
from sbx.sdk import volumes as V

app = typer.Typer(help="Persistent volumes: mounted by sandboxes (sbx new --volume NAME:/path), kept after them.",
                  no_args_is_help=True)


def _show(vol: dict[str, Any], json_: bool) -> None:
    if json_:
        print_json({"volume": vol})
        return
    size = f"{vol['sizeGiB']} GiB" if vol.get("sizeGiB") else "no cap"
    users = ", ".join(vol.get("sandboxes") or []) or "-"
    out.print(f"{vol['name']} {vol['id']} {size} (mounted by: {users})", markup=False)


@app.command("create")
@handle_errors
def create(name: str = typer.Argument(..., help="The volume's name (a lower-case letter or digit, then up to 62 "
                                      "of a-z, 0-9, '.', '_', '-')."),
           size: int = typer.Option(None, "--size", help="The most it may hold, GiB (default: no cap)."),
           json_: bool = JSON_OPT) -> None:
    """Make a volume."""
    with client() as c:
        vol = c.run(V.create_volume(name, size))
    _show(vol, json_)


@app.command("list")
@handle_errors
def list_(json_: bool = JSON_OPT) -> None:
    """Your volumes and the sandboxes that mount them."""
    with client() as c:
        items = c.run(V.volumes())
    if json_:
        print_json({"volumes": items})
        return
    print_table(("NAME", "SIZE", "MOUNTED BY", "CREATED"),
                ((v["name"], f"{v['sizeGiB']} GiB" if v.get("sizeGiB") else "-",
                  ", ".join(v.get("sandboxes") or []) or "-", v.get("createdAt") or "-") for v in items))


@app.command("show")
@handle_errors
def show(name: str = typer.Argument(..., help="Volume name."), json_: bool = JSON_OPT) -> None:
    """One volume."""
    with client() as c:
        vol = c.run(V.volume(name))
    _show(vol, json_)


@app.command("delete")
@handle_errors
def delete(name: str = typer.Argument(..., help="Volume name.")) -> None:
    """Delete a volume and its files (refused while a sandbox that is not deleted mounts it)."""
    with client() as c:
        c.run(V.delete_volume(name))
