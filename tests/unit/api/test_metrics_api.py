"""``GET /metrics`` on the server and the node agent, request ids and JSON log lines from the API (issue 35), on a
FakeNode: the series a workload fills, that no label names a sandbox, the metrics token, the OpenAPI entry, a
refused start counted by its code, and a worker's log line carrying the sandbox id and the request's id."""

from __future__ import annotations

import io
import json
import logging
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sbx import logs
from tests.fakes import Api, FakeNode, make_api, served_node


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of a text exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` with exactly ``labels`` (0 when absent)."""
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def token_api(tmp_path: Path) -> Iterator[Api]:
    yield from make_api(tmp_path, settings={"metrics_token": "scrape-me"})


def test_a_workload_fills_the_series_and_no_label_names_a_sandbox(api: Api) -> None:
    before = api.c.get("/metrics").text
    sb = api.new()
    sid = sb["id"]
    code, lines = api.exec(sid, "echo hi")
    assert code == 200 and lines[-1]["exitCode"] == 0
    assert api.post(f"/v1/sandboxes/{sid}/stop?wait=true").status_code == 200
    assert api.post(f"/v1/sandboxes/{sid}/resume?wait=true").status_code == 200
    r = api.c.get("/metrics")  # no API key needed
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert value(text, "sbx_sandboxes", state="running") == 1
    assert value(text, "sbx_sandboxes", state="stopped") == 0
    for op in ("create", "stop", "resume"):
        grown = (value(text, "sbx_operation_seconds_count", op=op, outcome="ok")
                 - value(before, "sbx_operation_seconds_count", op=op, outcome="ok"))
        assert grown == 1, op
    assert (value(text, "sbx_exec_seconds_count", outcome="ok")
            - value(before, "sbx_exec_seconds_count", outcome="ok")) == 1
    assert value(text, "sbx_operation_seconds_bucket", op="create", outcome="ok", le="+Inf") >= 1
    node = api.control.router.default_name
    assert value(text, "sbx_node_memory_bytes", node=node) > 0
    assert value(text, "sbx_node_memory_reserved_bytes", node=node) == 256 << 20  # one test-profile small
    assert value(text, "sbx_node_up", node=node, status="ready") == 1
    assert sid not in text and sb["subdomain"] not in text
    assert api.delete(f"/v1/sandboxes/{sid}?wait=true").status_code == 200
    after = api.c.get("/metrics").text
    assert value(after, "sbx_sandboxes", state="running") == 0
    assert (value(after, "sbx_operation_seconds_count", op="delete", outcome="ok")
            - value(before, "sbx_operation_seconds_count", op="delete", outcome="ok")) == 1


def test_a_refused_start_counts_by_its_code(api: Api) -> None:
    before = api.c.get("/metrics").text
    huge = api.control.settings.sizes["xlarge"]
    with api.control.lifecycle.cond, pytest.raises(Exception) as e:
        api.control._place(huge, "a test sandbox", among=set())
    assert getattr(e.value, "code", "") == "egress_proxy_unavailable"
    text = api.c.get("/metrics").text
    assert (value(text, "sbx_admission_refusals_total", code="egress_proxy_unavailable", status="409")
            - value(before, "sbx_admission_refusals_total", code="egress_proxy_unavailable", status="409")) == 1


def test_the_metrics_token_guards_the_scrape(token_api: Api) -> None:
    assert token_api.c.get("/metrics").status_code == 401
    assert token_api.c.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert token_api.c.get("/metrics", headers=token_api.h).status_code == 401  # the API key is not it
    r = token_api.c.get("/metrics", headers={"Authorization": "Bearer scrape-me"})
    assert r.status_code == 200 and "sbx_sandboxes" in r.text


def test_openapi_describes_metrics(api: Api) -> None:
    op = api.c.get("/openapi.json").json()["paths"]["/metrics"]["get"]
    assert "text/plain; version=0.0.4; charset=utf-8" in op["responses"]["200"]["content"]
    assert "401" in op["responses"]


def test_request_ids_are_answered_and_reach_a_workers_log_line(api: Api) -> None:
    r = api.c.get("/healthz")
    assert r.headers["x-request-id"].startswith("req_")
    assert api.c.get("/healthz", headers={"X-Request-Id": "abc-123"}).headers["x-request-id"] == "abc-123"
    bad = api.c.get("/healthz", headers={"X-Request-Id": "no spaces or \"quotes\" here"}).headers["x-request-id"]
    assert bad.startswith("req_")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter())
    sbx_log = logging.getLogger("sbx")
    old_level = sbx_log.level
    sbx_log.addHandler(handler)
    sbx_log.setLevel(logging.INFO)
    try:
        r = api.c.post("/v1/sandboxes?wait=true", json={"type": "small"},
                       headers={**api.h, "X-Request-Id": "rq-create-1"})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "rq-create-1"
        sid = r.json()["sandbox"]["id"]
    finally:
        sbx_log.removeHandler(handler)
        sbx_log.setLevel(old_level)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    done = [x for x in lines if x.get("sandboxId") == sid and x.get("requestId") == "rq-create-1"]
    assert done, lines
    assert {"time", "level", "logger", "message"} <= set(done[0])


def test_the_node_agent_serves_metrics(tmp_path: Path) -> None:
    node = FakeNode(tmp_path / "node")
    try:
        with served_node(node, "node-token") as url:
            body = json.dumps({"args": [], "kwargs": {}}).encode()
            req = urllib.request.Request(url + "/v1/node/call/info", data=body, method="POST", headers={
                "Authorization": "Bearer node-token", "Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 200
            with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:  # no node token
                text = resp.read().decode()
        assert value(text, "sbx_node_call_seconds_count", call="info") >= 1
        assert value(text, "sbx_criu_failures_total", kind="dump") >= 0
        assert "sbx_criu_seconds_bucket" in text
    finally:
        node.close()


def test_a_node_call_carries_the_callers_ids(tmp_path: Path) -> None:
    from sbx.node.remote.client import RemoteNode

    node = FakeNode(tmp_path / "node")
    seen: list[tuple[str | None, str | None]] = []
    info = node.info

    def recording_info() -> object:
        seen.append((logs.sandbox_id.get(), logs.request_id.get()))
        return info()

    node.info = recording_info  # type: ignore[method-assign]
    try:
        with served_node(node, "node-token") as url:
            remote = RemoteNode(url, "node-token")
            with logs.bound("sb_0123456789", "req_from_server"):
                remote.info()
            remote.info()
    finally:
        node.close()
    assert seen == [("sb_0123456789", "req_from_server"), (None, None)]
