"""``sbx ssh-key``: the SSH public keys the SSH gateway lets in (``ssh -p 2222 <sandbox id>@HOST``).

::

    sbx ssh-key add [FILE|-] [--name N]     (default: ~/.ssh/id_ed25519.pub, else id_ecdsa.pub, else id_rsa.pub)
    sbx ssh-key list
    sbx ssh-key delete ID
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from sbx.cli.common import JSON_OPT, client, fail, handle_errors, out, print_json, print_table
from sbx.sdk import sshkeys as K

app = typer.Typer(help="SSH public keys for the SSH gateway (ssh -p 2222 SANDBOX_ID@HOST).", no_args_is_help=True)

DEFAULT_KEYS = ("id_ed25519.pub", "id_ecdsa.pub", "id_rsa.pub")


def _read_key(file: str | None) -> str:
    if file == "-":
        return sys.stdin.read()
    if file is None:
        for name in DEFAULT_KEYS:
            path = Path.home() / ".ssh" / name
            if path.is_file():
                return path.read_text()
        raise fail("invalid_ssh_key", "no FILE given and no ~/.ssh/id_ed25519.pub, id_ecdsa.pub or id_rsa.pub "
                   "found (make one with ssh-keygen -t ed25519)")
    try:
        return Path(file).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise fail("invalid_ssh_key", f"cannot read {file}: {e}") from None


@app.command("add")
@handle_errors
def add(
    file: str = typer.Argument(None, help="The public key file (a .pub), or - for stdin (default: "
                               "~/.ssh/id_ed25519.pub, id_ecdsa.pub or id_rsa.pub)."),
    name: str = typer.Option(None, "--name", help="A name for the key (default: its comment)."),
    account: str = typer.Option(None, "--account", help="Another account's (the admin key only)."),
    json_: bool = JSON_OPT,
) -> None:
    """Register an SSH public key: it then logs in to this account's sandboxes with ssh -p 2222 SANDBOX_ID@HOST
    (and scp, sftp, rsync, ssh -L, VS Code Remote-SSH)."""
    text = _read_key(file)
    with client() as c:
        key = c.run(K.add_ssh_key(text, name, account))
    if json_:
        print_json({"sshKey": key})
    else:
        out.print(f"{key['id']} {key['fingerprint']} ({key['name']})", markup=False)


@app.command("list")
@handle_errors
def list_(account: str = typer.Option(None, "--account", help="One account's (the admin key only)."),
          json_: bool = JSON_OPT) -> None:
    """The SSH keys of this account (the admin: of every account)."""
    with client() as c:
        keys = c.run(K.ssh_keys(account))
    if json_:
        print_json({"sshKeys": keys})
        return
    print_table(("ID", "NAME", "TYPE", "FINGERPRINT", "ACCOUNT", "CREATED"),
                ((k["id"], k["name"], k["algorithm"], k["fingerprint"], k["account"], k["createdAt"]) for k in keys))


@app.command("delete")
@handle_errors
def delete(key_id: str = typer.Argument(..., help="The key's id (sshkey_...).")) -> None:
    """Delete an SSH key: the gateway refuses it from the next login on."""
    with client() as c:
        c.run(K.delete_ssh_key(key_id))
    out.print(f"deleted {key_id}", markup=False)
