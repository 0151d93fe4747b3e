"""Metrics and logs on a real server and node agent (issue 35): `sbx server` (``SBX_LOG_FORMAT=json``) driving an
`sbx node serve` in a network namespace of its own (tests/nodenet.py). A short workload (create, exec, stop with
memory, resume, delete) through the API, then:

- ``GET /metrics`` on the server shows sandboxes by state, each operation's latency histogram with its buckets
  filled, the exec round trip, the node's capacity; no label names the sandbox;
- ``GET /metrics`` on the node agent (no node token) shows the CRIU dump and restore it ran and the node calls;
- every series the Grafana dashboard (deploy/grafana/sbx.json) queries is among those two expositions;
- the server's log is JSON lines, and one of them carries the sandbox id and the id of the request that created it;
- a sandbox cannot open the node agent's port (where its ``/metrics`` is).
"""

from __future__ import annotations

import json
import re
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import grafana
from tests.e2e.conftest import Server, start_server
from tests.nodenet import NodeHost, node_netns

TEXT_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING|ERROR) ")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, NodeHost]]:
    tmp = tmp_path_factory.mktemp("sbx-metrics")
    with node_netns(1, tmp) as node:
        node.extra_env["SBX_LOG_FORMAT"] = "json"
        node.start()
        (tmp / "server").mkdir()
        with start_server(tmp / "server", node="mtsrv", bridge="sbxmtsv", subnet="10.91.0.0/16",
                          SBX_NODE_URL=node.url, SBX_NODE_TOKEN=node.token, SBX_NODE_HEARTBEAT_SECONDS="1",
                          SBX_NODE_UNREACHABLE_SECONDS="5", SBX_LOG_FORMAT="json") as srv:
            yield srv, node
        assert node.stop() == 0, node.logs()


