"""Admission and space on real sandboxes (issue 17, item 6).

- A flood of creates beyond the node's memory gets clear ``507 insufficient_capacity`` answers (the CLI exits
  non-zero naming the code; the API answers the JSON error), never a sandbox that ends ``boot_failed``, and every
  accepted sandbox answers exec. A stopped sandbox whose room was taken is refused on resume and stays stopped with
  its memory; deleting a sandbox makes room again.
- Space given back: 2 GB written and then deleted inside a sandbox leaves the host's filesystem again (``du`` of the
  data volume's sparse backing file), and so does deleting a sandbox that holds 2 GB.

The server here is this module's own (node ``capacity`` on bridge ``sbxcapy0`` / 10.97.0.0/16; SBX_CAP_NODE /
SBX_CAP_BRIDGE / SBX_CAP_SUBNET override them) with ``SBX_MEMORY_OVERCOMMIT`` set so that the node may promise four
test-profile small sandboxes (4 x 256 MiB) of this host's RAM, and the volume checked for trimming every 5 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from sbx.config import Settings, load_settings
from tests.e2e.conftest import Server, start_server
from tests.e2e.helpers import poll

pytestmark = pytest.mark.e2e

SLOTS = 4
SMALL_MIB = 256
GB = 1000**3


def _host_memory_mib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("MemTotal:"))


def _overcommit() -> str:
    """The ratio that lets the node promise SLOTS small sandboxes and a half, never SLOTS + 1."""
    usable = _host_memory_mib() - getattr(Settings(), "memory_reserve_mib", 1024)
    return f"{(SLOTS * SMALL_MIB + SMALL_MIB // 2) / usable:.8f}"


@pytest.fixture(scope="module")
def cap_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(
        tmp_path_factory.mktemp("sbx-cap"),
        node=os.environ.get("SBX_CAP_NODE", "capacity"),
        bridge=os.environ.get("SBX_CAP_BRIDGE", "sbxcapy0"),
        subnet=os.environ.get("SBX_CAP_SUBNET", "10.97.0.0/16"),
        SBX_MEMORY_OVERCOMMIT=_overcommit(),
        SBX_TRIM_SECONDS="5",
    ) as srv:
        yield srv


@pytest.fixture
def clean(cap_server: Server) -> Iterator[Server]:
    """The server, with every sandbox of the test deleted afterwards (each test starts from an empty node)."""
    yield cap_server
    for sb in cap_server.api("GET", "/v1/sandboxes")["sandboxes"]:
        cap_server.api("DELETE", f"/v1/sandboxes/{sb['id']}?wait=true")


def _new(server: Server, type: str = "small") -> subprocess.CompletedProcess[str]:
    return server.sbx("new", "--type", type, "--json", timeout=900)


def _id(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stderr
    return str(json.loads(proc.stdout.strip().splitlines()[-1])["sandbox"]["id"])


def _post(server: Server, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST", headers={
        "Authorization": f"Bearer {server.token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _states(server: Server) -> dict[str, dict[str, Any]]:
    return {sb["id"]: sb for sb in server.api("GET", "/v1/sandboxes")["sandboxes"]}


def _answers(server: Server, sid: str) -> bool:
    r = server.sbx("exec", sid, "--timeout", "120", "echo alive", timeout=300)
    return r.returncode == 0 and r.stdout == "alive\n"


def _refused(proc: subprocess.CompletedProcess[str]) -> bool:
    return proc.returncode != 0 and "error: insufficient_capacity: not enough memory" in proc.stderr


def test_a_create_flood_beyond_memory_gets_clear_507s_and_no_boot_failures(clean: Server) -> None:
    server = clean
    with ThreadPoolExecutor(max_workers=SLOTS + 3) as pool:
        results = list(pool.map(lambda _: _new(server), range(SLOTS + 3)))
    accepted = [_id(r) for r in results if r.returncode == 0]
    refused = [r for r in results if r.returncode != 0]
    assert len(accepted) == SLOTS, [r.stderr for r in refused]
    assert len(refused) == 3 and all(_refused(r) for r in refused), [r.stderr for r in refused]
    status, body = _post(server, "/v1/sandboxes", {"type": "small"})
    assert status == 507 and body["error"]["code"] == "insufficient_capacity", body
    assert "memory" in body["error"]["message"]
    states = _states(server)
    assert sorted(states) == sorted(accepted)  # a refusal leaves no sandbox behind
    assert all(sb["state"] == "running" for sb in states.values()), states
    assert all(_answers(server, sid) for sid in accepted)

    # a stopped sandbox gives its room back; once another takes it, resuming is refused and changes nothing
    stopped = accepted[0]
    server.sbx("exec", stopped, "echo kept > ~/mark", check=True)
    server.sbx("stop", stopped, "--wait", check=True)
    late = _id(_new(server))
    r = server.sbx("resume", stopped, "--wait")
    assert _refused(r), (r.returncode, r.stderr)
    status, body = _post(server, f"/v1/sandboxes/{stopped}/resume", {})
    assert status == 507 and body["error"]["code"] == "insufficient_capacity", body
    assert _states(server)[stopped]["state"] == "stopped"
    r = server.sbx("fork", late)
    assert _refused(r), (r.returncode, r.stderr)
    assert len(_states(server)) == SLOTS + 1

    # deleting one makes room: the stopped one resumes with its memory and files, and then a create fits again
    server.sbx("delete", late, "--wait", check=True)
    server.sbx("resume", stopped, "--wait", check=True)
    sb = _states(server)[stopped]
    assert (sb["state"], sb["memoryRestored"]) == ("running", True), sb
    assert server.sbx("exec", stopped, "cat ~/mark", check=True).stdout == "kept\n"
    _delete(server, accepted[1])
    assert _answers(server, _id(_new(server)))
    assert not [s for s in _states(server).values() if s["state"] == "error"]


def _delete(server: Server, sid: str) -> None:
    server.api("DELETE", f"/v1/sandboxes/{sid}?wait=true")


# --- space --------------------------------------------------------------------------------------------------------


def _settings() -> Settings:
    return load_settings(profile="test")


def _host_bytes(path: Path) -> int:
    """Bytes ``path`` takes on the host's disk (``du``: allocated blocks, holes excluded)."""
    return os.stat(path).st_blocks * 512


