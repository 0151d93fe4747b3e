import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from sbx.control.store import Store  # noqa: E402
from tests.fakes import FakeNode  # noqa: E402


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
