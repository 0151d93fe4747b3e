"""The warm sandboxes' bookkeeping (sbx.node.memory.warmpool): each is handed to one create only, also under concurrent
takes; an unknown size gets none; a taken one no create claims is deleted a minute later; a create that can't use
its warm sandbox deletes it; a reconcile or a shutdown deletes them all. The runtime is not involved (the delete is
recorded)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from sbx.config import load_settings
from sbx.node.memory import warmpool
from sbx.node.types import SandboxSpec


class Pool(warmpool.WarmPoolMixin):
    def __init__(self, tmp: Path) -> None:  # only what the bookkeeping reads, none of NodeBase's host setup
        self.settings = load_settings(home=tmp)
        self._pool_ready: dict[str, list[str]] = {}
        self._pool_taken: dict[str, tuple[str, float]] = {}
        self._pool_filling: set[str] = set()
        self._pool_images: dict[str, dict[str, Any]] = {}
        self._pool_guard = threading.Lock()
        self._shutdown_at = None
        self.deleted: list[str] = []
        self.fills: list[str] = []

    def delete(self, id: str) -> None:
        self.deleted.append(id)

    def _pool_fill_later(self, size: Any, image: dict[str, Any] | None = None) -> None:
        self.fills.append(warmpool.pool_key(size, image))


def test_concurrent_takes_never_share_a_warm_sandbox(tmp_path: Path) -> None:
    p = Pool(tmp_path)
    p._pool_ready["small"] = [f"sb_warm00000{i}" for i in range(5)]
    got: list[str | None] = []
    start = threading.Barrier(8)

    def take() -> None:
        start.wait()
        got.append(p.pool_take("small"))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [g for g in got if g is not None]
    assert sorted(ids) == [f"sb_warm00000{i}" for i in range(5)] and got.count(None) == 3
    assert set(p._pool_taken) == set(ids) and p._pool_ready["small"] == []
    assert p.fills == ["small"] * 5  # each take asks for a new one
    assert p.pool_take("nosuchsize") is None and p.pool_take("default") is None


def test_a_taken_warm_sandbox_nobody_claims_is_deleted_later(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = Pool(tmp_path)
    p._pool_ready["small"] = ["sb_warm000001", "sb_warm000002"]
    clock = [1000.0]
    monkeypatch.setattr(warmpool.time, "monotonic", lambda: clock[0])
    assert p.pool_take("small") == "sb_warm000001"
    clock[0] += warmpool.TAKE_SECONDS - 1
    assert p.pool_take("small") == "sb_warm000002" and p.deleted == []
    clock[0] += 2  # the first is past its minute, the second not yet
    assert p.pool_take("small") is None
    assert p.deleted == ["sb_warm000001"] and list(p._pool_taken) == ["sb_warm000002"]


def test_a_create_that_cannot_use_its_warm_sandbox_deletes_it(tmp_path: Path) -> None:
    p = Pool(tmp_path)
    size = p.settings.sizes["small"]
    p._pool_ready["small"] = ["sb_warm000001"]
    assert p.pool_take("small") == "sb_warm000001"
    # a --cold create (use=False) for that id: the warm sandbox goes, and the create goes on as before
    assert p._pool_claim(SandboxSpec(id="sb_warm000001", hostname="a-b-c", size=size), use=False) is False
    assert p.deleted == ["sb_warm000001"] and p._pool_taken == {}
    # an id that is no warm sandbox: nothing is touched
    assert p._pool_claim(SandboxSpec(id="sb_other00001", hostname="a-b-c", size=size), use=True) is False
    assert p.deleted == ["sb_warm000001"]


def test_forget_deletes_every_warm_sandbox_ready_or_taken(tmp_path: Path) -> None:
    p = Pool(tmp_path)
    p._pool_ready = {"small": ["sb_warm000001", "sb_warm000002"], "default": ["sb_warm000003"]}
    assert p.pool_take("default") == "sb_warm000003"
    assert p.pool_counts() == {"small": 2}
    p._pool_forget()
    assert sorted(p.deleted) == ["sb_warm000001", "sb_warm000002", "sb_warm000003"]
    assert p._pool_ready == {} and p._pool_taken == {} and p.pool_counts() == {}


def test_a_user_images_warm_sandboxes_are_its_own(tmp_path: Path) -> None:
    """Issue 32: an image's pool (``<size>@<key>``) serves only creates of that image and size; an image whose facts
    this node never saw (no create of it from its template here) has no pool."""
    p = Pool(tmp_path)
    size = p.settings.sizes["small"]
    key = "a" * 64
    image = {"key": key, "init": "systemd", "name": "tools"}
    p._pool_images[key] = image
    p._pool_ready = {f"small@{key}": ["sb_warmimg001", "sb_warmimg002"], "small": ["sb_warmdef001"]}
    assert p.pool_take(f"small@{'b' * 64}") is None and p.pool_take(f"nosuchsize@{key}") is None
    assert p.pool_take(f"small@{key}") == "sb_warmimg001" and p.fills == [f"small@{key}"]
    # a create of the default image can't use the image's warm sandbox: it is deleted
    assert p._pool_claim(SandboxSpec(id="sb_warmimg001", hostname="a-b-c", size=size), use=True) is False
    assert p.deleted == ["sb_warmimg001"]
    assert p.pool_take("small") == "sb_warmdef001"
    assert p.pool_counts() == {f"small@{key}": 1}


def test_warm_sandbox_ids_have_the_control_planes_form() -> None:
    from sbx.control.store.ids import ID_RE

    assert all(ID_RE.match(warmpool._new_id()) for _ in range(200))
