"""Fixtures shared by the unit tests of the CLI and SDK."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes import LiveServer, serve_live


@pytest.fixture
def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveServer]:
    """The app on a real port with a FakeNode; SBX_URL/SBX_TOKEN point at it and HOME is a temp dir."""
    yield from serve_live(tmp_path, monkeypatch)
