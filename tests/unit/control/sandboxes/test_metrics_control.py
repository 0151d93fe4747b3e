"""What the control plane counts into :mod:`sbx.metrics` around a live migration (issue 35), on two fake nodes: a
refused migration in ``sbx_admission_refusals_total``, a failed and a successful one in
``sbx_operation_seconds{op="migrate"}`` by outcome, and the successful one's pause in
``sbx_migration_pause_seconds``."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbx import metrics
from sbx.control.errors import ControlError
from sbx.node.types import NodeError
from tests.fakes import FakeNode, two_node_plane, wait_until


def sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_migration_is_counted_refused_failed_and_done(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sbx.control.sandboxes import migrating

    refusals = sample("sbx_admission_refusals_total", code="insufficient_capacity", status="507")
    failed = sample("sbx_operation_seconds_count", op="migrate", outcome="error")
    done = sample("sbx_operation_seconds_count", op="migrate", outcome="ok")
    pauses, paused = sample("sbx_migration_pause_seconds_count"), sample("sbx_migration_pause_seconds_sum")
    with two_node_plane(tmp_path) as (cp, one, two):
        cp.registry.cordon("fake2", True)
        sid = cp.create("small").id
        wait_until(lambda: cp.get(sid).state == "running")
        with pytest.raises(ControlError):
            cp.migrate(sid)  # no other ready node
        assert sample("sbx_admission_refusals_total", code="insufficient_capacity", status="507") == refusals + 1
        cp.registry.cordon("fake2", False)

        def fail(src: object, dst: object, url: str, spec: object) -> dict[str, float]:
            raise NodeError("migration_failed", "restore: the destination answered restore_failed")

        monkeypatch.setattr(migrating.livemove, "migrate", fail)
        cp.migrate(sid)
        wait_until(lambda: cp.get(sid).state == "running")
        assert sample("sbx_operation_seconds_count", op="migrate", outcome="error") == failed + 1

        def move(src: FakeNode, dst: FakeNode, url: str, spec: object) -> dict[str, float]:
            dst.boxes[sid] = src.boxes.pop(sid)
            return {"pauseS": 0.25, "totalS": 0.5}

        monkeypatch.setattr(migrating.livemove, "migrate", move)
        cp.migrate(sid)
        wait_until(lambda: cp.get(sid).state == "running" and cp.get(sid).node == "fake2")
        assert sample("sbx_operation_seconds_count", op="migrate", outcome="ok") == done + 1
        assert sample("sbx_migration_pause_seconds_count") == pauses + 1
        assert sample("sbx_migration_pause_seconds_sum") == pytest.approx(paused + 0.25)
        assert sample("sbx_migration_pause_seconds_bucket", le="0.25") >= 1