def call(srv: Server, method: str, path: str, body: dict[str, Any] | None = None, request_id: str | None = None
         ) -> tuple[int, bytes, dict[str, str]]:
    """One API call with the server's token; ``(status, body, headers)``."""
    headers = {"Authorization": f"Bearer {srv.token}", "Content-Type": "application/json"}
    if request_id:
        headers["X-Request-Id"] = request_id
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(srv.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def scrape(url: str, context: ssl.SSLContext | None = None) -> str:
    # no token of any kind (a node over mutual TLS wants the scraper's certificate: `context`)
    with urllib.request.urlopen(url + "/metrics", timeout=30, context=context) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return resp.read().decode()


def value(text: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return 0.0


def exec_out(srv: Server, sid: str, command: str) -> str:
    status, body, _ = call(srv, "POST", f"/v1/sandboxes/{sid}/exec", {"command": command, "timeout": 60})
    assert status == 200, body
    lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
    assert lines[-1].get("exitCode") == 0, lines
    return "".join(x.get("data", "") for x in lines if x.get("stream") == "stdout")


def json_lines(lines: list[str]) -> list[dict[str, Any]]:
    """The lines that are JSON objects (a log's tail may begin inside a line; other output is not JSON)."""
    out = []
    for x in lines:
        try:
            obj = json.loads(x)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def test_a_workload_shows_in_metrics_and_json_logs(cluster: tuple[Server, NodeHost]) -> None:
    srv, node = cluster
    status, body, headers = call(srv, "POST", "/v1/sandboxes?wait=true", {"type": "small"},
                                 request_id="e2e-metrics-create")
    assert status == 200, body
    assert headers.get("x-request-id") == "e2e-metrics-create"
    sb = json.loads(body)["sandbox"]
    sid = sb["id"]
    assert exec_out(srv, sid, "echo hi").strip() == "hi"
    probe = f"timeout 3 bash -c 'exec 3<>/dev/tcp/{node.node_ip}/7700' && echo open || echo closed"
    assert exec_out(srv, sid, probe).strip() == "closed", "the node agent's port is reachable from a sandbox"
    status, body, _ = call(srv, "POST", f"/v1/sandboxes/{sid}/stop?wait=true", {})
    assert status == 200 and json.loads(body)["sandbox"]["memorySaved"] is True, body
    status, body, _ = call(srv, "POST", f"/v1/sandboxes/{sid}/resume?wait=true", {})
    assert status == 200 and json.loads(body)["sandbox"]["memoryRestored"] is True, body
    assert exec_out(srv, sid, "echo again").strip() == "again"

    mid = scrape(srv.url)
    assert value(mid, "sbx_sandboxes", state="running") == 1
    status, body, _ = call(srv, "DELETE", f"/v1/sandboxes/{sid}?wait=true")
    assert status == 200, body
    text = scrape(srv.url)
    assert value(text, "sbx_sandboxes", state="running") == 0
    for op in ("create", "stop", "resume", "delete"):
        count = value(text, "sbx_operation_seconds_count", op=op, outcome="ok")
        assert count >= 1, op
        assert value(text, "sbx_operation_seconds_bucket", op=op, outcome="ok", le="+Inf") == count, op
        assert 0 < value(text, "sbx_operation_seconds_sum", op=op, outcome="ok") < 300 * count, op
    # a create answers within a few seconds here: some finite bucket holds it
    assert value(text, "sbx_operation_seconds_bucket", op="create", outcome="ok", le="60.0") >= 1
    assert value(text, "sbx_exec_seconds_count", outcome="ok") >= 3
    assert value(text, "sbx_exec_seconds_bucket", outcome="ok", le="10.0") >= 3
    assert value(text, "sbx_node_memory_bytes", node=node.node_name) > 0
    assert value(text, "sbx_node_disk_free_bytes", node=node.node_name) > 0
    assert value(text, "sbx_node_up", node=node.node_name, status="ready") == 1
    assert sid not in text and sid not in mid and sb["subdomain"] not in text

    node_text = scrape(node.url, node.client_context())
    assert value(node_text, "sbx_criu_seconds_count", kind="dump") >= 1
    assert value(node_text, "sbx_criu_seconds_count", kind="restore") >= 1
    assert value(node_text, "sbx_criu_seconds_bucket", kind="dump", le="+Inf") >= 1
    assert value(node_text, "sbx_criu_failures_total", kind="dump") == 0
    for c in ("create", "stop", "resume", "delete"):
        assert value(node_text, "sbx_node_call_seconds_count", call=c) >= 1, c
    assert sid not in node_text

    assert grafana.check_series(grafana.load(), [text, node_text]) >= 17

    lines = Path(srv.log).read_text(errors="replace").splitlines()
    assert not [x for x in lines if TEXT_LOG_LINE.match(x)], "a text log line with SBX_LOG_FORMAT=json"
    records = json_lines(lines)
    assert records and all({"time", "level", "logger", "message"} <= set(r) for r in records)
    mine = [r for r in records if r.get("sandboxId") == sid and r.get("requestId") == "e2e-metrics-create"]
    assert mine, [r for r in records if r.get("sandboxId") == sid]
    node_lines = json_lines(node.logs().splitlines())
    assert node_lines, node.logs()[-2000:]


def test_an_embedded_node_counts_criu_runs_on_the_servers_metrics(server: Server) -> None:
    """With the node inside `sbx server` (no SBX_NODE_URL) its CRIU runs show on the server's own /metrics."""
    before = scrape(server.url)
    status, body, _ = call(server, "POST", "/v1/sandboxes?wait=true", {"type": "small"})
    assert status == 200, body
    sid = json.loads(body)["sandbox"]["id"]
    try:
        status, body, _ = call(server, "POST", f"/v1/sandboxes/{sid}/stop?wait=true", {})
        assert status == 200 and json.loads(body)["sandbox"]["memorySaved"] is True, body
        status, body, _ = call(server, "POST", f"/v1/sandboxes/{sid}/resume?wait=true", {})
        assert status == 200 and json.loads(body)["sandbox"]["memoryRestored"] is True, body
        text = scrape(server.url)
    finally:
        call(server, "DELETE", f"/v1/sandboxes/{sid}?wait=true")
    for kind in ("dump", "restore"):
        grown = (value(text, "sbx_criu_seconds_count", kind=kind)
                 - value(before, "sbx_criu_seconds_count", kind=kind))
        assert grown >= 1, kind
    assert value(text, "sbx_criu_failures_total", kind="restore") == value(before, "sbx_criu_failures_total",
                                                                              kind="restore")
    assert (value(text, "sbx_operation_seconds_count", op="resume", outcome="ok")
            - value(before, "sbx_operation_seconds_count", op="resume", outcome="ok")) == 1
    assert ("sbx_admission_refusals_total", {"code": "insufficient_capacity", "status": "507"}) in [
        (s.name, s.labels) for f in text_string_to_metric_families(text) for s in f.samples]
    assert sid not in text
