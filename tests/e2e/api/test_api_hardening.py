"""Issue 9 end to end: bad input on the real server and real sandboxes gets a clear error with a stable code and
nothing changes; exec carries bytes exactly and its timeout always kills; jobs take env/cwd/timeout/stdin and can
be killed; an ``autoResume`` sandbox is resumed by an exec or a file call."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import tarfile
import urllib.request
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import SBX
from tests.e2e.helpers import poll

pytestmark = pytest.mark.e2e


def new_sandbox(server: Any, *args: str) -> str:
    return str(server.sbx("new", "--type", "small", *args, check=True).stdout.strip())


@pytest.fixture(scope="module")
def http(server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"},
                      timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def sid(server: Any) -> str:
    return new_sandbox(server)


def run(http: httpx.Client, sid: str, command: str, **body: Any) -> tuple[str, dict[str, Any]]:
    """Exec through the API; returns (stdout text, exit line)."""
    r = http.post(f"/v1/sandboxes/{sid}/exec", json={"command": command, **body})
    assert r.status_code == 200, r.text
    lines = [json.loads(line) for line in r.text.splitlines()]
    out = "".join(x["data"] for x in lines if x.get("stream") == "stdout")
    return out, lines[-1]


def error_of(r: httpx.Response) -> tuple[int, str, str | None]:
    body = r.json()
    assert set(body) == {"error"} and {"code", "message"} <= set(body["error"]), body
    return r.status_code, body["error"]["code"], body["error"].get("field")


# --- item 1: file operations check before they touch anything -------------------------------------------------
def test_removing_home_root_or_a_mount_point_is_refused_and_nothing_changes(http: httpx.Client, sid: str) -> None:
    run(http, sid, "mkdir -p keep && echo precious > keep/a && echo dot > .dotfile")
    files = f"/v1/sandboxes/{sid}/files"
    for path, user in (("~", "user"), ("/home/user", "user"), (".", "user"), ("~/", "user"), ("/", "root"),
                       ("/home", "root"), ("~", "root"), ("/tmp", "root"), ("/proc", "root"),
                       ("/home/user/..", "root")):
        r = http.delete(files, params={"path": path, "user": user})
        assert error_of(r)[:2] == (403, "protected_path"), (path, user, r.text)
    out, _ = run(http, sid, "cat keep/a .dotfile; ls -d /tmp /proc/1 >/dev/null && echo mounts-ok")
    assert out == "precious\ndot\nmounts-ok\n"


def test_a_removal_that_would_fail_half_way_removes_nothing(http: httpx.Client, sid: str) -> None:
    # a folder with a root-owned subfolder: rm -rf as user would delete what it can, then fail
    run(http, sid, "cd /home/user && mkdir -p half/a half/locked/inner && touch half/a/f half/locked/inner/g && "
        "chown -R user:user half && chown -R root:root half/locked && chmod 755 half/locked", user="root")
    r = http.delete(f"/v1/sandboxes/{sid}/files", params={"path": "half"})
    assert error_of(r)[:2] == (403, "permission_denied")
    out, _ = run(http, sid, "find half | sort")
    assert out.split() == ["half", "half/a", "half/a/f", "half/locked", "half/locked/inner", "half/locked/inner/g"]
    r = http.delete(f"/v1/sandboxes/{sid}/files", params={"path": "/home/user/half", "user": "root"})
    assert r.status_code == 200, r.text
    assert run(http, sid, "ls half 2>&1 || echo gone")[0].endswith("gone\n")


def test_bad_file_targets_are_400_and_make_nothing(http: httpx.Client, sid: str) -> None:
    files = f"/v1/sandboxes/{sid}/files"
    r = http.put(files, params={"path": "up/" + "n" * 300}, content=b"x")
    assert error_of(r) == (400, "invalid_path", "path")
    r = http.put(files, params={"path": "untar-here", "archive": "tar"}, content=b"this is not a tar archive" * 50)
    assert error_of(r)[:2] == (400, "invalid_archive")
    out, _ = run(http, sid, "ls -d up untar-here 2>/dev/null | wc -l")
    assert out.strip() == "0"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("t.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"ok"))
    assert http.put(files, params={"path": "untar-here", "archive": "tar"}, content=buf.getvalue()).status_code == 200
    assert http.get(files, params={"path": "untar-here/t.txt"}).content == b"ok"


# --- items 2-4: exec and jobs bounds --------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "status", "code", "field"), [
    ({"command": "x" * (70 * 1024)}, 400, "invalid_command", "command"),
    ({"command": "true", "env": {f"V{i}": "x" for i in range(1000)}}, 400, "invalid_env", "env"),
    ({"command": "true", "env": {"A=B": "x"}}, 400, "invalid_env", "env"),
    ({"command": "true", "env": {"": "x"}}, 400, "invalid_env", "env"),
    ({"command": "true", "timeout": 1e308}, 400, "invalid_timeout", "timeout"),
    ({"command": "true", "timeout": 2147484}, 400, "invalid_timeout", "timeout"),
    ({"command": "true", "timeout": -1}, 400, "invalid_timeout", "timeout"),
    ({"command": "true", "timeout": False}, 422, "invalid_request", "timeout"),
    ({"command": "true", "timeout": "5"}, 422, "invalid_request", "timeout"),
    ({"command": "true", "cwd": "does/not/exist"}, 400, "invalid_cwd", "cwd"),
    ({"command": "true", "cwd": "/etc/hostname"}, 400, "invalid_cwd", "cwd"),
    ({"command": "true", "cwd": "/root"}, 400, "invalid_cwd", "cwd"),
    ({"timeout": 5}, 422, "invalid_request", "command"),
    ({"command": "echo \u0000"}, 400, "invalid_command", "command"),
])
def test_exec_and_jobs_refuse_bad_bodies_naming_the_field(http: httpx.Client, sid: str, body: dict[str, Any],
                                                          status: int, code: str, field: str) -> None:
    for what in ("exec", "jobs"):
        if what == "jobs" and field == "timeout" and body.get("timeout") in (2147484,):
            continue  # a job may not take a week either: same bound, same answer (checked once)
        r = http.post(f"/v1/sandboxes/{sid}/{what}", json=body)
        assert error_of(r) == (status, code, field), (what, r.text)


def test_timeout_infinity_and_huge_ttls_are_refused(http: httpx.Client, sid: str) -> None:
    r = http.post(f"/v1/sandboxes/{sid}/exec", content=b'{"command": "true", "timeout": Infinity}',
                  headers={"Content-Type": "application/json"})
    assert error_of(r)[:2] == (400, "invalid_timeout")
    for path, body in (("/v1/sandboxes", {"ttl": 2 ** 70}), (f"/v1/sandboxes/{sid}/resume", {"ttl": 2 ** 64}),
                       (f"/v1/sandboxes/{sid}/fork", {"ttl": 10 ** 12})):
        assert error_of(http.post(path, json=body)) == (400, "invalid_ttl", "ttl"), path


def test_cwd_is_relative_to_home_like_the_files_api(http: httpx.Client, sid: str) -> None:
    run(http, sid, "mkdir -p work/sub")
    assert run(http, sid, "pwd", cwd="work/sub")[0] == "/home/user/work/sub\n"
    assert run(http, sid, "pwd", cwd="~")[0] == "/home/user\n"
    assert run(http, sid, "pwd", cwd="/tmp")[0] == "/tmp\n"
    assert run(http, sid, "pwd", cwd="~", user="root")[0] == "/root\n"


def test_a_tiny_timeout_still_kills_the_command(http: httpx.Client, sid: str) -> None:
    for timeout in (0.001, 0.01):
        run(http, sid, "rm -f /tmp/finished")
        _, end = run(http, sid, "sleep 30; touch /tmp/finished", timeout=timeout)
        # the exec answered before the command could finish, and nothing of it is left running
        assert run(http, sid, "ls /tmp/finished 2>/dev/null | wc -l")[0].strip() == "0"
        assert end == {"exitCode": 124, "timedOut": True}
        poll(lambda: run(http, sid, "pgrep -fx 'sleep 30' | wc -l")[0].strip() == "0", "the killed sleep to go",
             timeout=20)


def test_exec_output_is_carried_byte_exact(server: Any, http: httpx.Client, sid: str) -> None:
    run(http, sid, "head -c 4096 /dev/urandom > /tmp/rand.bin; printf '\\xff\\xfe\\x00a' >> /tmp/rand.bin")
    want = http.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/rand.bin"}).content
    assert len(want) == 4100
    r = http.post(f"/v1/sandboxes/{sid}/exec", json={"command": "cat /tmp/rand.bin; cat /tmp/rand.bin >&2",
                                                     "encoding": "base64"})
    lines = [json.loads(line) for line in r.text.splitlines()]
    frames = [x for x in lines if "stream" in x]
    assert frames and all(x["encoding"] == "base64" for x in frames)
    for stream in ("stdout", "stderr"):
        got = b"".join(base64.b64decode(x["data"]) for x in frames if x["stream"] == stream)
        assert got == want, stream
    assert lines[-1] == {"exitCode": 0, "timedOut": False}
    # the CLI writes the raw bytes to its stdout
    cli = subprocess.run([SBX, "exec", sid, "cat /tmp/rand.bin"], env=server.env, capture_output=True, timeout=120)
    assert cli.returncode == 0 and cli.stdout == want


def test_jobs_take_env_cwd_stdin_timeout_and_can_be_killed(server: Any, http: httpx.Client, sid: str) -> None:
    run(http, sid, "mkdir -p jobdir")
    base = f"/v1/sandboxes/{sid}/jobs"
    r = http.post(base, json={"command": "cat; echo $FOO; pwd", "env": {"FOO": "bar"}, "cwd": "jobdir",
                              "stdin": "from stdin\n"})
    assert r.status_code == 201, r.text
    job = r.json()["job"]["id"]
    done = http.get(f"{base}/{job}/wait", params={"timeout": 120}).json()["job"]
    assert done["exitCode"] == 0
    logs = [json.loads(line) for line in http.get(f"{base}/{job}/logs").text.splitlines()]
    assert "".join(x["data"] for x in logs if x.get("stream") == "stdout") == "from stdin\nbar\n/home/user/jobdir\n"

    timed = http.post(base, json={"command": "sleep 300", "timeout": 1}).json()["job"]["id"]
    assert http.get(f"{base}/{timed}/wait", params={"timeout": 120}).json()["job"]["exitCode"] == 124

    long = http.post(base, json={"command": "sleep 300"}).json()["job"]["id"]
    killed = http.post(f"{base}/{long}/kill")
    assert killed.status_code == 200, killed.text
    assert (killed.json()["job"]["running"], killed.json()["job"]["exitCode"]) == (False, 137)
    assert error_of(http.post(f"{base}/job_nosuchjb/kill"))[:2] == (404, "not_found")
    # and from the CLI
    cli_job = server.sbx("exec", sid, "--detach", "sleep 300", check=True).stdout.strip()
    r2 = server.sbx("kill", sid, cli_job)
    assert r2.returncode == 0, r2.stderr
    assert http.get(f"{base}/{cli_job}").json()["job"]["exitCode"] == 137


# --- item 6: one error shape ----------------------------------------------------------------------------------
def test_every_error_has_the_same_shape(server: Any, http: httpx.Client, sid: str) -> None:
    url = f"/v1/sandboxes/{sid}/exec"
    json_ct = {"Content-Type": "application/json"}
    for raw in (b'{"command": "tr', b"[" * 100_000 + b"]" * 100_000, b'{"command": "\xff\xfe"}'):
        assert error_of(http.post(url, content=raw, headers=json_ct))[:2] == (422, "invalid_request"), raw[:20]
    assert error_of(http.post(url, json={})) == (422, "invalid_request", "command")
    assert error_of(http.post(url, json={"command": "true", "bogus": 1})) == (422, "invalid_request", "bogus")
    r = http.put("/v1/sandboxes")
    assert error_of(r)[:2] == (405, "method_not_allowed")
    assert set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD", "POST"}
    assert error_of(http.get("/v1/nothing-here"))[:2] == (404, "not_found")
    assert error_of(httpx.get(server.url + "/v1/sandboxes"))[:2] == (401, "unauthorized")
    big = http.post(url, content=b'{"command": "' + b"x" * (2 << 20) + b'"}', headers=json_ct)
    assert error_of(big)[:2] == (413, "body_too_large")
    assert http.head("/healthz").status_code == 200


def test_a_proxy_502_never_shows_the_sandbox_address(server: Any, http: httpx.Client, sid: str) -> None:
    route = http.post(f"/v1/sandboxes/{sid}/routes", json={"port": 9, "public": True}).json()["route"]
    host = route["url"].split("://", 1)[1]
    req = urllib.request.Request(f"http://127.0.0.1:{server.proxy_port}/", headers={"Host": host})
    try:
        urllib.request.urlopen(req, timeout=60)
        raise AssertionError("expected a 502")
    except urllib.error.HTTPError as e:
        body = json.loads(e.read())
        assert e.code == 502 and body["error"]["code"] == "upstream_unreachable"
    address = run(http, sid, "hostname -I")[0].split()[0]
    assert address not in json.dumps(body)


# --- item 9: autoResume ---------------------------------------------------------------------------------------
def test_exec_and_files_resume_an_auto_resume_sandbox(server: Any, http: httpx.Client) -> None:
    auto = new_sandbox(server, "--auto-resume")
    run(http, auto, "echo kept > note.txt")
    server.sbx("stop", auto, "--wait", check=True)
    out, end = run(http, auto, "cat note.txt")
    assert (out, end["exitCode"]) == ("kept\n", 0)
    assert http.get(f"/v1/sandboxes/{auto}").json()["sandbox"]["state"] == "running"
    # a stop still in flight: the exec waits for it, then resumes
    assert http.post(f"/v1/sandboxes/{auto}/stop").status_code == 202
    assert http.get(f"/v1/sandboxes/{auto}/files", params={"path": "note.txt"}).content == b"kept\n"
    # without autoResume a stopped sandbox still answers 409 not_running
    plain = new_sandbox(server)
    server.sbx("stop", plain, "--wait", check=True)
    r = http.post(f"/v1/sandboxes/{plain}/exec", json={"command": "true"})
    assert error_of(r)[:2] == (409, "not_running")
