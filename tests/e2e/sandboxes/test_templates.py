"""Memory templates and fork with memory (issue 13), on real sandboxes through the CLI.

- ``sbx new`` after a size's first cold boot restores that size's template: every sandbox from it has its own
  hostname, machine-id, SSH host keys, IPv4 and MAC (distinct from the template's and from a sibling made at the
  same time), the host's clock, an empty /tmp (but for systemd's own folders) and ``is-system-running`` =
  ``running``; ``--cold`` boots instead.
- ``sbx fork ID --memory``: the fork has the source's process with the same in-sandbox PID and memory SHA-256, a
  new identity, ``memoryRestored: true``; the two diverge afterwards and the source keeps its PID.
- A server killed with SIGKILL in the middle of a template build leaves nothing half made.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.faultsrv import FaultServer
from tests.e2e.helpers import identity, new_small, poll, sh

pytestmark = pytest.mark.e2e

# test_node_runtime's COUNTER (128 MiB of random bytes, its PID and SHA-256 printed), which also prints the hash of
# its buffer again on SIGUSR1: asked in a fork, it shows the memory came along.
COUNTER = (
    "python3 -u -c 'import os,time,hashlib,signal;b=bytearray(os.urandom(1<<20))*128;"
    "say=lambda *a:print(os.getpid(),hashlib.sha256(b).hexdigest(),flush=True);"
    "signal.signal(signal.SIGUSR1,say);say();[time.sleep(1) for _ in iter(int,1)]'"
)


@pytest.fixture(scope="module")
def fs(tmp_path_factory: pytest.TempPathFactory):
    f = FaultServer(tmp_path_factory.mktemp("sbx-templates"), prefix="SBX_TPL", node="tpl", bridge="sbxtpl0",
                    subnet="10.97.0.0/16")
    f.start()
    yield f
    f.close()


def _templates(f: FaultServer) -> Path:
    return Path("/var/lib/sbx/volume/nodes") / f.node / "templates"








def _ready_template(f: FaultServer) -> dict:  # type: ignore[type-arg]
    metas = poll(lambda: list(_templates(f).glob("*-small/template.json")), "the small template", timeout=300)
    return json.loads(metas[0].read_text())  # type: ignore[no-any-return]


def test_sandboxes_from_a_template_get_their_own_identity(fs):
    first = new_small(fs)  # the first small sandbox cold boots and asks for the template
    assert fs.node_record(first)["startedFrom"] == "boot"
    meta = _ready_template(fs)
    assert meta["hostname"] == "sbx-template" and meta["size"] == "small"
    made: dict[int, str] = {}

    def make(i: int) -> None:
        made[i] = new_small(fs)

    threads = [threading.Thread(target=make, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = made[0], made[1]
    for sid in (a, b):
        assert fs.node_record(sid)["startedFrom"] == "template"
    # each has a uid range of its own (the template's was given back once it was dumped, so one may reuse it)
    assert len({fs.node_record(s)["uidBase"] for s in (a, b, first)}) == 3
    ida, idb, idfirst = identity(fs, a), identity(fs, b), identity(fs, first)
    print(ida, idb, idfirst)
    for key in ida:
        assert ida[key] != idb[key], key
        assert ida[key] != idfirst[key], key
    assert ida["hostname"] == ida["etc_hostname"] != "sbx-template"
    assert ida["ip"].split("/")[0] == fs.node_record(a)["lease"]["address"].split("/")[0]
    for sid in (a, b):
        out = sh(fs, sid, "systemctl is-system-running; date +%s; "
                           "ls -A /tmp | grep -v -e '^systemd-private-' -e '^\\.[A-Za-z0-9]*-unix$' | wc -l; "
                           "stat -c %U /home/user; sudo -n true && echo sudo-ok").split()
        assert out[0] == "running"
        assert abs(int(out[1]) - time.time()) < 5  # the host's clock, not the template's
        assert out[2] == "0"  # nothing in /tmp but what systemd makes at boot
        assert out[3] == "user" and out[4] == "sudo-ok"
    # the sandboxes' disks are their own copies: a write in one is not in the other
    sh(fs, a, "echo only-a > ~/mark")
    assert sh(fs, b, "cat ~/mark 2>/dev/null || echo none").strip() == "none"


def test_cold_forces_a_boot(fs):
    _ready_template(fs)
    sid = new_small(fs, "--cold")
    assert fs.node_record(sid)["startedFrom"] == "boot"
    assert sh(fs, sid, "systemctl is-system-running").strip() == "running"


def test_fork_with_memory_keeps_the_process_and_gets_a_new_identity(fs):
    assert fs.srv is not None
    src = new_small(fs)
    job = fs.srv.sbx("exec", src, "--detach", COUNTER, check=True).stdout.strip()
    first = poll(lambda: fs.srv.sbx("logs", src, job).stdout.strip(), "the counter's first line", timeout=60)
    pid, digest = first.split()[:2]
    # written just before the fork, still in the page cache: the fork's disk has it (the copy is synced first)
    written = sh(fs, src, "head -c 4M /dev/urandom > ~/before && sha256sum < ~/before").split()[0]
    fork = json.loads(fs.srv.sbx("fork", src, "--memory", "--wait", "--json", check=True).stdout.splitlines()[-1])
    fork_id = fork.get("id") or fork["sandbox"]["id"]
    assert sh(fs, fork_id, "sha256sum < ~/before").split()[0] == written
    view = json.loads(fs.srv.sbx("info", fork_id, "--json", check=True).stdout)["sandbox"]
    assert view["memoryRestored"] is True and view["state"] == "running"
    # the same process with the same in-sandbox PID in both; asked in the fork, it hashes the same memory
    for sid in (src, fork_id):
        assert "python3" in sh(fs, sid, f"cat /proc/{pid}/cmdline | tr '\\0' ' '")
    sh(fs, fork_id, f"kill -USR1 {pid}")
    lines = poll(lambda: (fs.srv.sbx("logs", fork_id, job).stdout.split("\n")[1:2] or [""])[0].strip(),
                 "the fork's counter to answer SIGUSR1", timeout=60)
    assert lines.split() == [pid, digest]
    assert len(fs.srv.sbx("logs", src, job).stdout.strip().split("\n")) == 1  # the source's output is its own
    ida, ids = identity(fs, fork_id), identity(fs, src)
    for key in ida:
        assert ida[key] != ids[key], key
    # they diverge: a file and a process in one are not in the other
    sh(fs, fork_id, "echo fork > ~/who; sleep 1000 >/dev/null 2>&1 &")
    sh(fs, src, "echo src > ~/who")
    assert sh(fs, fork_id, "cat ~/who").strip() == "fork"
    assert sh(fs, src, "cat ~/who").strip() == "src"
    assert "sleep 1000" not in sh(fs, src, "ps -eo args")
    assert "python3" in sh(fs, src, f"cat /proc/{pid}/cmdline | tr '\\0' ' '")  # the source kept its PID


def test_a_fork_made_right_after_a_create_gets_ssh_keys_of_its_own(fs):
    """A sandbox from a template makes its SSH host keys after ``sbx new`` answered; a fork with memory asked for
    at once waits for them instead of copying ``ssh-keygen`` half done (CI once saw the fork's sshd never start)."""
    assert fs.srv is not None
    src = new_small(fs)
    fork = json.loads(fs.srv.sbx("fork", src, "--memory", "--wait", "--json", check=True).stdout.splitlines()[-1])
    fork_id = fork.get("id") or fork["sandbox"]["id"]
    ida, ids = identity(fs, fork_id), identity(fs, src)
    assert ida["ssh_key"] != ids["ssh_key"] and ida["hostname"] != ids["hostname"]
    for sid in (fork_id, src):
        fs.srv.sbx("delete", sid, "--wait", check=True)


def test_plain_fork_keeps_memory_restored_null(fs):
    assert fs.srv is not None
    src = new_small(fs)
    fork = fs.srv.sbx("fork", src, "--wait", check=True).stdout.strip().splitlines()[-1]
    view = json.loads(fs.srv.sbx("info", fork, "--json", check=True).stdout)["sandbox"]
    assert view["memoryRestored"] is None


def test_fork_with_memory_of_a_stopped_sandbox_is_refused(fs):
    assert fs.srv is not None
    src = new_small(fs)
    fs.srv.sbx("stop", src, "--wait", check=True)
    r = fs.srv.sbx("fork", src, "--memory", "--json")
    assert r.returncode != 0 and re.search(r"invalid_state|not_running", r.stdout + r.stderr)


def test_a_server_killed_before_a_template_sandbox_got_its_ssh_keys_gives_them_at_restart(fs):
    """A sandbox from a template gets its SSH host keys and sshd from a thread once ``sbx new`` has answered; a
    server killed before that thread ran finishes it when it starts again (the record's ``identityPending``)."""
    _ready_template(fs)
    fs.kill9()
    fs.start(SBX_TEST_HOLD_IDENTITY="120")
    sid = new_small(fs)
    assert fs.node_record(sid)["startedFrom"] == "template"
    poll(lambda: (fs.sandbox_dir(sid) / "identity-hold").exists(), "the identity thread to hold", 60, 0.1)
    assert fs.node_record(sid)["identityPending"] is True
    keys = "ls /etc/ssh/ssh_host_*_key 2>/dev/null | wc -l; systemctl is-active ssh || true"
    assert sh(fs, sid, keys).split() == ["0", "inactive"]  # a template has neither
    fs.kill9()
    fs.start(SBX_TEST_HOLD_IDENTITY="")
    poll(lambda: sh(fs, sid, keys).split()[1] == "active", "sshd after the restart", 60)
    assert int(sh(fs, sid, keys).split()[0]) >= 3
    assert "identityPending" not in fs.node_record(sid)
    fs.srv.sbx("delete", sid, "--wait", check=True)


def test_server_killed_mid_template_build_leaves_nothing_half_made(tmp_path):
    f = FaultServer(tmp_path, prefix="SBX_TPLK", node="tplk", bridge="sbxtplk0", subnet="10.98.0.0/16")
    try:
        f.start(SBX_TEST_HOLD_TEMPLATE="60")
        tdir = _templates(f)
        sid = new_small(f)  # cold boot; the template build starts in the background and holds half assembled
        poll(lambda: (tdir / "build-hold").exists(), "the template build to hold", timeout=300, interval=0.1)
        assert list(tdir.glob("*.tmp")) and not list(tdir.glob("*/template.json"))
        f.kill9()
        f.start(SBX_TEST_HOLD_TEMPLATE="")
        assert not list(tdir.glob("*.tmp")) and not (tdir / "build-hold").exists()
        assert not [p for p in tdir.iterdir() if not (p / "template.json").is_file()]
        sandboxes = Path("/var/lib/sbx/volume/nodes") / f.node / "sandboxes"
        assert sorted(p.name for p in sandboxes.iterdir()) == [sid]  # the hidden build sandbox is gone
        assert not list(Path(f"/run/sbx/{f.node}/runc").glob("sb_tpl*"))
        # the next cold boot builds it again, completely, and the one after comes from it
        new_small(f)
        _ready_template(f)
        later = new_small(f)
        assert f.node_record(later)["startedFrom"] == "template"
    finally:
        f.close()
