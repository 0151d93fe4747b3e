"""The import-linter contracts in pyproject.toml hold for the tree, and fail when a lower layer imports an upper
one or the in-sandbox side imports the host side (checked on a copy of the tree with one bad import added)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = str(Path(sys.executable).parent / "lint-imports")


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([LINT, "--config", str(tree / "pyproject.toml"), "--no-cache"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "sbx", tmp_path / "sbx", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_tree_keeps_its_contracts(tree: Path) -> None:
    r = _lint(tree)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 kept, 0 broken" in r.stdout


@pytest.mark.parametrize(
    ("module", "imports", "contract"),
    [
        ("sbx/storage/upward.py", "import sbx.api.app", "Layers point down"),
        ("sbx/runtime/upward.py", "from sbx.control import service", "Layers point down"),
        ("sbx/guest/hostside.py", "import sbx.node.agent", "never imports the host side"),
    ],
)
def test_a_bad_import_breaks_a_contract(tree: Path, module: str, imports: str, contract: str) -> None:
    (tree / module).write_text(f'"""A deliberate violation."""\n{imports}  # noqa: F401\n')
    r = _lint(tree)
    assert r.returncode != 0
    assert "1 broken" in r.stdout and contract in r.stdout
