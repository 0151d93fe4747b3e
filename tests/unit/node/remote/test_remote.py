"""The node API and RemoteNode (issue 10) against a FakeNode served on a real port: every NodeAgent call crosses
HTTP and comes back as the same dataclasses and errors, exec streams and stops, exits reach a watcher, and no
route answers without the node token."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sbx.config import TEST_SIZES
from sbx.node.remote import wire
from sbx.node.remote.client import RemoteNode
from sbx.node.remote.server import create_node_app
from sbx.node.types import (
    ExecEvent,
    JobInfo,
    NodeError,
    NodeInfo,
    ResumeResult,
    SandboxSpec,
    SnapshotInfo,
    Stats,
    StopResult,
)
from tests.fakes import FakeNode, wait_until

TOKEN = "sbxn_test-token"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[FakeNode, RemoteNode]]:
    import uvicorn

    fake = FakeNode(tmp_path / "node")
    port = _port()
    server = uvicorn.Server(uvicorn.Config(create_node_app(fake, TOKEN, "fake"), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout=30)
    remote = RemoteNode(f"http://127.0.0.1:{port}", TOKEN)
    try:
        yield fake, remote
    finally:
        remote.unwatch()
        server.should_exit = True
        thread.join(timeout=30)
        fake.close()


SPEC = SandboxSpec(id="sb_aaaaaaaaaa", hostname="red-fox-den", size=TEST_SIZES["small"], env={"A": "1"})


def test_the_wire_round_trips_every_node_dataclass_and_refuses_others() -> None:
    values = [
        SPEC, ResumeResult(True), StopResult(False, "criu said no"), ExecEvent("stdout", b"\x00\xffhi"),
        JobInfo("job_abcdefgh", "sleep 1", True, None, "2026-12-01T00:00:00Z"), Stats(256, 42, 1.5, 7, 0, 9, 3),
        SnapshotInfo("s", "sb_x", 2048), NodeInfo("n1", 4096, 1 << 30, "/v", 2, 0.5, 1, {"kernel": "6.1"}),
        {"k": [b"x", None, 1.5]},
    ]
    for value in values:
        assert wire.decode(wire.encode(value)) == value
    with pytest.raises(ValueError, match="unknown type"):
        wire.decode({"__type__": "Popen"})
    with pytest.raises(ValueError, match="unknown fields"):
        wire.decode({"__type__": "StopResult", "memory_saved": True, "rm": 1})
    with pytest.raises(TypeError):
        wire.encode(Path("/etc/shadow"))


def test_every_route_needs_the_node_token(served: tuple[FakeNode, RemoteNode]) -> None:
    fake, remote = served
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        with httpx.Client(base_url=remote.url, headers=headers) as c:
            assert c.get("/v1/node/health").status_code == 401
            r = c.post("/v1/node/call/create", json={"args": [wire.encode(SPEC)], "kwargs": {}})
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
            assert c.post("/v1/node/exec", json={"id": SPEC.id, "command": "true"}).status_code == 401
            assert c.get("/v1/node/exits").status_code == 401
    assert fake.boxes == {}
    wrong = RemoteNode(remote.url, "sbxn_wrong")
    with pytest.raises(NodeError) as e:
        wrong.create(SPEC)
    assert e.value.code == "node_unauthorized"
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    with pytest.raises(InvalidStatus):  # the WebSocket is closed before it is accepted: the handshake fails
        with connect("ws" + remote.url[4:] + "/v1/node/spawn") as ws:
            ws.recv(timeout=5)


def test_calls_cross_the_wire_with_their_types_and_errors(served: tuple[FakeNode, RemoteNode]) -> None:
    fake, remote = served
    assert remote.create(SPEC) == "boot"
    assert fake.boxes[SPEC.id].spec == SPEC
    assert remote.status(SPEC.id) == "running"
    job = remote.exec_detached(SPEC.id, "echo job-out", env={"B": "2"})
    assert isinstance(job, JobInfo)
    wait_until(lambda: remote.jobs(SPEC.id)[0].exit_code == 0)
    assert remote.job_output(SPEC.id, job.id, "stdout") == b"job-out\n"
    assert isinstance(remote.stats(SPEC.id), Stats)
    snap = remote.snapshot(SPEC.id, "one")
    assert isinstance(snap, SnapshotInfo) and [s.name for s in remote.snapshots()] == ["one"]
    stopped = remote.stop(SPEC.id, keep_memory=True)
    assert isinstance(stopped, StopResult) and stopped.memory_saved
    resumed = remote.resume(SPEC.id, SPEC)
    assert resumed == ResumeResult(memory_restored=True)
    assert remote.reconcile({SPEC.id: "running"}) == {SPEC.id: "running"}
    assert isinstance(remote.info(), NodeInfo)
    with pytest.raises(NodeError) as e:
        remote.delete_snapshot("nope")
    assert (e.value.code, e.value.message) == ("not_found", "no snapshot nope")
    with pytest.raises(NodeError) as e:
        remote._call("remove_everything")
    assert e.value.code == "unknown_method"
    with pytest.raises(NodeError) as e:
        remote._call("stop", SPEC.id, no_such_argument=1)
    assert e.value.code == "bad_call"


def test_exec_streams_output_and_exit_and_stops_when_asked(served: tuple[FakeNode, RemoteNode]) -> None:
    fake, remote = served
    remote.create(SPEC)
    events = list(remote.exec(SPEC.id, "echo out; echo err >&2; exit 3"))
    assert b"".join(e.data for e in events if e.kind == "stdout") == b"out\n"
    assert b"".join(e.data for e in events if e.kind == "stderr") == b"err\n"
    assert events[-1] == ExecEvent("exit", exit_code=3)
    # a silent command: keepalive lines let the client see its stop; then no exit event
    stop_at = time.monotonic() + 1.0
    quiet = list(remote.exec(SPEC.id, "sleep 60", stop=lambda: time.monotonic() > stop_at))
    assert all(e.kind != "exit" for e in quiet)
    with pytest.raises(NodeError) as e:  # (the fake raises on the first event: the error travels in the stream)
        list(remote.exec("sb_unknown00", "true"))
    assert e.value.code == "not_found"


def test_a_watcher_gets_the_nodes_exits(served: tuple[FakeNode, RemoteNode]) -> None:
    fake, remote = served
    seen: list[tuple[str, str, str | None]] = []
    remote.watch(lambda sid, kind, detail: seen.append((sid, kind, detail)))
    wait_until(lambda: fake.on_exit is not None)
    time.sleep(0.5)  # the watcher's first poll has learnt where the node's numbering is
    fake.on_exit(SPEC.id, "poweroff", None)  # type: ignore[misc]
    fake.on_exit("sb_bbbbbbbbbb", "crashed", "init died")  # type: ignore[misc]
    wait_until(lambda: len(seen) == 2, timeout=15)
    assert seen == [(SPEC.id, "poweroff", None), ("sb_bbbbbbbbbb", "crashed", "init died")]


def test_a_node_that_is_not_there_is_unreachable() -> None:
    remote = RemoteNode(f"http://127.0.0.1:{_port()}", TOKEN)
    with pytest.raises(NodeError) as e:
        remote.status(SPEC.id)
    assert e.value.code == "node_unreachable"
    with pytest.raises(NodeError) as e:
        remote.prepare(wait=0.5)
    assert e.value.code == "node_unreachable"


def test_migration_routes_take_only_a_migration_ticket(served: tuple[FakeNode, RemoteNode]) -> None:
    # the node token is not a ticket, and a node without that arrival refuses every ticket: 401, nothing written
    _fake, remote = served
    for headers in ({}, {"Authorization": f"Bearer {TOKEN}"}, {"Authorization": "Bearer sbxm_guess"}):
        with httpx.Client(base_url=remote.url, headers=headers) as c:
            r = c.put(f"/v1/node/migrate/{SPEC.id}/memory", content=b"SBXFILES")
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
            for step in ("pages", "restore", "confirm", "abort"):
                assert c.post(f"/v1/node/migrate/{SPEC.id}/{step}").status_code == 401
            assert c.get(f"/v1/node/migrate/{SPEC.id}").status_code == 401
            assert c.get("/v1/node/migrate/..%2F..%2Fetc").status_code in (401, 404)
