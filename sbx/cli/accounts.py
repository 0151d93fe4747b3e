"""Verbs for accounts, API keys, plans and usage (issue 12)::

    sbx admin account create NAME [--plan P] | account list | account set-plan ACCOUNT PLAN    (admin key)
    sbx admin account suspend ACCOUNT | account resume ACCOUNT | account delete ACCOUNT [--yes] [--no-wait]
    sbx admin key create ACCOUNT [--name N] [--expires-in S] | key list ACCOUNT | key revoke KEY
    sbx plan [--json]
    sbx usage [--from DATE] [--to DATE] [--by sandbox|size|day] [--json]

A new key's token is printed once (it is stored hashed); give it to the account's user as ``SBX_TOKEN`` or the
``token`` of their ``~/.config/sbx/config.toml``.
"""

from __future__ import annotations

from typing import Any

import typer

from sbx.cli.common import JSON_OPT, client, err, handle_errors, print_json, print_table
from sbx.sdk import accounts as A

admin_app = typer.Typer(help="Accounts and API keys of this installation (needs the admin key).",
                        no_args_is_help=True)
account_app = typer.Typer(help="Accounts: create, list, change plan, suspend, resume, delete.",
                          no_args_is_help=True)
key_app = typer.Typer(help="API keys: create (shown once), list, revoke.", no_args_is_help=True)
admin_app.add_typer(account_app, name="account")
admin_app.add_typer(key_app, name="key")


def _money(usd: float) -> str:
    """Dollars with cents, or six decimals below a cent (per-second use of a small sandbox)."""
    return f"${usd:.6f}" if usd < 0.01 else f"${usd:.2f}"


def _limit(value: float) -> str:
    return "no limit" if not value else f"{value:g}"


@account_app.command("create")
@handle_errors
def account_create(name: str = typer.Argument(..., help="Account name (letters, digits, . _ -)."),
                   plan: str = typer.Option(None, "--plan", help="Plan (default: the server's default_plan)."),
                   json_: bool = JSON_OPT) -> None:
    """Create an account with a first API key; its token is shown only now."""
    with client() as c:
        made = c.run(A.create_account(name, plan))
    if json_:
        print_json(made)
        return
    acct, key = made["account"], made["key"]
    print_table(("ACCOUNT", "NAME", "PLAN", "KEY", "TOKEN"),
                [(acct["id"], acct["name"], acct["plan"], key["id"], key["token"])])
    err.print("the token is shown only once: keep it (SBX_TOKEN, or token in ~/.config/sbx/config.toml)",
              markup=False)


@account_app.command("list")
@handle_errors
def account_list(json_: bool = JSON_OPT) -> None:
    """Every account of the installation."""
    with client() as c:
        rows = c.run(A.list_accounts())
    if json_:
        print_json({"accounts": rows})
        return
    print_table(("ID", "NAME", "PLAN", "STATE", "CREATED"),
                [(a["id"], a["name"], a["plan"], a.get("state", "active"), a["createdAt"]) for a in rows])


@account_app.command("suspend")
@handle_errors
def account_suspend(account_id: str = typer.Argument(..., help="Account id (acct_...)."),
                    json_: bool = JSON_OPT) -> None:
    """Suspend an account: its keys answer 403 account_suspended, its running sandboxes stop with memory."""
    with client() as c:
        out = c.run(A.suspend_account(account_id))
    if json_:
        print_json(out)
        return
    acct, ids = out["account"], out["sandboxes"]
    err.print(f"{acct['id']} ({acct['name']}) suspended; stopping {len(ids)} sandboxes with memory"
              + (f": {', '.join(ids)}" if ids else ""), markup=False)


@account_app.command("resume")
@handle_errors
def account_resume(account_id: str = typer.Argument(..., help="Account id (acct_...)."),
                   json_: bool = JSON_OPT) -> None:
    """Lift a suspension: the account's keys work again (its sandboxes stay stopped until resumed)."""
    with client() as c:
        acct = c.run(A.resume_account(account_id))
    if json_:
        print_json({"account": acct})
        return
    err.print(f"{acct['id']} ({acct['name']}) is {acct['state']}", markup=False)


DELETE_WAIT = 900.0
"""Seconds ``account delete`` waits for the deletion to finish (``--no-wait``: none)."""


@account_app.command("delete")
@handle_errors
def account_delete(account_id: str = typer.Argument(..., help="Account id (acct_...)."),
                   yes: bool = typer.Option(False, "--yes", "-y", help="Don't ask for confirmation."),
                   wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait until it is deleted."),
                   json_: bool = JSON_OPT) -> None:
    """Delete an account with its sandboxes, snapshots, secrets, hosted ports and keys (its usage stays)."""
    import time

    if not yes and not typer.confirm(f"delete account {account_id} and everything it has?"):
        raise typer.Exit(1)
    with client() as c:
        out = c.run(A.delete_account(account_id))
        acct = out["account"]
        deadline = time.monotonic() + DELETE_WAIT
        while wait and acct["state"] != "deleted" and time.monotonic() < deadline:
            time.sleep(1.0)
            acct = c.run(A.account(account_id))["account"]
    if json_:
        print_json({"account": acct, "sandboxes": out["sandboxes"]})
        return
    err.print(f"{acct['id']} ({acct['name']}) {acct['state']}; {len(out['sandboxes'])} sandboxes removed"
              if acct["state"] == "deleted" else
              f"{acct['id']} ({acct['name']}) {acct['state']}: removing {len(out['sandboxes'])} sandboxes",
              markup=False)
    if wait and acct["state"] != "deleted":
        raise typer.Exit(1)


