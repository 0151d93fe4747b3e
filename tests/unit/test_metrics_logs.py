"""The metrics registry (:mod:`sbx.metrics`), the operation timer (:class:`sbx.control.sandboxes.observe.OpTimer`) and
the JSON log format (:mod:`sbx.logs`), without a server (issue 35)."""

from __future__ import annotations

import io
import json
import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sbx import logs, metrics
from sbx.control.sandboxes.observe import OpTimer

FAMILIES = {"sbx_operation_seconds": "histogram", "sbx_exec_seconds": "histogram",
            "sbx_migration_pause_seconds": "histogram", "sbx_admission_refusals": "counter",
            "sbx_criu_failures": "counter", "sbx_criu_seconds": "histogram", "sbx_node_call_seconds": "histogram"}


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_the_registry_exports_every_family_with_its_type() -> None:
    got = families(metrics.render().decode())
    for name, kind in FAMILIES.items():
        assert name in got and got[name].type == kind, name
    ops = {s.labels["op"] for s in got["sbx_operation_seconds"].samples}
    assert ops == set(metrics.OPERATIONS)  # known label values exist from the start, at 0
    assert not any(n.endswith("_created") for n in got)


def test_render_adds_an_apps_collectors_without_registering_them() -> None:
    class One:
        def collect(self) -> Any:
            from prometheus_client.core import GaugeMetricFamily

            g = GaugeMetricFamily("sbx_test_gauge", "a test gauge")
            g.add_metric([], 7)
            yield g

    assert "sbx_test_gauge 7.0" in metrics.render([One()]).decode()
    assert "sbx_test_gauge" not in metrics.render().decode()


def test_the_metrics_token() -> None:
    assert metrics.authorized(None, "")
    assert metrics.authorized("Bearer anything", "")
    assert not metrics.authorized(None, "t0k")
    assert not metrics.authorized("Bearer t0", "t0k")
    assert not metrics.authorized("Basic t0k", "t0k")
    assert metrics.authorized("bearer t0k", "t0k")


def _row(sid: str, state: str, error_code: str | None = None) -> Any:
    return SimpleNamespace(id=sid, state=state, error_code=error_code)


def _count(op: str, outcome: str) -> tuple[float, float]:
    """(sum, count) of ``sbx_operation_seconds{op,outcome}`` now."""
    labels = {"op": op, "outcome": outcome}
    return (metrics.REGISTRY.get_sample_value("sbx_operation_seconds_sum", labels) or 0.0,
            metrics.REGISTRY.get_sample_value("sbx_operation_seconds_count", labels) or 0.0)


def test_the_timer_measures_from_the_first_transient_state_to_the_stable_one() -> None:
    now = [100.0]
    timer = OpTimer(clock=lambda: now[0])
    sum0, n0 = _count("fork", "ok")
    timer.on_state(None, _row("sb_a", "forking"), "", None)  # a new row
    now[0] += 1.0
    timer.on_state(None, _row("sb_a", "provisioning"), "forking", None)  # still the fork
    now[0] += 1.5
    assert timer.in_flight() == 1
    timer.on_state(None, _row("sb_a", "running"), "provisioning", None)
    sum1, n1 = _count("fork", "ok")
    assert (n1 - n0, round(sum1 - sum0, 6)) == (1, 2.5)
    assert timer.in_flight() == 0

    rsum0, rn0 = _count("resume", "error")
    timer.on_state(None, _row("sb_b", "resuming"), "stopped", None)
    now[0] += 0.25
    timer.on_state(None, _row("sb_b", "stopped", error_code="node_unreachable"), "resuming", None)
    rsum1, rn1 = _count("resume", "error")
    assert (rn1 - rn0, round(rsum1 - rsum0, 6)) == (1, 0.25)
    # a stable-to-stable change (a crash seen by the watcher) times nothing
    timer.on_state(None, _row("sb_c", "stopped"), "running", None)
    assert timer.in_flight() == 0


def _json_lines(fn: Any) -> list[dict[str, Any]]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter())
    log = logging.getLogger("sbx.test.jsonlogs")
    log.propagate = False
    log.setLevel(logging.DEBUG)
    log.addHandler(handler)
    try:
        fn(log)
    finally:
        log.removeHandler(handler)
    text = out.getvalue()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_a_json_line_has_the_fields_and_the_ids_when_known() -> None:
    def emit(log: logging.Logger) -> None:
        log.info("plain %s", "line")
        with logs.bound("sb_0123456789", "req_1"):
            log.warning("two\nlines")
        with logs.bound(request="req_2"):
            try:
                raise ValueError("boom")
            except ValueError:
                log.exception("failed")

    plain, bound, failed = _json_lines(emit)
    assert set(plain) == {"time", "level", "logger", "message"}
    assert plain["message"] == "plain line" and plain["level"] == "info" and plain["logger"] == "sbx.test.jsonlogs"
    assert plain["time"].endswith("Z") and "T" in plain["time"]
    assert bound["sandboxId"] == "sb_0123456789" and bound["requestId"] == "req_1"
    assert bound["message"] == "two\nlines" and bound["level"] == "warning"
    assert failed["requestId"] == "req_2" and "sandboxId" not in failed
    assert "ValueError: boom" in failed["exception"]
    assert logs.sandbox_id.get() is None and logs.request_id.get() is None  # unbound after the blocks


def test_ids_go_to_a_worker_thread_explicitly() -> None:
    seen: list[tuple[str | None, str | None]] = []

    def work() -> None:
        seen.append((logs.sandbox_id.get(), logs.request_id.get()))

    with logs.bound(request="req_w"):
        run = logs.carry_to("sb_worker0001")(work)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    plain = threading.Thread(target=work)  # a thread started without them knows neither
    with logs.bound("sb_x", "req_x"):
        plain.start()
    plain.join()
    assert seen == [("sb_worker0001", "req_w"), (None, None)]


def test_configure_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="text, json"):
        logs.configure("info", "xml")
    assert logs.uvicorn_log_config("json") is None
    assert logs.uvicorn_log_config("text") is not None
