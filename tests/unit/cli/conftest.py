import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.fakes import LiveServer  # noqa: E402


@pytest.fixture
def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveServer]:
    """The app on a real port with a FakeNode; SBX_URL/SBX_TOKEN point at it and HOME is a temp dir."""
    server = LiveServer(tmp_path).start()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("SBX_URL", server.url)
    monkeypatch.setenv("SBX_TOKEN", server.token)
    yield server
    server.stop()