@account_app.command("set-plan")
@handle_errors
def account_set_plan(account_id: str = typer.Argument(..., help="Account id (acct_...)."),
                     plan: str = typer.Argument(..., help="New plan."), json_: bool = JSON_OPT) -> None:
    """Move an account to another plan."""
    with client() as c:
        acct = c.run(A.set_plan(account_id, plan))
    if json_:
        print_json({"account": acct})
        return
    err.print(f"{acct['id']} ({acct['name']}) is on the {acct['plan']} plan", markup=False)


@key_app.command("create")
@handle_errors
def key_create(account_id: str = typer.Argument(..., help="Account id (acct_...)."),
               name: str = typer.Option("default", "--name", help="A name to tell keys apart."),
               expires_in: int = typer.Option(None, "--expires-in", help="Seconds until the key stops working."),
               json_: bool = JSON_OPT) -> None:
    """Create an API key for an account; its token is shown only now."""
    with client() as c:
        key = c.run(A.create_key(account_id, name, expires_in))
    if json_:
        print_json({"key": key})
        return
    print_table(("KEY", "NAME", "EXPIRES", "TOKEN"), [(key["id"], key["name"], key["expiresAt"] or "never",
                                                       key["token"])])
    err.print("the token is shown only once: keep it", markup=False)


@key_app.command("list")
@handle_errors
def key_list(account_id: str = typer.Argument(..., help="Account id (acct_...)."), json_: bool = JSON_OPT) -> None:
    """An account's keys (prefixes only: tokens are not stored)."""
    with client() as c:
        keys = c.run(A.list_keys(account_id))
    if json_:
        print_json({"keys": keys})
        return
    print_table(("KEY", "NAME", "PREFIX", "ADMIN", "EXPIRES", "REVOKED"),
                [(k["id"], k["name"], k["prefix"], "yes" if k["admin"] else "", k["expiresAt"] or "never",
                  k["revokedAt"] or "") for k in keys])


@key_app.command("revoke")
@handle_errors
def key_revoke(key_id: str = typer.Argument(..., help="Key id (key_...)."), json_: bool = JSON_OPT) -> None:
    """Revoke an API key: from now on it answers 401."""
    with client() as c:
        key = c.run(A.revoke_key(key_id))
    if json_:
        print_json({"key": key})
        return
    err.print(f"revoked {key['id']} ({key['name']})", markup=False)


@handle_errors
def plan(json_: bool = JSON_OPT) -> None:
    """Show your account's plan, its limits and what you use now."""
    with client() as c:
        data = c.run(A.account())
    if json_:
        print_json(data)
        return
    p, used = data["plan"], data["used"]
    print_table(("", "LIMIT", "USED"), [
        ("account", data["account"]["name"], data["account"]["id"]),
        ("plan", f"{p['name']} (${p['priceUsdMonth']:g}/month)", ""),
        ("sizes", ", ".join(p["sizes"]), ""),
        ("runtimes", ", ".join(p.get("runtimes") or ()), ""),
        ("starts per hour", _limit(p["startsPerHour"]), str(used["startsLastHour"])),
        ("running at once", _limit(p["running"]), str(used["running"])),
        ("included storage GiB", _limit(p["storageGiB"]), f"{used['storedGiB']:.3f}"),
    ])


def _row(key: str, fig: dict[str, Any]) -> tuple[str, ...]:
    return (key, f"{fig['runningSeconds']:.0f}", f"{fig['runningGiBHours']:.4f}", f"{fig['storedGiBHours']:.4f}",
            _money(fig["cost"]))


@handle_errors
def usage(
    from_: str = typer.Option(None, "--from", help="Start: a date (2026-12-01) or ISO time, UTC (default: the "
                              "start of this month)."),
    to: str = typer.Option(None, "--to", help="End (exclusive; default now)."),
    by: str = typer.Option(None, "--by", help="Group by sandbox, size or day."),
    json_: bool = JSON_OPT,
) -> None:
    """Metered use and cost: seconds running, GiB-hours running and stored, cost in USD."""
    if by is not None and by not in ("sandbox", "size", "day"):
        raise typer.BadParameter("use sandbox, size or day", param_hint="--by")
    with client() as c:
        rep = c.run(A.usage(from_, to, by))
    if json_:
        print_json(rep)
        return
    rows = [_row(g["key"], g) for g in rep["groups"]] if by else [_row(k, v) for k, v in rep["bySize"].items()]
    print_table(((by or "size").upper(), "SECONDS", "RUN GIB-H", "STORED GIB-H", "COST"),
                [*rows, _row("total", rep["total"])])
    err.print(f"{rep['from']} to {rep['to']}, {rep['priceModel']} prices", markup=False)
