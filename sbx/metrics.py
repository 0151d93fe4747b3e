"""Prometheus series of sbx (issue 35), defined once for every room: ``GET /metrics`` on ``sbx server``
(:mod:`sbx.api.observe`) and on ``sbx node serve`` (:mod:`sbx.node.remote.server`) render them.

This module imports nothing of sbx's other rooms (an import-linter contract in ``pyproject.toml`` holds it), so the
control plane, the node and the runtime all may count into it. Every series is an aggregate: no label carries a
sandbox id, an account or a key (labels are operation names, error codes and node names), so a scrape tells an
operator how the installation runs and nothing about any one account's sandboxes.

Series (each name as it appears in the exposition; a histogram adds ``_bucket``, ``_sum`` and ``_count``):

- ``sbx_operation_seconds{op,outcome}``: a lifecycle operation from its request to its settled state (``op``:
  create, fork, stop, resume, delete, migrate; ``outcome``: ok or error), measured by the control plane where the
  row reaches its stable state;
- ``sbx_exec_seconds{outcome}``: an attached exec's round trip in the control plane, start to exit line;
- ``sbx_migration_pause_seconds``: the pause of each live migration (the source's freeze to the destination's run);
- ``sbx_admission_refusals_total{code,status}``: starts refused (507 ``insufficient_capacity``, 403
  ``plan_limit``, 409 ``egress_proxy_unavailable``...);
- ``sbx_criu_failures_total{kind}`` and ``sbx_criu_seconds{kind}``: CRIU dumps and restores (``kind``: dump,
  restore) that failed, and how long each run took, counted in the process that runs runc (the node);
- ``sbx_node_call_seconds{call}``: node API calls as the node agent served them (``sbx node serve`` only);
- the gauges a scrape of the server computes from its store (:mod:`sbx.control.sandboxes.observe`):
  ``sbx_sandboxes{state}``, ``sbx_node_memory_bytes{node}``, ``sbx_node_memory_reserved_bytes{node}``,
  ``sbx_node_disk_free_bytes{node}``, ``sbx_node_up{node,status}``, ``sbx_replication_pending``,
  ``sbx_replication_lag_seconds``, ``sbx_trim_passes_total``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

disable_created_metrics()  # no ``*_created`` series beside each counter and histogram: nothing here reads them

REGISTRY = CollectorRegistry(auto_describe=True)
"""The process's own series (those below). Not prometheus-client's default registry, so a library that registers
there adds nothing to sbx's exposition."""

_SLOW = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Buckets for operations that take a second or so (create, resume, CRIU runs)."""
_FAST = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Buckets for short round trips (an exec, a node call, a migration's pause)."""

OPERATION_SECONDS = Histogram(
    "sbx_operation_seconds", "Lifecycle operations, from the request to the settled state (control plane).",
    ["op", "outcome"], buckets=_SLOW, registry=REGISTRY)
EXEC_SECONDS = Histogram(
    "sbx_exec_seconds", "Attached exec round trips in the control plane, from the call to the exit line.",
    ["outcome"], buckets=_FAST, registry=REGISTRY)
MIGRATION_PAUSE_SECONDS = Histogram(
    "sbx_migration_pause_seconds", "The pause of each live migration (source frozen until the destination runs).",
    buckets=_FAST, registry=REGISTRY)
ADMISSION_REFUSALS = Counter(
    "sbx_admission_refusals", "Starts (create, resume, fork, migration) refused by placement or the account's plan.",
    ["code", "status"], registry=REGISTRY)
CRIU_FAILURES = Counter(
    "sbx_criu_failures", "CRIU runs that failed, by kind (dump, restore).", ["kind"], registry=REGISTRY)
CRIU_SECONDS = Histogram(
    "sbx_criu_seconds", "CRIU runs (runc checkpoint or restore), failed or not, by kind.", ["kind"], buckets=_SLOW,
    registry=REGISTRY)
NODE_CALL_SECONDS = Histogram(
    "sbx_node_call_seconds", "Node API calls as the node agent served them, by call.", ["call"], buckets=_FAST,
    registry=REGISTRY)

OUTCOMES = ("ok", "error")
"""The values of the ``outcome`` label."""

OPERATIONS = ("create", "fork", "stop", "resume", "delete", "migrate")
"""The values of ``sbx_operation_seconds``' ``op`` label."""
REFUSALS = (("insufficient_capacity", "507"), ("plan_limit", "403"), ("egress_proxy_unavailable", "409"))
"""The ``(code, status)`` pairs of ``sbx_admission_refusals_total`` that placement and plans refuse with."""
CRIU_KINDS = ("dump", "restore")
"""The values of the CRIU series' ``kind`` label."""

# every label value known in advance is exported from the start (at 0), so a dashboard's query finds its series
# before the first operation of its kind
for _op in OPERATIONS:
    for _outcome in OUTCOMES:
        OPERATION_SECONDS.labels(op=_op, outcome=_outcome)
for _outcome in OUTCOMES:
    EXEC_SECONDS.labels(outcome=_outcome)
for _code, _status in REFUSALS:
    ADMISSION_REFUSALS.labels(code=_code, status=_status)
for _kind in CRIU_KINDS:
    CRIU_FAILURES.labels(kind=_kind)
    CRIU_SECONDS.labels(kind=_kind)

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The exposition's media type (Prometheus text format 0.0.4)."""


class _Union:
    """One collector that yields the metrics of several (a registry, and collectors of one app)."""

    def __init__(self, parts: Iterable[Any]):
        self._parts = list(parts)

    def collect(self) -> Iterator[Any]:
        for part in self._parts:
            yield from part.collect()


def render(extra: Iterable[Any] = ()) -> bytes:
    """The text exposition of :data:`REGISTRY` plus ``extra`` (collectors of one app, such as the server's gauges
    computed from its store). ``extra`` is not registered anywhere, so several apps in one process (tests) each
    render their own. Each of ``extra`` has a ``collect()`` that yields metric families."""
    scrape = CollectorRegistry(auto_describe=False)
    scrape.register(_Union([REGISTRY, *extra]))  # type: ignore[arg-type]
    return generate_latest(scrape)


def authorized(header: str | None, token: str) -> bool:
    """Whether a scrape with ``Authorization`` header ``header`` may read ``/metrics``: always when ``token`` (the
    ``SBX_METRICS_TOKEN`` setting) is empty, else only with ``Bearer <token>`` (compared in constant time)."""
    if not token:
        return True
    import hmac

    scheme, _, cred = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(cred.strip().encode(), token.encode())
