"""Issue 31 end to end: E2B's own Python SDK (the pinned ``e2b`` package, unmodified) drives a real sbx server and
real sandboxes through ``E2B_API_URL=<server>/e2b`` and ``E2B_SANDBOX_URL=<server>``: create, commands (output,
exit codes, a background process), files, pause (= stop with memory) and connect (= resume, the same process still
running), kill; stdin, a terminal, a watcher, a signed URL and a call deadline; a second account's key sees none
of it; bad input gets E2B's error shape, never a 5xx."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server

e2b = pytest.importorskip("e2b")

pytestmark = pytest.mark.e2e


@pytest.fixture
def e2b_env(server: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """The two URLs and the key, as a user of the SDK sets them."""
    monkeypatch.setenv("E2B_API_URL", server.url + "/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", server.url)
    monkeypatch.setenv("E2B_API_KEY", server.token)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    yield server


def _second_key(server: Server) -> str:
    made = json.loads(server.sbx("admin", "account", "create", f"e2b-other-{time.time_ns()}", "--plan", "team",
                                 "--json", check=True).stdout)
    return str(made["key"]["token"])


def test_the_e2b_sdk_creates_runs_writes_pauses_resumes_and_kills(e2b_env: Server) -> None:
    from e2b import CommandExitException, Sandbox, SandboxQuery, SandboxState

    sbx = Sandbox.create(timeout=600, metadata={"suite": "e2b"}, envs={"GREETING": "hi there"})
    try:
        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id and info.metadata == {"suite": "e2b"}
        assert info.state == SandboxState.RUNNING

        out: list[str] = []
        r = sbx.commands.run('echo "$GREETING"; echo to-err >&2; id -un; pwd', on_stdout=out.append)
        assert r.exit_code == 0
        assert r.stdout == "hi there\nuser\n/home/user\n" and r.stderr == "to-err\n"
        assert "".join(out) == r.stdout
        assert sbx.commands.run("echo $X", envs={"X": "42"}, cwd="/tmp").stdout == "42\n"
        with pytest.raises(CommandExitException) as failed:
            sbx.commands.run("echo bad >&2; exit 3")
        assert failed.value.exit_code == 3 and failed.value.stderr == "bad\n"

        bg = sbx.commands.run("python3 -u -c 'import time\nwhile True: print(\"tick\"); time.sleep(0.5)'",
                              background=True)
        assert bg.pid > 1
        assert sbx.commands.run(f"kill -0 {bg.pid} && echo alive").stdout == "alive\n"  # a pid of the sandbox's
        assert bg.pid in [p.pid for p in sbx.commands.list()]

        sbx.files.write("notes/hello.txt", "hello from e2b\n")
        assert sbx.files.read("notes/hello.txt") == "hello from e2b\n"
        assert sbx.files.read("/home/user/notes/hello.txt", format="bytes") == b"hello from e2b\n"
        names = {e.name: e for e in sbx.files.list("/home/user/notes")}
        assert set(names) == {"hello.txt"} and names["hello.txt"].size == 15
        assert sbx.commands.run("stat -c '%U %a' notes/hello.txt").stdout == "user 644\n"
        assert sbx.files.make_dir("/home/user/d1/d2") is True
        assert sbx.files.make_dir("/home/user/d1/d2") is False
        assert sbx.files.exists("/home/user/d1/d2") and not sbx.files.exists("/home/user/nope")
        moved = sbx.files.rename("/home/user/notes/hello.txt", "/home/user/d1/moved.txt")
        assert moved.path == "/home/user/d1/moved.txt"
        sbx.files.remove("/home/user/d1")
        assert not sbx.files.exists("/home/user/d1")

        assert sbx.pause() is True
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert sbx.sandbox_id in [s.sandbox_id for s in paused]
        assert not sbx.is_running()

        again = Sandbox.connect(sbx.sandbox_id)
        assert again.is_running()
        assert again.commands.run(f"kill -0 {bg.pid} && echo still-alive").stdout == "still-alive\n"
        assert bg.pid in [p.pid for p in again.commands.list()]
        follow = again.commands.connect(bg.pid)
        assert again.commands.kill(bg.pid) is True
        with pytest.raises(CommandExitException):
            follow.wait()
        assert bg.pid not in [p.pid for p in again.commands.list()]
    finally:
        assert sbx.kill() is True
    assert Sandbox.kill(sbx.sandbox_id) is False
    assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]


def test_stdin_terminals_watchers_signed_urls_and_deadlines(e2b_env: Server) -> None:
    from e2b import Sandbox, TimeoutException
    from e2b.sandbox.commands.command_handle import PtySize
    from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

    sbx = Sandbox.create(timeout=300)
    try:
        cat = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(cat.pid, "hello through stdin\n")
        sbx.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "hello through stdin\n"

        seen: list[bytes] = []
        term = sbx.pty.create(PtySize(rows=24, cols=100))
        sbx.pty.send_stdin(term.pid, b"tput cols; exit\n")
        assert term.wait(on_pty=seen.append).exit_code == 0
        assert b"100" in b"".join(seen)

        sbx.files.make_dir("/home/user/watched")
        watch = sbx.files.watch_dir("/home/user/watched")
        sbx.files.write("/home/user/watched/new.txt", "x")
        events = watch.get_new_events()
        assert ("new.txt", FilesystemEventType.CREATE) in [(e.name, e.type) for e in events]
        watch.stop()

        url = sbx.download_url("/home/user/watched/new.txt", use_signature_expiration=60)
        assert "E2b-Sandbox-Id" not in url and httpx.get(url).content == b"x"  # no header: the signature routes it

        with pytest.raises(TimeoutException):
            sbx.commands.run("sleep 10", timeout=2)
    finally:
        sbx.kill()


def test_another_accounts_key_sees_and_touches_nothing(e2b_env: Server) -> None:
    from e2b import Sandbox, SandboxNotFoundException

    other = _second_key(e2b_env)
    mine = Sandbox.create(timeout=300)
    try:
        theirs = [s.sandbox_id for s in Sandbox.list(api_key=other).next_items()]
        assert mine.sandbox_id not in theirs
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(mine.sandbox_id, api_key=other)
        with pytest.raises(SandboxNotFoundException):
            Sandbox.connect(mine.sandbox_id, api_key=other)
        assert Sandbox.kill(mine.sandbox_id, api_key=other) is False
        # the envd side wants the owner's access token: a request without it is refused
        r = httpx.post(e2b_env.url + "/process.Process/List", json={},
                       headers={"E2b-Sandbox-Id": mine.sandbox_id, "E2b-Sandbox-Port": "49983"})
        assert r.status_code == 401 and r.json()["code"] == 401
        assert mine.is_running()
    finally:
        mine.kill()


@pytest.mark.parametrize("method,path,body,status", [
    ("POST", "/sandboxes", {"templateID": 5}, 400),
    ("POST", "/v2/sandboxes", {"templateID": "huge"}, 400),
    ("POST", "/sandboxes", {"templateID": "base", "timeout": -1}, 400),
    ("POST", "/sandboxes", {"templateID": "base", "metadata": {"a": 1}}, 400),
    ("POST", "/sandboxes", {"templateID": "base", "envVars": {"1X": "y"}}, 400),
    ("POST", "/sandboxes", "[1, 2", 400),
    ("GET", "/v2/sandboxes?state=sleeping", None, 400),
    ("GET", "/v2/sandboxes?limit=0", None, 400),
    ("GET", "/v2/sandboxes?nextToken=%%%", None, 400),
    ("GET", "/sandboxes/sb_nothere00", None, 404),
    ("DELETE", "/sandboxes/sb_nothere00", None, 404),
    ("POST", "/sandboxes/sb_nothere00/pause", {}, 404),
    ("POST", "/sandboxes/sb_nothere00/connect", {"timeout": 10}, 404),
    ("POST", "/sandboxes/sb_nothere00/timeout", {"timeout": "soon"}, 400),
    ("GET", "/nowhere", None, 404),
])
def test_bad_input_gets_e2b_errors_and_never_a_5xx(e2b_env: Server, method: str, path: str, body: Any,
                                                   status: int) -> None:
    content = body if isinstance(body, str) else (json.dumps(body) if body is not None else None)
    r = httpx.request(method, e2b_env.url + "/e2b" + path, content=content, timeout=120,
                      headers={"X-API-KEY": e2b_env.token, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    got = r.json()
    assert set(got) == {"code", "message"} and got["code"] == status and got["message"]


def test_without_a_key_or_with_a_wrong_one_it_is_401(e2b_env: Server) -> None:
    from e2b import AuthenticationException, Sandbox

    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="key_wrongwrongwrong").next_items()
    r = httpx.get(e2b_env.url + "/e2b/v2/sandboxes")
    assert r.status_code == 401 and r.json()["code"] == 401
    r = httpx.get(e2b_env.url + "/health", headers={"E2b-Sandbox-Id": "sb_nothere00"})
    assert r.status_code == 502 and r.json()["code"] == 502
