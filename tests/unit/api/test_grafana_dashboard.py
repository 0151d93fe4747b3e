"""The Grafana dashboard in the repository (``deploy/grafana/sbx.json``, issue 35) loads as a dashboard model, and
every series its panels query is one that ``GET /metrics`` of a server (after a short workload on a FakeNode) or
of a node agent really exports, with the labels the panel groups or filters by (:mod:`tests.grafana`)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests import grafana
from tests.fakes import Api, FakeNode, served_node


def test_the_dashboard_is_a_grafana_model() -> None:
    grafana.check_model(grafana.load())


def test_the_checks_catch_a_series_nobody_exports() -> None:
    dash = grafana.load()
    dash["panels"][0]["targets"][0]["expr"] = "sum by (state) (sbx_sandboxes_typo)"
    with pytest.raises(AssertionError, match="sbx_sandboxes_typo is not exported"):
        grafana.check_series(dash, ["# TYPE sbx_sandboxes gauge\nsbx_sandboxes{state=\"running\"} 1\n"])
    dash["panels"][0]["targets"][0]["expr"] = "sum by (account) (sbx_sandboxes)"
    with pytest.raises(AssertionError, match="no label"):
        grafana.check_series(dash, ["# TYPE sbx_sandboxes gauge\nsbx_sandboxes{state=\"running\"} 1\n"])
    dash["panels"][0]["targets"][0]["expr"] = "sum(sbx_sandboxes"
    with pytest.raises(AssertionError, match="unbalanced"):
        grafana.check_model(dash)


def test_every_panel_queries_series_that_metrics_exports(api: Api, tmp_path: Path) -> None:
    sid = api.new()["id"]
    assert api.exec(sid, "true")[0] == 200
    assert api.post(f"/v1/sandboxes/{sid}/stop?wait=true").status_code == 200
    server_text = api.c.get("/metrics").text
    node = FakeNode(tmp_path / "node2")
    try:
        with served_node(node, "tok") as url:
            req = urllib.request.Request(url + "/v1/node/call/info", data=json.dumps({}).encode(), method="POST",
                                         headers={"Authorization": "Bearer tok", "Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=10).close()
            with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
                node_text = resp.read().decode()
    finally:
        node.close()
    assert grafana.check_series(grafana.load(), [server_text, node_text]) >= 17
