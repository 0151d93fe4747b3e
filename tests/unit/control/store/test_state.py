"""The lifecycle state machine: the transition table, persistence of every transition, waiting and 409 busy."""

from __future__ import annotations

import threading

import pytest

from sbx.control.errors import ControlError
from sbx.control.store.database import SandboxRow, Store, utcnow
from sbx.control.store.state import STABLE, STATES, TRANSIENT, TRANSITIONS, Lifecycle, can_transition


def _row(store: Store, state: str = "running", sid: str = "sb_aaaaaaaaaa") -> str:
    now = utcnow()
    store.add_sandbox(SandboxRow(id=sid, name="n", type="small", state=state, subdomain=f"a-b-{sid}", ttl=0, env={},
                                 no_snapshots=False, has_memory=False, created_at=now, updated_at=now))
    return sid


def _lifecycle(store: Store, wait: float = 5.0) -> tuple[Lifecycle, list[tuple[str, str]]]:
    seen: list[tuple[str, str]] = []
    return Lifecycle(store, lambda row, old: seen.append((old, row.state)), wait), seen


def test_table_covers_every_state_and_only_known_states() -> None:
    assert set(TRANSITIONS) == set(STATES)
    for src, dsts in TRANSITIONS.items():
        assert dsts <= set(STATES), src
    assert TRANSIENT | STABLE == set(STATES) and not TRANSIENT & STABLE
    assert TRANSITIONS["deleted"] == frozenset()
    for state in TRANSIENT:  # every operation in flight can end, or fail
        assert "error" in TRANSITIONS[state]


@pytest.mark.parametrize(
    ("src", "dst", "ok"),
    [
        ("provisioning", "running", True),
        ("running", "stopping", True),
        ("stopping", "stopped", True),
        ("stopped", "resuming", True),
        ("resuming", "running", True),
        ("forking", "provisioning", True),
        ("running", "deleting", True),
        ("stopped", "deleting", True),
        ("deleting", "deleted", True),
        ("error", "deleting", True),
        ("running", "resuming", False),
        ("stopped", "stopping", False),
        ("running", "running", False),
        ("deleted", "running", False),
        ("stopping", "running", False),
        ("provisioning", "stopping", False),
    ],
)
def test_allowed_transitions(src: str, dst: str, ok: bool) -> None:
    assert can_transition(src, dst) is ok


def test_transition_persists_and_emits(store: Store) -> None:
    sid = _row(store)
    lc, seen = _lifecycle(store)
    lc.transition(sid, "stopping")
    assert store.get_sandbox(sid).state == "stopping"  # type: ignore[union-attr]
    lc.transition(sid, "stopped", has_memory=True)
    row = store.get_sandbox(sid)
    assert row is not None and (row.state, row.has_memory) == ("stopped", True)
    assert seen == [("running", "stopping"), ("stopping", "stopped")]


def test_forbidden_transition_is_refused_and_nothing_changes(store: Store) -> None:
    sid = _row(store, "stopped")
    lc, seen = _lifecycle(store)
    with pytest.raises(ControlError) as e:
        lc.transition(sid, "running")
    assert (e.value.code, e.value.status) == ("invalid_transition", 409)
    assert store.get_sandbox(sid).state == "stopped"  # type: ignore[union-attr]
    assert seen == []


def test_begin_waits_for_the_operation_in_flight(store: Store) -> None:
    sid = _row(store, "stopping")
    lc, _ = _lifecycle(store, wait=30)
    t = threading.Timer(0.2, lambda: lc.transition(sid, "stopped"))
    t.start()
    before, after = lc.begin(sid, "resuming")
    t.join()
    assert (before.state, after.state) == ("stopped", "resuming")


def test_begin_answers_busy_with_the_state_after_the_bounded_wait(store: Store) -> None:
    sid = _row(store, "stopping")
    lc, _ = _lifecycle(store, wait=0.2)
    with pytest.raises(ControlError) as e:
        lc.begin(sid, "resuming")
    assert (e.value.code, e.value.status, e.value.state) == ("busy", 409, "stopping")


def test_begin_refuses_a_transition_the_table_forbids(store: Store) -> None:
    sid = _row(store, "running")
    lc, _ = _lifecycle(store)
    with pytest.raises(ControlError) as e:
        lc.begin(sid, "resuming")
    assert (e.value.code, e.value.status, e.value.state) == ("invalid_state", 409, "running")


def test_unknown_and_deleted_are_404(store: Store) -> None:
    lc, _ = _lifecycle(store)
    _row(store, "deleted", "sb_dddddddddd")
    for sid in ("sb_zzzzzzzzzz", "sb_dddddddddd"):
        with pytest.raises(ControlError) as e:
            lc.begin(sid, "stopping")
        assert (e.value.code, e.value.status) == ("not_found", 404)


def test_a_hold_keeps_operations_waiting_until_released(store: Store) -> None:
    sid = _row(store, "running")
    lc, _ = _lifecycle(store, wait=0.2)
    lc.acquire_hold(sid, {"running"})
    with pytest.raises(ControlError) as e:
        lc.begin(sid, "stopping")
    assert e.value.code == "busy"
    lc.release_hold(sid)
    assert lc.begin(sid, "stopping")[1].state == "stopping"


def test_wait_for_running_reports_not_running(store: Store) -> None:
    sid = _row(store, "stopped")
    lc, _ = _lifecycle(store)
    with pytest.raises(ControlError) as e:
        lc.wait_for(sid, {"running"})
    assert (e.value.code, e.value.state) == ("not_running", "stopped")
