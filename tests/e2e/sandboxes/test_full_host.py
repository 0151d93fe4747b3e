"""A full host (issue 36): sandboxes fill a small data volume while the disk guard watches it.

The server gets its own ``SBX_HOME`` with a 3 GiB loop-backed XFS data volume made here (CRIU is the host's, the
base image a copy of the host's), and a host-side ballast file on it so it runs short quickly. Reserve 1 GiB, floor
0.6 GiB, checked every second. Three sandboxes: ``c`` fills its own disk (ENOSPC inside, cleanly), ``a`` and ``b``
write and fsync chunks at two rates until the volume passes the floor. Then: ``disk_low`` events for all three, a new
sandbox refused with 507, the writers stopped with ``stop_reason`` ``disk_full`` (fastest first) while ``c`` runs on,
every disk and seal passes ``e2fsck -fn``, the database passes SQLite's integrity check; once the ballast is deleted
every sandbox gets ``disk_ok``, resumes, and holds every chunk its writer had synced.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sbx.config import load_settings
from sbx.node.host.image import image_path
from sbx.storage.volume import ensure_volume, unmount_volume
from tests.e2e.conftest import Server, start_server
from tests.e2e.helpers import poll
from tests.slots import slotted

pytestmark = pytest.mark.e2e

MiB = 1 << 20
GiB = 1 << 30
NODE, BRIDGE, SUBNET = "dfull", "sbxdf0", "10.115.0.0/16"

WRITER = """mkdir -p /var/tmp/w && cd /var/tmp/w
last=$(date +%s); i=0
while [ $i -lt {max} ]; do
  i=$((i+1))
  if ! dd if=/dev/zero of=c$i bs=1M count={chunk} conv=fsync status=none 2>err; then
    echo "failed at $i: $(cat err)" >> result; sync result; exit 1
  fi
  echo $i >> synced; sync synced
  sleep {pause}
  now=$(date +%s)
  if [ $((now-last)) -gt 4 ]; then echo "paused before $((i+1))" >> result; sync result; exit 0; fi
  last=$now
