"""Fixtures for end-to-end tests on real sandboxes: ``server`` runs `sbx server` as a subprocess (as root) with the
test profile, its own state dir, node name, bridge, subnet and port, and HOME in a temp dir so the client config it
writes lands there. ``sbx`` runs the CLI as a subprocess against it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.nodenet import force_clean, node_tls, run_ca
from tests.slots import slotted

VENV_BIN = Path(sys.executable).parent
SBX = str(VENV_BIN / "sbx")


@dataclass
class Server:
    url: str
    token: str
    env: dict[str, str]
    home: Path
    log: Path
    proxy_port: int = 0
    ssh_port: int = 0

    def sbx(self, *args: str, timeout: float = 600, check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run ``sbx ARGS`` with this server's client config; returns the completed process (text)."""
        r = subprocess.run([SBX, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"sbx {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
        return r

    def api(self, method: str, path: str) -> dict:  # type: ignore[type-arg]
        req = urllib.request.Request(self.url + path, method=method,
                                     headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())  # type: ignore[no-any-return]

    def delete_all(self) -> None:
        """Delete every sandbox and wait for each; one that is gone by then (a delete already in flight) is fine."""
        for sb in self.api("GET", "/v1/sandboxes")["sandboxes"]:
            try:
                self.api("DELETE", f"/v1/sandboxes/{sb['id']}?wait=true")
            except urllib.error.HTTPError as e:
                if e.code != 404:
                    raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The session's server: node ``e2e`` on bridge ``sbxe2e0`` / 10.89.0.0/16, automatic snapshots off.
    SBX_E2E_NODE / SBX_E2E_BRIDGE / SBX_E2E_SUBNET let two e2e runs share this host."""
    with start_server(
        tmp_path_factory.mktemp("sbx-ctl-e2e"),
        node=os.environ.get("SBX_E2E_NODE", "e2e"),
        bridge=os.environ.get("SBX_E2E_BRIDGE", "sbxe2e0"),
        subnet=os.environ.get("SBX_E2E_SUBNET", "10.89.0.0/16"),
    ) as srv:
        yield srv


@contextmanager
def start_server(tmp: Path, node: str, bridge: str, subnet: str, **env_extra: str) -> Iterator[Server]:
    """Run `sbx server` (test profile) with its own state dir, node, bridge, subnet and ports, HOME under ``tmp``;
    ``env_extra`` adds ``SBX_*`` settings. On exit deletes its sandboxes, stops it (it must exit 0) and removes
    its bridge. Node, bridge and subnet move to the run's test slot (:mod:`tests.slots`)."""
    if os.geteuid() != 0:
        pytest.fail("end-to-end tests boot real sandboxes and must run as root")
    node, bridge, subnet = slotted(node, bridge, subnet)
    port = _free_port()
    proxy_port = _free_port()
    ssh_port = _free_port()  # the SSH gateway: another server may hold the default 2222
    env = {
        **os.environ,
        "SBX_PROFILE": "test",
        "SBX_STATE_DIR": str(tmp / "state"),
        "SBX_NODE_NAME": node,
        "SBX_BRIDGE": bridge,
        "SBX_SUBNET": subnet,
        "SBX_PORT": str(port),
        "SBX_PROXY_PORT": str(proxy_port),
        "SBX_SSH_GATEWAY_PORT": str(ssh_port),
        "SBX_AUTO_SNAPSHOT_SECONDS": "0",
        "SBX_CONSOLIDATE_SECONDS": "0",  # no move the test did not ask for (test_consolidation.py sets it)
        "SBX_REPLICATE_SECONDS": "0",  # no seal replica the test did not ask for (test_seal_replicas.py sets it)
        "SBX_WARM_POOL": "0",  # no warm sandbox the test did not ask for (test_warm_pool.py sets it)
        # image builds trust what this host trusts (a TLS-inspecting proxy's CA on some networks)
        "SBX_BUILD_CA_FILE": "/etc/ssl/certs/ca-certificates.crt",
        # mutual TLS with the node agents of tests/nodenet.py: the test CA's folder is the server's TLS folder
        "SBX_NODE_TLS_DIR": str(run_ca() if node_tls() else tmp / "no-tls"),
        "HOME": str(tmp / "home"),
        "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
    }
    for key in ("SBX_URL", "SBX_TOKEN", "XDG_CONFIG_HOME", "SBX_HOME"):
        env.pop(key, None)
    env.update(env_extra)  # a test may give its server a home of its own (test_full_host.py)
    log = tmp / "server.log"
    with log.open("wb") as logf:
        proc = subprocess.Popen([SBX, "server"], env=env, stdout=logf, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900  # the first start may build the base image
    while True:
        if proc.poll() is not None:
            pytest.fail(f"sbx server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2):
                break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"sbx server did not answer:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
    cfg = tomllib.loads((tmp / "home" / ".config" / "sbx" / "config.toml").read_text())
    assert cfg["url"] == url
    srv = Server(url=url, token=cfg["token"], env=env, home=tmp / "home", log=log, proxy_port=proxy_port,
                 ssh_port=int(env["SBX_SSH_GATEWAY_PORT"]))
    try:
        yield srv
    finally:
        try:
            srv.delete_all()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            _cleanup_host(env)  # also when delete_all failed (a server that died): its sandboxes still run
        assert code == 0, f"sbx server did not stop cleanly ({code}):\n{log.read_text()[-4000:]}"


def _cleanup_host(env: dict[str, str]) -> None:
    """Remove what the test server left on the host: its bridge and nftables table, any container still running on
    its node and its node folder (:func:`tests.nodenet.force_clean`)."""
    from sbx.config import load_settings
    from sbx.node.network.bridge import remove_bridge

    settings = load_settings(node_name=env["SBX_NODE_NAME"], bridge=env["SBX_BRIDGE"], subnet=env["SBX_SUBNET"],
                             profile="test")
    remove_bridge(settings.bridge, settings.node_name)
    force_clean(settings.node_name, settings.node_dir)
