"""The ``sbx`` command (console script ``sbx = sbx.cli.main:app``): assembles the verbs of each group.

Verbs::

    sbx new --type small --name N [--from SNAP] [--ttl S] [--no-snapshots] [--auto-resume] [--env K=V] [--json]
    sbx list | info ID | stop ID [--wait] | resume ID [--type T] [--require-memory] [--ttl S] [--wait] | delete ID
    sbx exec ID "CMD" [--timeout 30] [--detach] [--tty] [--user root] | jobs ID | logs ID JOB [-f] | wait ID JOB
    sbx kill ID JOB
    sbx ssh ID [-- CMD] | cp LOCAL ID:PATH | cp ID:PATH LOCAL
    sbx host ID [PORT [--public]] | unhost ID PORT
    sbx fork ID [--type T] [--ttl S] [--name N] [--wait] [--json]
    sbx snapshot ID NAME | snapshots [ID] | snapshot-delete NAME
    sbx plan | usage [--from D] [--to D] [--by sandbox|size|day]
    sbx admin account create|list|set-plan|suspend|resume|delete | admin key create|list|revoke
    sbx secret set NAME --host H [--header 'Authorization: Bearer {secret}'] < value | list | rm | log | bind | unbind
    sbx new|fork ... --secret NAME
    sbx server | setup | doctor
    sbx node serve [--host H] [--port P] | node list [--json] | node cordon NODE | node uncordon NODE
    sbx node drain NODE [--wait] | migrate ID [--to NODE] [--wait] [--json]
"""

from __future__ import annotations

import typer

from sbx.cli import (
    accounts,
    admin,
    ca,
    exec,
    files,
    fork,
    images,
    lifecycle,
    nodes,
    ports,
    secrets,
    ssh,
    sshkeys,
    volumes,
)

app = typer.Typer(
    name="sbx",
    help="Self-hosted machine-like sandboxes for AI agents: create, exec, stop with memory, resize, fork.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

app.command("new", rich_help_panel="Sandboxes")(lifecycle.new)
app.command("list", rich_help_panel="Sandboxes")(lifecycle.list_)
app.command("info", rich_help_panel="Sandboxes")(lifecycle.info)
app.command("stop", rich_help_panel="Sandboxes")(lifecycle.stop)
app.command("resume", rich_help_panel="Sandboxes")(lifecycle.resume)
app.command("delete", rich_help_panel="Sandboxes")(lifecycle.delete)

app.command("exec", rich_help_panel="Commands")(exec.exec_)
app.command("jobs", rich_help_panel="Commands")(exec.jobs)
app.command("logs", rich_help_panel="Commands")(exec.logs)
app.command("wait", rich_help_panel="Commands")(exec.wait)
app.command("kill", rich_help_panel="Commands")(exec.kill)
app.command("ssh", rich_help_panel="Commands")(ssh.ssh)
app.command("cp", rich_help_panel="Commands")(files.cp)

app.command("host", rich_help_panel="Ports")(ports.host)
app.command("unhost", rich_help_panel="Ports")(ports.unhost)

app.add_typer(secrets.app, name="secret", rich_help_panel="Secrets")
app.add_typer(sshkeys.app, name="ssh-key", rich_help_panel="Commands")
app.add_typer(images.app, name="image", rich_help_panel="Images")
app.add_typer(volumes.app, name="volume", rich_help_panel="Volumes")

app.command("fork", rich_help_panel="Copies")(fork.fork)
app.command("snapshot", rich_help_panel="Copies")(fork.snapshot)
app.command("snapshots", rich_help_panel="Copies")(fork.snapshots)
app.command("snapshot-delete", rich_help_panel="Copies")(fork.snapshot_delete)

app.command("plan", rich_help_panel="Account")(accounts.plan)
app.command("usage", rich_help_panel="Account")(accounts.usage)
app.add_typer(accounts.admin_app, name="admin", rich_help_panel="Machine")

app.command("server", rich_help_panel="Machine")(admin.server)
app.command("setup", rich_help_panel="Machine")(admin.setup)
app.command("doctor", rich_help_panel="Machine")(admin.doctor)
app.add_typer(nodes.app, name="node", rich_help_panel="Machine")
app.add_typer(ca.app, name="ca", rich_help_panel="Machine")
app.command("migrate", rich_help_panel="Machine")(nodes.migrate)

if __name__ == "__main__":
    app()
