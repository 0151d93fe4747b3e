"""A `sbx server` that fault tests can kill -9 and start again on the same state (tests/e2e/faults/test_faults.py).

Node, bridge and subnet come from ``<prefix>_NODE`` / ``_BRIDGE`` / ``_SUBNET`` environment variables (prefix
``SBX_FAULT``: defaults ``faults`` / ``sbxfault0`` / 10.88.0.0/16, which no other test uses)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.conftest import SBX, VENV_BIN, Server, _cleanup_host, _free_port
from tests.e2e.helpers import poll
from tests.nodenet import node_tls, run_ca
from tests.slots import slotted


class FaultServer:
    """``start()`` runs the server (again) with the same state dir, ports and node; ``kill9()`` SIGKILLs it;
    ``close()`` deletes its sandboxes, stops it with SIGTERM and removes its bridge and node folder. ``srv`` is the
    :class:`Server` handle of the current run (CLI and API calls)."""

    def __init__(self, tmp: Path, prefix: str = "SBX_FAULT", node: str = "faults", bridge: str = "sbxfault0",
                 subnet: str = "10.88.0.0/16", **env_extra: str):
        if os.geteuid() != 0:
            pytest.fail("end-to-end tests boot real sandboxes and must run as root")
        self.tmp = tmp
        self.node, bridge, subnet = slotted(os.environ.get(f"{prefix}_NODE", node),
                                            os.environ.get(f"{prefix}_BRIDGE", bridge),
                                            os.environ.get(f"{prefix}_SUBNET", subnet))
        self.port = _free_port()
        self.env = {
            **os.environ,
            "SBX_PROFILE": "test",
            "SBX_STATE_DIR": str(tmp / "state"),
            "SBX_NODE_NAME": self.node,
            "SBX_BRIDGE": bridge,
            "SBX_SUBNET": subnet,
            "SBX_PORT": str(self.port),
            "SBX_PROXY_PORT": str(_free_port()),
            "SBX_SSH_GATEWAY_PORT": "0",  # no SSH gateway: another server may hold 2222
            "SBX_AUTO_SNAPSHOT_SECONDS": "0",
            "SBX_CONSOLIDATE_SECONDS": "0",
            "SBX_REPLICATE_SECONDS": "0",
            "SBX_WARM_POOL": "0",
            # mutual TLS with the node agents of tests/nodenet.py (as tests/e2e/conftest.py's start_server)
            "SBX_NODE_TLS_DIR": str(run_ca() if node_tls() else tmp / "no-tls"),
            "HOME": str(tmp / "home"),
            "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            **env_extra,
        }
        for key in ("SBX_URL", "SBX_TOKEN", "XDG_CONFIG_HOME", "SBX_HOME"):
            self.env.pop(key, None)
        self.log = tmp / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.srv: Server | None = None

    def start(self, **env_override: str) -> Server:
        """Start the server (``env_override`` changes settings for this run only) and wait for /healthz."""
        env = {**self.env, **env_override}
        env = {k: v for k, v in env.items() if v != ""}
        with self.log.open("ab") as logf:
            logf.write(b"\n==== start ====\n")
            self.proc = subprocess.Popen([SBX, "server"], env=env, stdout=logf, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 900
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"sbx server exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.proc.kill()
                    pytest.fail(f"sbx server did not answer:\n{self.log.read_text()[-4000:]}")
                time.sleep(0.5)
        cfg = tomllib.loads((self.tmp / "home" / ".config" / "sbx" / "config.toml").read_text())
        self.srv = Server(url=url, token=cfg["token"], env=env, home=self.tmp / "home", log=self.log)
        return self.srv

    def kill9(self) -> None:
        """SIGKILL the server process (its runc/CRIU children live on in their own sessions, as in a crash)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def term(self, timeout: float = 180) -> int:
        """SIGTERM the server and return its exit status (SIGKILL after ``timeout`` seconds: then -9)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def bundle(self, sid: str) -> Path:
        """The sandbox's OCI bundle folder on this node."""
        return Path("/run/sbx") / self.node / "bundles" / sid

    def sandbox_dir(self, sid: str) -> Path:
        """The sandbox's folder on this node's data volume (``node.json``, disk, memory image)."""
        return Path("/var/lib/sbx/volume/nodes") / self.node / "sandboxes" / sid

    def node_record(self, sid: str) -> dict:  # type: ignore[type-arg]
        """The node's record of the sandbox (``node.json``; ``{}`` while it is missing or half-written)."""
        try:
            return json.loads((self.sandbox_dir(sid) / "node.json").read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return {}

    def wait_frozen_hold(self, sid: str, timeout: float = 120) -> None:
        """Wait until the node holds the sandbox's root frozen (SBX_TEST_HOLD_FROZEN's marker file exists)."""
        poll(lambda: glob.glob(str(self.bundle(sid) / "*.frozen-hold")), f"{sid}'s root to be held frozen",
             timeout=timeout, interval=0.05)

    def restart(self, **env_override: str) -> Server:
        """kill -9 the server and start it again (with ``env_override`` for the new run)."""
        self.kill9()
        return self.start(**env_override)

    def thaw_all(self) -> None:
        """Thaw every sandbox root of this node (so a failing test never leaves writers hung in D state)."""
        for rootfs in glob.glob(str(Path("/run/sbx") / self.node / "bundles" / "*" / "rootfs")):
            subprocess.run(["fsfreeze", "-u", rootfs], capture_output=True)

    def close(self) -> None:
        self.thaw_all()
        try:
            if self.proc is not None and self.proc.poll() is None and self.srv is not None:
                self.srv.delete_all()
        finally:
            code = 0
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    code = self.proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    code = self.proc.wait()
            _cleanup_host(self.env)
        assert code == 0, f"sbx server did not stop cleanly ({code}):\n{self.log.read_text()[-4000:]}"


def start_replicas(a: FaultServer, b: FaultServer, between: Callable[[], None] | None = None) -> None:
    """Start two replicas of one installation (the same database in both's settings): ``a``, then ``between()``
    (e.g. ``sbx node add`` through ``a``, whose sealed token needs the secrets key it makes), then ``b`` with
    ``a``'s admin key and secrets key copied into its state folder, as an operator would."""
    a.start()
    if between is not None:
        between()
    (b.tmp / "state").mkdir(parents=True, exist_ok=True)
    for name in ("token", "secrets.key"):
        if (a.tmp / "state" / name).is_file():
            shutil.copy2(a.tmp / "state" / name, b.tmp / "state" / name)
    b.start()
