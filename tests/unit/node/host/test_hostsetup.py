"""Host setup (sbx.node.host.setup, sbx.node.host.criuinstall): package detection, the private apt configuration, CRIU
wrappers, the sid install and doctor."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from sbx.config import Settings
from sbx.node.host import criuinstall
from sbx.node.host import setup as hostsetup
from sbx.node.host.setup import Check


def test_missing_packages_uses_dpkg() -> None:
    assert hostsetup.missing_packages(["dpkg", "sbx-imagetest-no-such-package"]) == ["sbx-imagetest-no-such-package"]
    assert hostsetup.missing_packages(["dpkg", "coreutils"]) == []


def test_private_apt_configuration(tmp_path: Path) -> None:
    apt = criuinstall._PrivateApt(tmp_path / "apt", "http://mirror.example.org/debian")
    apt.prepare()
    sources = (tmp_path / "apt/etc/sources.list").read_text()
    assert sources == (
        f"deb [signed-by={criuinstall.KEYRING}] http://mirror.example.org/debian {criuinstall.CRIU_SUITE} main\n"
    )
    assert (tmp_path / "apt/var/lib/dpkg/status").read_text() == ""
    opts = apt.options()
    pairs = dict(o.split("=", 1) for o in opts[1::2])
    assert all(flag == "-o" for flag in opts[0::2])
    assert pairs["Dir::State::status"] == str(tmp_path / "apt/var/lib/dpkg/status")
    assert pairs["Dir::Etc::SourceList"] == str(tmp_path / "apt/etc/sources.list")
    assert pairs["Dir::Cache"].startswith(str(tmp_path)) and pairs["Dir::State"].startswith(str(tmp_path))
    assert pairs["APT::Install-Recommends"] == "false"


def test_private_apt_config_is_read_by_apt(tmp_path: Path) -> None:
    apt = criuinstall._PrivateApt(tmp_path / "apt", "http://mirror.example.org/debian")
    apt.prepare()
    dump = apt.run("apt-config", "dump")
    assert f'Dir::State::status "{tmp_path}/apt/var/lib/dpkg/status";' in dump
    assert 'APT::Install-Recommends "false";' in dump


def test_wrappers_exec_through_the_loader(tmp_path: Path) -> None:
    criuinstall.write_wrappers(tmp_path, "x86_64-linux-gnu", "ld-linux-x86-64.so.2")
    root = tmp_path / "root"
    criu = (tmp_path / "criu").read_text()
    assert criu == (tmp_path / "bin/criu").read_text()
    assert f"ROOT={root}\n" in criu
    assert (
        'exec "$ROOT/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path "$ROOT/usr/lib/x86_64-linux-gnu" '
        '"$ROOT/usr/sbin/criu" "$@"'
    ) in criu
    restore = (tmp_path / "bin/iptables-restore").read_text()
    assert '--argv0 iptables-nft-restore "$ROOT/usr/sbin/xtables-nft-multi" "$@"' in restore
    assert "XTABLES_LIBDIR=" in restore
    for name in ("criu", "bin/criu", "bin/iptables", "bin/ip6tables-restore", "bin/iptables-save"):
        path = tmp_path / name
        assert path.stat().st_mode & 0o777 == 0o755
        subprocess.run(["sh", "-n", str(path)], check=True)


def test_wrapper_quotes_odd_paths(tmp_path: Path) -> None:
    odd = tmp_path / "with space"
    criuinstall.write_wrappers(odd)
    assert f"ROOT='{odd / 'root'}'\n" in (odd / "criu").read_text()


def _fake_criu(settings: Settings, version: str) -> None:
    settings.criu_dir.mkdir(parents=True, exist_ok=True)
    wrapper = settings.criu_dir / "criu"
    wrapper.write_text(f"#!/bin/sh\necho 'Version: {version}'\n")
    wrapper.chmod(0o755)


def test_installed_version_and_skip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(home=tmp_path)
    assert criuinstall.installed_criu_version(settings) is None
    _fake_criu(settings, criuinstall.CRIU_VERSION)
    assert criuinstall.installed_criu_version(settings) == criuinstall.CRIU_VERSION

    def no_apt(*_a: object, **_k: object) -> None:
        raise AssertionError("must not touch apt")

    monkeypatch.setattr(criuinstall._PrivateApt, "run", no_apt)
    messages: list[str] = []
    assert criuinstall.install_criu(settings, messages.append) == criuinstall.CRIU_VERSION
    assert "already installed" in messages[0]


def test_version_ordering() -> None:
    v = criuinstall.version_tuple
    assert v("4.2.1-1") == (4, 2, 1)
    assert v("4.2.1-1") >= v("4.2.1") > v("4.1.1-2") > v("3.17.1-2+deb12u1")
    assert v("6.18.44-fc-v857") >= (5, 10)


def test_doctor_reports_every_check(tmp_path: Path) -> None:
    checks = hostsetup.doctor(Settings(home=tmp_path))
    names = [c.name for c in checks]
    assert names == [
        "runc",
        "runsc",
        "criu",
        "criu check",
        "mmdebstrap",
        "data volume",
        "base image",
        "cgroup v1 memory controller",
        "kernel",
        "user namespaces",
        "ip forwarding",
        "lxcfs",
        "sysctl fs.inotify.max_user_instances",
        "sysctl fs.inotify.max_user_watches",
        "sysctl kernel.pid_max",
        "sysctl net.netfilter.nf_conntrack_max",
    ]
    by_name = {c.name: c for c in checks}
    assert all(isinstance(c, Check) and c.detail for c in checks)
    # nothing is installed under this empty home
    for name in ("criu", "criu check", "data volume", "base image"):
        assert not by_name[name].ok and by_name[name].fix
    assert all(c.fix == "" for c in checks if c.ok)


def test_doctor_reports_a_mount_left_by_a_dead_lxcfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostsetup.lxcfs, "is_mounted", lambda path=None: True)
    monkeypatch.setattr(hostsetup.lxcfs, "is_alive", lambda path=None: False)
    monkeypatch.setattr(hostsetup.shutil, "which", lambda name: f"/usr/bin/{name}")
    check = hostsetup._check_lxcfs()
    assert not check.ok and "daemon died" in check.detail and check.fix
    monkeypatch.setattr(hostsetup.lxcfs, "is_alive", lambda path=None: True)
    assert hostsetup._check_lxcfs().ok


def test_doctor_sees_a_fake_old_criu(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    _fake_criu(settings, "3.17.1")
    check = next(c for c in hostsetup.doctor(settings) if c.name == "criu")
    assert not check.ok and "3.17.1" in check.detail


def test_install_criu_from_sid(tmp_path: Path) -> None:
    """The real thing: sid's CRIU through the private apt client, then `criu check` (root, network)."""
    if os.geteuid() != 0:
        pytest.fail("criu check needs root")
    settings = Settings(home=tmp_path)
    messages: list[str] = []
    assert criuinstall.install_criu(settings, messages.append) == criuinstall.CRIU_VERSION
    assert (settings.criu_dir / "root/usr/sbin/criu").is_file()
    assert not list((settings.criu_dir / "apt").rglob("*.deb"))
    out = subprocess.run([str(settings.criu_dir / "criu"), "check"], capture_output=True, text=True)
    assert "Looks good" in out.stdout + out.stderr
    ipt = subprocess.run(
        [str(settings.criu_dir / "bin/iptables-restore"), "--version"], capture_output=True, text=True, check=True
    )
    assert "nf_tables" in ipt.stdout
    checks = {c.name: c for c in hostsetup.doctor(settings)}
    assert checks["criu"].ok and checks["criu check"].ok
    # a second run is a no-op
    again: list[str] = []
    criuinstall.install_criu(settings, again.append)
    assert len(again) == 1 and "already installed" in again[0]
