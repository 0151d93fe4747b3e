"""The image recipe (sbx.guest.recipe): its hash follows the guest files, its data is consistent, and the guest
package never imports the host side."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sbx.guest import recipe

GUEST_PKG = Path(recipe.__file__).resolve().parent
HOST_SIDE = ("sbx.api", "sbx.cli", "sbx.sdk", "sbx.control", "sbx.node", "sbx.runtime", "sbx.storage", "sbx.config")


@pytest.fixture
def files_copy(tmp_path: Path) -> Path:
    dest = tmp_path / "files"
    shutil.copytree(recipe.files_dir(), dest, symlinks=True)
    return dest


def test_hash_is_stable_and_hex() -> None:
    h = recipe.recipe_hash()
    assert h == recipe.recipe_hash()
    assert len(h) == 64 and all(c in "0123456789abcdef" for c in h)


def test_hash_of_a_copy_equals_the_original(files_copy: Path) -> None:
    assert recipe.recipe_hash(files_copy) == recipe.recipe_hash()


def test_hash_changes_when_a_guest_file_changes(files_copy: Path) -> None:
    before = recipe.recipe_hash(files_copy)
    unit = files_copy / "etc/systemd/system/sbx-identity.service"
    unit.write_text(unit.read_text() + "# changed\n")
    assert recipe.recipe_hash(files_copy) != before


def test_hash_changes_when_a_guest_file_is_added_or_made_executable(files_copy: Path) -> None:
    before = recipe.recipe_hash(files_copy)
    extra = files_copy / "etc/extra.conf"
    extra.write_text("x\n")
    added = recipe.recipe_hash(files_copy)
    assert added != before
    extra.chmod(0o755)
    assert recipe.recipe_hash(files_copy) not in (before, added)


def test_hash_changes_when_the_recipe_data_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    before = recipe.recipe_hash()
    monkeypatch.setattr(recipe, "PACKAGES", (*recipe.PACKAGES, "htop"))
    assert recipe.recipe_hash() != before


def test_every_guest_file_exists_and_every_file_is_installed() -> None:
    from sbx.node.images.layer import MINIMAL_FILES  # what images without systemd get (sbx.guest.minimal)

    root = recipe.files_dir()
    listed = {f.src for f in recipe.GUEST_FILES + MINIMAL_FILES}
    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    assert listed == on_disk
    for f in recipe.GUEST_FILES:
        assert f.dest.startswith("/") and f.dest.endswith(f.src)
        assert 0 <= f.mode <= 0o777


def test_required_units_are_masked() -> None:
    required = {
        "getty@tty1.service",
        "console-getty.service",
        "serial-getty@.service",
        "systemd-udevd.service",
        "systemd-udevd-control.socket",
        "systemd-udevd-kernel.socket",
        "systemd-networkd.service",
        "systemd-resolved.service",
        "systemd-timesyncd.service",
        "sys-kernel-debug.mount",
        "sys-kernel-tracing.mount",
        "sys-fs-fuse-connections.mount",
        "dev-hugepages.mount",
        "sys-kernel-config.mount",
    }
    assert required <= set(recipe.MASKED_UNITS)
    assert not set(recipe.MASKED_UNITS) & set(recipe.ENABLED_UNITS)
    assert "systemd-logind.service" not in recipe.MASKED_UNITS


def test_services_keep_the_uts_namespace_for_criu() -> None:
    text = (recipe.files_dir() / "etc/systemd/system/service.d/10-sbx.conf").read_text()
    assert "[Service]" in text and "ProtectHostname=no" in text


def test_identity_unit_runs_before_ssh_and_is_conditional() -> None:
    text = (recipe.files_dir() / "etc/systemd/system/sbx-identity.service").read_text()
    assert "ConditionPathExists=/etc/sbx/identity" in text
    assert "ssh.service" in text.split("Before=", 1)[1].splitlines()[0]
    assert "ExecStart=/usr/lib/sbx/sbx-identity" in text
    assert "sbx-identity.service" in recipe.ENABLED_UNITS and "ssh.service" in recipe.ENABLED_UNITS


def test_identity_script_is_valid_shell_and_executable() -> None:
    script = recipe.files_dir() / "usr/lib/sbx/sbx-identity"
    assert script.stat().st_mode & 0o111
    subprocess.run(["sh", "-n", str(script)], check=True)
    text = script.read_text()
    assert "ssh-keygen -A" in text and "/var/lib/sbx-guest/identity-applied" in text


def test_user_and_sudoers() -> None:
    assert (recipe.USER.name, recipe.USER.uid, recipe.USER.gid) == ("user", 1000, 1000)
    assert recipe.USER.home == "/home/user" and recipe.USER.shell == "/bin/bash"
    sudoers = next(f for f in recipe.GUEST_FILES if f.dest == "/etc/sudoers.d/user")
    assert sudoers.mode == 0o440
    assert "user ALL=(ALL:ALL) NOPASSWD: ALL" in (recipe.files_dir() / sudoers.src).read_text()


def test_identity_files_left_to_the_host() -> None:
    assert "/etc/ssh/ssh_host_*" in recipe.REMOVE_GLOBS
    assert "/etc/machine-id" in recipe.EMPTY_FILES
    assert recipe.PLAIN_FILES["/etc/resolv.conf"] == ""


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names.append("sbx.guest" + ("." + node.module if node.module else ""))
            elif node.module:
                names.append(node.module)
    return names


def test_guest_source_never_imports_the_host_side() -> None:
    sources = list(GUEST_PKG.rglob("*.py"))
    assert sources
    for path in sources:
        for name in _imports(path):
            assert not name.startswith(HOST_SIDE), f"{path} imports {name}"


def test_importing_the_recipe_loads_no_host_module() -> None:
    code = (
        "import sys, sbx.guest.recipe as r; r.recipe_hash(); "
        f"bad = [m for m in sys.modules if m.startswith({HOST_SIDE!r})]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
