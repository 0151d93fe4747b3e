"""A real ``sbx server`` for the benchmark, run as a subprocess with its own node.

It gets its own state dir and ``HOME`` under a temp dir (so the client config it writes lands there, not in the
caller's home), node name ``bench``, bridge ``sbxb0``, subnet ``10.92.0.0/16`` (``SBX_BENCH_NODE``, ``_BRIDGE``,
``_SUBNET`` override them), free API and proxy ports,
automatic snapshots off and the test size profile (small 256 MiB, default 512 MiB, large 1 GiB, xlarge 2 GiB).
It runs in its own session, so a Ctrl-C in the terminal reaches only the benchmark, which then deletes its
sandboxes through the API before it stops the server.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sbx.config import Settings, load_settings
from sbx.sdk import Client, SbxError
from sbx.sdk import protocol as P
from tests.outside import make_ca

VENV_BIN = Path(sys.executable).parent
NODE_NAME = os.environ.get("SBX_BENCH_NODE", "bench")
BRIDGE = os.environ.get("SBX_BENCH_BRIDGE", "sbxb0")
SUBNET = os.environ.get("SBX_BENCH_SUBNET", "10.92.0.0/16")
"""Node, bridge and subnet of the benchmark's server; SBX_BENCH_NODE / SBX_BENCH_BRIDGE / SBX_BENCH_SUBNET let two
runs share a host."""
PROFILE = "test"
UPSTREAM_HOST = "bench-upstream.sbx-test.example"
"""The name of the egress figure's upstream (:mod:`bench.egress`), in its certificate."""


class ServerError(Exception):
    """The server did not start or answer; ``log_tail`` holds the end of its log."""

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(f"{message}\n{log_tail}" if log_tail else message)
        self.log_tail = log_tail


def upstream_ca(tmp: Path) -> Path:
    """Make the run's upstream CA and the upstream's certificate in ``tmp/egress`` (once); returns the CA file,
    which the benchmark server is told to trust (``SBX_EGRESS_UPSTREAM_CA``) for the egress figure
    (:mod:`bench.egress`)."""
    folder = tmp / "egress"
    if (folder / "ca.crt").is_file():
        return folder / "ca.crt"
    folder.mkdir(parents=True, exist_ok=True)
    return make_ca(folder, "sbx bench upstream CA", {"server": UPSTREAM_HOST}, days=7)


def sbx_binary() -> str:
    """The ``sbx`` console script next to this Python (the venv's), else the one on PATH.
    Raises ``ServerError`` when there is none."""
    local = VENV_BIN / "sbx"
    if local.is_file():
        return str(local)
    found = shutil.which("sbx")
    if not found:
        raise ServerError("no `sbx` command next to this Python or on PATH")
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_settings() -> Settings:
    """The :class:`Settings` of the benchmark's node (same host paths as the server subprocess sees)."""
    return load_settings(node_name=NODE_NAME, bridge=BRIDGE, subnet=SUBNET, profile=PROFILE)


