"""A fork when its source's node is full (issue 10 item 4): one `sbx server` driving two node agents, each in a
network namespace of its own (tests/nodenet.py, nodes 12 and 13): node 12 is the server's configured node
(SBX_NODE_URL), node 13 is added with `sbx node add`. Each node may promise 512 MiB of memory limits (the server's
SBX_MEMORY_RESERVE_MIB is the host's RAM minus 512 MiB, SBX_MEMORY_OVERCOMMIT 1), so two running small sandboxes
(256 MiB each) fill a node.

With node 12 full (two running sandboxes, one of them with a Python process holding 128 MiB of random bytes):

- a fork of a stopped sandbox and a fork of a running one land on node 13 (the response and `sbx info` say so),
  have the source's files, boot with their own hostname, machine-id, address and SSH host key; the sources are
  where they were, as they were;
- both nodes full: the fork is refused with 507 naming both nodes, and nothing is created;
- `sbx fork --memory` lands on node 13 with the process (same PID, same SHA-256 of its memory) and its own
  identity;
- with room on node 12 again, a fork stays there (a reflink, no `moved` event).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import info as _info
from tests.e2e.cluster import node_cluster, ok
from tests.e2e.conftest import Server
from tests.e2e.helpers import poll
from tests.nodenet import NodeHost

HOG = r"""
import hashlib, os, signal, time
blob = os.urandom(128 << 20)
def report(*_):
    with open('/home/user/memsha.tmp', 'w') as f:
        f.write(f"{os.getpid()} {hashlib.sha256(blob).hexdigest()}")
    os.replace('/home/user/memsha.tmp', '/home/user/memsha')
signal.signal(signal.SIGUSR1, report)
report()
while True:
    time.sleep(1)
