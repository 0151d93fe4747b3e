"""Warm sandboxes (issue 13, sbx.node.memory.warmpool), on real sandboxes through the CLI: a server keeping two per
size.

- Once the small template is built, two small sandboxes are restored from it ahead of time (phase ``pooled``,
  hostname ``sbx-pool``), unlisted. Two ``sbx new`` at once take them over (``startedFrom: "pool"``, the warm
  sandboxes' ids): each has its own hostname (UTS and files), machine-id, SSH host keys, IPv4 and MAC, distinct
  from each other's, from a cold-booted one's and from what the warm sandbox had; the host's clock; an empty /tmp;
  ``is-system-running`` = ``running``; its own disk. Two new warm sandboxes are made after them.
- ``--cold`` takes none. The server's shutdown deletes the warm sandboxes (no container, no folder left), and a
  server killed with SIGKILL leaves its warm sandboxes to the next start's reconcile, which deletes them.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.faultsrv import FaultServer
from tests.e2e.helpers import identity, new_small, poll, sh

pytestmark = pytest.mark.e2e



@pytest.fixture(scope="module")
def fs(tmp_path_factory: pytest.TempPathFactory):
    f = FaultServer(tmp_path_factory.mktemp("sbx-warm"), prefix="SBX_WARM", node="wpool", bridge="sbxwp0",
                    subnet="10.90.0.0/16", SBX_WARM_POOL="2")
    f.start()
    yield f
    f.close()


def _sandboxes(f: FaultServer) -> Path:
    return Path("/var/lib/sbx/volume/nodes") / f.node / "sandboxes"


def _warm(f: FaultServer) -> dict[str, dict]:  # type: ignore[type-arg]
    """``{id: node record}`` of the warm sandboxes ready on the node."""
    out = {}
    for rec_file in _sandboxes(f).glob("*/node.json"):
        try:
            rec = json.loads(rec_file.read_text())
        except (OSError, ValueError):
            continue
        if rec.get("phase") == "pooled":
            out[rec_file.parent.name] = rec
    return out


def _containers(f: FaultServer) -> set[str]:
    p = subprocess.run(["runc", "--root", f"/run/sbx/{f.node}/runc", "list", "-q"], capture_output=True, text=True)
    return set(p.stdout.split())








def _fill(f: FaultServer, n: int = 2) -> dict[str, dict]:  # type: ignore[type-arg]
    return poll(lambda: (w if len(w := _warm(f)) >= n else None), f"{n} warm small sandboxes", timeout=300)


def test_new_sandboxes_take_over_warm_ones_with_their_own_identity(fs):
    first = new_small(fs)  # cold boots; the template is built, then the warm sandboxes
    assert fs.node_record(first)["startedFrom"] == "boot"
    warm = _fill(fs)
    disk = {sid: Path("/run/sbx") / fs.node / "bundles" / sid / "disk" for sid in warm}
    before = {sid: (disk[sid] / "etc" / "machine-id").read_text().strip() for sid in warm}
    for sid, rec in warm.items():
        assert rec["spec"]["hostname"] == "sbx-pool" and rec["pooled"] == "small"
        assert sid in _containers(fs)
    assert fs.srv is not None
    listed = {s["id"] for s in json.loads(fs.srv.sbx("list", "--json", check=True).stdout)["sandboxes"]}
    assert listed == {first}  # nobody's: not listed

    made: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: made.__setitem__(i, new_small(fs))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = made[0], made[1]
    assert {a, b} == set(warm)  # the warm sandboxes became these two
    for sid in (a, b):
        rec = fs.node_record(sid)
        assert rec["startedFrom"] == "pool" and rec["phase"] == "running" and "pooled" not in rec
        info = json.loads(fs.srv.sbx("info", sid, "--json", check=True).stdout)["sandbox"]
        assert info["state"] == "running"
        assert rec["spec"]["hostname"] == info["subdomain"]
    ida, idb, idfirst = identity(fs, a), identity(fs, b), identity(fs, first)
    for key in ida:
        assert ida[key] != idb[key], key
        assert ida[key] != idfirst[key], key
    for sid, ident in ((a, ida), (b, idb)):
        assert ident["hostname"] == ident["etc_hostname"] == fs.node_record(sid)["spec"]["hostname"] != "sbx-pool"
        assert ident["machine_id"] != before[sid]  # a new one at the claim, not the warm sandbox's
        assert ident["ip"].split("/")[0] == fs.node_record(sid)["lease"]["address"].split("/")[0]
        out = sh(fs, sid, "systemctl is-system-running; date +%s; "
                           "ls -A /tmp | grep -v -e '^systemd-private-' -e '^\\.[A-Za-z0-9]*-unix$' | wc -l; "
                           "stat -c %U /home/user; sudo -n true && echo sudo-ok").split()
        assert out[0] == "running"
        assert abs(int(out[1]) - time.time()) < 5
        assert out[2] == "0"
        assert out[3] == "user" and out[4] == "sudo-ok"
    sh(fs, a, "echo only-a > ~/mark")
    assert sh(fs, b, "cat ~/mark 2>/dev/null || echo none").strip() == "none"
    # two new warm sandboxes, neither of them one that was handed out
    again = _fill(fs)
    assert not set(again) & {a, b, first}


def test_cold_takes_no_warm_sandbox(fs):
    warm = _fill(fs)
    sid = new_small(fs, "--cold")
    assert fs.node_record(sid)["startedFrom"] == "boot" and sid not in warm
    assert set(_warm(fs)) == set(warm)


def test_shutdown_deletes_warm_sandboxes_and_a_crash_leaves_them_to_the_reconcile(fs):
    warm = set(_fill(fs))
    assert fs.term() == 0
    assert not warm & _containers(fs)
    assert not any((_sandboxes(fs) / sid).exists() for sid in warm)
    fs.start()
    sid = new_small(fs)  # the template survives; the pool fills again after this create
    assert fs.node_record(sid)["startedFrom"] == "template"
    warm = set(_fill(fs))
    fs.kill9()
    assert warm <= _containers(fs)  # a crash leaves them running
    fs.start()
    assert not warm & _containers(fs)
    assert not any((_sandboxes(fs) / w).exists() for w in warm)
    assert fs.srv is not None
    listed = {s["id"] for s in json.loads(fs.srv.sbx("list", "--json", check=True).stdout)["sandboxes"]}
    assert not warm & listed
