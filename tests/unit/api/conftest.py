from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes import Api, make_api


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    yield from make_api(tmp_path)
