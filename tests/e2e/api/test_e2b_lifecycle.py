"""Issue 31 end to end, through E2B's own SDK: what a sandbox does at its timeout (``lifecycle={"on_timeout":
"kill"}``, i.e. ``autoPause: false``, kills it as on E2B; by default sbx pauses it; a pause asked for is no
timeout), and ``commands.stream_input`` (a client stream) feeding a process's stdin."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.e2e.api.test_e2b_sdk import e2b_env  # noqa: F401  (a fixture: the SDK's URLs and key)

e2b = pytest.importorskip("e2b")

pytestmark = pytest.mark.e2e


def _until(what: Callable[[], bool], seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _state(sandbox_id: str) -> str:
    """``running``, ``paused`` or ``gone``."""
    from e2b import Sandbox, SandboxNotFoundException

    try:
        return str(Sandbox.get_info(sandbox_id).state.value)
    except SandboxNotFoundException:
        return "gone"


@pytest.mark.usefixtures("e2b_env")
def test_on_timeout_kill_kills_the_default_pauses_and_a_pause_asked_for_stays() -> None:
    from e2b import Sandbox

    killed = Sandbox.create(timeout=600, lifecycle={"on_timeout": "kill"}, metadata={"suite": "lifecycle"})
    paused = Sandbox.create(timeout=600)
    kept = Sandbox.create(timeout=600, lifecycle={"on_timeout": "kill"})
    now = Sandbox.create(timeout=600, lifecycle={"on_timeout": "kill"})
    try:
        info = killed.get_info()
        assert info.lifecycle == {"on_timeout": "kill", "auto_resume": False}
        assert info.metadata == {"suite": "lifecycle"}  # sbx's own label stays out of E2B's metadata
        assert paused.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
        assert kept.pause() is True  # asked for: not a timeout
        killed.set_timeout(3)
        paused.set_timeout(3)

        now.set_timeout(0)  # "time out now"
        assert _until(lambda: _state(now.sandbox_id) == "gone", 30)

        assert _until(lambda: _state(killed.sandbox_id) == "gone")
        assert Sandbox.kill(killed.sandbox_id) is False
        assert _until(lambda: _state(paused.sandbox_id) == "paused")
        time.sleep(5)  # two sweeps later: the paused ones are still there
        assert (_state(paused.sandbox_id), _state(kept.sandbox_id)) == ("paused", "paused")

        again = Sandbox.connect(kept.sandbox_id, timeout=600)
        assert again.commands.run("echo back").stdout == "back\n"
    finally:
        for sb in (killed, paused, kept, now):
            Sandbox.kill(sb.sandbox_id)


@pytest.mark.usefixtures("e2b_env")
def test_stream_input_feeds_a_process_stdin_as_the_iterable_yields() -> None:
    from e2b import NotFoundException, Sandbox

    sbx = Sandbox.create(timeout=300)
    try:
        cat = sbx.commands.run("cat", background=True, stdin=True)

        def pieces() -> object:
            yield "one\n"
            yield b"two\n"
            yield ""  # nothing to write
            yield "three " * 2000 + "\n"  # over one envelope's worth of a pipe write

        sbx.commands.stream_input(cat.pid, pieces())  # type: ignore[arg-type]
        sbx.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "one\ntwo\n" + "three " * 2000 + "\n"

        with pytest.raises(NotFoundException):
            sbx.commands.stream_input(999999, ["x"])
    finally:
        sbx.kill()
