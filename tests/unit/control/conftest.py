import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbx.control.store.database import Store
from tests.fakes import FakeNode
from tests.pgcluster import PgCluster, pg_cluster


@pytest.fixture
def node(tmp_path: Path) -> Iterator[FakeNode]:
    n = FakeNode(tmp_path / "node")
    yield n
    n.close()


@pytest.fixture(scope="session")
def pg() -> Iterator[PgCluster]:
    """A throwaway PostgreSQL cluster for the whole session (tests/pgcluster.py)."""
    with pg_cluster() as cluster:
        yield cluster


@pytest.fixture
def pg_url(pg: PgCluster) -> str:
    """The URL of a fresh, empty PostgreSQL database."""
    return pg.create_db(f"t{uuid.uuid4().hex[:12]}")


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A migrated store on each engine: SQLite in a temp file, PostgreSQL in a fresh database."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'state' / 'sbx.db'}"
    else:
        url = request.getfixturevalue("pg_url")
    s = Store(url)
    yield s
    s.close()
