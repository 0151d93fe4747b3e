"""`sbx cp`, `sbx host`/`unhost`, `sbx ssh` and `sbx exec -t` (typer CliRunner) against the real app on a real port
with a FakeNode that can spawn (see test_files_ports.py); plus the local tar safety of `sbx cp`."""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sbx.cli.files import _safe_members, parse_remote
from sbx.cli.main import app
from tests.fakes import LiveServer, serve_live
from tests.unit.api.test_files_ports import SpawnNode

runner = CliRunner(mix_stderr=False)


def sbx(*args: str, input: bytes | None = None):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args), catch_exceptions=False, input=input)


@pytest.fixture
def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveServer]:
    monkeypatch.setattr("tests.fakes.FakeNode", SpawnNode)
    yield from serve_live(tmp_path, monkeypatch)


def new() -> str:
    r = sbx("new")
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


def test_parse_remote() -> None:
    assert parse_remote("sb_abcdefghij:~/x") == ("sb_abcdefghij", "~/x")
    assert parse_remote("sb_abcdefghij:") == ("sb_abcdefghij", "~")
    assert parse_remote("./sb_abcdefghij:x") is None and parse_remote("/tmp/a") is None


def test_cp_files_and_folders_both_ways(live: LiveServer, tmp_path: Path) -> None:
    sid = new()
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(2_500_000))
    assert sbx("cp", str(src), f"{sid}:data/src.bin").exit_code == 0
    assert (live.node.root / sid / "data" / "src.bin").read_bytes() == src.read_bytes()
    assert sbx("cp", str(src), f"{sid}:data").exit_code == 0  # onto a folder: inside it
    assert (live.node.root / sid / "data" / "src.bin").exists()
    out = tmp_path / "out"
    out.mkdir()
    assert sbx("cp", f"{sid}:data/src.bin", str(out)).exit_code == 0
    assert (out / "src.bin").read_bytes() == src.read_bytes()
    r = sbx("cp", f"{sid}:data/src.bin", "-")
    assert r.stdout_bytes == src.read_bytes()

    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f").write_text("deep")
    (tree / "top").write_text("top")
    os.symlink("top", tree / "link")
    assert sbx("cp", str(tree), f"{sid}:copied").exit_code == 0
    assert (live.node.root / sid / "copied" / "a" / "b" / "f").read_text() == "deep"
    assert os.readlink(live.node.root / sid / "copied" / "link") == "top"
    back = tmp_path / "back"
    assert sbx("cp", f"{sid}:copied", str(back)).exit_code == 0
    assert (back / "a" / "b" / "f").read_text() == "deep" and (back / "top").read_text() == "top"


def test_cp_errors(live: LiveServer, tmp_path: Path) -> None:
    sid = new()
    r = sbx("cp", str(tmp_path), str(tmp_path))
    assert r.exit_code == 1 and r.stderr.startswith("error: invalid_request: ")
    r = sbx("cp", f"{sid}:nope", str(tmp_path / "x"))
    assert r.exit_code == 1 and r.stderr.startswith("error: not_found: ")
    r = sbx("cp", str(tmp_path / "missing"), f"{sid}:x")
    assert r.exit_code == 1 and r.stderr.startswith("error: not_found: ")


def test_local_extraction_refuses_members_outside_the_target(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        def add(name: str, data: bytes = b"x", **kw: object) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            for k, v in kw.items():
                setattr(info, k, v)
            tf.addfile(info, io.BytesIO(data) if info.isfile() else None)

        add("./ok")
        add("../escape")
        add("/abs")
        add("./esc-link", type=tarfile.SYMTYPE, linkname=str(tmp_path), size=0)
        add("./esc-link/through")
        add("./hard", type=tarfile.LNKTYPE, linkname="/etc/passwd", size=0)
        add("./dev", type=tarfile.CHRTYPE, size=0)
    dest = tmp_path / "dest"
    dest.mkdir()
    buf.seek(0)
    with tarfile.open(fileobj=buf, mode="r|") as tf:
        tf.extractall(str(dest), members=_safe_members(tf, dest))
    assert sorted(p.name for p in dest.iterdir()) == ["esc-link", "ok"]
    assert not (tmp_path / "escape").exists() and not (tmp_path / "through").exists()


def test_host_and_unhost(live: LiveServer) -> None:
    sid = new()
    r = sbx("host", sid, "8000")
    assert r.exit_code == 0
    url, token = r.stdout.splitlines()
    assert url.startswith("https://8000-") and url.endswith(".sbx.localhost") and token.startswith("token: sbxr_")
    r = sbx("host", sid, "3000", "--public", "--json")
    assert json.loads(r.stdout)["route"]["public"] is True
    r = sbx("host", sid)
    assert r.exit_code == 0 and "8000" in r.stdout and "3000" in r.stdout and "public" in r.stdout
    assert sbx("unhost", sid, "3000").exit_code == 0
    assert [x["port"] for x in json.loads(sbx("host", sid, "--json").stdout)["routes"]] == [8000]
    r = sbx("unhost", sid, "3000")
    assert r.exit_code == 1 and r.stderr.startswith("error: not_found: ")
    assert sbx("host", sid, "0").exit_code == 2


def test_new_auto_resume(live: LiveServer) -> None:
    r = sbx("new", "--auto-resume", "--json")
    assert json.loads(r.stdout)["sandbox"]["autoResume"] is True


def test_ssh_and_exec_tty(live: LiveServer) -> None:
    sid = new()
    r = sbx("ssh", sid, "--", "test -t 1 && echo in-a-tty; exit 5")
    assert r.exit_code == 5 and r.stdout.strip() == "in-a-tty"
    r = sbx("exec", "-t", sid, "echo", "$GREETING", "-e", "GREETING=hi")
    assert r.exit_code == 0 and r.stdout.strip() == "hi"
    r = sbx("ssh", "sb_0000000000", "--", "true")
    assert r.exit_code == 1 and r.stderr.startswith("error: not_found: ")
