"""`sbx ca` (issue 35) from the CLI (typer CliRunner): init makes the CA and the server's certificate once, issue
writes a node's folder naming its hosts, show lists both, a roll trusts two CAs until finish-rotation, and the
errors are stable codes with exit 1 (a second init, issue without a CA, a bad name)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sbx.cli.main import app

runner = CliRunner(mix_stderr=False)


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SBX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("SBX_NODE_TLS_DIR", raising=False)
    return tmp_path / "state"


def sbx(*args: str) -> tuple[int, str, str]:
    r = runner.invoke(app, list(args), catch_exceptions=False)
    return r.exit_code, r.stdout, r.stderr


def test_init_issue_show_and_a_roll(state: Path, tmp_path: Path) -> None:
    code, _, err = sbx("ca", "issue", "node1", "--out", str(tmp_path / "n1"))
    assert code == 1 and err.startswith("error: no_ca:")
    assert sbx("ca", "init")[0] == 0
    folder = state / "tls"
    assert stat.S_IMODE((folder / "ca.key").stat().st_mode) == 0o600
    code, _, err = sbx("ca", "init")
    assert code == 1 and err.startswith("error: ca_exists:")
    code, _, err = sbx("ca", "issue", "node1", "--host", "10.0.0.3", "--host", "n1.example", "--out",
                       str(tmp_path / "n1"))
    assert code == 0 and "node1: certificate" in err
    assert stat.S_IMODE((tmp_path / "n1" / "key.pem").stat().st_mode) == 0o600
    code, _, err = sbx("ca", "issue", "bad/name", "--out", str(tmp_path / "bad"))
    assert code == 1 and err.startswith("error: invalid_name:")
    code, out, _ = sbx("ca", "show", "--dir", str(tmp_path / "n1"), "--json")
    shown = json.loads(out)["certificates"]
    assert [(c["file"], c["hosts"]) for c in shown] == [("ca.crt", ""), ("cert.pem", "10.0.0.3,n1.example")]
    assert shown[1]["subject"] == "CN=node1,O=sbx"
    assert sbx("ca", "rotate")[0] == 0
    assert len(json.loads(sbx("ca", "show", "--json")[1])["certificates"]) == 3  # two CAs trusted, one server
    assert sbx("ca", "finish-rotation")[0] == 0
    after = json.loads(sbx("ca", "show", "--json")[1])["certificates"]
    assert len(after) == 2 and after[1]["issuer"] == after[0]["subject"]  # the server's, under the new CA
    assert not (folder / "ca-old.key").exists()