@dataclass
class BenchServer:
    """A running benchmark server: ``url``, ``token``, ``env`` (for ``sbx`` subprocesses: HOME, PATH with the
    venv's bin first), ``tmp`` (its temp dir), ``log`` (server output), ``settings`` (its embedded node's settings:
    the benchmark node's, also for a server given a node agent with ``SBX_NODE_URL``, which has none)."""

    url: str
    token: str
    env: dict[str, str]
    tmp: Path
    log: Path
    settings: Settings
    proc: subprocess.Popen[bytes]

    def client(self) -> Client:
        """A fresh SDK client for this server (close it when done)."""
        return Client(url=self.url, token=self.token)

    def sbx(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run the real ``sbx ARGS`` against this server; returns the completed process (text).
        With ``check``, raises ``RuntimeError`` on a non-zero exit."""
        r = subprocess.run([sbx_binary(), *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"sbx {' '.join(args)} -> {r.returncode}: {r.stderr.strip() or r.stdout.strip()}")
        return r

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def delete_all(self) -> list[str]:
        """Delete every sandbox on this server (waiting for each); returns the ids it could not delete."""
        failed = []
        with self.client() as c:
            try:
                boxes = c.list()
            except SbxError:
                return ["(list failed)"]
            for sb in boxes:
                try:
                    c.run(P.delete(sb["id"], wait=True))
                except SbxError as e:
                    if e.code != "not_found":
                        failed.append(sb["id"])
        return failed


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise ServerError(f"sbx server exited with {proc.returncode}", log.read_text(errors="replace")[-3000:])
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise ServerError(f"sbx server did not answer within {timeout:.0f} s",
                                  log.read_text(errors="replace")[-3000:]) from None
            time.sleep(0.25)


def start(tmp: Path, start_timeout: float = 900, env_extra: Mapping[str, str] | None = None,
          node: tuple[str, str, str] | None = None, log_level: str = "warning") -> BenchServer:
    """Start ``sbx server`` in ``tmp`` (state in ``tmp/state``, ``HOME=tmp/home``, log ``tmp/server.log``) and
    wait until ``/healthz`` answers (the first start on a host may build the base image: ``start_timeout``
    seconds). ``env_extra`` adds or overrides ``SBX_*`` settings (the remote-node figure gives a server
    ``SBX_NODE_URL`` / ``SBX_NODE_TOKEN``). ``node``: its ``(node name, bridge, subnet)`` instead of the
    benchmark's; ``log_level``: the server's (the cross-node figure reads moves from an ``info`` log). Raises
    ``ServerError`` when it exits or does not answer (it is killed then)."""
    name, bridge, subnet = node or (NODE_NAME, BRIDGE, SUBNET)
    port = free_port()
    env = {
        **os.environ,
        "SBX_PROFILE": PROFILE,
        "SBX_STATE_DIR": str(tmp / "state"),
        "SBX_NODE_NAME": name,
        "SBX_BRIDGE": bridge,
        "SBX_SUBNET": subnet,
        "SBX_PORT": str(port),
        "SBX_PROXY_PORT": str(free_port()),  # the hosted-ports proxy: another server may hold the default 7080
        "SBX_SSH_GATEWAY_PORT": "0",  # no SSH gateway (another server may hold 2222)
        "SBX_AUTO_SNAPSHOT_SECONDS": "0",
        "SBX_CONSOLIDATE_SECONDS": "0",
        "SBX_REPLICATE_SECONDS": "0",
        "SBX_EGRESS_UPSTREAM_CA": str(upstream_ca(tmp)),  # the egress figure's upstream (bench.egress)
        "HOME": str(tmp / "home"),
        "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
    }
    for key in ("SBX_URL", "SBX_TOKEN", "XDG_CONFIG_HOME", "SBX_HOST", "SBX_HOME", "SBX_NODE_URL", "SBX_NODE_TOKEN",
                "SBX_DATABASE_URL"):
        env.pop(key, None)
    env.update(env_extra or {})
    if env.get("SBX_NODE_URL", "").startswith("https://"):  # a node agent of tests.nodenet over mutual TLS
        from tests.nodenet import run_ca

        env.setdefault("SBX_NODE_TLS_DIR", str(run_ca()))
    (tmp / "home").mkdir(parents=True, exist_ok=True)
    log = tmp / "server.log"
    with log.open("wb") as logf:
        proc = subprocess.Popen([sbx_binary(), "server", "--log-level", log_level], env=env, stdout=logf,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log, start_timeout)
        cfg = tomllib.loads((tmp / "home" / ".config" / "sbx" / "config.toml").read_text())
    except BaseException:
        _terminate(proc)
        raise
    settings = load_settings(node_name=name, bridge=bridge, subnet=subnet, profile=PROFILE)
    return BenchServer(url=url, token=str(cfg["token"]), env=env, tmp=tmp, log=log, settings=settings, proc=proc)


def _terminate(proc: subprocess.Popen[bytes], timeout: float = 120) -> int:
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    try:
        with open("/proc/self/mounts") as f:
            points = [line.split()[1] for line in f]
    except OSError:
        return []
    return [p for p in points if (p + "/").startswith(prefix)]


def cleanup_host(settings: Settings) -> None:
    """Remove what the benchmark node leaves on the host once its server has stopped: its bridge and nftables
    table, its node folder on the volume and its run dir when they hold no sandbox, and its empty cgroups."""
    from sbx.node.network.bridge import remove_bridge

    try:
        remove_bridge(settings.bridge, settings.node_name)
    except Exception as e:  # the bridge is gone already, or pyroute2 refused: say so, go on
        print(f"bench: removing bridge {settings.bridge}: {e}", file=sys.stderr)
    if not any((settings.node_dir / "sandboxes").glob("*")):
        shutil.rmtree(settings.node_dir, ignore_errors=True)
    run_dir = Path("/run/sbx") / settings.node_name
    if run_dir.is_dir() and not _mounts_under(run_dir):
        shutil.rmtree(run_dir, ignore_errors=True)
    for node_cgroup in Path("/sys/fs/cgroup").glob(f"*/sbx/{settings.node_name}"):
        _rmdir_cgroup(node_cgroup)


def _rmdir_cgroup(path: Path) -> None:
    """Remove an empty cgroup and its empty children (rmdir only: a cgroup with tasks stays)."""
    for child in path.iterdir():
        if child.is_dir():
            _rmdir_cgroup(child)
    try:
        path.rmdir()
    except OSError:
        pass


@contextmanager
def running_server(keep_tmp: bool = False, env_extra: Mapping[str, str] | None = None) -> Iterator[BenchServer]:
    """Start a benchmark server in a fresh temp dir (``env_extra``: more settings, see :func:`start`); at the end
    (also after Ctrl-C or an error) delete every sandbox on it, stop it with SIGTERM, clean the host
    (:func:`cleanup_host`; not for a server given a node agent with ``SBX_NODE_URL``: that node's host is its
    maker's to clean) and remove the temp dir (kept when ``keep_tmp``, or when something is still mounted below
    it). A Ctrl-C during this cleanup is ignored. Raises ``ServerError`` when it does not start."""
    tmp = Path(tempfile.mkdtemp(prefix="sbx-bench-"))
    embedded = not (env_extra or {}).get("SBX_NODE_URL")
    srv = None
    try:
        srv = start(tmp, env_extra=env_extra)
        yield srv
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if srv is not None and srv.proc.poll() is not None:
                print(f"bench: sbx server died early (exit {srv.proc.returncode}); log kept: {srv.log}",
                      file=sys.stderr)
                keep_tmp = True
            elif srv is not None:
                print("bench: cleaning up (deleting sandboxes, stopping the server)", file=sys.stderr)
                try:
                    left = srv.delete_all()
                    if left:
                        print(f"bench: could not delete {', '.join(left)}", file=sys.stderr)
                finally:
                    code = _terminate(srv.proc)
                    if code != 0:
                        print(f"bench: sbx server exited with {code}; log: {srv.log}", file=sys.stderr)
                        keep_tmp = True
            if embedded:
                cleanup_host(node_settings())
            mounted = _mounts_under(tmp)
            if mounted:
                print(f"bench: left {tmp} in place, still mounted: {', '.join(mounted)}", file=sys.stderr)
            elif not keep_tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            signal.signal(signal.SIGINT, previous)
