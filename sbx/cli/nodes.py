"""``sbx node ...``: the node agent of one host as its own process (issue 10).

``sbx node serve`` runs this host's node agent (sandboxes, disks, network) with its own HTTP API on
``--host``/``--port`` (settings ``node_host``/``node_port``, default 127.0.0.1:7700), authenticated with the node
token (``SBX_NODE_TOKEN``, or one it makes in ``<state_dir>/node-token``). A server reaches it with
``SBX_NODE_URL=http://HOST:PORT SBX_NODE_TOKEN=... sbx server``. ``sbx node list [--json]``, ``sbx node cordon NODE``,
``sbx node uncordon NODE``, ``sbx node drain NODE`` and ``sbx node consolidation`` ask the server about its registry
(:mod:`sbx.control.cluster.registry`), its drains and its consolidation loop; ``sbx node add URL --token T`` and
``sbx node remove NODE`` add a further node agent for every replica (:mod:`sbx.control.cluster.router`); ``sbx migrate
ID
[--to NODE]`` (a top-level verb) live-migrates one running sandbox.
"""

from __future__ import annotations

import ssl
from typing import Any

import typer

from sbx import tls
from sbx.cli.admin import KEEP_ALIVE, SHUTDOWN_GRACE, _host_failure, _progress, _uvicorn_server
from sbx.cli.common import JSON_OPT, client, err, fail, handle_errors, out, print_json, print_table, spinner
from sbx.config import load_settings
from sbx.sdk import nodes as N
from sbx.sdk import protocol as P

app = typer.Typer(help="This host's node agent (several nodes).", no_args_is_help=True)


