"""`sbx admin account suspend|resume|delete` (typer CliRunner) against the real app on a real port with a FakeNode
(issue 36): what the admin types and sees, and the errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sbx.cli.main import app
from tests.fakes import LiveServer, serve_live

runner = CliRunner(mix_stderr=False)


def sbx(*args: str, input: str | None = None):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args), catch_exceptions=False, input=input)


@pytest.fixture
def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveServer]:
    yield from serve_live(tmp_path, monkeypatch)


def test_suspend_resume_delete_verbs(live: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    made = json.loads(sbx("admin", "account", "create", "gina", "--plan", "team", "--json").stdout)
    acct, token = made["account"]["id"], made["key"]["token"]
    monkeypatch.setenv("SBX_TOKEN", token)
    sid = sbx("new").stdout.strip()
    monkeypatch.setenv("SBX_TOKEN", live.token)
    r = sbx("admin", "account", "suspend", acct)
    assert r.exit_code == 0 and r.stderr.strip() == f"{acct} (gina) suspended; stopping 1 sandboxes with memory: {sid}"
    assert "suspended" in sbx("admin", "account", "list").stdout
    monkeypatch.setenv("SBX_TOKEN", token)
    r = sbx("list")
    assert r.exit_code == 1 and r.stderr.startswith("error: account_suspended: ")
    monkeypatch.setenv("SBX_TOKEN", live.token)
    r = sbx("admin", "account", "resume", acct)
    assert r.exit_code == 0 and r.stderr.strip() == f"{acct} (gina) is active"
    r = sbx("admin", "account", "delete", acct, input="n\n")  # asks first; no: nothing happens
    assert r.exit_code == 1 and "delete account" in r.stdout
    assert json.loads(sbx("admin", "account", "list", "--json").stdout)["accounts"][-1]["state"] == "active"
    r = sbx("admin", "account", "delete", acct, "--yes")
    assert r.exit_code == 0 and r.stderr.strip() == f"{acct} (gina) deleted; 1 sandboxes removed", r.stderr
    monkeypatch.setenv("SBX_TOKEN", token)
    r = sbx("list")
    assert r.exit_code == 1 and r.stderr.startswith("error: unauthorized: ")
    monkeypatch.setenv("SBX_TOKEN", live.token)
    r = sbx("admin", "account", "suspend", acct)
    assert r.exit_code == 1 and r.stderr.startswith("error: account_deleted: ")
    for verb in ("suspend", "resume"):
        r = sbx("admin", "account", verb, "acct_default")
        assert r.exit_code == 1 and r.stderr.startswith("error: protected_account: ")
    r = sbx("admin", "account", "delete", "acct_nope", "--yes")
    assert r.exit_code == 1 and r.stderr.startswith("error: not_found: ")