"""

IDENTITY = ("hostname; cat /etc/machine-id; ip -4 -o addr show eth0 | awk '{print $4}'; "
            "cut -d' ' -f2 /etc/ssh/ssh_host_ed25519_key.pub")


def _memtotal_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, list[NodeHost]]]:
    with node_cluster(tmp_path_factory.mktemp("sbx-forkelse"), [12, 13], "fesrv", "sbxfesv", "10.96.0.0/16",
                      SBX_MEMORY_RESERVE_MIB=str(_memtotal_mib() - 512), SBX_MEMORY_OVERCOMMIT="1",
                      SBX_CONSOLIDATE_SECONDS="0") as c:
        yield c


def _fork(srv: Server, *args: str) -> dict:  # type: ignore[type-arg]
    """``sbx fork ARGS --wait --json``: the first event's sandbox (the API's answer) and the fork's ``moved``
    event if any, as ``{"first": view, "moved": event | None, "id": id}``."""
    lines = [json.loads(x) for x in ok(srv, "fork", *args, "--wait", "--json").splitlines() if x.strip()]
    first = lines[0]["sandbox"]
    moved = next((ev for ev in lines if ev.get("event") == "moved"), None)
    return {"first": first, "moved": moved, "id": first["id"]}


def _memsha(srv: Server, sid: str) -> list[str]:
    ok(srv, "exec", sid, "rm -f ~/memsha; kill -USR1 $(pgrep -o -f hog.py); for i in $(seq 100); do "
                         "[ -s ~/memsha ] && exit 0; sleep 0.1; done; exit 1", timeout=60)
    return ok(srv, "exec", sid, "cat ~/memsha", timeout=60).split()


def _identity(srv: Server, sid: str, other: list[str] | None = None) -> list[str]:
    """hostname, machine-id, address and SSH host key of ``sid``; with ``other`` (another sandbox's), waits (60 s)
    for its SSH host key to differ from that one's (sbx-identity makes new keys just after a start)."""
    def read() -> list[str] | None:
        r = srv.sbx("exec", sid, f"systemctl -q is-active ssh.service && {IDENTITY}", timeout=60)
        lines = r.stdout.split()
        if r.returncode != 0 or len(lines) != 4 or (other is not None and lines[3] == other[3]):
            return None
        return lines

    got: list[str] = poll(read, f"{sid}'s identity", timeout=60)
    return got


def test_forks_of_a_full_node_land_on_another_one_and_stay_home_when_it_has_room(
        cluster: tuple[Server, list[NodeHost]]) -> None:
    srv, nodes = cluster
    n12, n13 = nodes[0].node_name, nodes[1].node_name
    ok(srv, "node", "cordon", n13)  # everything starts on node 12
    live = ok(srv, "new", "--type", "small").strip()
    parked = ok(srv, "new", "--type", "small").strip()
    ok(srv, "exec", live, f"echo from-{live} > ~/note && cat > ~/hog.py <<'EOF'\n{HOG}\nEOF")
    ok(srv, "exec", live, "--detach", "python3 ~/hog.py")
    poll(lambda: srv.sbx("exec", live, "test -s ~/memsha", timeout=60).returncode == 0, "the hog", 120)
    pid, mem_sha = _memsha(srv, live)
    ok(srv, "exec", parked, f"echo from-{parked} > ~/note")
    ok(srv, "stop", parked, "--wait")
    filler = ok(srv, "new", "--type", "small").strip()
    assert {_info(srv, s)["node"] for s in (live, parked, filler)} == {n12}
    ok(srv, "node", "uncordon", n13)
    live_id = _identity(srv, live)

    # node 12 is full (live and filler run there): a fork of the stopped sandbox goes to node 13
    f1 = _fork(srv, parked)
    assert f1["first"]["node"] == n13 and f1["moved"] is not None
    assert (f1["moved"]["from"], f1["moved"]["to"]) == (n12, n13)
    v1 = _info(srv, f1["id"])
    assert (v1["state"], v1["node"], v1["memoryRestored"]) == ("running", n13, None)
    assert ok(srv, "exec", f1["id"], "cat ~/note", timeout=60).strip() == f"from-{parked}"
    id1 = _identity(srv, f1["id"])
    assert id1[0] == v1["subdomain"] and f1["id"] != parked
    assert (_info(srv, parked)["state"], _info(srv, parked)["node"]) == ("stopped", n12)

    # and a fork of the running one
    f2 = _fork(srv, live)
    assert f2["first"]["node"] == n13 and f2["moved"] is not None
    v2 = _info(srv, f2["id"])
    assert (v2["state"], v2["node"]) == ("running", n13)
    assert ok(srv, "exec", f2["id"], "cat ~/note", timeout=60).strip() == f"from-{live}"
    id2 = _identity(srv, f2["id"], other=live_id)
    assert id2[0] == v2["subdomain"]
    for a, b in zip(id2, live_id, strict=True):
        assert a != b
    assert "hog.py" not in ok(srv, "exec", f2["id"], "ps -eo args", timeout=60)  # booted fresh
    assert _memsha(srv, live) == [pid, mem_sha]  # the source runs on with its process

    # both nodes full now: refused, naming both, and nothing is created
    before = ok(srv, "list", "--json")
    r = srv.sbx("fork", live, "--wait", timeout=120)
    assert r.returncode != 0
    assert "insufficient_capacity" in r.stderr and n12 in r.stderr and n13 in r.stderr, r.stderr
    assert [s["id"] for s in json.loads(ok(srv, "list", "--json"))["sandboxes"]] == \
        [s["id"] for s in json.loads(before)["sandboxes"]]

    # --memory, with room on node 13 again: the process comes along, with the fork's own identity
    ok(srv, "delete", f1["id"], "--wait")
    f3 = _fork(srv, live, "--memory")
    assert f3["first"]["node"] == n13 and f3["moved"] is not None and f3["moved"]["memory"] is True
    v3 = _info(srv, f3["id"])
    assert (v3["state"], v3["node"], v3["memoryRestored"]) == ("running", n13, True)
    assert _memsha(srv, f3["id"]) == [pid, mem_sha]
    id3 = _identity(srv, f3["id"], other=live_id)
    assert id3[0] == v3["subdomain"]
    for a, b in zip(id3, live_id, strict=True):
        assert a != b
    assert ok(srv, "exec", f3["id"], "cat ~/note", timeout=60).strip() == f"from-{live}"

    # room on node 12 again: a fork stays there (a reflink copy, nothing moves)
    ok(srv, "delete", filler, "--wait")
    f4 = _fork(srv, live)
    assert f4["first"]["node"] == n12 and f4["moved"] is None
    assert _info(srv, f4["id"])["node"] == n12
    assert ok(srv, "exec", f4["id"], "cat ~/note", timeout=60).strip() == f"from-{live}"
    for sid in (f2["id"], f3["id"], f4["id"], live, parked):
        ok(srv, "delete", sid, "--wait")
