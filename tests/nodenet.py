"""Test topology for several nodes on one host (issue 10): each node agent in a network namespace of its own,
joined to the host by a veth pair, so every call between a server and a node crosses a network.

Names come from :func:`tests.slots.slotted` (``nodes`` / ``sbxnd`` / ``10.93.0.0/16`` moved to the run's slot), so
two runs in different slots never share a namespace, bridge or address. Node ``k`` (1..8) gets:

- network namespace ``<node>-<k>`` (``/run/netns``), with ``lo`` and ``eth0`` (the veth's far end,
  ``a.b.(240+k).2/24``, default route via the host end ``a.b.(240+k).1`` named ``<bridge>h<k>``);
- node name ``<node><k>``, its sandboxes' bridge ``<bridge><k>`` inside the namespace on ``a.b.(16·k).0/20``;
- its own state folder (node token, logs) under the test's temp folder;
- mutual TLS by default (issue 35): its certificate (``<state>/tls``, naming its address) is issued by this run's
  test CA (:func:`run_ca`, made once per process), whose folder is also the servers' TLS folder
  (``SBX_NODE_TLS_DIR``, given by ``tests/e2e/conftest.py``'s ``start_server``); ``tls=False`` runs a plain node.

The node agent runs under ``nsenter --net`` only: it keeps the host's mount namespace, so the disks it mounts stay
where a restarted agent finds them (``ip netns exec`` would give each start a private mount namespace).
"""

from __future__ import annotations

import os
import secrets
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.slots import slotted

if TYPE_CHECKING:
    from sbx.node.remote.client import RemoteNode

VENV_BIN = Path(sys.executable).parent
SBX = str(VENV_BIN / "sbx")
NODE_PORT = 7700


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} -> {r.returncode}: {r.stderr}")
    return r


class NodeAgentError(RuntimeError):
    """``sbx node serve`` exited or did not answer; the message ends with its log."""


