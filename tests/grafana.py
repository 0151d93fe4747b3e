"""Checks of the Grafana dashboard ``deploy/grafana/sbx.json`` that tests/unit/api/test_grafana_dashboard.py and
tests/e2e/api/test_metrics.py share: the dashboard model's shape (what Grafana needs to import it: a uid, a schema
version, panels with unique ids on the 24-column grid, Prometheus targets with unique refIds) and that every series
a panel's PromQL names, with the labels it groups or filters by, is one that ``/metrics`` exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "sbx.json"
PANEL_TYPES = {"timeseries", "stat", "gauge", "table", "bargauge"}
_METRIC = re.compile(r"\bsbx_[a-z0-9_]+\b")
_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"(sbx_[a-z0-9_]+)\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")


def load(path: Path = DASHBOARD) -> dict[str, Any]:
    """The dashboard as a dict (the file must be one JSON object)."""
    dash = json.loads(path.read_text())
    assert isinstance(dash, dict)
    return dash


def check_model(dash: dict[str, Any]) -> None:
    """Assert the dashboard model has what Grafana's import needs, and panels that don't overlap."""
    assert isinstance(dash.get("uid"), str) and dash["uid"] and len(dash["uid"]) <= 40
    assert isinstance(dash.get("title"), str) and dash["title"]
    assert isinstance(dash.get("schemaVersion"), int) and dash["schemaVersion"] >= 36
    variables = {v["name"] for v in dash.get("templating", {}).get("list", [])}
    panels = dash["panels"]
    assert panels and len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        assert isinstance(p["id"], int) and p["type"] in PANEL_TYPES and p["title"], p
        g = p["gridPos"]
        assert all(isinstance(g[k], int) and g[k] >= 0 for k in ("x", "y", "w", "h")), p["title"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        uid = p["datasource"]["uid"]
        assert p["datasource"]["type"] == "prometheus" and uid.removeprefix("${").removesuffix("}") in variables
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(set(refs)) == len(refs), p["title"]
        for t in p["targets"]:
            assert isinstance(t["expr"], str) and t["expr"].strip(), p["title"]
            _balanced(t["expr"])


def _balanced(expr: str) -> None:
    stack: list[str] = []
    pairs = {")": "(", "]": "[", "}": "{"}
    in_str = False
    for ch in expr:
        if ch == '"':
            in_str = not in_str
        elif in_str:
            continue
        elif ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            assert stack and stack.pop() == pairs[ch], f"unbalanced {expr!r}"
    assert not stack and not in_str, f"unbalanced {expr!r}"


def exported(texts: list[str]) -> dict[str, set[str]]:
    """``{sample name: label names}`` of the expositions ``texts`` (a family without samples yet still counts:
    a counter as ``<name>_total``, a histogram as ``_bucket``/``_sum``/``_count``, a gauge by its name)."""
    out: dict[str, set[str]] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            names = {"counter": [fam.name + "_total"],
                     "histogram": [fam.name + s for s in ("_bucket", "_sum", "_count")]}.get(fam.type, [fam.name])
            for n in names:
                out.setdefault(n, set())
            for s in fam.samples:
                out.setdefault(s.name, set()).update(s.labels)
    return out


def used(dash: dict[str, Any]) -> list[tuple[str, str, str, set[str]]]:
    """``(panel title, expr, series, label names)`` for each series each target's PromQL names; the label names
    are those it groups by and those it filters on."""
    out = []
    for p in dash["panels"]:
        for t in p["targets"]:
            expr = t["expr"]
            by = {x.strip() for m in _BY.finditer(expr) for x in m.group(1).split(",") if x.strip()}
            matched: dict[str, set[str]] = {}
            for m in _MATCHERS.finditer(expr):
                matched.setdefault(m.group(1), set()).update(_MATCHER_LABEL.findall(m.group(2)))
            for name in sorted(set(_METRIC.findall(expr))):
                out.append((p["title"], expr, name, by | matched.get(name, set())))
    return out


def check_series(dash: dict[str, Any], texts: list[str]) -> int:
    """Assert every series a panel names is exported by one of ``texts`` with every label the panel uses (``le``
    on a ``_bucket``); returns how many (panel, series) pairs were checked."""
    have = exported(texts)
    pairs = used(dash)
    assert pairs
    for title, expr, name, labels in pairs:
        assert name in have, f"panel {title!r}: {name} is not exported ({expr})"
        extra = {"le"} if name.endswith("_bucket") else set()
        missing = labels - have[name] - extra
        # a label is missing only when the series has samples without it (a family with none yet has no labels)
        assert not missing or not have[name], f"panel {title!r}: {name} has no label {missing} ({expr})"
    return len(pairs)
