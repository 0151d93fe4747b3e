"""The ``sbx`` entry point's fast path (:mod:`sbx.cli.fast`): which command lines it serves itself and which go to
the typer app unchanged, and that it never loads typer, rich or httpx for the ones it serves."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sbx.cli.fast import _Fallback, parse_exec


def test_plain_exec_calls_are_parsed_with_the_verbs_defaults() -> None:
    assert parse_exec(["exec", "sb_1", "echo", "hi"]) == {
        "id": "sb_1", "command": "echo hi", "timeout": None, "user": "user", "env": None, "cwd": None}
    assert parse_exec(["exec", "--timeout", "5", "sb_1", "true", "--user", "root", "-e", "A=1=2", "--cwd", "/tmp",
                       "-u", "root"]) == {
        "id": "sb_1", "command": "true", "timeout": 5.0, "user": "root", "env": {"A": "1=2"}, "cwd": "/tmp"}


@pytest.mark.parametrize("argv", [
    [], ["exec"], ["exec", "sb_1"], ["list"], ["exec", "sb_1", "echo", "-n", "hi"], ["exec", "sb_1", "--", "ls"],
    ["exec", "sb_1", "true", "--json"], ["exec", "-d", "sb_1", "true"], ["exec", "sb_1", "true", "--tty"],
    ["exec", "sb_1", "true", "--help"], ["exec", "sb_1", "true", "--timeout"], ["exec", "sb_1", "x", "--timeout", "-1"],
    ["exec", "sb_1", "x", "--timeout", "inf"], ["exec", "sb_1", "x", "--timeout", "abc"],
    ["exec", "sb_1", "x", "--env", "NOEQ"], ["exec", "sb_1", "x", "--timeout=5"], ["exec", "sb/../x", "true"],
])
def test_everything_else_goes_to_the_full_cli(argv: list[str]) -> None:
    with pytest.raises(_Fallback):
        parse_exec(argv)


def test_the_fast_path_loads_no_heavy_module() -> None:
    code = ("import sys; from sbx.cli import fast; fast.parse_exec(['exec', 'sb_1', 'true']); "
            "import sbx.sdk.protocol, sbx.sdk.config; "
            "print(sorted(m for m in ('typer', 'rich', 'httpx', 'click') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