@dataclass
class NodeHost:
    """One node agent's "machine": namespace, addresses, names, and the agent process once started."""

    k: int
    netns: str
    node_name: str
    bridge: str
    subnet: str
    host_veth: str
    host_ip: str
    node_ip: str
    state: Path
    token: str = field(default_factory=lambda: "sbxn_" + secrets.token_urlsafe(16))
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)  # more settings for the agent (test holds, say)
    # serve the node API over mutual TLS with a certificate of run_ca() (SBX_TEST_NODE_TLS=0: plain, run-wide)
    tls: bool = field(default_factory=lambda: node_tls())

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.node_ip}:{NODE_PORT}"

    @property
    def tls_dir(self) -> Path:
        return self.state / "tls"

    def client_context(self) -> ssl.SSLContext | None:
        """What a server presents to this node (the test CA's server certificate), None for a plain node."""
        from sbx import tls

        if not self.tls:
            return None
        ident = tls.identity(run_ca())
        assert ident is not None
        return ident.client_context()

    def env(self) -> dict[str, str]:
        env = {
            **os.environ,
            "SBX_PROFILE": "test",
            "SBX_STATE_DIR": str(self.state),
            "SBX_NODE_NAME": self.node_name,
            "SBX_BRIDGE": self.bridge,
            "SBX_SUBNET": self.subnet,
            "SBX_NODE_TOKEN": self.token,
            "SBX_NODE_HOST": self.node_ip,
            "SBX_NODE_PORT": str(NODE_PORT),
            "SBX_NODE_TLS_DIR": str(self.tls_dir),  # no certificate there: a plain node
            "SBX_WARM_POOL": "0",  # no warm sandbox the test did not ask for (tests/e2e/sandboxes/test_warm_pool.py)
            "HOME": str(self.state / "home"),
            "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        }
        for key in ("SBX_URL", "SBX_TOKEN", "SBX_NODE_URL", "SBX_DATABASE_URL", "SBX_HOME"):
            env.pop(key, None)
        return {**env, **self.extra_env}

    def start(self, probe: ssl.SSLContext | None = None) -> None:
        """Start ``sbx node serve`` in the namespace and wait until it answers its health check (``probe``: the
        TLS context to ask with, default :meth:`client_context`; a certificate already in :attr:`tls_dir` is kept,
        else one of :func:`run_ca` is issued when :attr:`tls`) (the base image is
        ready: :func:`host_netns` made it). The agent runs in a session of its own, so a Ctrl-C in the terminal
        reaches only the caller, which can still delete the node's sandboxes through it before stopping it.
        Raises :class:`NodeAgentError` when it exits or does not answer within 600 s (it is killed then)."""
        self.state.mkdir(parents=True, exist_ok=True)
        if self.tls and not (self.tls_dir / "cert.pem").is_file():
            from sbx import tls

            tls.issue(run_ca(), self.tls_dir, self.node_name, [self.node_ip])
        self.log = self.state / f"node-{int(time.time() * 1000)}.log"
        with self.log.open("wb") as logf:
            self.proc = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{self.netns}", "--", SBX, "node", "serve"],
                env=self.env(), stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise NodeAgentError(f"sbx node exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                req = urllib.request.Request(self.url + "/v1/node/health",
                                             headers={"Authorization": f"Bearer {self.token}"})
                with urllib.request.urlopen(req, timeout=2, context=probe or self.client_context()):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.proc.kill()
                    self.proc.wait()
                    raise NodeAgentError(f"sbx node did not answer:\n{self.log.read_text()[-4000:]}") from None
                time.sleep(0.3)

    def kill(self) -> None:
        """SIGKILL the agent (its sandboxes keep running)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> int:
        """SIGTERM the agent and wait; its exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def logs(self) -> str:
        return "\n".join(p.read_text()[-4000:] for p in sorted(self.state.glob("node-*.log")))


_CA: list[Path] = []


def node_tls() -> bool:
    """Whether this run's node agents serve mutual TLS: yes unless ``SBX_TEST_NODE_TLS=0``."""
    return os.environ.get("SBX_TEST_NODE_TLS", "1") != "0"


def run_ca() -> Path:
    """This process's test CA (made on first use in a temporary folder, 0700): ``ca.key``, ``ca.crt`` and a
    server certificate (``cert.pem``/``key.pem``), so the folder is a server's ``SBX_NODE_TLS_DIR`` as is."""
    if not _CA:
        from sbx import tls

        folder = Path(tempfile.mkdtemp(prefix="sbx-test-ca-"))
        tls.make_ca(folder)
        tls.issue(folder, folder, "sbx-test-server")
        _CA.append(folder)
    return _CA[0]


def node_host(k: int, tmp: Path) -> NodeHost:
    """The names and addresses of node ``k`` (1..8) in this run's slot (nothing is created)."""
    base, bridge, net = slotted("nodes", "sbxnd", "10.93.0.0/16")
    a, b = net.split(".")[:2]
    return NodeHost(
        k=k, netns=f"{base}-{k}", node_name=f"{base}{k}", bridge=f"{bridge}{k}", subnet=f"{a}.{b}.{16 * k}.0/20",
        host_veth=f"{bridge}h{k}", host_ip=f"{a}.{b}.{240 + k}.1", node_ip=f"{a}.{b}.{240 + k}.2",
        state=tmp / f"node{k}",
    )


@contextmanager
def node_netns(k: int, tmp: Path) -> Iterator[NodeHost]:
    """Make node ``k``'s namespace and veth pair (:func:`host_netns` with :func:`node_host`'s names)."""
    if os.geteuid() != 0:
        pytest.fail("several-node tests make network namespaces and must run as root")
    with host_netns(node_host(k, tmp)) as h:
        yield h


@contextmanager
def host_netns(h: NodeHost) -> Iterator[NodeHost]:
    """Make ``h``'s namespace and veth pair (a leftover of a killed run with the same names is removed first); on
    exit stop its agent (if one runs), remove the namespace (the veth goes with it) and the node's folder on the
    volume when it holds no sandbox. The benchmark's remote-node figure (bench/remote.py) uses it with names of its
    own. Needs root; raises ``AssertionError`` when an ``ip`` step fails."""
    from sbx.config import load_settings
    from sbx.node.host.image import ensure_image
    from sbx.storage.locks import file_lock

    # The base image is made here, in the host's namespace (the node's has no way out to the mirrors), and its
    # lock is held (shared: other node tests may run meanwhile) while the node runs, so a server of another recipe
    # on this host cannot prune it.
    image = ensure_image(load_settings(profile="test"))
    with file_lock(image.with_suffix(".lock"), shared=True):
        yield from _netns(h)


@contextmanager
def node_netns_many(ks: list[int], tmp: Path) -> Iterator[list[NodeHost]]:
    """:func:`node_netns` for several nodes at once (``ks``, made in that order, removed in reverse). Each holds the
    base image's lock shared, so one process may hold it for several nodes."""
    with ExitStack() as stack:
        yield [stack.enter_context(node_netns(k, tmp)) for k in ks]


def _netns(h: NodeHost) -> Iterator[NodeHost]:
    _run("ip", "netns", "del", h.netns, check=False)  # a leftover of a killed run
    _run("ip", "link", "del", h.host_veth, check=False)
    _run("ip", "netns", "add", h.netns)
    try:
        _run("ip", "link", "add", h.host_veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
        _run("ip", "addr", "add", f"{h.host_ip}/24", "dev", h.host_veth)
        _run("ip", "link", "set", h.host_veth, "up")
        ns = ("ip", "-n", h.netns)
        _run(*ns, "link", "set", "lo", "up")
        _run(*ns, "addr", "add", f"{h.node_ip}/24", "dev", "eth0")
        _run(*ns, "link", "set", "eth0", "up")
        _run(*ns, "route", "add", "default", "via", h.host_ip)
        # the host routes between the nodes' veths; on a fresh host no sbx server has turned forwarding on yet
        # (then node-to-node calls, a migration's transfer, time out)
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
        yield h
    finally:
        if h.proc is not None and h.proc.poll() is None:
            h.stop()
        _cleanup_node(h)
        _run("ip", "netns", "del", h.netns, check=False)
        _run("ip", "link", "del", h.host_veth, check=False)


def _cleanup_node(h: NodeHost) -> None:
    """Remove what node ``h`` left (its agent stopped): :func:`force_clean`."""
    from sbx.config import load_settings

    settings = load_settings(node_name=h.node_name, bridge=h.bridge, subnet=h.subnet, profile="test",
                             state_dir=h.state)
    force_clean(settings.node_name, settings.node_dir)


def force_clean(node_name: str, node_dir: Path) -> list[str]:
    """Remove everything a stopped node ``node_name`` (folder ``node_dir`` on the volume) left on this host: the
    containers still in its runc state root (a test that failed before deleting its sandboxes, an agent killed
    with them running), every mount under its run and volume folders, then both folders. The next test of this
    slot reuses the node's names, and a container left running would break it. Returns the containers it removed
    (with the runtime's own ``delete`` and ``remove_tree``)."""
    from sbx.runtime.runc import RuncRuntime, remove_tree

    run_dir = Path("/run/sbx") / node_name
    left: list[str] = []
    if (run_dir / "runc").is_dir():
        runc = RuncRuntime(run_dir / "runc", Path("criu"))  # no checkpoint here: CRIU's path is never used
        left = list(runc.statuses())
        for cid in left:
            runc.delete(cid)
    if (run_dir / "runsc").is_dir():  # gvisor sandboxes (sbx.runtime.runsc), with their network namespaces
        from sbx.runtime.runsc import RunscRuntime

        runsc = RunscRuntime(run_dir / "runsc")
        for cid in runsc.list():
            runsc.destroy(cid)
            left.append(cid)
    for folder in (run_dir, node_dir):
        remove_tree(folder)  # lazily unmounts every mount it meets instead of descending into it
    return left


def exec_out(node: RemoteNode, sid: str, command: str, timeout: float = 120) -> tuple[int | None, str]:
    """Run ``command`` as root in sandbox ``sid`` through the node API of ``node``: ``(exit code, stdout)`` (code
    None when the stream ended without an exit event)."""
    out, code = b"", None
    for ev in node.exec(sid, command, user="root", timeout=timeout):
        if ev.kind == "stdout":
            out += ev.data
        elif ev.kind == "exit":
            code = ev.exit_code
    return code, out.decode()
