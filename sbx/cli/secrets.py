"""``sbx secret``: credentials the egress proxy injects into sandboxes' requests, which never hold them.

::

    sbx secret set NAME --host api.example.com [--path /v1] [--method GET] [--header 'Authorization: Bearer {secret}'
                   | --basic-user U]  [--file F]      (value from stdin or --file, never an argument)
    sbx secret list | rm NAME | log NAME | bind ID NAME | unbind ID NAME
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from sbx.cli.common import JSON_OPT, client, fail, handle_errors, out, print_json, print_table
from sbx.sdk import secrets as S

app = typer.Typer(help="Secrets the egress proxy injects (sandboxes use placeholders, never values).",
                  no_args_is_help=True)


def _read_value(file: Path | None) -> str:
    if file is not None:
        data = file.read_text()
    else:
        if sys.stdin.isatty():
            out.print("value (end with Ctrl-D):", markup=False)
        data = sys.stdin.read()
    value = data[:-1] if data.endswith("\n") else data  # `echo tok | sbx secret set` keeps no newline
    if not value:
        raise fail("invalid_value", "the value is empty (give it on stdin or with --file)")
    return value


@app.command("set")
@handle_errors
def set_(
    name: str = typer.Argument(..., help="Secret name; sandboxes write sbx-secret:NAME where it belongs."),
    host: list[str] = typer.Option(None, "--host", help="Host it may go to: api.example.com or *.example.com "
                                   "(repeatable; required for a new secret, replaces the rule when given)."),
    path: str = typer.Option(None, "--path", help="Only requests whose path starts with this."),
    method: list[str] = typer.Option(None, "--method", help="Only these methods (repeatable)."),
    header: str = typer.Option(None, "--header", help="Set this header instead of replacing the placeholder, e.g. "
                               "'Authorization: Bearer {secret}'."),
    basic_user: str = typer.Option(None, "--basic-user", help="Send it as HTTP basic auth password of this user."),
    file: Path = typer.Option(None, "--file", exists=True, dir_okay=False, help="Read the value from this file."),
    json_: bool = JSON_OPT,
) -> None:
    """Create a secret or rotate its value (read from stdin or --file). Running sandboxes get the new value on
    their next request."""
    rules = None
    if host:
        rule: dict[str, object] = {"hosts": host, "pathPrefix": path, "methods": method or None}
        if header is not None and basic_user is not None:
            raise fail("invalid_rules", "use --header or --basic-user, not both")
        if header is not None:
            hname, colon, template = header.partition(":")
            if not colon:
                raise fail("invalid_rules", "--header is 'Name: value with {secret}'")
            rule.update(action="header", header=hname.strip(), value=template.strip())
        elif basic_user is not None:
            rule.update(action="basic", username=basic_user)
        else:
            rule["action"] = "replace"
        rules = [{k: v for k, v in rule.items() if v is not None}]
    elif path or method or header or basic_user:
        raise fail("invalid_rules", "--path, --method, --header and --basic-user need --host")
    value = _read_value(file)
    with client() as c:
        sec = c.run(S.put_secret(name, value, rules))
    if json_:
        print_json({"secret": sec})
    else:
        out.print(f"{sec['name']} version {sec['version']}: use {sec['placeholder']}", markup=False)


def _rule_text(rule: dict[str, object]) -> str:
    where = ",".join(rule["hosts"]) + (str(rule["pathPrefix"]) if rule.get("pathPrefix") else "")  # type: ignore[arg-type]
    if rule.get("methods"):
        where = "/".join(rule["methods"]) + " " + where  # type: ignore[arg-type]
    action = rule["action"]
    if action == "header":
        action = f"header {rule['header']}"
    elif action == "basic":
        action = f"basic {rule['username']}"
    return f"{where} ({action})"


@app.command("list")
@handle_errors
def list_(json_: bool = JSON_OPT) -> None:
    """Secrets: names, versions, rules and bound sandboxes (never values)."""
    with client() as c:
        items = c.run(S.secrets())
    if json_:
        print_json({"secrets": items})
        return
    print_table(("NAME", "VERSION", "RULES", "SANDBOXES", "UPDATED"),
                ((s["name"], str(s["version"]), "; ".join(_rule_text(r) for r in s["rules"]),
                  ",".join(s["sandboxes"]) or "-", s["updatedAt"]) for s in items))


@app.command("rm")
@handle_errors
def rm(name: str = typer.Argument(..., help="Secret name.")) -> None:
    """Delete a secret; sandboxes bound to it stop getting it at once."""
    with client() as c:
        c.run(S.delete_secret(name))


@app.command("log")
@handle_errors
def log(name: str = typer.Argument(..., help="Secret name."),
        limit: int = typer.Option(100, "--limit", min=1, max=10000, help="Most recent uses to show."),
        json_: bool = JSON_OPT) -> None:
    """Each request the proxy put the secret into: time, sandbox, host, method, path, upstream status."""
    with client() as c:
        uses = c.run(S.secret_log(name, limit))
    if json_:
        print_json({"uses": uses})
        return
    print_table(("TIME", "SANDBOX", "METHOD", "HOST", "PATH", "STATUS"),
                ((u["at"], u["sandbox"], u["method"], u["host"], u["path"],
                  "-" if u["status"] is None else str(u["status"])) for u in uses))


@app.command("bind")
@handle_errors
def bind(sandbox_id: str = typer.Argument(..., help="Sandbox id."),
         name: str = typer.Argument(..., help="Secret name.")) -> None:
    """Let a running or stopped sandbox use a secret (from its next connection on)."""
    with client() as c:
        names = c.run(S.bind_secret(sandbox_id, name))
    out.print(" ".join(names), markup=False)


@app.command("unbind")
@handle_errors
def unbind(sandbox_id: str = typer.Argument(..., help="Sandbox id."),
           name: str = typer.Argument(..., help="Secret name.")) -> None:
    """Take a secret away from a sandbox."""
    with client() as c:
        names = c.run(S.bind_secret(sandbox_id, name, bind=False))
    out.print(" ".join(names) or "-", markup=False)
