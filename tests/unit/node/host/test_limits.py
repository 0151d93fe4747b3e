"""Kernel limits for many sandboxes (sbx.node.host.limits) against a fake /proc/sys and sysctl.d folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbx.node.host import limits


def _proc(tmp: Path, values: dict[str, int]) -> Path:
    root = tmp / "proc-sys"
    for key, value in values.items():
        p = root / key.replace(".", "/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"{value}\n")
    return root


def test_apply_raises_low_limits_keeps_higher_ones_and_writes_the_sysctl_file(tmp_path: Path) -> None:
    proc = _proc(tmp_path, {"fs.inotify.max_user_instances": 128, "fs.inotify.max_user_watches": 8_000_000,
                            "kernel.pid_max": 32768})
    conf = tmp_path / "sysctl.d" / "60-sbx.conf"
    after = {lim.key: lim for lim in limits.apply(conf, proc)}
    assert after["fs.inotify.max_user_instances"].current == 8192
    assert after["fs.inotify.max_user_watches"].current == 8_000_000  # already higher: kept
    assert after["kernel.pid_max"].current == 4194304
    assert after["net.netfilter.nf_conntrack_max"].current is None  # no conntrack: absent is fine
    assert all(lim.ok and not lim.error for lim in after.values())
    text = conf.read_text()
    assert "fs.inotify.max_user_instances = 8192\n" in text and "fs.inotify.max_user_watches = 8000000\n" in text
    assert "nf_conntrack_max" not in text


def test_a_key_that_cannot_be_written_is_reported_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = _proc(tmp_path, {"fs.inotify.max_user_instances": 128, "fs.inotify.max_user_watches": 8192,
                            "kernel.pid_max": 32768})
    ro = proc / "fs" / "inotify" / "max_user_instances"
    write = Path.write_text

    def read_only(self: Path, data: str, *a: object, **kw: object) -> int:
        if self == ro:  # like a read-only /proc/sys key in a container
            raise PermissionError(30, "Read-only file system")
        return write(self, data, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", read_only)
    after = {lim.key: lim for lim in limits.apply(tmp_path / "60-sbx.conf", proc)}
    bad = after["fs.inotify.max_user_instances"]
    assert not bad.ok and bad.error
    assert after["fs.inotify.max_user_watches"].ok and after["kernel.pid_max"].ok


def test_read_reports_a_low_limit(tmp_path: Path) -> None:
    proc = _proc(tmp_path, {"fs.inotify.max_user_instances": 128, "fs.inotify.max_user_watches": 1048576,
                            "kernel.pid_max": 4194304, "net.netfilter.nf_conntrack_max": 65536})
    got = {lim.key: lim.ok for lim in limits.read(proc)}
    assert got == {"fs.inotify.max_user_instances": False, "fs.inotify.max_user_watches": True,
                   "kernel.pid_max": True, "net.netfilter.nf_conntrack_max": False}
