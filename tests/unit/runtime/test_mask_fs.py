"""The node's mask filesystem (issue 33, :func:`sbx.runtime.oci.ensure_mask_dir`): an empty read-only tmpfs of host
root, mode 0555, mounted once and kept; what the sandboxes' /sys masks bind, so their mountinfo names no host path."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from sbx.runtime import oci


def test_mask_dir_is_an_empty_read_only_tmpfs_mounted_once(tmp_path: Path) -> None:
    path = tmp_path / "node" / "masked"
    path.parent.mkdir()
    path.write_text("something else")  # a file where the folder goes is replaced
    try:
        assert oci.ensure_mask_dir(path) == path
        assert os.path.ismount(path) and list(path.iterdir()) == []
        st = path.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, 0o555)
        r = subprocess.run(["mkdir", str(path / "d")], capture_output=True, text=True)
        assert r.returncode != 0 and "Read-only file system" in r.stderr
        line = [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines() if f" {path} " in ln]
        assert len(line) == 1 and " - tmpfs sbx-masked ro," in line[0]
        oci.ensure_mask_dir(path)  # again: the same mount, not a second one over it
        again = [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines() if f" {path} " in ln]
        assert again == line
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)


def test_masks_bind_the_mask_dir_for_sys_folders() -> None:
    masked, binds = oci.masks("/run/sbx/n/masked")
    assert {b["destination"] for b in binds} <= {p for p in oci.MASKED_PATHS if p.startswith("/sys/")}
    assert all(b["source"] == "/run/sbx/n/masked" and "ro" in b["options"] for b in binds)
    assert "/proc/cmdline" in masked
