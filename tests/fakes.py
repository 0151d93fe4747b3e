"""An in-memory :class:`sbx.node.types.NodeAgent` for unit tests.

Each sandbox gets a folder under a temporary root that stands in for its disk: ``exec`` runs the command with the
host's ``bash -c`` inside that folder (``HOME`` points there), so output, exit codes and timeouts are real; fork
and snapshots copy the folder. Tests can hold an operation in flight with :meth:`FakeNode.gate` and make the next
call of an operation fail with :meth:`FakeNode.fail_next`.
"""

from __future__ import annotations

import datetime as dt
import os
import queue
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sbx.node.types import (
    ExecEvent,
    JobInfo,
    NodeError,
    NodeInfo,
    NodeStatus,
    ResumeResult,
    SandboxSpec,
    SnapshotInfo,
    Stats,
    StopResult,
)
from tests.e2e.helpers import poll


@dataclass
class _Job:
    info: JobInfo
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path


@dataclass
class _Box:
    spec: SandboxSpec
    dir: Path
    status: NodeStatus = "running"
    jobs: dict[str, _Job] = field(default_factory=dict)


class FakeNode:
    """A node that keeps sandboxes as folders. ``calls`` records ``(operation, id, details)`` tuples."""

    def __init__(self, root: Path | None = None):
        self.root = root or Path(tempfile.mkdtemp(prefix="sbx-ctl-fake-"))
        self.boxes: dict[str, _Box] = {}
        self.snaps: dict[str, tuple[SnapshotInfo, Path]] = {}
        self.calls: list[tuple[str, str, dict[str, object]]] = []
        self.egress: dict[str, bool] = {}  # set_egress_proxy's last word per sandbox
        self.images: dict[str, dict[str, object]] = {}  # facts of the images "built" here, by key
        self.name = "fake"  # the name info() reports
        self.fingerprint = {"cpuModel": "fake", "kernel": "6.1"}
        self.cpu_mismatch = False
        self.unreachable = False  # set: info() (the heartbeat) fails as for a node that went away
        self.memory_save_error: str | None = None  # set: the next stops fail to save memory with this error
        self.prepared = False
        self.stats_calls = 0
        self._gates: dict[str, threading.Event] = {}
        self._fail: dict[str, NodeError] = {}
        self._lock = threading.RLock()

    # test controls --------------------------------------------------------------------------------------------
    def gate(self, op: str) -> threading.Event:
        """Make operation ``op`` (create, stop, resume, fork, delete, snapshot) wait until the returned event is
        set (at most 30 s). The gate stays until :meth:`ungate`."""
        ev = threading.Event()
        self._gates[op] = ev
        return ev

    def ungate(self, op: str) -> None:
        ev = self._gates.pop(op, None)
        if ev is not None:
            ev.set()

    def fail_next(self, op: str, code: str, message: str = "fake failure") -> None:
        """Make the next call of ``op`` raise ``NodeError(code, message)``."""
        self._fail[op] = NodeError(code, message)

    def _enter(self, op: str, id: str, **details: object) -> None:
        with self._lock:
            self.calls.append((op, id, details))
            err = self._fail.pop(op, None)
        gate = self._gates.get(op)
        if gate is not None:
            gate.wait(30)
        if err is not None:
            raise err

    def _box(self, id: str) -> _Box:
        box = self.boxes.get(id)
        if box is None:
            raise NodeError("not_found", f"no sandbox {id} on this node")
        return box

    def _running(self, id: str) -> _Box:
        box = self._box(id)
        if box.status != "running":
            raise NodeError("not_running", f"sandbox {id} is {box.status}")
        return box

    def close(self) -> None:
        """Kill leftover jobs and remove the temporary root."""
        for box in list(self.boxes.values()):
            self._kill_jobs(box)
        shutil.rmtree(self.root, ignore_errors=True)

    # NodeAgent ------------------------------------------------------------------------------------------------
    def prepare(self, progress=None) -> None:  # type: ignore[no-untyped-def]
        self.prepared = True
        if progress:
            progress("fake node ready")

    def create(self, spec: SandboxSpec, from_snapshot: str | None = None, cold: bool = False) -> str:
        self._enter("create", spec.id, size=spec.size.name, from_snapshot=from_snapshot, cold=cold)
        d = self.root / spec.id
        if from_snapshot is not None:
            if from_snapshot not in self.snaps:
                raise NodeError("not_found", f"no snapshot {from_snapshot}")
            shutil.copytree(self.snaps[from_snapshot][1], d)
        else:
            d.mkdir(parents=True)
        with self._lock:
            self.boxes[spec.id] = _Box(spec=spec, dir=d)
        return "boot"

    def pool_take(self, size: str) -> str | None:
        return None  # the fake node keeps no warm sandboxes

    # images: facts made up from the inputs (no build); fail_next("build_image"/"import_image", code) fails one
    def _image_facts(self, key: str, source: str, user: str | None = None) -> dict[str, object]:
        return {"key": key, "os_id": "debian", "os_name": "Debian GNU/Linux 12 (bookworm)", "init": "systemd",
                "shell": "/bin/bash", "env": {"GREETING": "hi"}, "workdir": "/opt/app", "user": user,
                "users": {"root": [0, 0, "/root"], "user": [1000, 1000, "/home/user"]}, "content_bytes": 1 << 20,
                "size_bytes": 4 << 20, "source": source, "built_at": "2026-12-06T00:00:00Z", "build_seconds": 0.1}

    def build_image(self, dockerfile: Path, context: Path, progress=None, bases=None):  # type: ignore[no-untyped-def]
        self._enter("build_image", "", dockerfile=dockerfile.read_text(), bases=dict(bases or {}),
                    files=sorted(p.name for p in context.iterdir()))
        if progress is not None:
            progress("STEP 1/1: FROM fake")
        import hashlib

        key = hashlib.sha256(dockerfile.read_bytes()).hexdigest()
        self.images[key] = self._image_facts(key, "dockerfile")
        return dict(self.images[key])

    def import_image(self, archive: Path, progress=None):  # type: ignore[no-untyped-def]
        self._enter("import_image", "", size=archive.stat().st_size)
        import hashlib

        key = hashlib.sha256(archive.read_bytes()).hexdigest()
        self.images[key] = self._image_facts(key, "archive")
        return dict(self.images[key])

    def delete_image(self, key: str) -> None:
        self._enter("delete_image", "", key=key)
        self.images.pop(key, None)

    def exec(
        self,
        id: str,
        command: str,
        *,
        user: str = "user",
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> Iterator[ExecEvent]:
        box = self._running(id)
        self.calls.append(("exec", id, {"command": command, "user": user, "timeout": timeout}))
        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(box.dir), "LANG": "C.UTF-8"}
        full_env.update(box.spec.env)
        full_env.update(env or {})
        proc = subprocess.Popen(
            ["bash", "-c", command], cwd=cwd or box.dir, env=full_env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True,
        )
        q: queue.Queue[tuple[str, bytes]] = queue.Queue()

        def pump(kind: str, stream) -> None:  # type: ignore[no-untyped-def]
            for chunk in iter(lambda: stream.read1(4096), b""):
                q.put((kind, chunk))
            q.put((kind, b""))

        threads = [threading.Thread(target=pump, args=(k, s), daemon=True)
                   for k, s in (("stdout", proc.stdout), ("stderr", proc.stderr))]
        for t in threads:
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        open_streams, timed_out = 2, False
        try:
            while open_streams:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                if stop is not None:
                    if stop():
                        return
                    wait = 0.2 if wait is None else min(wait, 0.2)
                try:
                    kind, data = q.get(timeout=wait)
                except queue.Empty:
                    if deadline is None or time.monotonic() < deadline:
                        continue
                    timed_out = True
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
                if not data:
                    open_streams -= 1
                    continue
                yield ExecEvent(kind=kind, data=data)  # type: ignore[arg-type]
            code = proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        yield ExecEvent(kind="exit", exit_code=124 if timed_out else code, timed_out=timed_out)

    def exec_detached(self, id: str, command: str, *, user: str = "user", env: dict[str, str] | None = None,
                      cwd: str | None = None, timeout: float | None = None, stdin: str | None = None) -> JobInfo:
        box = self._running(id)
        self.calls.append(("exec_detached", id, {"command": command, "env": env, "cwd": cwd, "timeout": timeout,
                                                 "stdin": stdin}))
        job_id = "job_" + secrets.token_hex(4)
        jobs_dir = box.dir / ".jobs"
        jobs_dir.mkdir(exist_ok=True)
        out, err = jobs_dir / f"{job_id}.out", jobs_dir / f"{job_id}.err"
        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(box.dir), **box.spec.env,
                    **(env or {})}
        argv = ["timeout", "-k", "5", str(timeout), "bash", "-c", command] if timeout else ["bash", "-c", command]
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(argv, cwd=box.dir, env=full_env, stdout=o, stderr=e, stdin=subprocess.PIPE,
                                    start_new_session=True)
            assert proc.stdin is not None
            try:
                proc.stdin.write((stdin or "").encode())
                proc.stdin.close()
            except BrokenPipeError:
                pass
        started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        info = JobInfo(id=job_id, command=command, running=True, exit_code=None, started_at=started)
        box.jobs[job_id] = _Job(info=info, proc=proc, out=out, err=err)
        return info

    def kill_job(self, id: str, job: str) -> None:
        box = self._running(id)
        if job not in box.jobs:
            raise NodeError("not_found", f"no job {job}")
        if box.jobs[job].proc.poll() is None:
            os.killpg(box.jobs[job].proc.pid, signal.SIGKILL)
            box.jobs[job].proc.wait()

    def jobs(self, id: str) -> list[JobInfo]:
        box = self._box(id)
        result = []
        for job in box.jobs.values():
            code = job.proc.poll()
            job.info.running = code is None
            job.info.exit_code = code if code is None or code >= 0 else 128 - code
            result.append(JobInfo(**vars(job.info)))
        return result

    def job_output(self, id: str, job: str, stream: str, offset: int = 0) -> bytes:
        box = self._box(id)
        if job not in box.jobs:
            raise NodeError("not_found", f"no job {job}")
        path = box.jobs[job].out if stream == "stdout" else box.jobs[job].err
        with path.open("rb") as f:
            f.seek(offset)
            return f.read()

    def _kill_jobs(self, box: _Box) -> None:
        for job in box.jobs.values():
            if job.proc.poll() is None:
                os.killpg(job.proc.pid, signal.SIGKILL)
                job.proc.wait()

    def stop(self, id: str, keep_memory: bool = True) -> StopResult:
        self._enter("stop", id, keep_memory=keep_memory)
        box = self._box(id)
        if keep_memory and self.memory_save_error:
            keep_memory, error = False, self.memory_save_error
        else:
            error = None
        if not keep_memory:
            self._kill_jobs(box)
        box.status = "checkpointed" if keep_memory else "stopped"
        return StopResult(keep_memory, error)

    def resume(self, id: str, spec: SandboxSpec, *, cold: bool = False, require_memory: bool = False) -> ResumeResult:
        self._enter("resume", id, size=spec.size.name, cold=cold, require_memory=require_memory)
        box = self._box(id)
        if box.status == "running":
            raise NodeError("already_running", f"sandbox {id} is running")
        had_memory = box.status == "checkpointed"
        if require_memory and (cold or not had_memory or self.cpu_mismatch):
            reason = "cpu_mismatch" if self.cpu_mismatch else "no_checkpoint"
            raise NodeError(reason, "memory cannot be restored here")
        box.spec = spec
        box.status = "running"
        if had_memory and not cold and not self.cpu_mismatch:
            return ResumeResult(memory_restored=True)
        self._kill_jobs(box)
        reason = "resized" if cold else ("cpu_mismatch" if self.cpu_mismatch else "no_checkpoint")
        return ResumeResult(memory_restored=False, reason=reason)

    def fork(self, source_id: str, spec: SandboxSpec, memory: bool = False) -> None:
        self._fork_as("fork", source_id, spec, memory, "running")

    def fork_stopped(self, source_id: str, spec: SandboxSpec, memory: bool = False) -> None:
        """A fork made here stopped (``checkpointed`` with ``memory``), to move to another node."""
        self._fork_as("fork_stopped", source_id, spec, memory, "checkpointed" if memory else "stopped")

    def _fork_as(self, op: str, source_id: str, spec: SandboxSpec, memory: bool, status: NodeStatus) -> None:
        self._enter(op, spec.id, source=source_id, size=spec.size.name, memory=memory)
        src = self._running(source_id) if memory else self._box(source_id)
        d = self.root / spec.id
        shutil.copytree(src.dir, d, ignore=shutil.ignore_patterns(".jobs"))
        with self._lock:
            self.boxes[spec.id] = _Box(spec=spec, dir=d, status=status)

    def snapshot(self, id: str, name: str) -> SnapshotInfo:
        self._enter("snapshot", id, name=name)
        box = self._box(id)
        if name in self.snaps:
            raise NodeError("snapshot_exists", f"snapshot {name} exists")
        d = self.root / ".snapshots" / name
        shutil.copytree(box.dir, d, ignore=shutil.ignore_patterns(".jobs"))
        info = SnapshotInfo(name=name, source_id=id, size_mib=box.spec.size.disk_mib)
        self.snaps[name] = (info, d)
        return info

    def delete_snapshot(self, name: str) -> None:
        self._enter("delete_snapshot", name)
        if name not in self.snaps:
            raise NodeError("not_found", f"no snapshot {name}")
        _, d = self.snaps.pop(name)
        shutil.rmtree(d, ignore_errors=True)

    def snapshots(self) -> list[SnapshotInfo]:
        return [info for info, _ in self.snaps.values()]

    def delete(self, id: str) -> None:
        self._enter("delete", id)
        box = self.boxes.pop(id, None)
        if box is not None:
            self._kill_jobs(box)
            shutil.rmtree(box.dir, ignore_errors=True)

    def stats(self, id: str, space: bool = True) -> Stats:
        box = self._running(id)
        self.stats_calls += 1
        return Stats(
            memory_total_mb=box.spec.size.memory_mib, memory_used_mb=42, cpu_percent=1.5, disk_used_mb=7, oom_kills=0
        )

    def status(self, id: str, settled: bool = False) -> NodeStatus:
        box = self.boxes.get(id)
        return "absent" if box is None else box.status

    def egress_ready(self) -> bool:
        return True

    def serve_egress(self, handler) -> None:  # type: ignore[no-untyped-def]
        self.egress_handler = handler

    def set_egress_proxy(self, id: str, enabled: bool) -> None:
        self.egress[id] = enabled

    def close_egress(self) -> None:
        pass

    def info(self) -> NodeInfo:
        if self.unreachable:
            raise NodeError("node_unreachable", "the fake node is unreachable")
        running = sum(1 for b in self.boxes.values() if b.status == "running")
        return NodeInfo(name=self.name, memory_mib=4096, disk_free_bytes=50 << 30, disk_path="/fake", vcpus=2,
                        load1=0.5, running=running, fingerprint=dict(self.fingerprint))
    def watch(self, on_exit) -> None:  # type: ignore[no-untyped-def]
        self.on_exit = on_exit

    def unwatch(self) -> None:
        self.on_exit = None

    def reconcile(self, known: dict[str, str]) -> dict[str, NodeStatus]:
        self.calls.append(("reconcile", "", {"known": dict(known)}))
        return {id: self.status(id) for id in known}


