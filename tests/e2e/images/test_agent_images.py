"""The ready images of ``images/`` (issue 32), built as the README says and checked in a sandbox of each: Claude
Code and Codex answer ``--version``, the Python data image imports pandas and draws a plot. Their base is
``FROM sbx-debian``, sbx's own image, so this also checks that base and npm reaching its registry from a RUN step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import Server

RECIPES = Path(__file__).resolve().parents[3] / "images"


def ok(srv: Server, *args: str, timeout: float = 1500) -> str:
    return srv.sbx(*args, timeout=timeout, check=True).stdout


@pytest.mark.parametrize(("name", "check", "want"), [
    ("claude-code", "claude --version", "(Claude Code)"),
    ("codex", "codex --version", "codex-cli"),
    ("python-data", "python3 -c 'import pandas, matplotlib.pyplot as p; p.plot([1, 2]); p.savefig(\"/tmp/p.png\"); "
                    "print(\"pandas\", pandas.__version__)' && test -s /tmp/p.png", "pandas 1."),
])
def test_a_ready_image_builds_and_its_tool_runs(server: Server, name: str, check: str, want: str) -> None:
    ok(server, "image", "build", str(RECIPES / name), "--name", name)
    r = server.sbx("new", "--image", name)  # the test profile's small disk is 2 GiB: an image may not fit
    if r.returncode != 0:
        assert "image_too_large" in r.stderr and "pick a larger type" in r.stderr, r.stderr
        r = server.sbx("new", "--image", name, "--type", "default", check=True)
    sid = r.stdout.strip()
    try:
        out = ok(server, "exec", sid, check)
        assert want in out, out
    finally:
        ok(server, "delete", sid, "--wait")  # an image is in use until its sandboxes are gone
        ok(server, "image", "delete", name)
