"""Verbs for hosted ports: ``host`` (publish a port, or list routes) and ``unhost``."""

from __future__ import annotations

import typer

from sbx.cli.common import JSON_OPT, client, handle_errors, out, print_json, print_table
from sbx.sdk import protocol as P


@handle_errors
def host(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    port: int = typer.Argument(None, min=1, max=65535, help="Port to publish (omit to list the routes)."),
    public: bool = typer.Option(False, "--public", help="Anyone with the URL may connect (no token)."),
    json_: bool = JSON_OPT,
) -> None:
    """Publish a port of the sandbox at https://PORT-SUBDOMAIN.DOMAIN and print the URL and its token (send it
    as the X-Sbx-Token header, or once as ?token=, which sets a cookie). Without PORT, list the routes."""
    with client() as c:
        if port is None:
            routes = c.run(P.routes(sandbox_id))
            if json_:
                print_json({"routes": routes})
                return
            print_table(("PORT", "ACCESS", "URL", "TOKEN"),
                        ((str(r["port"]), "public" if r["public"] else "token", r["url"],
                          "" if r["public"] else r["token"]) for r in routes))
            return
        route = c.run(P.host(sandbox_id, port, public))
    if json_:
        print_json({"route": route})
        return
    out.print(route["url"], markup=False)
    if not route["public"]:
        out.print(f"token: {route['token']}", markup=False)


@handle_errors
def unhost(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    port: int = typer.Argument(..., min=1, max=65535, help="The published port."),
) -> None:
    """Stop publishing a port."""
    with client() as c:
        c.run(P.unhost(sandbox_id, port))
