"""An exec of a running sandbox reads its row once (issue 13: each read is ~0.3 ms of a ~10 ms round trip): the
check that it runs (:meth:`sbx.control.sandboxes.planebase.PlaneBase.wait_running`) hands the row's node to the exec,
which
goes straight to that node. Two fake nodes (tests.fakes.two_node_plane), so the exec must reach the right one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes import two_node_plane, wait_until


def test_an_exec_reads_the_row_once_and_runs_on_the_rows_node(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    with two_node_plane(tmp_path) as (cp, one, two):
        rows = [cp.create("small"), cp.create("small")]
        for row in rows:
            wait_until(lambda row=row: cp.get(row.id).state == "running")
        assert {cp.get(r.id).node for r in rows} == {one.name, two.name}  # spread: one on each node
        reads: list[str] = []
        real = cp.store.get_sandbox

        def counted(sandbox_id: str):  # type: ignore[no-untyped-def]
            reads.append(sandbox_id)
            return real(sandbox_id)

        monkeypatch.setattr(cp.store, "get_sandbox", counted)
        for row in rows:
            reads.clear()
            lines = list(cp.exec(row.id, "echo hi"))
            assert lines[-1].get("exitCode") == 0, lines
            assert reads == [row.id]
            node = one if cp.get(row.id).node == one.name else two
            assert any(c[0] == "exec" and c[1] == row.id for c in node.calls), node.calls


def test_an_exec_through_the_api_reads_the_row_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The route's ownership check reads the row and hands it to the exec (sbx.api.auth.owned), which uses it when
    it says ``running``: one read per exec, not two. A stopped sandbox's row is read again (it may be resuming)."""
    from tests.fakes import make_api

    apis = make_api(tmp_path)
    api = next(apis)
    try:
        sid = api.new()["id"]
        reads: list[str] = []
        real = api.control.store.get_sandbox

        def counted(sandbox_id: str):  # type: ignore[no-untyped-def]
            reads.append(sandbox_id)
            return real(sandbox_id)

        monkeypatch.setattr(api.control.store, "get_sandbox", counted)
        status, lines = api.exec(sid, "echo hi")
        assert status == 200 and lines[-1].get("exitCode") == 0, lines
        assert reads == [sid]
        monkeypatch.setattr(api.control.store, "get_sandbox", real)
        assert api.post(f"/v1/sandboxes/{sid}/stop?wait=true").status_code == 200
        monkeypatch.setattr(api.control.store, "get_sandbox", counted)
        reads.clear()
        r = api.post(f"/v1/sandboxes/{sid}/exec", json={"command": "true"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "not_running", r.text
        assert reads.count(sid) >= 2  # the check's read, then the exec's own
    finally:
        apis.close()
