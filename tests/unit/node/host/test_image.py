"""Base image: its path, reuse and pruning, and a real build checked with debugfs (the mirror it is built from:
test_aptsources.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from sbx.config import Settings
from sbx.guest import recipe
from sbx.node.host import image
from sbx.storage import locks


def test_image_path_is_named_after_the_recipe_hash(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    assert image.image_path(settings) == settings.images_dir / f"{recipe.recipe_hash()}.ext4"


def test_ensure_image_returns_an_existing_image_without_building(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(home=tmp_path)
    target = image.image_path(settings)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"")

    def fail(*_a: object, **_k: object) -> None:
        raise AssertionError("must not build")

    monkeypatch.setattr(image, "build_image", fail)
    assert image.ensure_image(settings) == target


# --------------------------------------------------------------------------------------------------------
# The real build (root, mmdebstrap and the host's Debian mirror; about a minute).


def _debugfs(img: Path, request: str) -> str:
    proc = subprocess.run(["debugfs", "-R", request, str(img)], capture_output=True, text=True, check=True)
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, Path, list[str]]]:
    if os.geteuid() != 0:
        pytest.fail("building the base image needs root (mmdebstrap --mode=root, chroot)")
    home = tmp_path_factory.mktemp("sbx-imagetest")
    settings = replace(Settings(), home=home)
    messages: list[str] = []
    path = image.ensure_image(settings, messages.append)
    yield settings, path, messages
    shutil.rmtree(home, ignore_errors=True)


def test_build_writes_the_image_atomically(built: tuple[Settings, Path, list[str]]) -> None:
    settings, path, messages = built
    assert path == image.image_path(settings) and path.is_file()
    assert path.with_suffix(".json").is_file()
    leftovers = [p.name for p in path.parent.iterdir() if p.name.startswith(".build-")]
    assert leftovers == []
    assert any(m.startswith("Bootstrapping") for m in messages)
    assert any(m.startswith("Image ready") for m in messages)
    # sparse: far fewer blocks allocated than the apparent size... and about 1.5x the content
    st = path.stat()
    assert st.st_blocks * 512 < st.st_size
    blkid = subprocess.run(["blkid", "-o", "export", str(path)], capture_output=True, text=True, check=True)
    assert "TYPE=ext4" in blkid.stdout and f"LABEL={image.FS_LABEL}" in blkid.stdout
    subprocess.run(["e2fsck", "-f", "-n", str(path)], check=True, capture_output=True)


def test_second_call_reuses_the_image(built: tuple[Settings, Path, list[str]]) -> None:
    settings, path, _ = built
    before = path.stat().st_mtime_ns
    assert image.ensure_image(settings) == path
    assert path.stat().st_mtime_ns == before


def test_image_has_the_user_and_sudoers(built: tuple[Settings, Path, list[str]]) -> None:
    _, path, _ = built
    home = _debugfs(path, "stat /home/user")
    assert "Type: directory" in home and "User:  1000" in home and "Group:  1000" in home
    sudoers = _debugfs(path, "stat /etc/sudoers.d/user")
    assert "Mode:  0440" in sudoers
    assert "NOPASSWD: ALL" in _debugfs(path, "cat /etc/sudoers.d/user")
    passwd = _debugfs(path, "cat /etc/passwd")
    assert "user:x:1000:1000::/home/user:/bin/bash" in passwd


def test_image_masks_units(built: tuple[Settings, Path, list[str]]) -> None:
    _, path, _ = built
    for unit in ("getty@tty1.service", "systemd-udevd.service", "sys-kernel-debug.mount", "serial-getty@.service"):
        out = _debugfs(path, f"stat /etc/systemd/system/{unit}")
        assert "Type: symlink" in out and "/dev/null" in out, unit


def test_image_enables_ssh_and_identity(built: tuple[Settings, Path, list[str]]) -> None:
    _, path, _ = built
    wants = _debugfs(path, "ls -l /etc/systemd/system/multi-user.target.wants")
    assert "ssh.service" in wants
    sysinit = _debugfs(path, "ls -l /etc/systemd/system/sysinit.target.wants")
    assert "sbx-identity.service" in sysinit
    dropin = _debugfs(path, "cat /etc/systemd/system/service.d/10-sbx.conf")
    assert "ProtectHostname=no" in dropin
    script = _debugfs(path, "stat /usr/lib/sbx/sbx-identity")
    assert "Mode:  0755" in script


def test_image_leaves_identity_to_the_host(built: tuple[Settings, Path, list[str]]) -> None:
    _, path, _ = built
    mid = _debugfs(path, "stat /etc/machine-id")
    assert "Type: regular" in mid and "Size: 0" in mid
    resolv = _debugfs(path, "stat /etc/resolv.conf")
    assert "Type: regular" in resolv
    ssh_dir = _debugfs(path, "ls /etc/ssh")
    assert "sshd_config" in ssh_dir and "ssh_host_" not in ssh_dir


def test_a_new_build_deletes_images_of_older_recipes_unless_locked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(home=tmp_path)
    images = settings.images_dir
    images.mkdir(parents=True)
    for name in ("old", "busy"):
        (images / f"{name}.ext4").write_bytes(b"image")
        (images / f"{name}.json").write_text("{}")
    monkeypatch.setattr(image, "build_image", lambda target, progress=None: target.write_bytes(b"new"))
    with locks.file_lock(images / "busy.lock"):  # another process building or reading it
        target = image.ensure_image(settings)
    assert target == image.image_path(settings) and target.read_bytes() == b"new"
    assert sorted(p.name for p in images.iterdir()) == sorted(
        ["busy.ext4", "busy.json", "busy.lock", target.name, f"{target.stem}.lock"]
    )
    # an image already there is returned as is, and nothing is pruned
    (images / "older.ext4").write_bytes(b"image")
    assert image.ensure_image(settings) == target and (images / "older.ext4").exists()


def test_prune_leaves_an_image_a_running_node_holds(tmp_path: Path) -> None:
    """Another sbx on this host (an older recipe) holds its image while it runs: a build of a new recipe must not
    delete it from under that node (it would build it again and delete this one in turn)."""
    settings = Settings(home=tmp_path)
    images = settings.images_dir
    images.mkdir(parents=True)
    for name in ("held", "free", "new"):
        (images / f"{name}.ext4").write_bytes(b"image")
    hold = image.hold_image(images / "held.ext4")
    try:
        assert image.prune_images(settings, keep=images / "new.ext4") == [images / "free.ext4"]
        assert (images / "held.ext4").exists()
    finally:
        os.close(hold)
    assert image.prune_images(settings, keep=images / "new.ext4") == [images / "held.ext4"]
    assert sorted(p.name for p in images.iterdir()) == ["new.ext4"]
