"""``RuncRuntime.pause`` retries runc's ``unable to freeze`` (cgroup v1's freezer left ``FREEZING``) and nothing else.

runc is a fake here: a script that fails the way runc 1.1 does for its first N calls, then succeeds."""
from __future__ import annotations

from pathlib import Path

import pytest

from sbx.runtime.base import RuntimeError_
from sbx.runtime.runc import RuncRuntime


def fake_runc(tmp_path: Path, fails: int, message: str) -> tuple[RuncRuntime, Path]:
    calls = tmp_path / "calls"
    script = tmp_path / "runc"
    script.write_text(
        "#!/bin/sh\n"
        f"echo \"$@\" >> {calls}\n"
        f"if [ $(wc -l < {calls}) -le {fails} ]; then\n"
        f"  echo 'time=\"2026-12-04T21:29:34Z\" level=error msg=\"{message}\"' >&2; exit 1\n"
        "fi\n")
    script.chmod(0o755)
    return RuncRuntime(tmp_path / "state", tmp_path / "criu", runc=str(script)), calls


def test_a_freeze_that_did_not_take_is_tried_again(tmp_path: Path) -> None:
    rt, calls = fake_runc(tmp_path, fails=2, message="unable to freeze")
    rt.pause("sb_x")
    lines = calls.read_text().splitlines()
    assert len(lines) == 3 and all(line.endswith("pause sb_x") for line in lines)


def test_a_freeze_that_never_takes_fails_after_the_retries(tmp_path: Path) -> None:
    rt, calls = fake_runc(tmp_path, fails=99, message="unable to freeze")
    with pytest.raises(RuntimeError_, match="unable to freeze"):
        rt.pause("sb_x", retries=2)
    assert len(calls.read_text().splitlines()) == 3


def test_other_pause_errors_are_not_retried(tmp_path: Path) -> None:
    rt, calls = fake_runc(tmp_path, fails=99, message="container not running")
    with pytest.raises(RuntimeError_, match="container not running"):
        rt.pause("sb_x")
    assert len(calls.read_text().splitlines()) == 1
