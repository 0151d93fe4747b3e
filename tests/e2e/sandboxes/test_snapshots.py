"""Forks, snapshots and space accounting through the real `sbx` CLI and HTTP API on real sandboxes.

- a file written and forked at once is in the child; the child's writes never reach the parent (nor the parent's
  later writes the child); a fork copies type and env (unless overridden), not ttl;
- fork of a stopped sandbox leaves the source stopped and still resumable with its memory;
- snapshot -> ``new --from`` -> stop -> resume ends running with only the snapshot's content; deleting the
  snapshot afterwards leaves that sandbox bootable with its files;
- snapshot names are validated (400 ``invalid_snapshot_name``) and unique (409 ``snapshot_exists``);
- a ``--no-snapshots`` sandbox cannot be forked, snapshotted or resumed (409 ``snapshots_disabled``);
- ``info`` stats and ``snapshots --json`` report bytes allocated and unique; deleting a sandbox frees about what
  only it held, and never what something else still uses.

XFS frees reflinked blocks in the background: volume figures are polled with a deadline, never timed.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.e2e.helpers import poll

pytestmark = pytest.mark.e2e

MiB = 1 << 20


# --- helpers -----------------------------------------------------------------------------------------------------
def new(server: Any, *args: str) -> str:
    sid = server.sbx("new", "--type", "small", *args, check=True).stdout.strip()
    assert re.fullmatch(r"sb_[a-z0-9]{10}", sid), sid
    return sid


def run(server: Any, sid: str, command: str) -> str:
    r = server.sbx("exec", sid, command, "--timeout", "120")
    assert r.returncode == 0, f"{command!r} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout  # type: ignore[no-any-return]


def info(server: Any, sid: str) -> dict[str, Any]:
    return json.loads(server.sbx("info", sid, "--json", check=True).stdout)["sandbox"]  # type: ignore[no-any-return]


def fork(server: Any, sid: str, *args: str) -> str:
    fid = server.sbx("fork", sid, *args, "--wait", check=True).stdout.strip()
    assert re.fullmatch(r"sb_[a-z0-9]{10}", fid), fid
    return fid


def snapshots(server: Any, *args: str) -> dict[str, dict[str, Any]]:
    r = server.sbx("snapshots", *args, "--json", check=True)
    return {s["name"]: s for s in json.loads(r.stdout)["snapshots"]}


def cli_error(r: Any) -> str:
    """The code of a failed CLI call (``error: <code>: <message>`` on stderr, exit 1)."""
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    m = re.match(r"error: ([a-z_]+): ", r.stderr)
    assert m, r.stderr
    return m.group(1)


def api(server: Any, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    """One HTTP call to the server; returns (status, JSON body), errors included."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Authorization": f"Bearer {server.token}"}
    if data is not None:
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(server.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def volume_free(server: Any) -> int:
    """Free bytes on the reflink volume the test server's disks live on."""
    from sbx.config import load_settings

    st = os.statvfs(load_settings(node_name=server.env["SBX_NODE_NAME"], profile="test").volume)
    return st.f_bavail * st.f_frsize


def stats(server: Any, sid: str) -> dict[str, Any]:
    return info(server, sid)["stats"]  # type: ignore[no-any-return]


# --- fork --------------------------------------------------------------------------------------------------------
def test_fork_copies_the_disk_at_once_and_the_copies_diverge(server: Any) -> None:
    src = new(server, "--name", "snap-src", "--ttl", "7200", "--env", "FOO=bar")
    run(server, src, "echo one > ~/f; sudo sh -c 'echo etc > /etc/parent-etc'")  # no sync: the fork must flush
    child = fork(server, src)
    assert run(server, child, "cat ~/f /etc/parent-etc; echo $FOO").split() == ["one", "etc", "bar"]
    sb = info(server, child)
    assert (sb["name"], sb["type"], sb["ttl"], sb["memoryRestored"]) == ("snap-src (fork)", "small", 3600, None)
    assert info(server, src)["ttl"] == 7200

    run(server, child, "echo child > ~/f; echo only > ~/child-only; sudo sh -c 'echo x > /etc/child-etc'; sync")
    run(server, src, "echo later > ~/later; sync")
    assert run(server, src, "cat ~/f; for f in ~/child-only /etc/child-etc; do test -e $f && echo leaked $f; done; "
                            "echo end").split() == ["one", "end"]
    assert run(server, child, "cat ~/f; test -e ~/later && echo leaked || echo clean").split() == ["child", "clean"]

    other = fork(server, src, "--env", "FOO=baz", "--name", "renamed", "--ttl", "0", "--type", "default")
    assert run(server, other, "echo $FOO; cat ~/later").split() == ["baz", "later"]
    sb = info(server, other)
    assert (sb["name"], sb["ttl"], sb["type"]) == ("renamed", 0, "default")
    for sid in (other, child, src):
        server.sbx("delete", sid, "--wait", check=True)


def test_fork_of_a_stopped_sandbox_leaves_it_stopped_with_its_memory(server: Any) -> None:
    src = new(server, "--name", "stopped-src")
    run(server, src, "echo kept > ~/kept")
    job = server.sbx("exec", src, "--detach", "sleep 1000", check=True).stdout.strip()
    assert job.startswith("job_")
    # the job's unit answers before its login shell has exec'd sleep
    pid = poll(lambda: run(server, src, "pgrep -x sleep || true").strip() or None, "sleep to start", 30, 0.1)
    server.sbx("stop", src, "--wait", check=True)
    r = server.sbx("fork", src, "--wait", "--json", check=True)
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert [e["event"] for e in events] == ["forking", "state", "ready"]
    child = events[-1]["id"]
    assert events[0]["sandbox"]["memoryRestored"] is None
    assert run(server, child, "cat ~/kept; pgrep -x sleep || echo no-sleep").split() == ["kept", "no-sleep"]
    assert info(server, src)["state"] == "stopped"
    server.sbx("resume", src, "--wait", check=True)  # the source's memory image is untouched by the fork
    sb = info(server, src)
    assert (sb["state"], sb["memoryRestored"]) == ("running", True)
    assert run(server, src, "pgrep -x sleep").split()[0] == pid
    for sid in (child, src):
        server.sbx("delete", sid, "--wait", check=True)


# --- snapshots ---------------------------------------------------------------------------------------------------
def test_snapshot_new_from_stop_resume_chain(server: Any) -> None:
    src = new(server, "--name", "tmpl-src")
    run(server, src, "echo a > ~/a")
    assert server.sbx("snapshot", src, "e2e-tmpl", check=True).stdout.strip() == "e2e-tmpl"
    run(server, src, "echo b > ~/b")
    listed = snapshots(server, src)
    assert set(listed) == {"e2e-tmpl"}
    snap = listed["e2e-tmpl"]
    assert (snap["sandboxId"], snap["auto"]) == (src, False)
    assert snap["allocatedBytes"] > 0 and 0 <= snap["uniqueBytes"] <= snap["allocatedBytes"]
    assert "e2e-tmpl" in server.sbx("snapshots", check=True).stdout
    assert "e2e-tmpl" in snapshots(server)
    assert cli_error(server.sbx("snapshot", src, "e2e-tmpl")) == "snapshot_exists"

    copy = new(server, "--from", "e2e-tmpl")
    assert run(server, copy, "cat ~/a; test -e ~/b && echo has-b || echo no-b").split() == ["a", "no-b"]
    run(server, copy, "echo c > ~/c")
    server.sbx("stop", copy, "--wait", check=True)
    server.sbx("resume", copy, "--wait", check=True)
    sb = info(server, copy)
    assert (sb["state"], sb["memoryRestored"]) == ("running", True)
    assert run(server, copy, "cat ~/a ~/c; test -e ~/b && echo has-b || echo no-b").split() == ["a", "c", "no-b"]

    # Deleting the snapshot the sandbox came from frees nothing it still uses: it cold-boots and reads its files.
    assert server.sbx("snapshot-delete", "e2e-tmpl", check=True).stdout.strip() == "deleted e2e-tmpl"
    assert "e2e-tmpl" not in snapshots(server)
    assert cli_error(server.sbx("snapshot-delete", "e2e-tmpl")) == "not_found"
    server.sbx("stop", copy, "--no-memory", "--wait", check=True)
    assert cli_error(server.sbx("resume", copy, "--require-memory", "--wait")) == "memory_unavailable"
    assert info(server, copy)["state"] == "stopped"
    server.sbx("resume", copy, "--wait", check=True)
    assert info(server, copy)["memoryRestored"] is False
    assert run(server, copy, "cat ~/a ~/c").split() == ["a", "c"]
    assert cli_error(server.sbx("new", "--from", "e2e-tmpl")) == "not_found"
    for sid in (copy, src):
        server.sbx("delete", sid, "--wait", check=True)


@pytest.mark.parametrize("name", ["", "   ", "a" * 64, "bad name", "slash/x", "-lead", "semi;colon", "ünï"])
def test_snapshot_names_are_validated(server: Any, named_source: str, name: str) -> None:
    # `--` so that "-lead" reaches the server instead of being read as an option
    assert cli_error(server.sbx("snapshot", named_source, "--", name)) == "invalid_snapshot_name"
    status, body = api(server, "POST", f"/v1/sandboxes/{named_source}/snapshot", {"name": name})
    assert (status, body["error"]["code"]) == (400, "invalid_snapshot_name")


@pytest.fixture(scope="module")
def named_source(server: Any) -> Any:
    sid = new(server, "--name", "names-src")
    yield sid
    server.sbx("delete", sid, "--wait")


def test_sandbox_names_and_missing_things_are_errors_not_sandboxes(server: Any, named_source: str) -> None:
    before = {sb["id"] for sb in json.loads(server.sbx("list", "--json", check=True).stdout)["sandboxes"]}
    assert cli_error(server.sbx("fork", named_source, "--name", "   ", "--wait")) == "invalid_name"
    assert cli_error(server.sbx("fork", named_source, "--name", "x" * 201, "--wait")) == "invalid_name"
    assert cli_error(server.sbx("new", "--name", "", "--json")) == "invalid_name"
    assert cli_error(server.sbx("fork", "sb_0000000000", "--wait")) == "not_found"
    assert cli_error(server.sbx("snapshot", "sb_0000000000", "fine-name")) == "not_found"
    assert cli_error(server.sbx("snapshots", "sb_0000000000")) == "not_found"
    status, body = api(server, "POST", f"/v1/sandboxes/{named_source}/fork", {"name": ""})
    assert (status, body["error"]["code"]) == (400, "invalid_name")
    after = {sb["id"] for sb in json.loads(server.sbx("list", "--json", check=True).stdout)["sandboxes"]}
    assert after == before


def test_no_snapshots_sandbox_cannot_be_forked_snapshotted_or_resumed(server: Any) -> None:
    sid = new(server, "--no-snapshots", "--name", "nosnap")
    run(server, sid, "echo x > ~/x")
    assert cli_error(server.sbx("fork", sid, "--wait")) == "snapshots_disabled"
    assert cli_error(server.sbx("snapshot", sid, "nosnap-1")) == "snapshots_disabled"
    status, body = api(server, "POST", f"/v1/sandboxes/{sid}/fork", {})
    assert (status, body["error"]["code"]) == (409, "snapshots_disabled")
    status, body = api(server, "POST", f"/v1/sandboxes/{sid}/snapshot", {"name": "nosnap-1"})
    assert (status, body["error"]["code"]) == (409, "snapshots_disabled")
    assert "nosnap-1" not in snapshots(server)
    server.sbx("stop", sid, "--wait", check=True)  # a stop keeps the disk only
    assert info(server, sid)["state"] == "stopped"
    assert cli_error(server.sbx("resume", sid, "--wait")) == "snapshots_disabled"
    status, body = api(server, "POST", f"/v1/sandboxes/{sid}/resume", {})
    assert (status, body["error"]["code"]) == (409, "snapshots_disabled")
    status, body = api(server, "POST", f"/v1/sandboxes/{sid}/fork", {})
    assert (status, body["error"]["code"]) == (409, "snapshots_disabled")
    assert info(server, sid)["state"] == "stopped"
    server.sbx("delete", sid, "--wait", check=True)


# --- space accounting --------------------------------------------------------------------------------------------
def test_space_accounting_and_delete_frees_only_what_is_unshared(server: Any) -> None:
    parent = new(server, "--name", "space-parent")
    before = stats(server, parent)
    assert before["diskAllocatedBytes"] > 0 and 0 <= before["diskUniqueBytes"] <= before["diskAllocatedBytes"]
    run(server, parent, "head -c 64M /dev/urandom > ~/pbig && sync")
    psum = run(server, parent, "md5sum < ~/pbig")
    alone = stats(server, parent)["diskUniqueBytes"]
    assert alone >= before["diskUniqueBytes"] + 60 * MiB  # pbig is only the parent's

    child = fork(server, parent)
    # After the fork pbig is shared: neither copy would free it on its own.
    assert stats(server, parent)["diskUniqueBytes"] < alone - 48 * MiB
    assert stats(server, child)["diskUniqueBytes"] < 32 * MiB
    assert run(server, child, "md5sum < ~/pbig") == psum
    run(server, child, "head -c 128M /dev/urandom > ~/cbig && sync")
    cstats = stats(server, child)
    assert cstats["diskUniqueBytes"] >= 120 * MiB
    assert cstats["diskAllocatedBytes"] >= cstats["diskUniqueBytes"] + 60 * MiB  # pbig is allocated, not unique

    free = volume_free(server)
    server.sbx("delete", child, "--wait", check=True)
    poll(lambda: volume_free(server) - free >= 96 * MiB, "the child's 128 MiB file to be freed")
    assert run(server, parent, "md5sum < ~/pbig") == psum  # shared blocks stayed
    poll(lambda: stats(server, parent)["diskUniqueBytes"] >= 60 * MiB, "pbig to be the parent's alone again")

    # A snapshot shares the parent's blocks; once the parent is gone it holds them alone, and still serves them.
    server.sbx("snapshot", parent, "e2e-space", check=True)
    snap = snapshots(server)["e2e-space"]
    assert snap["allocatedBytes"] >= 64 * MiB and snap["uniqueBytes"] < 16 * MiB
    server.sbx("delete", parent, "--wait", check=True)
    poll(lambda: snapshots(server)["e2e-space"]["uniqueBytes"] >= 60 * MiB, "the snapshot to hold pbig alone")
    copy = new(server, "--from", "e2e-space")
    assert run(server, copy, "md5sum < ~/pbig") == psum
    assert stats(server, copy)["diskUniqueBytes"] < 32 * MiB
    server.sbx("snapshot-delete", "e2e-space", check=True)
    poll(lambda: stats(server, copy)["diskUniqueBytes"] >= 60 * MiB, "pbig to be the copy's alone")
    server.sbx("stop", copy, "--wait", check=True)
    st = stats(server, copy)  # a stopped sandbox still reports its disk
    assert st["diskAllocatedBytes"] >= 64 * MiB and st["diskUniqueBytes"] >= 60 * MiB
    server.sbx("resume", copy, "--wait", check=True)
    assert run(server, copy, "md5sum < ~/pbig") == psum
    server.sbx("delete", copy, "--wait", check=True)