@app.command("serve")
def serve(
    host: str = typer.Option(None, "--host", help="Listen address (default from settings: 127.0.0.1)."),
    port: int = typer.Option(None, "--port", help="Listen port (default from settings: 7700)."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
    log_format: str = typer.Option(None, "--log-format", help="text (default) or json: one JSON object per line "
                                   "with the sandbox and request ids (default from SBX_LOG_FORMAT)."),
) -> None:
    """Run this host's node agent with its HTTP API for servers (SIGTERM stops it; sandboxes keep running)."""
    import uvicorn

    from sbx import logs
    from sbx.node.agent import LocalNode  # the real node: imported only here
    from sbx.node.remote.server import create_node_app
    from sbx.node.remote.wire import ensure_node_token, node_token_path

    overrides: dict[str, Any] = {}
    if host:
        overrides["node_host"] = host
    if port:
        overrides["node_port"] = port
    if log_format:
        overrides["log_format"] = log_format
    settings = load_settings(**overrides)
    try:
        logs.configure(log_level, settings.log_format)
    except ValueError as e:
        raise fail("invalid_log_format", str(e)) from None
    token = ensure_node_token(settings)
    node = LocalNode(settings)
    try:
        node.prepare(progress=_progress)
        # a restarted agent puts its own sandboxes in order first: an operation it was killed in is finished or
        # undone, and the network pins of the sandboxes that kept running are loaded again
        node.reconcile(node.recorded())
    except Exception as e:  # host checks, volume, image, network: report, don't trace
        raise _host_failure(e) from None
    # mutual TLS when this node has its certificate (sbx.tls: `sbx ca issue` on the server, copied here)
    ident = tls.identity(settings.tls_dir)
    tls_opts: dict[str, Any] = {}
    if ident is not None:
        tls_opts = {"ssl_certfile": str(ident.cert), "ssl_keyfile": str(ident.key), "ssl_ca_certs": str(ident.ca),
                    "ssl_cert_reqs": ssl.CERT_REQUIRED}
    # the port relay listens next to the node API (node_port + 1): the servers' proxies reach hosted ports there
    app_ = create_node_app(node, token, settings.node_name, relay=(settings.node_host, settings.node_port + 1),
                           metrics_token=settings.metrics_token,
                           relay_tls=ident.server_context() if ident is not None else None)
    where = "SBX_NODE_TOKEN" if settings.node_token else str(node_token_path(settings.state_dir))
    scheme = "https" if ident is not None else "http"
    err.print(f"sbx node {settings.node_name} on {scheme}://{settings.node_host}:{settings.node_port} "
              f"(node token: {where})", markup=False)
    if ident is None:
        err.print(f"warning: no TLS certificate in {settings.tls_dir}: node calls (secrets, memory images) cross "
                  "the network in clear; see `sbx ca issue`", markup=False)
    config = uvicorn.Config(app_, host=settings.node_host, port=settings.node_port, log_level=log_level,
                            log_config=logs.uvicorn_log_config(settings.log_format),
                            lifespan="on", timeout_graceful_shutdown=int(SHUTDOWN_GRACE) + 5,
                            timeout_keep_alive=KEEP_ALIVE, access_log=False, **tls_opts)
    _uvicorn_server(config, on_exit=lambda: node.begin_shutdown(SHUTDOWN_GRACE)).run()
    if node.cleanup_host():
        err.print(f"removed {settings.bridge}, the nftables table and /run/sbx/{settings.node_name}", markup=False)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


@app.command("list")
@handle_errors
def list_(json_: bool = JSON_OPT) -> None:
    """The nodes the servers heartbeat: STATUS is ready, cordoned or unreachable (no heartbeat answered for
    SBX_NODE_UNREACHABLE_SECONDS), with ", removable" for an added node that is cordoned and empty (by a drain or
    consolidation: `sbx node remove` takes it); MEMORY, DISK FREE and VCPUS are its capacity, DISKS the sizes of its
    sandboxes' disks together (sparse: what they may grow to, the overcommit against DISK FREE), LOAD its 1-minute
    load."""
    with client() as c:
        items = c.run(N.nodes())
    if json_:
        print_json({"nodes": items})
        return
    print_table(("NAME", "STATUS", "SANDBOXES", "MEMORY", "DISK FREE", "DISKS", "VCPUS", "LOAD", "CPU", "URL"),
                ((n["name"], n["status"] + (", removable" if n.get("removable") else ""), str(n["sandboxes"]),
                  f"{n['capacity']['memoryMiB']} MiB",
                  _gib(n["capacity"]["diskFreeBytes"]), _gib(n["capacity"].get("diskPromisedBytes", 0)),
                  str(n["capacity"]["vcpus"]), f"{n['load']['load1']:.2f}",
                  n["fingerprint"].get("cpuModel", ""), n["url"]) for n in items))


@app.command("add")
@handle_errors
def add(
    url: str = typer.Argument(..., help="The node agent's URL (`sbx node serve` on that host: http://HOST:7700)."),
    token: str = typer.Option(..., "--token", help="Its node token (SBX_NODE_TOKEN there, or its "
                                                   "<state dir>/node-token)."),
    json_: bool = JSON_OPT,
) -> None:
    """Add a node agent to the nodes every server replica drives (new sandboxes may go there)."""
    with client() as c:
        node = c.run(N.add_node(url, token))
    if json_:
        print_json({"node": node})
        return
    out.print(f"added {node['name']} ({node['url']}, {node['status']})", markup=False)


@app.command("remove")
@handle_errors
def remove(name: str = typer.Argument(..., help="The node (a NAME of `sbx node list`).")) -> None:
    """Stop driving an added node (it must hold no sandbox)."""
    with client() as c:
        c.run(N.remove_node(name))
    out.print(f"removed {name}", markup=False)


@app.command("cordon")
@handle_errors
def cordon(name: str = typer.Argument(..., help="The node (a NAME of `sbx node list`).")) -> None:
    """Place no new sandbox on NODE; the sandboxes it holds keep running."""
    with client() as c:
        c.run(N.cordon(name, True))
    out.print(f"cordoned {name}", markup=False)


@app.command("uncordon")
@handle_errors
def uncordon(name: str = typer.Argument(..., help="The node (a NAME of `sbx node list`).")) -> None:
    """Let new sandboxes go to NODE again."""
    with client() as c:
        c.run(N.cordon(name, False))
    out.print(f"uncordoned {name}", markup=False)


def _drain_line(item: dict[str, Any]) -> str:
    """One sandbox of a drain as the CLI prints it."""
    what = {"migrate": "migrated (running)", "move": "moved (stopped)", "none": "left"}.get(item["action"], "")
    if item["status"] == "done":
        pause = f", paused {item['pauseS']:.2f} s" if item.get("pauseS") is not None else ""
        return f"{item['id']}  {what} {item['from']} -> {item['to']} in {item['seconds'] or 0:.2f} s{pause}"
    if item["status"] == "failed":
        e = item["error"] or {}
        return f"{item['id']}  stays on {item['from']}: {e.get('code', 'failed')}: {e.get('message', '')}"
    if item["status"] == "gone":
        return f"{item['id']}  deleted meanwhile"
    return f"{item['id']}  {item['status']} ({item['action']})"


@app.command("drain")
@handle_errors
def drain(
    name: str = typer.Argument(..., help="The node (a NAME of `sbx node list`)."),
    wait: bool = typer.Option(False, "--wait", help="Show each sandbox as it moves and wait for the end."),
    json_: bool = JSON_OPT,
) -> None:
    """Cordon NODE and move every sandbox off it: running ones by live migration (same id, URL, processes and
    memory; their users see a short pause), stopped ones with their disk and memory image. Placement picks where
    each goes; a sandbox no other node can take stays (insufficient_capacity). Exits 1 when the node is not empty
    at the end (with --wait)."""
    import time

    with client() as c:
        d = c.run(N.drain(name))
        if wait:
            if not json_:
                out.print(f"draining {name}: {len(d['sandboxes'])} sandboxes to move"
                          if d["sandboxes"] else f"draining {name}: nothing to move", markup=False)
            shown: set[str] = set()
            while True:
                for item in d["sandboxes"]:
                    if item["status"] in ("done", "failed", "gone") and item["id"] not in shown:
                        shown.add(item["id"])
                        if not json_:
                            out.print(_drain_line(item), markup=False)
                if d["state"] == "done":
                    break
                time.sleep(0.5)
                d = c.run(N.drain_status(name))
    if json_:
        print_json({"drain": d})
    elif not wait:
        out.print(f"draining {name} (cordoned): {len(d['sandboxes'])} sandboxes to move; "
                  f"`sbx node drain {name} --wait` follows it", markup=False)
    else:
        out.print(f"{name} is empty (still cordoned)" if d["empty"] else
                  f"{name} is not empty: {sum(1 for i in d['sandboxes'] if i['status'] == 'failed')} sandboxes "
                  "stay", markup=False)
    if wait and not d["empty"]:
        raise typer.Exit(1)


@handle_errors
def migrate(
    sandbox_id: str = typer.Argument(..., help="Sandbox id (a running sandbox)."),
    to: str = typer.Option(None, "--to", help="The destination node (a NAME of `sbx node list`); default: the "
                                              "ready node with the most room and the same CPU, kernel and CRIU."),
    wait: bool = typer.Option(False, "--wait", help="Return once it runs on the destination."),
    json_: bool = JSON_OPT,
) -> None:
    """Move a running sandbox to another node while it runs (admin key): same id, URL, processes and memory,
    one short pause. A move that fails leaves it running where it was (exit 1 with the reason, with --wait)."""
    with client() as c:
        with spinner(f"migrating {sandbox_id}", wait and not json_):
            sb = c.run(P.migrate(sandbox_id, to, wait))  # with --wait, a move that failed is an error here
        moved = None
        if wait and not json_:
            moved = next((e for e in reversed(c.run(P.events(sandbox_id))) if e.get("event") == "migrated"), None)
    if json_:
        print_json({"sandbox": sb})
    elif not wait:
        out.print(f"{sb['id']} migrating from {sb['node']} (`sbx info {sb['id']}` shows where it runs)",
                  markup=False)
    elif moved is not None and moved["to"] == sb["node"]:
        out.print(f"{sb['id']} migrated {moved['from']} -> {moved['to']} in {moved.get('totalS') or 0:.2f} s, "
                  f"paused {moved.get('pauseS') or 0:.2f} s", markup=False)
    else:
        out.print(f"{sb['id']} {sb['state']} on {sb['node']}", markup=False)


@app.command("consolidation")
@handle_errors
def consolidation(json_: bool = JSON_OPT) -> None:
    """What the consolidation loop (SBX_CONSOLIDATE_SECONDS) decided last: which light node it empties onto
    fuller ones and where each sandbox goes, or why it empties none; each node's memory use; its last drain."""
    with client() as c:
        k = c.run(N.consolidation())
    if json_:
        print_json({"consolidation": k})
        return
    r = k["rules"]
    if not k["enabled"]:
        out.print("consolidation is off (SBX_CONSOLIDATE_SECONDS=0)", markup=False)
    else:
        out.print(f"consolidation every {k['periodS']:g} s: a node is light below {r['lightFraction']:.0%} of its "
                  f"memory used; destinations keep {r['headroom']:.0%} free", markup=False)
    if not k["leader"]:
        out.print("this server replica does not lead consolidation (another one does)", markup=False)
    plan = k["plan"]
    if plan is None:
        out.print("no pass yet", markup=False)
    else:
        out.print(f"last pass {k['lastRunAt']}: {plan['action']}: {plan['reason']}", markup=False)
        for m in plan["moves"]:
            out.print(f"  {m['id']} -> {m['to']}", markup=False)
        print_table(("NAME", "STATUS", "USED", "CAPACITY", "SANDBOXES", "LIGHT"),
                    ((n["name"], n["status"], f"{n['usedMiB']} MiB ({n['fraction']:.0%})", f"{n['capacityMiB']} MiB",
                      str(n["sandboxes"]), "yes" if n["light"] else f"no: {n['why']}") for n in plan["nodes"]))
    d = k["drain"]
    if d is not None:
        out.print(f"last consolidation drain of {d['node']}: {d['state']}", markup=False)
        for item in d["sandboxes"]:
            out.print(_drain_line(item), markup=False)
    if k["outcome"]:
        out.print(k["outcome"], markup=False)
    if k["removable"]:
        out.print("removable: " + ", ".join(k["removable"]), markup=False)
