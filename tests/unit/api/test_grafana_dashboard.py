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


def test_the_dashboard_loads_in_grafanas_own_model() -> None:
    """Grafana's dashboard types (grafana-foundation-sdk, generated from Grafana's schema) decode the file: each
    panel keeps its id, type, title and place, and each target decodes as a Prometheus query with its expression."""
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import dashboard, prometheus

    plugins.register_default_plugins()
    raw = grafana.load()
    model = dashboard.Dashboard.from_json(raw)
    assert (model.uid, model.title, model.schema_version) == (raw["uid"], raw["title"], raw["schemaVersion"])
    assert model.panels is not None and len(model.panels) == len(raw["panels"])
    for panel, want in zip(model.panels, raw["panels"], strict=True):
        assert isinstance(panel, dashboard.Panel)
        assert (panel.id_val, panel.type_val, panel.title) == (want["id"], want["type"], want["title"])
        assert panel.targets is not None
        assert all(isinstance(t, prometheus.Dataquery) for t in panel.targets), want["title"]
        assert [t.expr for t in panel.targets] == [t["expr"] for t in want["targets"]]
    back = json.loads(json.dumps(model, cls=JSONEncoder))
    assert [p["gridPos"] for p in back["panels"]] == [p["gridPos"] for p in raw["panels"]]
    assert back["templating"]["list"][0]["name"] == "datasource"