done
echo done >> result
"""
"""Writes ``max`` chunks of ``chunk`` MiB, each fsynced and then listed in ``synced`` (fsynced too); ends at the
first failure, or when it notices it was stopped (a jump of the clock after a memory restore)."""

FILL = """avail=$(df --output=avail -B1M / | tail -1)
fallocate -l $((avail-48))M /var/tmp/reserved
dd if=/dev/zero of=/var/tmp/fill bs=1M count=1000 conv=fsync status=none
"""
"""``c`` fills its own disk: most of it with fallocate (no data reaches the volume), the last 48 MiB with data."""


def _events(server: Server, sid: str) -> list[dict[str, Any]]:
    req = urllib.request.Request(f"{server.url}/v1/sandboxes/{sid}/events",
                                 headers={"Authorization": f"Bearer {server.token}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return [json.loads(line) for line in resp.read().decode().splitlines() if line.strip()]


def _kinds(server: Server, sid: str) -> list[str]:
    return [str(e.get("event")) for e in _events(server, sid)]


def _sandbox(server: Server, sid: str) -> dict[str, Any]:
    return dict(server.api("GET", f"/v1/sandboxes/{sid}")["sandbox"])


@pytest.fixture
def full_host(tmp_path: Path) -> Iterator[tuple[Server, Any]]:
    """A server on its own 3 GiB data volume holding a 1.25 GiB ballast file (``volume/ballast``); yields the
    server and its settings. The volume is unmounted and removed afterwards."""
    node, bridge, subnet = slotted(NODE, BRIDGE, SUBNET)
    home = tmp_path / "sbxhome"
    home.mkdir()
    os.symlink("/var/lib/sbx/criu", home / "criu")  # the host's CRIU install (sbx setup made it)
    settings = load_settings(home=home, node_name=node, bridge=bridge, subnet=subnet, profile="test",
                             volume_size_gib=3)
    ensure_volume(settings)
    try:
        image = image_path(replace(settings, home=Path("/var/lib/sbx")))
        target = image_path(settings)
        subprocess.run(["cp", "--sparse=always", str(image), str(target)], check=True)
        shutil.copy(image.with_suffix(".json"), target.with_suffix(".json"))
        subprocess.run(["fallocate", "-l", str(1280 * MiB), str(settings.volume / "ballast")], check=True)
        env = {"SBX_HOME": str(home), "SBX_VOLUME_SIZE_GIB": "3", "SBX_DISK_RESERVE_GIB": "1.0",
               "SBX_DISK_FLOOR_GIB": "0.6", "SBX_DISK_CHECK_SECONDS": "1", "SBX_TEMPLATES": "0",
               "SBX_TRIM_SECONDS": "0"}
        with start_server(tmp_path, NODE, BRIDGE, SUBNET, **env) as srv:
            yield srv, settings
    finally:
        for _ in range(30):
            try:
                unmount_volume(settings, remove_backing=True)
                break
            except Exception:  # a disk still being unmounted by the stopping server
                time.sleep(1)


def test_a_full_host_stops_the_fastest_writers_and_everything_resumes(full_host: tuple[Server, Any]) -> None:
    server, settings = full_host
    ids = {}
    for name in ("a", "b", "c"):
        r = server.sbx("new", "--type", "small", "--json", check=True)
        ids[name] = json.loads(r.stdout)["sandbox"]["id"]
    a, b, c = ids["a"], ids["b"], ids["c"]

    # the overcommit is stated: three 2 GiB disks on a 3 GiB volume
    [node] = json.loads(server.sbx("node", "list", "--json", check=True).stdout)["nodes"]
    assert node["capacity"]["diskPromisedBytes"] == 3 * 2 * GiB, node
    assert server.sbx("node", "list", check=True).stdout.splitlines()[0].split()[4:7] == ["DISK", "FREE", "DISKS"]
    doctor = server.sbx("doctor", timeout=300).stdout
    line = next(x for x in doctor.splitlines() if "data volume" in x)
    assert re.search(r"sandbox disks may grow to 6 GiB: 2\.0\dx the 3 GiB volume", line), line  # XFS keeps some

    # c fills its own disk: the write fails with ENOSPC inside, the sandbox runs on
    r = server.sbx("exec", c, "--user", "root", FILL, timeout=300)
    assert r.returncode != 0 and "No space left on device" in r.stderr, (r.returncode, r.stdout, r.stderr)
    assert server.sbx("exec", c, "echo alive", check=True).stdout.strip() == "alive"

    # a writes fast, b slowly, both fsync each chunk and list it as synced
    server.sbx("exec", a, "--user", "root", "-d", WRITER.format(max=80, chunk=16, pause=0.2), check=True)
    server.sbx("exec", b, "--user", "root", "-d", WRITER.format(max=300, chunk=4, pause=0.3), check=True)

    poll(lambda: all("disk_low" in _kinds(server, s) for s in (a, b, c)), "disk_low events", timeout=120)
    r = server.sbx("new", "--type", "small")
    assert r.returncode != 0 and "insufficient_capacity" in r.stderr, (r.stdout, r.stderr)

    poll(lambda: all(_sandbox(server, s)["state"] == "stopped" for s in (a, b)), "a and b stopped", timeout=120)
    rows = {s: _sandbox(server, s) for s in (a, b, c)}
    assert rows[a]["stopReason"] == "disk_full" and rows[b]["stopReason"] == "disk_full", rows
    assert rows[c]["state"] == "running", rows[c]
    full = {s: [e for e in _events(server, s) if e["event"] == "disk_full"] for s in (a, b)}
    assert full[a] and full[b], full
    first_a, first_b = full[a][0], full[b][0]
    print(f"disk_full: a at {first_a['freeBytes'] / MiB:.0f} MiB free ({first_a['growthBytesPerSecond'] / MiB:.1f}"
          f" MiB/s, memory {first_a['keepMemory']}), b at {first_b['freeBytes'] / MiB:.0f} MiB free "
          f"({first_b['growthBytesPerSecond'] / MiB:.1f} MiB/s, memory {first_b['keepMemory']})")
    assert first_a["growthBytesPerSecond"] > first_b["growthBytesPerSecond"]
    assert first_a["freeBytes"] >= first_b["freeBytes"]  # the fastest went first
    st = os.statvfs(settings.volume)
    print(f"volume free after the stops: {st.f_bavail * st.f_frsize / MiB:.0f} MiB")
    assert st.f_bavail > 0

    # every disk (all stopped now) and every seal is a clean ext4; the database is intact
    server.sbx("stop", c, "--wait", check=True)
    checked = 0
    for sid in (a, b, c):
        folder = settings.node_dir / "sandboxes" / sid
        for img in [folder / "disk.ext4", *sorted((folder / "seals").glob("*.ext4"))]:
            fsck = subprocess.run(["e2fsck", "-fn", str(img)], capture_output=True, text=True)
            assert fsck.returncode == 0, f"{img}: {fsck.returncode}\n{fsck.stdout}\n{fsck.stderr}"
            checked += 1
    assert checked >= 6  # three disks and at least one seal each (a stop seals the disk)
    dbs = sorted(Path(server.env["SBX_STATE_DIR"]).rglob("*.db"))
    assert dbs
    for db in dbs:
        with sqlite3.connect(db) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",), db

    # space comes back: disk_ok, and every sandbox resumes with what its writer had synced
    (settings.volume / "ballast").unlink()
    poll(lambda: all("disk_ok" in _kinds(server, s) for s in (a, b)), "disk_ok events", timeout=60)
    for sid in (a, b, c):
        server.sbx("resume", sid, "--wait", check=True, timeout=300)
    for sid, chunk in ((a, 16), (b, 4)):
        synced = server.sbx("exec", sid, "cat /var/tmp/w/synced", check=True).stdout.split()
        assert synced, sid
        sizes = server.sbx("exec", sid, f"cd /var/tmp/w && stat -c %s {' '.join('c' + n for n in synced)}",
                           check=True).stdout.split()
        if sizes != [str(chunk * MiB)] * len(synced):
            listing = server.sbx("exec", sid, "ls -la /var/tmp/w; cat /var/tmp/w/result").stdout
            raise AssertionError(f"{sid}: {len(synced)} synced, sizes {sizes}\n{listing}")
        result = server.sbx("exec", sid, "cat /var/tmp/w/result 2>/dev/null || true", check=True).stdout
        assert "failed" not in result, (sid, result)  # no write of the writer failed (no EIO from a full volume)
        print(f"{sid}: {len(synced)} chunks of {chunk} MiB synced before the stop, all there after the resume")
    assert server.sbx("exec", c, "echo alive", check=True).stdout.strip() == "alive"
    for e in _events(server, a):
        print("event", json.dumps(e, separators=(",", ":")))
