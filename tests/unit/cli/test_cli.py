"""The `sbx` CLI (typer CliRunner) against the real app on a real port with a FakeNode: the seed guides' usage."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sbx.cli.admin import write_client_config
from sbx.cli.main import app
from tests.fakes import LiveServer, fake_settings

runner = CliRunner(mix_stderr=False)


def sbx(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args), catch_exceptions=False)


def new(*args: str) -> str:
    r = sbx("new", "--type", "small", *args)
    assert r.exit_code == 0, r.stderr
    sid = r.stdout.strip()
    assert re.fullmatch(r"sb_[a-z0-9]{10}", sid)
    return sid


def test_new_prints_the_id_and_info_json_works_with_jq_paths(live: LiveServer) -> None:
    sid = new("--name", "aeo-fork-1", "--ttl", "600")
    r = sbx("info", sid, "--json")
    assert r.exit_code == 0
    sb = json.loads(r.stdout)["sandbox"]
    assert (sb["id"], sb["type"], sb["name"], sb["ttl"], sb["state"]) == (sid, "small", "aeo-fork-1", 600, "running")
    human = sbx("info", sid)
    assert human.exit_code == 0 and sid in human.stdout and not human.stdout.lstrip().startswith("{")
    r = sbx("new", "--type", "default", "--json")
    assert json.loads(r.stdout)["sandbox"]["type"] == "default"
    listing = sbx("list")
    assert sid in listing.stdout
    assert len(json.loads(sbx("list", "--json").stdout)["sandboxes"]) == 2


def test_exec_streams_and_exits_with_the_commands_code(live: LiveServer) -> None:
    sid = new()
    r = sbx("exec", sid, "echo out; echo err >&2; exit 137")
    assert (r.exit_code, r.stdout, r.stderr) == (137, "out\n", "err\n")
    r = sbx("exec", sid, "--timeout", "600", "echo options after the id")
    assert (r.exit_code, r.stdout) == (0, "options after the id\n")
    r = sbx("exec", "--timeout", "5", sid, "true")
    assert r.exit_code == 0


def test_exec_timeout_exits_124_with_a_note(live: LiveServer) -> None:
    sid = new()
    r = sbx("exec", sid, "--timeout", "0.3", "echo started; sleep 20")
    assert r.exit_code == 124 and r.stdout == "started\n"
    assert "timed out" in r.stderr


def test_exec_default_timeout_is_30_seconds(live: LiveServer) -> None:
    sid = new()
    assert sbx("exec", sid, "true").exit_code == 0
    assert [c[2]["timeout"] for c in live.node.calls if c[0] == "exec"][-1] == 30.0


def test_exec_detach_jobs_logs_wait(live: LiveServer) -> None:
    sid = new()
    r = sbx("exec", sid, "--detach", "echo bg; exit 5")
    job = r.stdout.strip()
    assert r.exit_code == 0 and job.startswith("job_")
    assert sbx("wait", sid, job).exit_code == 5
    assert sbx("logs", sid, job).stdout == "bg\n"
    assert job in sbx("jobs", sid).stdout


def test_the_grow_loop_commands(live: LiveServer) -> None:
    """grow.sh: stop --wait, resume --type (no wait) and at once exec and info --json."""
    sid = new()
    assert sbx("stop", sid, "--wait").exit_code == 0
    assert json.loads(sbx("info", sid, "--json").stdout)["sandbox"]["state"] == "stopped"
    assert sbx("resume", sid, "--type", "default").exit_code == 0
    info = json.loads(sbx("info", sid, "--json").stdout)["sandbox"]
    assert {k: info[k] for k in ("type", "memoryGB", "memoryRestored", "resumeReason")} == {
        "type": "default", "memoryGB": 0.5, "memoryRestored": False, "resumeReason": "resized"}
    r = sbx("exec", sid, "--timeout", "600", "echo resumed")
    assert (r.exit_code, r.stdout) == (0, "resumed\n")


def test_resume_flags_and_errors(live: LiveServer) -> None:
    sid = new()
    sbx("stop", sid, "--wait")
    r = sbx("resume", sid, "--type", "large", "--require-memory")
    assert r.exit_code == 1
    assert r.stderr.strip().startswith("error: invalid_require_memory: ")
    r = sbx("resume", sid, "--require-memory", "--ttl", "99", "--wait", "--json")
    sb = json.loads(r.stdout)["sandbox"]
    assert (sb["state"], sb["memoryRestored"], sb["ttl"]) == ("running", True, 99)
    sbx("stop", sid, "--wait")
    sbx("resume", sid, "--type", "default", "--wait")
    r = sbx("stop", sid, "--wait")
    r = sbx("resume", sid, "--type", "small")
    assert r.exit_code == 1 and r.stderr.startswith("error: invalid_resize: ")


def test_fork_wait_json_streams_the_seed_event_lines(live: LiveServer) -> None:
    src = new("--name", "aeo")
    sbx("stop", src, "--wait")
    r = sbx("fork", src, "--type", "default", "--ttl", "1800", "--wait", "--json")
    assert r.exit_code == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["event"], x.get("state")) for x in lines] == [
        ("forking", None), ("state", "provisioning"), ("ready", "ready")]
    assert set(lines[0]) == {"event", "id", "source", "sandbox"} and lines[0]["source"] == src
    assert set(lines[1]) == {"event", "id", "state"}
    ready = lines[-1]
    assert (ready["sandbox"]["type"], ready["sandbox"]["memoryGB"], ready["sandbox"]["memoryRestored"]) == (
        "default", 0.5, None)
    assert ready["url"].startswith("https://")
    fork = json.loads(sbx("info", ready["id"], "--json").stdout)["sandbox"]
    assert (fork["name"], fork["ttl"]) == ("aeo (fork)", 1800)
    src_now = json.loads(sbx("info", src, "--json").stdout)["sandbox"]
    assert (src_now["state"], src_now["type"]) == ("stopped", "small")


def test_fork_without_wait_prints_the_new_id_at_once(live: LiveServer) -> None:
    src = new()
    r = sbx("fork", src, "--name", "mine")
    assert r.exit_code == 0 and re.fullmatch(r"sb_[a-z0-9]{10}\n", r.stdout) and r.stdout.strip() != src


def test_snapshot_verbs_and_new_from(live: LiveServer) -> None:
    sid = new()
    sbx("exec", sid, "echo kept > ~/f")
    assert sbx("snapshot", sid, "my-stack").stdout.strip() == "my-stack"
    r = sbx("snapshot", sid, "my-stack")
    assert r.exit_code == 1 and r.stderr.startswith("error: snapshot_exists: ")
    r = sbx("snapshot", sid, "bad name!")
    assert r.exit_code == 1 and r.stderr.startswith("error: invalid_snapshot_name: ")
    assert "my-stack" in sbx("snapshots").stdout
    assert [s["name"] for s in json.loads(sbx("snapshots", sid, "--json").stdout)["snapshots"]] == ["my-stack"]
    copy = new("--from", "my-stack")
    assert sbx("exec", copy, "cat ~/f").stdout == "kept\n"
    assert sbx("snapshot-delete", "my-stack").exit_code == 0
    r = sbx("snapshot-delete", "my-stack")
    assert r.exit_code == 1 and r.stderr.startswith("error: not_found: ")


def test_no_snapshots_flag(live: LiveServer) -> None:
    sid = new("--no-snapshots")
    r = sbx("fork", sid)
    assert r.exit_code == 1 and r.stderr.startswith("error: snapshots_disabled: ")


def test_delete_and_error_exits(live: LiveServer) -> None:
    sid = new()
    assert sbx("delete", sid, "--wait").exit_code == 0
    r = sbx("info", sid)
    assert (r.exit_code, r.stderr.strip()) == (1, f"error: not_found: sandbox {sid} not found")
    r = sbx("new", "--type", "huge")
    assert r.exit_code == 1 and r.stderr.startswith("error: invalid_type: ")


def test_usage_errors_exit_2(live: LiveServer) -> None:
    assert sbx("exec").exit_code == 2
    assert sbx("new", "--ttl", "soon").exit_code == 2
    assert sbx("bogus-verb").exit_code == 2


def test_wrong_token_is_reported(live: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SBX_TOKEN", "nope")
    r = sbx("list")
    assert r.exit_code == 1 and r.stderr.startswith("error: unauthorized: ")


def test_server_writes_the_client_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    settings = fake_settings(tmp_path, port=7123)
    write_client_config(settings, "tok")
    path = tmp_path / ".config" / "sbx" / "config.toml"
    assert tomllib.loads(path.read_text()) == {"url": "http://127.0.0.1:7123", "token": "tok"}
    assert path.stat().st_mode & 0o777 == 0o600


def test_doctor_prints_checks_and_fails_when_one_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import sbx.node.host.setup as hs

    checks = [hs.Check("runc", True, "1.1.5", ""), hs.Check("criu", False, "missing", "run `sbx setup`")]
    monkeypatch.setattr(hs, "doctor", lambda settings: checks)
    r = sbx("doctor", "--json")
    assert r.exit_code == 1
    assert json.loads(r.stdout)["checks"][1] == {"name": "criu", "ok": False, "detail": "missing",
                                                 "fix": "run `sbx setup`"}
    human = sbx("doctor")
    assert "FAIL" in human.stdout and "run `sbx setup`" in human.stdout


def test_setup_reports_a_host_failure_as_an_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import sbx.node.host.setup as hs

    def boom(settings, progress=None):  # type: ignore[no-untyped-def]
        progress("step one")
        raise hs.HostSetupError("no mirror found")

    monkeypatch.setattr(hs, "setup_host", boom)
    r = sbx("setup")
    assert r.exit_code == 1
    assert "step one" in r.stderr and "error: host_setup_failed: no mirror found" in r.stderr


def test_a_negative_ttl_is_an_invalid_ttl_error(live: LiveServer) -> None:
    r = sbx("new", "--ttl", "-5")
    assert r.exit_code == 1 and r.stderr.startswith("error: invalid_ttl: "), r.stderr


def test_stopping_a_no_snapshots_sandbox_says_it_cannot_come_back(live: LiveServer) -> None:
    sid = new("--no-snapshots")
    r = sbx("stop", sid, "--wait")
    assert r.exit_code == 0 and r.stdout.strip() == f"{sid} stopped"
    assert "cannot be resumed" in r.stderr and f"sbx delete {sid}" in r.stderr
    assert json.loads(sbx("info", sid, "--json").stdout)["sandbox"]["noSnapshots"] is True
    plain = new()
    assert sbx("stop", plain, "--wait").stderr == ""


def test_piped_tables_are_not_cut_at_80_columns(live: LiveServer) -> None:
    name = "a-long-name-" + "x" * 90
    sid = new("--name", name)
    listing = sbx("list").stdout
    row = next(line for line in listing.splitlines() if sid in line)
    assert name in row and "…" not in listing


def test_labels_filter_the_list_and_jobs_can_be_killed(live: LiveServer) -> None:
    ml = new("--label", "team=ml", "--label", "tier=gpu")
    web = new("--label", "team=web")
    r = sbx("list", "--label", "team=ml", "--json")
    assert r.exit_code == 0 and [s["id"] for s in json.loads(r.stdout)["sandboxes"]] == [ml]
    assert json.loads(sbx("info", web, "--json").stdout)["sandbox"]["labels"] == {"team": "web"}
    assert sbx("list", "--label", "nolabel").exit_code == 2  # KEY=VALUE or a usage error
    job = sbx("exec", ml, "--detach", "--env", "A=b", "sleep 60").stdout.strip()
    r = sbx("kill", ml, job)
    assert r.exit_code == 0 and r.stdout.strip() == f"{job} exit 137"
