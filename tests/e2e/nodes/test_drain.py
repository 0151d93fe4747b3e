"""Draining a node (issue 11, items 1 and 2): one `sbx server` driving two node agents, each in a network
namespace of its own (tests/nodenet.py, nodes 7 and 8): node 7 is the server's configured node (SBX_NODE_URL),
node 8 is added with `sbx node add`.

- `sbx node drain NODE7 --wait` with a running sandbox (a Python process holding 128 MiB of random bytes and an
  unlinked file open at a known offset, and a web server on a hosted port under a client loop) and a stopped one
  on node 7: afterwards both are on node 8, the running one with the same PID, the same SHA-256 of its memory,
  the same offset, exec works, `sbx info` shows node 8 and its id, name and URL are kept; the stopped one resumes
  there with its memory; the hosted-port client saw only a pause, no error; node 7 is cordoned and empty;
- a second drain of the now empty node reports nothing to move;
- with node 7 cordoned, a drain of node 8 finds no room anywhere: each sandbox is reported `failed` with
  `insufficient_capacity` and stays where it was, running;
- a drain whose destination agent is killed with -9 halfway (everything sent, before its restore): the sandbox
  is reported `failed` with `migration_failed` and runs on its source with the same process and memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import cordon, holder, node_cluster, ok, start_holder
from tests.e2e.cluster import info as _info
from tests.e2e.conftest import Server
from tests.e2e.helpers import poll
from tests.nodenet import NodeHost

VOLUME_NODES = Path("/var/lib/sbx/volume/nodes")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, list[NodeHost]]]:
    with node_cluster(tmp_path_factory.mktemp("sbx-drain"), [7, 8], "drsrv", "sbxdrsv", "10.99.0.0/16") as c:
        yield c


def _proxied(srv: Server, host: str, token: str) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{srv.proxy_port}/", headers={"Host": host, "X-Sbx-Token": token})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_drain_moves_running_and_stopped_sandboxes_with_their_processes(
        cluster: tuple[Server, list[NodeHost]]) -> None:
    srv, nodes = cluster
    n7, n8 = nodes[0].node_name, nodes[1].node_name
    cordon(srv, nodes, 8)  # both sandboxes start on node 7
    live = ok(srv, "new", "--type", "small").strip()
    parked = ok(srv, "new", "--type", "small").strip()
    assert (_info(srv, live)["node"], _info(srv, parked)["node"]) == (n7, n7)
    start_holder(srv, live)
    ok(srv, "exec", live, "mkdir -p ~/site && echo served > ~/site/index.html")
    ok(srv, "exec", live, "--detach", "cd ~/site && python3 -m http.server 8000")
    ok(srv, "exec", live, "for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/8000) 2>/dev/null && exit 0; "
                          "sleep 0.2; done; exit 1")
    route = json.loads(ok(srv, "host", live, "8000", "--json"))["route"]
    pid, mem_sha, offset, nlink = holder(srv, live)
    assert (offset, nlink) == ("12345", "0")
    ok(srv, "exec", parked, "echo parked > ~/note")
    ok(srv, "exec", parked, "--detach", "sleep 100000")
    parked_pid = poll(lambda: ok(srv, "exec", parked, "pgrep -o -f '[s]leep 100000' || true").strip(),
                      "the job's sleep to start", 30, 0.1)  # its unit answers before the login shell runs it
    ok(srv, "stop", parked, "--wait")
    before = _info(srv, live)
    ok(srv, "node", "uncordon", n8)

    # a client loop on the hosted port during the whole drain
    answers: list[tuple[int, bytes, float]] = []
    done = threading.Event()

    def loop() -> None:
        while not done.is_set():
            status, body = _proxied(srv, route["host"], route["token"])
            answers.append((status, body, time.monotonic()))
            time.sleep(0.05)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    poll(lambda: len(answers) >= 3, "the client loop's first answers", 60)
    try:
        r = srv.sbx("node", "drain", n7, "--wait", timeout=600)
    finally:
        time.sleep(1)
        done.set()
        t.join(timeout=130)
    assert r.returncode == 0, r.stdout + r.stderr
    print(r.stdout)  # what a user sees, for the report
    assert f"{live}  migrated (running) {n7} -> {n8}" in r.stdout, r.stdout
    assert f"{parked}  moved (stopped) {n7} -> {n8}" in r.stdout, r.stdout
    assert f"{n7} is empty" in r.stdout, r.stdout
    bad = [(s, b[:200]) for s, b, _ in answers if (s, b) != (200, b"served\n")]
    assert not bad, bad
    assert len(answers) > 10
    gap = max(b[2] - a[2] for a, b in zip(answers, answers[1:], strict=False))
    print(f"hosted-port client: {len(answers)} answers, longest gap between two {gap:.2f} s")  # for the report

    after = _info(srv, live)
    assert (after["state"], after["node"]) == ("running", n8), after
    assert (after["id"], after["name"], after["url"], after["subdomain"]) == (
        before["id"], before["name"], before["url"], before["subdomain"])
    assert holder(srv, live) == [pid, mem_sha, offset, nlink]
    assert ok(srv, "exec", live, "echo hi", timeout=60) == "hi\n"
    assert ("v" + live[3:]) in subprocess.run(["ip", "-n", nodes[1].netns, "-br", "link"], capture_output=True,
                                              text=True).stdout
    assert ("v" + live[3:]) not in subprocess.run(["ip", "-n", nodes[0].netns, "-br", "link"], capture_output=True,
                                                  text=True).stdout
    req = urllib.request.Request(f"{srv.url}/v1/sandboxes/{live}/events",
                                 headers={"Authorization": f"Bearer {srv.token}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        events = [json.loads(ln) for ln in resp.read().decode().splitlines() if ln.strip()]
    migrated = [e for e in events if e.get("event") == "migrated"]
    assert migrated and (migrated[-1]["from"], migrated[-1]["to"], migrated[-1]["reason"]) == (n7, n8, "drain"), events
    assert migrated[-1]["pauseS"] > 0

    stopped = _info(srv, parked)
    assert (stopped["state"], stopped["node"]) == ("stopped", n8), stopped
    ok(srv, "resume", parked, "--wait")
    resumed = _info(srv, parked)
    assert (resumed["node"], resumed["memoryRestored"]) == (n8, True), resumed
    assert ok(srv, "exec", parked, "pgrep -o -f 'sleep 100000'").strip() == parked_pid
    assert ok(srv, "exec", parked, "cat ~/note") == "parked\n"

    listed = {n["name"]: n for n in json.loads(ok(srv, "node", "list", "--json"))["nodes"]}
    assert (listed[n7]["status"], listed[n7]["sandboxes"]) == ("cordoned", 0)

    # a second drain of the empty node has nothing to move
    again = srv.sbx("node", "drain", n7, "--wait", "--json", timeout=120)
    assert again.returncode == 0, again.stderr
    d = json.loads(again.stdout)["drain"]
    assert (d["state"], d["empty"], d["sandboxes"]) == ("done", True, [])
    assert "nothing to move" in ok(srv, "node", "drain", n7, "--wait")

    # no room anywhere else (node 7 cordoned): a drain of node 8 keeps every sandbox where it is, and says why
    full = srv.sbx("node", "drain", n8, "--wait", "--json", timeout=300)
    assert full.returncode == 1, full.stdout + full.stderr
    d = json.loads(full.stdout)["drain"]
    assert d["empty"] is False
    items = {i["id"]: i for i in d["sandboxes"]}
    assert set(items) == {live, parked}
    for item in items.values():
        assert (item["status"], item["error"]["code"]) == ("failed", "insufficient_capacity"), item
    assert (_info(srv, live)["state"], _info(srv, live)["node"]) == ("running", n8)
    assert holder(srv, live)[:2] == [pid, mem_sha]
    cordon(srv, nodes)
    for sid in (live, parked):
        ok(srv, "delete", sid, "--wait")


def test_a_drain_whose_destination_agent_is_killed_halfway_leaves_the_sandbox_running_on_its_source(
        cluster: tuple[Server, list[NodeHost]]) -> None:
    srv, nodes = cluster
    a, b = nodes
    cordon(srv, nodes, 8)
    sid = ok(srv, "new", "--type", "small").strip()
    assert _info(srv, sid)["node"] == a.node_name
    start_holder(srv, sid)
    before = holder(srv, sid)
    # node 8's agent, restarted to hold every arrival before its restore (everything sent, the source frozen)
    b.stop()
    b.extra_env["SBX_TEST_HOLD_MIGRATION"] = "120"
    try:
        b.start()
    finally:
        b.extra_env.pop("SBX_TEST_HOLD_MIGRATION")
    poll(lambda: {n["name"]: n["status"] for n in json.loads(ok(srv, "node", "list", "--json"))["nodes"]}
         .get(b.node_name) == "cordoned", "node 8 to answer again", 60)
    ok(srv, "node", "uncordon", b.node_name)
    drain = subprocess.Popen([str(Path(sys.executable).parent / "sbx"), "node", "drain", a.node_name, "--wait",
                              "--json"], env=srv.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        hold = VOLUME_NODES / b.node_name / "sandboxes" / sid / "migrate-hold"
        poll(hold.exists, "the destination to hold before its restore", 300, 0.1)
        assert _state_now(srv, sid) == "migrating"
        b.kill()
        out, err = drain.communicate(timeout=300)
    finally:
        if drain.poll() is None:
            drain.kill()
    assert drain.returncode == 1, out + err
    [item] = json.loads(out)["drain"]["sandboxes"]
    assert (item["id"], item["status"], item["error"]["code"]) == (sid, "failed", "migration_failed"), item
    info = _info(srv, sid)
    assert (info["state"], info["node"], info["error"]["code"]) == ("running", a.node_name, "migration_failed")
    assert holder(srv, sid) == before
    assert ok(srv, "exec", sid, "echo fine", timeout=60) == "fine\n"
    b.start()  # it drops the arrival it never confirmed
    assert not (VOLUME_NODES / b.node_name / "sandboxes" / sid).exists()
    cordon(srv, nodes)
    ok(srv, "delete", sid, "--wait")


def _state_now(srv: Server, sid: str) -> str:
    return str(srv.api("GET", f"/v1/sandboxes/{sid}")["sandbox"]["state"])


def test_sbx_migrate_moves_one_running_sandbox_to_the_node_named(cluster: tuple[Server, list[NodeHost]]) -> None:
    srv, nodes = cluster
    a, b = nodes
    cordon(srv, nodes, 8)
    sid = ok(srv, "new", "--type", "small").strip()
    assert _info(srv, sid)["node"] == a.node_name
    ok(srv, "exec", sid, "--detach", "exec -a sbx-migrate-sleeper sleep 1000000")
    pid = poll(lambda: ok(srv, "exec", sid, "pgrep -f -o sbx-migrate-sleeper || true").strip() or None,
               "the sleeper to start", 60)
    # what can't be done is refused with its reason, and nothing changes
    for args, code in ((("--to", a.node_name), "invalid_destination"), (("--to", "no-such-node"), "not_found"),
                       (("--to", b.node_name), "insufficient_capacity")):  # node 8 is cordoned
        r = srv.sbx("migrate", sid, *args, "--wait", timeout=120)
        assert r.returncode == 1 and f"error: {code}:" in r.stderr, (args, r.stdout, r.stderr)
        assert (_info(srv, sid)["state"], _info(srv, sid)["node"]) == ("running", a.node_name)
    assert "cordoned" in srv.sbx("migrate", sid, "--to", b.node_name, timeout=120).stderr
    ok(srv, "node", "uncordon", b.node_name)
    moved = ok(srv, "migrate", sid, "--to", b.node_name, "--wait")
    print(moved)  # what a user sees, for the report
    assert moved.startswith(f"{sid} migrated {a.node_name} -> {b.node_name} in ") and "paused" in moved, moved
    assert _info(srv, sid)["node"] == b.node_name
    assert ok(srv, "exec", sid, "pgrep -f -o sbx-migrate-sleeper").strip() == pid
    # a command still attached when the move starts is ended with a clear error; the detached one moves along
    attached = subprocess.Popen([str(Path(sys.executable).parent / "sbx"), "exec", sid, "--timeout", "120",
                                 "echo started; sleep 100; echo late"], env=srv.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        poll(lambda: ok(srv, "exec", sid, "pgrep -f -x 'sleep 100' || true").strip(), "the attached command", 60)
        back = json.loads(ok(srv, "migrate", sid, "--wait", "--json"))["sandbox"]  # placement picks: node 7
        out, err = attached.communicate(timeout=60)
    finally:
        if attached.poll() is None:
            attached.kill()
    assert attached.returncode == 1 and out == "started\n" and "error: moved: " in err, (out, err)
    assert (back["state"], back["node"]) == ("running", a.node_name), back
    assert ok(srv, "exec", sid, "pgrep -f -o sbx-migrate-sleeper").strip() == pid
    cordon(srv, nodes)
    ok(srv, "delete", sid, "--wait")