def fake_settings(tmp: Path, **overrides: object):  # type: ignore[no-untyped-def]
    """Test-profile :class:`sbx.config.Settings` with state in ``tmp`` (no host paths touched)."""
    from sbx.config import load_settings

    values: dict[str, object] = {
        "home": tmp / "home",
        "state_dir": tmp / "state",
        "profile": "test",
        "node_name": "sbx-ctl-unit",
        "auto_snapshot_seconds": 0,
        "disk_reserve_gib": 0.0,  # admission must not depend on how full the test machine's disk is
    }
    values.update(overrides)
    return load_settings(**values)


TOKEN = "sbx_test_token"


def auth(token: str = TOKEN) -> dict[str, str]:
    """The Authorization header for ``token``."""
    return {"Authorization": f"Bearer {token}"}


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05):  # type: ignore[no-untyped-def]
    """Poll ``predicate()`` until it returns a truthy value (returned) or ``timeout`` seconds pass (AssertionError)."""
    return poll(predicate, "the condition", timeout, interval)


def serve_live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveServer]:
    """The app on a real port with a FakeNode; SBX_URL/SBX_TOKEN point at it and HOME is a temp dir (a fixture
    body: ``yield from serve_live(tmp_path, monkeypatch)``)."""
    server = LiveServer(tmp_path).start()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("SBX_URL", server.url)
    monkeypatch.setenv("SBX_TOKEN", server.token)
    yield server
    server.stop()


