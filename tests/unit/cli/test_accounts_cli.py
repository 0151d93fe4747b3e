"""Issue 12 from the CLI (typer CliRunner) against the real app with a FakeNode: `sbx admin account|key`,
`sbx plan`, `sbx usage`, and the cost line of `sbx info`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sbx.cli.main import app
from tests.fakes import LiveServer

runner = CliRunner(mix_stderr=False)


def sbx(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args), catch_exceptions=False)


def test_admin_account_and_key_commands_then_the_new_key_works(live: LiveServer,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    r = sbx("admin", "account", "create", "alice", "--plan", "trial", "--json")
    assert r.exit_code == 0, r.stderr
    made = json.loads(r.stdout)
    acct, token = made["account"]["id"], made["key"]["token"]
    human = sbx("admin", "account", "list")
    assert "alice" in human.stdout and "trial" in human.stdout
    r = sbx("admin", "key", "create", acct, "--name", "ci", "--expires-in", "3600")
    assert r.exit_code == 0 and "sbx_" in r.stdout and "shown only once" in r.stderr
    keys = json.loads(sbx("admin", "key", "list", acct, "--json").stdout)["keys"]
    assert [k["name"] for k in keys] == ["default", "ci"]
    monkeypatch.setenv("SBX_TOKEN", token)
    r = sbx("new", "--type", "xlarge")
    assert r.exit_code == 1 and "plan_limit" in r.stderr and "team plan allows it" in r.stderr
    plan = sbx("plan")
    assert plan.exit_code == 0 and "trial" in plan.stdout and "small, default" in plan.stdout
    assert sbx("admin", "account", "list").stderr.startswith("error: admin_only")
    monkeypatch.setenv("SBX_TOKEN", live.token)
    assert sbx("admin", "key", "revoke", keys[0]["id"]).exit_code == 0
    monkeypatch.setenv("SBX_TOKEN", token)
    assert sbx("list").stderr.startswith("error: unauthorized")


def test_usage_and_info_show_cost(live: LiveServer) -> None:
    sid = sbx("new", "--type", "small").stdout.strip()
    r = sbx("usage", "--by", "sandbox", "--json")
    rep = json.loads(r.stdout)
    assert [g["key"] for g in rep["groups"]] == [sid] and rep["currency"] == "USD"
    human = sbx("usage", "--by", "size")
    assert human.exit_code == 0 and "small" in human.stdout and "total" in human.stdout
    info = sbx("info", sid)
    assert "cost so far" in info.stdout
    assert sbx("usage", "--by", "week").exit_code == 2
