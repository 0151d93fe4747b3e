"""Store migrations and rows; ids, subdomains and word lists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sqlalchemy import inspect, text

from sbx.control.store import words
from sbx.control.store.database import Store, iso, utcnow
from sbx.control.store.ids import ID_RE, new_sandbox_id, new_subdomain, sandbox_url


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"])
def test_migrations_create_the_schema_and_reopen_cleanly(
    tmp_path: Path, engine: str, request: pytest.FixtureRequest
) -> None:
    url = f"sqlite:///{tmp_path / 'db' / 'sbx.db'}" if engine == "sqlite" else request.getfixturevalue("pg_url")
    s = Store(url)
    tables = set(inspect(s.engine).get_table_names())
    assert {"sandboxes", "snapshots", "events", "routes", "secrets", "secret_bindings", "secret_uses", "nodes",
            "seal_replicas", "node_leftovers", "drains", "images", "ssh_keys", "rate_buckets", "auth_attempts",
            "seal_archives", "alembic_version"} <= tables
    with s.engine.connect() as c:
        assert c.execute(text("select version_num from alembic_version")).scalar() == "0019_seal_archives"
    assert "labels" in {col["name"] for col in inspect(s.engine).get_columns("sandboxes")}
    assert "consolidated_at" in {col["name"] for col in inspect(s.engine).get_columns("nodes")}
    assert {"state", "state_changed_at"} <= {col["name"] for col in inspect(s.engine).get_columns("accounts")}
    assert {"image_id", "image"} <= {col["name"] for col in inspect(s.engine).get_columns("sandboxes")}
    s.add_event("sb_x", {"event": "state"})
    s.close()
    again = Store(url)
    assert [e.payload for e in again.events("sb_x")] == [{"event": "state"}]
    again.close()


def test_events_are_ordered_and_filtered_by_seq(store: Store) -> None:
    seqs = [store.add_event("sb_a", {"n": i}) for i in range(3)]
    store.add_event("sb_b", {"n": 99})
    assert [e.payload["n"] for e in store.events("sb_a")] == [0, 1, 2]
    assert [e.payload["n"] for e in store.events("sb_a", after=seqs[0])] == [1, 2]


def test_iso_times_are_utc_with_z() -> None:
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", iso(utcnow()) or "")


def test_ids_and_subdomains() -> None:
    ids = {new_sandbox_id() for _ in range(200)}
    assert len(ids) == 200 and all(ID_RE.match(i) for i in ids)
    sub = new_subdomain()
    first, second, animal = sub.split("-")
    assert first in words.ADJECTIVES and second in words.ADJECTIVES and first != second
    assert animal in words.ANIMALS
    assert sandbox_url(sub, "box.example") == f"https://{sub}.box.example"


def test_subdomain_skips_taken_names() -> None:
    seen: list[str] = []

    def taken(name: str) -> bool:
        seen.append(name)
        return len(seen) < 5

    name = new_subdomain(taken)
    assert name == seen[-1] and len(seen) == 5


def test_word_lists_are_big_unique_and_dns_safe() -> None:
    for lst in (words.ADJECTIVES, words.ANIMALS):
        assert len(lst) >= 60 and len(set(lst)) == len(lst)
        assert all(re.fullmatch(r"[a-z]+", w) for w in lst)


def test_snapshot_labels_migration_names_old_snapshots_by_their_key(tmp_path: Path) -> None:
    """0009: a snapshot stored before labels keeps its name: its label is its key, found within its account."""
    from alembic import command

    from sbx.control.store.database import alembic_config

    url = f"sqlite:///{tmp_path / 'sbx.db'}"
    command.upgrade(alembic_config(url), "head")
    command.downgrade(alembic_config(url), "0008_node_tokens")  # the downgrade works too: back to before labels
    from sqlalchemy import create_engine

    eng = create_engine(url)
    with eng.begin() as c:
        c.execute(text("insert into snapshots (name, sandbox_id, auto, size_mib, created_at, account_id) values "
                       "('old-one', 'sb_x', 0, 10, '2026-01-01 00:00:00', 'acct_a')"))
    eng.dispose()
    again = Store(url)
    row = again.find_snapshot("old-one", "acct_a")
    assert row is not None and (row.name, row.label) == ("old-one", "old-one")
    assert again.find_snapshot("old-one", "acct_b") is None
    assert again.find_snapshot("old-one", "acct_b", any_account=True) is not None
    again.close()