class LiveServer:
    """The real app on a real port (uvicorn in a thread) with a :class:`FakeNode`, for SDK and CLI tests.
    ``url``, ``token``, ``node``, ``app`` are set after :meth:`start`."""

    def __init__(self, tmp: Path, **app_kwargs: object):
        import socket

        from sbx.api.app import create_app

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.node = FakeNode(tmp / "node")
        self.token = TOKEN
        self.url = f"http://127.0.0.1:{self.port}"
        settings = fake_settings(tmp, port=self.port)
        app_kwargs.setdefault("reaper_tick", 0.2)
        self.app = create_app(settings, self.node, token=self.token, **app_kwargs)  # type: ignore[arg-type]
        self._thread: threading.Thread | None = None

    def start(self) -> LiveServer:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self.server.run, daemon=True)
        self._thread.start()
        wait_until(lambda: self.server.started, timeout=30)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.node.close()


# --- API test helpers ---------------------------------------------------------------------------------------------
class Api:
    """A TestClient on the real app with a FakeNode; ``h`` is the auth header."""

    def __init__(self, client, node: FakeNode):  # type: ignore[no-untyped-def]
        self.c = client
        self.node = node
        self.h = auth()
        self.control = client.app.state.control  # type: ignore[attr-defined]

    def post(self, path, json=None, **kw):  # type: ignore[no-untyped-def]
        return self.c.post(path, json=json, headers=self.h, **kw)

    def get(self, path, **kw):  # type: ignore[no-untyped-def]
        return self.c.get(path, headers=self.h, **kw)

    def delete(self, path, **kw):  # type: ignore[no-untyped-def]
        return self.c.delete(path, headers=self.h, **kw)

    def new(self, **body):  # type: ignore[no-untyped-def]
        """Create and wait until running; returns the sandbox dict."""
        body.setdefault("type", "small")
        r = self.post("/v1/sandboxes?wait=true", json=body)
        assert r.status_code == 200, r.text
        return r.json()["sandbox"]

    def sandbox(self, sid):  # type: ignore[no-untyped-def]
        r = self.get(f"/v1/sandboxes/{sid}")
        assert r.status_code == 200, r.text
        return r.json()["sandbox"]

    def exec(self, sid, command, **body):  # type: ignore[no-untyped-def]
        import json

        with self.c.stream("POST", f"/v1/sandboxes/{sid}/exec", json={"command": command, **body},
                           headers=self.h) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, r.json()
            return 200, [json.loads(line) for line in r.iter_lines() if line.strip()]