def _excess() -> int:
    """Bytes the volume file takes on the host beyond what the volume's filesystem uses: freed space not given back
    yet. Writes by other servers on this host move ``du`` and the volume's use alike, so this is what the test
    follows."""
    st = os.statvfs(_settings().volume)
    return _host_bytes(_settings().volume_backing) - (st.f_blocks - st.f_bfree) * st.f_frsize


def _settle_volume() -> int:
    """Give the volume's already-free blocks back first (as an admin's ``fstrim`` would), so that the 2 GB written
    next lands on fresh host blocks instead of reusing freed ones; returns ``du`` of the volume file then."""
    vol = _settings().volume
    for _ in range(3):
        subprocess.run(["sync", "-f", str(vol)], check=True)
        subprocess.run(["fstrim", str(vol)], check=True)
        time.sleep(1)
    return _host_bytes(_settings().volume_backing)


def _write_2gb(server: Server, sid: str) -> None:
    r = server.sbx("exec", sid, "--timeout", "900",
                   "head -c 2000000000 /dev/urandom > ~/big && sync && stat -c %s ~/big", timeout=1200)
    assert r.returncode == 0 and r.stdout.strip() == "2000000000", (r.returncode, r.stdout, r.stderr)


def test_space_deleted_inside_a_sandbox_and_by_deleting_it_goes_back_to_the_host(clean: Server) -> None:
    server = clean
    volume_file = _settings().volume_backing
    assert volume_file.is_file(), f"no data volume file at {volume_file}"
    sid = _id(_new(server, "default"))  # a 3 GiB disk (test profile) holds the 2 GB
    disk = _settings().volume / "nodes" / server.env["SBX_NODE_NAME"] / "sandboxes" / sid / "disk.ext4"
    assert disk.is_file(), f"no disk image at {disk}"

    start = _settle_volume()
    excess = _excess()
    _write_2gb(server, sid)
    assert _host_bytes(volume_file) > start + 1.5 * GB  # the write really reached the host's disk
    server.sbx("exec", sid, "rm ~/big && sync", check=True)
    # the sandbox's disk image gives the blocks back to the volume at once (discard)...
    poll(lambda: _host_bytes(disk) < 1 * GB, "the disk image to shrink after the delete inside", timeout=300)
    # ...and the volume gives them back to the host's filesystem (trim)
    poll(lambda: _excess() < excess + 0.5 * GB,
         f"the volume file to give the 2 GB back (du {start / GB:.2f} GB at the start, "
         f"{_host_bytes(volume_file) / GB:.2f} GB after the delete)", timeout=600, interval=2)

    start = _settle_volume()
    excess = _excess()
    _write_2gb(server, sid)
    assert _host_bytes(volume_file) > start + 1.5 * GB
    _delete(server, sid)
    assert not disk.exists()
    poll(lambda: _excess() < excess + 0.5 * GB,
         f"the volume file to give a deleted sandbox's 2 GB back (du {start / GB:.2f} GB at the start, "
         f"{_host_bytes(volume_file) / GB:.2f} GB after the delete)", timeout=600, interval=2)
