from collections.abc import Iterator
from pathlib import Path

import pytest

from sbx.control.store import Store
from tests.fakes import FakeNode


@pytest.fixture
def node(tmp_path: Path) -> Iterator[FakeNode]:
    n = FakeNode(tmp_path / "node")
    yield n
    n.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path / 'state' / 'sbx.db'}")
    yield s
    s.close()
