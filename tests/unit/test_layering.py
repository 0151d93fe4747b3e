"""The import-linter contracts in pyproject.toml hold for the tree, and fail when a lower layer imports an upper
one (between the packages, or between the rooms of control or of the node), accounts import nodes or sandbox
operations, the in-sandbox side imports the host side, or node code run outside the node process imports sbx (checked
on a copy of the tree with one bad import added)."""

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
    assert "0 broken" in r.stdout and "BROKEN" not in r.stdout


@pytest.mark.parametrize(
    ("module", "imports", "contract"),
    [
        ("sbx/storage/upward.py", "import sbx.api.app", "Layers point down"),
        ("sbx/runtime/upward.py", "from sbx.control import service", "Layers point down"),
        ("sbx/guest/hostside.py", "import sbx.node.agent", "never imports the host side"),
        ("sbx/node/container/upward.py", "import sbx.node.agentbase", "Node layers"),
        ("sbx/node/network/upward.py", "from sbx.node.lifecycle import containers", "Node layers"),
        ("sbx/node/network/sideways.py", "from sbx.node.host import aptsources", "Node layers"),
        ("sbx/node/memory/sideways.py", "from sbx.node.migration import outgoing", "Node layers"),
        ("sbx/node/migration/served.py", "from sbx.node.remote import server", "Node layers"),
        ("sbx/node/network/hookclient.py", "import sbx.config", "run outside the node process"),
        ("sbx/node/network/egressaddon.py", "from sbx.node.network import bridge", "run outside the node process"),
        ("sbx/metrics.py", "import sbx.config", "Metrics and logs"),
        ("sbx/logs.py", "from sbx.storage import mounts", "Metrics and logs"),
    ],
)
def test_a_bad_import_breaks_a_contract(tree: Path, module: str, imports: str, contract: str) -> None:
    (tree / module).write_text(f'"""A deliberate violation."""\n{imports}  # noqa: F401\n')
    r = _lint(tree)
    assert r.returncode != 0
    assert "1 broken" in r.stdout and contract in r.stdout


GLOBAL = "Layers point down: api/cli/sdk > control > node > runtime > storage"
CONTROL = "Control layers: reaper > service > sandboxes > cluster > accounts | secrets > store > errors"
ACCOUNTS = "Accounts (keys, plans, prices, usage) know no node and no sandbox operation"
TYPED_PLANE = "import typing\nif typing.TYPE_CHECKING:\n    from sbx.control.service import ControlPlane"


def test_the_control_contracts_are_declared(tree: Path) -> None:
    r = _lint(tree)
    assert f"{CONTROL} KEPT" in r.stdout and f"{ACCOUNTS} KEPT" in r.stdout, r.stdout


@pytest.mark.parametrize(
    ("module", "imports", "broken"),
    [
        # each layer of control, imported from below (a TYPE_CHECKING import counts: a type is a dependency)
        ("sbx/control/service.py", "from sbx.control import reaper", {CONTROL}),
        ("sbx/control/sandboxes/routes.py", TYPED_PLANE, {CONTROL}),
        ("sbx/control/cluster/orphans.py", TYPED_PLANE, {CONTROL}),
        ("sbx/control/cluster/drain.py", "from sbx.control.sandboxes.migrating import MigrateOps", {CONTROL}),
        ("sbx/control/secrets/nodes.py", "from sbx.control.cluster.router import NodeRouter", {CONTROL}),
        ("sbx/control/store/state.py", "from sbx.control.cluster import placement", {CONTROL}),
        ("sbx/control/errors.py", "from sbx.control.store import database", {CONTROL}),
        # accounts and secrets are independent of each other
        ("sbx/control/secrets/rules.py", "from sbx.control.accounts import plans", {CONTROL}),
        ("sbx/control/accounts/plans.py", "from sbx.control.secrets import rules", {CONTROL}),
        # accounts know no node and no sandbox operation
        ("sbx/control/accounts/pricing.py", "from sbx.node import types", {ACCOUNTS}),
        ("sbx/control/accounts/metering.py", "from sbx.control.cluster import capacity", {CONTROL, ACCOUNTS}),
        # nothing in control imports the API or the CLI (the package layers say so; through sbx.api.app the cluster
        # would also reach the plane)
        ("sbx/control/store/ids.py", "import sbx.cli", {GLOBAL}),
        ("sbx/control/cluster/trim.py", "import sbx.api.app", {GLOBAL, CONTROL}),
    ],
)
def test_a_bad_import_in_control_breaks_its_contract(tree: Path, module: str, imports: str, broken: set[str]) -> None:
    with (tree / module).open("a") as f:
        f.write(f"\n{imports}  # noqa: F401\n")
    r = _lint(tree)
    assert r.returncode != 0
    assert {line.removesuffix(" BROKEN") for line in r.stdout.splitlines() if line.endswith(" BROKEN")} == broken, \
        r.stdout


def test_out_of_process_modules_are_forbidden_every_other_sbx_module() -> None:
    """The forbidden contract for the OCI hook client and the egress proxy addon lists the rest of ``sbx`` by name
    (import-linter refuses a forbidden package that holds the source): a module added beside them must be named too."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    contract = next(c for c in config if "run outside the node process" in c["name"])
    sources = set(contract["source_modules"])
    want = set()
    for parent in ("sbx", "sbx.node", "sbx.node.network"):
        folder = ROOT.joinpath(*parent.split("."))
        for p in folder.iterdir():
            if p.name == "__pycache__" or p.name.startswith("__init__") or not (p.suffix == ".py" or p.is_dir()):
                continue
            name = f"{parent}.{p.stem}"
            if not any(s == name or s.startswith(name + ".") for s in sources):
                want.add(name)
    assert set(contract["forbidden_modules"]) == want
