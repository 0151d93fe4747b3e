"""SDK calls for the installation's nodes (issue 10/11; admin key): list, add, remove, cordon, drain and the
consolidation's state, sans-IO like :mod:`sbx.sdk.protocol`: drive them with ``Client.run`` / ``AsyncClient.run``.
Moving one sandbox is :func:`sbx.sdk.protocol.migrate` (``Sandbox.migrate``).

>>> from sbx.sdk import Client, nodes
>>> with Client() as c:
...     [n["name"] for n in c.run(nodes.nodes())]
"""

from __future__ import annotations

from sbx.sdk.protocol import Call, Request, long_timeout, wait_params


def nodes() -> Call:
    """``GET /v1/nodes``; returns node dicts (name, url, status, cordoned, capacity, load, fingerprint...)."""
    resp = yield Request("GET", "/v1/nodes")
    return list(resp.body["nodes"])


def add_node(url: str, token: str) -> Call:
    """``POST /v1/nodes``; returns the node dict of the added node agent."""
    resp = yield Request("POST", "/v1/nodes", {"url": url, "token": token})
    return dict(resp.body["node"])


def remove_node(name: str) -> Call:
    """``DELETE /v1/nodes/{name}``; returns the removed node's dict."""
    resp = yield Request("DELETE", f"/v1/nodes/{name}")
    return dict(resp.body["node"])


def cordon(name: str, cordoned: bool = True) -> Call:
    """``POST /v1/nodes/{name}/cordon`` (or ``/uncordon``); returns the node dict."""
    resp = yield Request("POST", f"/v1/nodes/{name}/{'cordon' if cordoned else 'uncordon'}")
    return dict(resp.body["node"])


def drain(name: str, wait: bool = False) -> Call:
    """``POST /v1/nodes/{name}/drain``; returns the drain dict (node, state, empty, sandboxes: id, action, status,
    to, error, pauseS...). ``wait``: answer when it has finished."""
    resp = yield Request("POST", f"/v1/nodes/{name}/drain", params=wait_params(wait), timeout=long_timeout(wait))
    return dict(resp.body["drain"])


def drain_status(name: str) -> Call:
    """``GET /v1/nodes/{name}/drain``; the drain dict of the node's last drain."""
    resp = yield Request("GET", f"/v1/nodes/{name}/drain")
    return dict(resp.body["drain"])


def consolidation() -> Call:
    """``GET /v1/consolidation``; the consolidation dict (enabled, periodS, leader, rules, lastRunAt, plan: action,
    node, reason, moves, nodes; drain, outcome, removable)."""
    resp = yield Request("GET", "/v1/consolidation")
    return dict(resp.body["consolidation"])