def make_api(tmp_path: Path, **kw) -> Iterator[Api]:  # type: ignore[no-untyped-def]
    """Yield an :class:`Api` on a fresh app (state in ``tmp_path``); ``settings`` overrides settings fields."""
    from fastapi.testclient import TestClient

    from sbx.api.app import create_app

    node = FakeNode(tmp_path / "node")
    settings_kw = kw.pop("settings", {})
    kw.setdefault("reaper_tick", 0.1)
    kw.setdefault("wait", 5.0)
    app = create_app(fake_settings(tmp_path, **settings_kw), node, token=TOKEN, **kw)
    with TestClient(app) as client:
        yield Api(client, node)
    node.close()




def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def served_node(node: FakeNode, token: str, name: str = "fake") -> Iterator[str]:
    """The node API (:func:`sbx.node.remote.server.create_node_app`) around ``node`` with ``token``, served by
    uvicorn on a free local port in a thread; yields its URL and stops the server afterwards."""
    import uvicorn

    from sbx.node.remote.server import create_node_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_node_app(node, token, name), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout=30)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def two_node_plane(tmp_path: Path) -> Iterator[tuple[Any, FakeNode, FakeNode]]:
    """A started :class:`sbx.control.service.ControlPlane` driving two fake nodes: its embedded ``fake`` (a 4 GiB
    host with 50 GiB free) and ``fake2`` attached at ``fake://two``, heartbeaten once; yields ``(cp, one, two)``
    and closes the plane afterwards."""
    from sbx.control.cluster.capacity import HostResources
    from sbx.control.service import ControlPlane

    one, two = FakeNode(tmp_path / "one"), FakeNode(tmp_path / "two")
    two.name = "fake2"
    cp = ControlPlane(fake_settings(tmp_path, node_heartbeat_seconds=0.1), one, wait=5.0,
                      host=lambda: HostResources(4096, 50 << 30, "/fake"))
    cp.start()
    try:
        cp.router.attach("fake2", "fake://two", two)
        cp.registry.beat()
        yield cp, one, two
    finally:
        cp.close()


def make_control(tmp_path: Path, node: FakeNode, **settings_kw: object):  # type: ignore[no-untyped-def]
    """A started :class:`ControlPlane` on ``node`` with state in ``tmp_path``."""
    from sbx.control.service import ControlPlane

    cp = ControlPlane(fake_settings(tmp_path, **settings_kw), node, wait=5.0)
    cp.start()
    return cp
