"""Verbs for the machine: ``server`` (API + control plane + node in one process), ``setup``, ``doctor``."""

from __future__ import annotations

import logging
import os
import tomllib
from typing import Any

import tomli_w
import typer

from sbx.cli.common import JSON_OPT, err, fail, print_json, print_table
from sbx.config import Settings, load_settings
from sbx.sdk.config import config_path


def write_client_config(settings: Settings, token: str) -> None:
    """Write ``~/.config/sbx/config.toml`` (``url``, ``token``; mode 0600) so the CLI and SDK find this server.

    An existing file that points at another server (different url and token) is left alone."""
    path = config_path()
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    data: dict[str, Any] = {"url": f"http://{host}:{settings.port}", "token": token}
    if path.is_file():
        try:
            with path.open("rb") as f:
                old = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError):
            old = {}
        if old == data:
            return
        if old and old.get("url") != data["url"] and old.get("token") != token:
            err.print(f"note: {path} points at another server; left unchanged", markup=False)
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        tomli_w.dump(data, f)


SHUTDOWN_GRACE = 10.0
KEEP_ALIVE = 120
"""Seconds the server and the node API keep an idle HTTP connection open. Longer than clients keep theirs in their
pools (httpx: 5 s; the reqwest pool under E2B's SDK: 90 s), so the client always closes an idle connection first: with
uvicorn's 5 s, a request sent on a connection as the server closed it failed with "connection closed before message
completed" (seen in a CI run of tests/e2e/api/test_e2b_lifecycle.py, after a 5 s pause)."""
"""Seconds attached exec streams may still run after SIGTERM; then their commands are killed and each client gets
the stream error ``server_shutdown``. Any other open stream is cut :data:`SHUTDOWN_GRACE` + 5 s after SIGTERM."""


def _uvicorn_server(config: Any, on_exit: Any = None) -> Any:
    """A uvicorn server that, on SIGTERM/SIGINT, shuts down cleanly and exits with status 0 (stock uvicorn re-raises
    the signal after shutdown, so the process would look killed to its supervisor). ``on_exit()`` is called on the
    first signal (the node starts its exec grace period)."""
    import contextlib
    import signal
    from collections.abc import Iterator

    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if on_exit is not None and not self.should_exit:
                on_exit()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server(config)


def _progress(message: str) -> None:
    err.print(message, markup=False)


def _host_failure(exc: Exception) -> typer.Exit:
    """Report a host-side failure (setup, node prepare) as ``error: <code>: <message>``; exit status 1."""
    code = getattr(exc, "code", None) or "host_error"
    message = getattr(exc, "message", None) or str(exc)
    return fail(str(code), str(message))


def server(
    host: str = typer.Option(None, "--host", help="Listen address (default from settings: 127.0.0.1)."),
    port: int = typer.Option(None, "--port", help="Listen port (default from settings: 7070)."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
    log_format: str = typer.Option(None, "--log-format", help="text (default) or json: one JSON object per line "
                                   "with the sandbox and request ids (default from SBX_LOG_FORMAT)."),
) -> None:
    """Run the sbx server: HTTP API, hosted-port proxy, SSH gateway, control plane and this machine's node, in one
    process (SIGTERM stops it). With ``SBX_NODE_URL`` (and ``SBX_NODE_TOKEN``) the node is that node agent instead."""
    import uvicorn

    from sbx import logs
    from sbx.api.app import create_app
    from sbx.api.auth import ensure_token
    from sbx.node.agent import LocalNode  # the real node: imported only here

    overrides: dict[str, Any] = {}
    if host:
        overrides["host"] = host
    if port:
        overrides["port"] = port
    if log_format:
        overrides["log_format"] = log_format
    settings = load_settings(**overrides)
    try:
        logs.configure(log_level, settings.log_format)
    except ValueError as e:
        raise fail("invalid_log_format", str(e)) from None
    logging.getLogger("alembic").setLevel(logging.WARNING)
    token = ensure_token(settings)
    write_client_config(settings, token)
    node: Any
    if settings.node_url:
        from sbx.node.remote.client import RemoteNode

        if not settings.node_token:
            raise fail("missing_node_token", "SBX_NODE_URL needs SBX_NODE_TOKEN (the node agent's token)")
        from sbx.node.types import NodeError

        try:
            node = RemoteNode(settings.node_url, settings.node_token, settings)
        except NodeError as e:  # node_tls_required, node_tls_missing
            raise fail(e.code, e.message) from None
    else:
        node = LocalNode(settings)
    try:
        node.prepare(progress=_progress)
    except Exception as e:  # host checks, volume, image, network: report, don't trace
        raise _host_failure(e) from None
    app = create_app(settings, node, token=token, serve_proxy=True, serve_ssh=True)
    ssh = f", SSH gateway on {settings.host}:{settings.ssh_gateway_port}" if settings.ssh_gateway_port else ""
    err.print(f"sbx server on {settings.api_url}, hosted ports on {settings.host}:{settings.proxy_port}{ssh} "
              f"(client config: {config_path()})", markup=False)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level, lifespan="on",
                            log_config=logs.uvicorn_log_config(settings.log_format),
                            timeout_graceful_shutdown=int(SHUTDOWN_GRACE) + 5, timeout_keep_alive=KEEP_ALIVE)
    _uvicorn_server(config, on_exit=lambda: _begin_shutdown(app)).run()
    if node.cleanup_host():
        err.print(f"removed {settings.bridge}, the nftables table and /run/sbx/{settings.node_name}", markup=False)


def _begin_shutdown(app: Any) -> None:
    """On the server's first SIGTERM/SIGINT: every node it drives (the configured one and those added with
    ``sbx node add``: :meth:`sbx.control.cluster.router.NodeRouter.agents`) starts the exec grace period, so each
    attached exec ends with ``server_shutdown``."""
    for _url, agent in app.state.control.router.agents().values():
        try:
            agent.begin_shutdown(SHUTDOWN_GRACE)
        except Exception as e:  # one node's trouble must not keep the others from hearing it
            logging.getLogger("sbx").warning("shutdown notice to a node failed: %s", e)


def setup() -> None:
    """Prepare this host for sandboxes (volume, CRIU, base image, network). Safe to re-run."""
    from sbx.node.host.setup import setup_host

    settings = load_settings()
    try:
        setup_host(settings, progress=_progress)
    except Exception as e:
        raise _host_failure(e) from None
    from sbx.cli.ca import ensure_ca

    if ensure_ca(settings.tls_dir):  # the installation CA of mutual TLS between servers and nodes (sbx.tls)
        err.print(f"installation CA and server certificate in {settings.tls_dir} (nodes: `sbx ca issue`)",
                  markup=False)
    err.print("host ready", markup=False)


def doctor(json_: bool = JSON_OPT) -> None:
    """Check this host and say how to fix what is missing; exits 1 if a check fails."""
    from sbx.node.host.setup import doctor as run_doctor

    checks = run_doctor(load_settings())
    if json_:
        print_json({"checks": [{"name": c.name, "ok": c.ok, "detail": c.detail, "fix": c.fix} for c in checks]})
    else:
        print_table(("", "CHECK", "DETAIL", "FIX"),
                    (("ok" if c.ok else "FAIL", c.name, c.detail or "", "" if c.ok else (c.fix or "")) for c in checks))
    if not all(c.ok for c in checks):
        raise typer.Exit(1)
