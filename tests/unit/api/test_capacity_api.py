"""507 insufficient_capacity as a user meets it: the HTTP answer and OpenAPI, the SDK's typed error, the CLI's
message and exit status (issue 17). The server runs on a FakeNode with settings that leave room for exactly one
test-profile small sandbox (256 MiB) of this host's real RAM."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sbx.cli.main import app as cli_app
from sbx.control.cluster.capacity import host_memory_mib
from sbx.sdk import Client, InsufficientCapacity, Sandbox, SbxError
from tests.fakes import LiveServer, serve_live

runner = CliRunner(mix_stderr=False)


@pytest.fixture
def one_slot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveServer]:
    """A live server whose node may promise 256 MiB: (RAM - (RAM - 256)) x 1."""
    monkeypatch.setenv("SBX_MEMORY_RESERVE_MIB", str(host_memory_mib() - 256))
    monkeypatch.setenv("SBX_MEMORY_OVERCOMMIT", "1")
    yield from serve_live(tmp_path, monkeypatch)


def _post(live: LiveServer, path: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(live.url + path, data=json.dumps(body).encode(), method="POST", headers={
        "Authorization": f"Bearer {live.token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_answers_507_with_the_error_shape_and_creates_nothing(one_slot: LiveServer) -> None:
    status, body = _post(one_slot, "/v1/sandboxes?wait=true", {"type": "small"})
    assert status == 200, body
    status, body = _post(one_slot, "/v1/sandboxes", {"type": "small", "name": "too-many"})
    assert status == 507
    err = body["error"]
    assert isinstance(err, dict) and err["code"] == "insufficient_capacity"
    assert "memory" in err["message"] and "256 MiB" in err["message"]
    listed = Client().list()
    assert len(listed) == 1 and "too-many" not in str(listed)


def test_openapi_documents_507_on_create_resume_and_fork(one_slot: LiveServer) -> None:
    with urllib.request.urlopen(one_slot.url + "/openapi.json", timeout=60) as resp:
        paths = json.loads(resp.read())["paths"]
    for path in ("/v1/sandboxes", "/v1/sandboxes/{sandbox_id}/resume", "/v1/sandboxes/{sandbox_id}/fork"):
        doc = paths[path]["post"]["responses"]["507"]
        assert "insufficient_capacity" in doc["description"]


def test_sdk_raises_its_typed_error(one_slot: LiveServer) -> None:
    with Sandbox.create(type="small") as sb:
        with pytest.raises(InsufficientCapacity) as e:
            Sandbox.create(type="small")
        assert isinstance(e.value, SbxError)
        assert (e.value.code, e.value.status) == ("insufficient_capacity", 507)
        with pytest.raises(InsufficientCapacity):
            sb.fork()
        sb.stop()
        with Sandbox.create(type="small"):  # the stopped one gave its room back...
            with pytest.raises(InsufficientCapacity):
                sb.resume()  # ...so resuming it does not fit now
        assert sb.info()["state"] == "stopped"


def test_cli_prints_the_code_and_exits_non_zero(one_slot: LiveServer) -> None:
    first = runner.invoke(cli_app, ["new", "--type", "small"], catch_exceptions=False)
    assert first.exit_code == 0, first.stderr
    r = runner.invoke(cli_app, ["new", "--type", "small"], catch_exceptions=False)
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr.startswith("error: insufficient_capacity: not enough memory on this node")
