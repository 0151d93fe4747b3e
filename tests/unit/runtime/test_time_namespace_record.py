"""The time namespace record of a memory image (sbx.runtime.criuimages): dropped for a dump of tasks in the host's
time namespace, kept for one whose tasks ran in a namespace of their own (a sandbox resumed from its memory
image), and that is told from /proc."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from sbx.runtime import criuimages


def test_the_record_is_dropped_unless_the_tasks_had_their_own(tmp_path: Path) -> None:
    (tmp_path / "timens-1.img").write_bytes(b"x")
    criuimages.mark_own_time_namespace(tmp_path, os.getpid())  # this process: the host's namespace
    assert not (tmp_path / criuimages.OWN_TIME_NAMESPACE).exists()
    assert criuimages.drop_time_namespace(tmp_path) is True
    assert not (tmp_path / "timens-1.img").exists()

    (tmp_path / "timens-1.img").write_bytes(b"x")
    (tmp_path / criuimages.OWN_TIME_NAMESPACE).write_text("1\n")
    assert criuimages.drop_time_namespace(tmp_path) is False
    assert (tmp_path / "timens-1.img").exists()


def test_a_process_in_its_own_time_namespace_is_told_apart() -> None:
    assert criuimages.own_time_namespace(os.getpid()) is False
    assert criuimages.own_time_namespace(None) is False
    assert criuimages.own_time_namespace(2**22 + 12345) is False  # no such process
    # a child of `unshare --time` runs in a new time namespace (the tests run as root)
    p = subprocess.Popen(["unshare", "--time", "--fork", "--kill-child", "sleep", "30"])
    try:
        for _ in range(100):
            kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
            if kids:
                break
            subprocess.run(["sleep", "0.05"])
        assert kids and criuimages.own_time_namespace(int(kids[0])) is True
    finally:
        p.kill()
        p.wait()
