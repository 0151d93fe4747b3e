"""``sbx ca ...``: the installation CA that authenticates servers and node agents to each other (mutual TLS,
:mod:`sbx.tls`; issue 35).

``sbx ca init`` (also done by ``sbx setup`` when there is none) makes the CA and the server's own certificate in
the server's TLS folder (``SBX_NODE_TLS_DIR``, else ``<state_dir>/tls``). ``sbx ca issue NAME --host ADDR --out
DIR`` writes a node's TLS folder (certificate, key, the CA to trust) for the operator to copy to that node's TLS
folder. ``sbx ca rotate`` and ``sbx ca finish-rotation`` roll the CA (docs/nodes-tls.md). ``sbx ca show`` lists the
certificates of a TLS folder.
"""

from __future__ import annotations

from pathlib import Path

import typer

from sbx import tls
from sbx.cli.common import JSON_OPT, err, fail, out, print_json, print_table
from sbx.config import load_settings

app = typer.Typer(help="The installation CA: certificates for servers and node agents (mutual TLS).",
                  no_args_is_help=True)

SERVER_NAME = "sbx-server"


def ensure_ca(folder: Path) -> bool:
    """Make the CA and the server's certificate in ``folder`` unless a CA or a TLS identity is there already
    (a node's folder copied from the server). True when it made them."""
    if tls.has_ca(folder) or tls.identity(folder) is not None:
        return False
    tls.make_ca(folder)
    tls.issue(folder, folder, SERVER_NAME)
    return True


@app.command("init")
def init() -> None:
    """Make the installation CA and this server's certificate (refused when a CA exists: see `sbx ca rotate`)."""
    folder = load_settings().tls_dir
    if not ensure_ca(folder):
        raise fail("ca_exists", f"{folder} already holds a CA or a certificate (roll it with `sbx ca rotate`)")
    err.print(f"installation CA and server certificate in {folder}", markup=False)


@app.command("issue")
def issue(
    name: str = typer.Argument(..., help="The node's name (SBX_NODE_NAME there); the certificate's common name."),
    host: list[str] = typer.Option([], "--host", help="An address or DNS name the node is reached at (its URL's "
                                                      "host); repeat for several."),
    out_dir: Path = typer.Option(..., "--out", help="The folder to write (copy it to the node's TLS folder: "
                                                    "<state dir>/tls there)."),
) -> None:
    """Issue a node's certificate (or a server replica's: no --host) under the installation CA."""
    folder = load_settings().tls_dir
    try:
        cert = tls.issue(folder, out_dir, name, host)
    except tls.TLSError as e:
        raise fail("no_ca", str(e)) from None
    except ValueError as e:
        raise fail("invalid_name", str(e)) from None
    err.print(f"{name}: certificate {cert.serial_number:x} until {cert.not_valid_after_utc:%Y-%m-%d} in {out_dir} "
              "(cert.pem, key.pem, ca.crt)", markup=False)


@app.command("rotate")
def rotate() -> None:
    """Start a CA roll: a new CA signs from now on; ca.crt trusts the new and the old CA until `finish-rotation`.
    The server keeps its certificate of the old CA (nodes not yet reissued trust only that one)."""
    folder = load_settings().tls_dir
    try:
        tls.rotate_ca(folder)
    except tls.TLSError as e:
        raise fail("no_ca", str(e)) from None
    err.print(f"new CA in {folder}; ca.crt trusts the new and the old one. Reissue every node's certificate "
              "(`sbx ca issue`), copy each folder to its node and restart that agent, restart the servers, then "
              "run `sbx ca finish-rotation`", markup=False)


@app.command("finish-rotation")
def finish_rotation() -> None:
    """End a CA roll: this server's certificate is reissued under the new CA, ca.crt trusts the new CA only and
    the old CA's key is deleted (every node must hold a certificate of the new CA by then)."""
    folder = load_settings().tls_dir
    try:
        tls.finish_rotation(folder)
    except tls.TLSError as e:
        raise fail("no_ca", str(e)) from None
    tls.issue(folder, folder, SERVER_NAME)
    err.print(f"{folder}: server certificate reissued, ca.crt trusts the new CA only. Restart the servers, then "
              "copy this ca.crt to every node and restart the agents", markup=False)


@app.command("show")
def show(
    folder: Path = typer.Option(None, "--dir", help="A TLS folder (default: this host's)."),
    json_: bool = JSON_OPT,
) -> None:
    """The certificates of a TLS folder: whom they name, who signed them, until when."""
    folder = folder or load_settings().tls_dir
    rows = []
    for fname in (tls.CA_CERT, tls.CERT):
        try:
            for c in tls.describe(folder / fname):
                rows.append({"file": fname, **c})
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise fail("bad_certificate", f"{folder / fname}: {e}") from None
    if json_:
        print_json({"dir": str(folder), "certificates": rows})
    elif not rows:
        out.print(f"no certificates in {folder}", markup=False)
    else:
        print_table(("FILE", "SUBJECT", "ISSUER", "NOT AFTER", "HOSTS"),
                    ((r["file"], r["subject"], r["issuer"], r["notAfter"][:10], r["hosts"]) for r in rows))
