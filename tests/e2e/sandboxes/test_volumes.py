"""Persistent volumes (issue 34) on real sandboxes through the CLI: two sandboxes share a volume (200 appends each,
at once, every line lands exactly once; both see the files as their own ``user``), a fork mounts it too, an SQLite
database on it passes ``PRAGMA integrity_check`` after a stop with memory and a resume, it outlives ``sbx delete`` of
every sandbox, ``sbx volume delete`` is refused while a sandbox mounts it, and root inside a sandbox finds neither
the volume's metadata nor its store (mount table, paths, ``..`` out of the mount, mounting, its own internal files).
A volume whose daemon died is mounted again by the restarted server's reconcile.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.faultsrv import FaultServer

pytestmark = pytest.mark.e2e

VOLUMES_DIR = "/var/lib/sbx/volumes"  # the server's SBX_HOME/volumes (the e2e server keeps the default home)


def _new(server: Any, *args: str) -> dict[str, Any]:
    r = server.sbx("new", "--type", "small", "--json", *args, check=True)
    return dict(json.loads(r.stdout)["sandbox"])


def _sh(server: Any, sid: str, command: str, user: str = "user", check: bool = True) -> str:
    r = server.sbx("exec", sid, "--user", user, command, check=check, timeout=300)
    return str(r.stdout)


def _appends(server: Any, sid: str, tag: str, errors: list[str]) -> None:
    # close-to-open with a lock around each append, as on any file system shared by several clients
    loop = f'for i in $(seq 1 200); do flock /data/log.lock sh -c "echo {tag}-$i >> /data/log"; done'
    r = server.sbx("exec", sid, loop, timeout=600)
    if r.returncode != 0:
        errors.append(f"{tag}: {r.returncode} {r.stderr}")


def test_volumes_end_to_end(server: Any) -> None:
    r = server.sbx("volume", "create", "shared", "--size", "2", "--json", check=True)
    vol = json.loads(r.stdout)["volume"]
    assert vol["name"] == "shared" and vol["sizeGiB"] == 2
    r = server.sbx("volume", "create", "shared")
    assert r.returncode == 1 and "volume_exists" in r.stderr
    r = server.sbx("new", "--volume", "shared:/proc/x")
    assert r.returncode == 1 and "invalid_volume_path" in r.stderr
    r = server.sbx("new", "--volume", "nope:/data")
    assert r.returncode == 1 and "volume_not_found" in r.stderr

    a = _new(server, "--volume", "shared:/data")
    b = _new(server, "--volume", "shared:/data")
    assert a["volumes"] == [{"name": "shared", "path": "/data", "readOnly": False}]
    info = server.sbx("info", b["id"], check=True).stdout
    assert "shared at /data" in info
    assert sorted(json.loads(server.sbx("volume", "list", "--json", check=True).stdout)["volumes"][0]["sandboxes"]) \
        == sorted([a["id"], b["id"]])

    # -- two sandboxes append to one file at once: every line exactly once, owned by each one's own `user`
    errors: list[str] = []
    threads = [threading.Thread(target=_appends, args=(server, sid, tag, errors)) for sid, tag in
               ((a["id"], "a"), (b["id"], "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    lines = _sh(server, b["id"], "cat /data/log").split()
    want = [f"{tag}-{i}" for tag in ("a", "b") for i in range(1, 201)]
    assert sorted(lines) == sorted(want), (len(lines), sorted(set(want) - set(lines))[:5])
    _sh(server, b["id"], "echo from-b > /data/b-file && mkdir -p /data/dir")
    for sid in (a["id"], b["id"]):
        owners = _sh(server, sid, "stat -c '%U:%G' /data/log /data/b-file /data/dir").split()
        assert owners == ["user:user"] * 3, (sid, owners)
        assert _sh(server, sid, "id -un && touch /data/dir/x-$(hostname) && echo ok").split() == ["user", "ok"]
    root_file = _sh(server, a["id"], "echo r > /data/root-file && stat -c '%U' /data/root-file", user="root")
    assert root_file.strip() == "root"
    assert _sh(server, b["id"], "stat -c '%U' /data/root-file").strip() == "root"
    assert "Permission denied" in server.sbx("exec", b["id"], "echo x >> /data/root-file").stderr + \
        server.sbx("exec", b["id"], "echo x >> /data/root-file 2>&1").stdout

    # -- a fork mounts the same volume
    fork_id = server.sbx("fork", a["id"], "--wait", check=True, timeout=600).stdout.strip()
    fork = json.loads(server.sbx("info", fork_id, "--json", check=True).stdout)["sandbox"]
    assert fork["volumes"] == a["volumes"]
    assert _sh(server, fork["id"], "cat /data/b-file").strip() == "from-b"
    _sh(server, fork["id"], "echo from-fork > /data/fork-file")
    assert _sh(server, a["id"], "cat /data/fork-file").strip() == "from-fork"

    # -- SQLite on the volume across a stop with memory and a resume
    py = ("import sqlite3; c = sqlite3.connect('/data/app.db'); c.execute('create table if not exists t (i integer, "
          "s text)'); c.executemany('insert into t values (?, ?)', [(i, 'x' * 100) for i in range(5000)]); "
          "c.commit(); print(c.execute('select count(*) from t').fetchone()[0])")
    assert _sh(server, a["id"], f'python3 -c "{py}"').strip() == "5000"
    server.sbx("exec", a["id"], "--detach", "sleep 3600", check=True)  # a process that must come back
    stopped = json.loads(server.sbx("stop", a["id"], "--wait", "--json", check=True, timeout=600).stdout)["sandbox"]
    assert stopped["state"] == "stopped" and stopped["memorySaved"] is True, stopped.get("stopError")
    # meanwhile the other sandbox keeps writing
    assert _sh(server, b["id"], f'python3 -c "{py}"').strip() == "10000"
    resumed = json.loads(server.sbx("resume", a["id"], "--wait", "--json", check=True, timeout=600).stdout)["sandbox"]
    assert resumed["memoryRestored"] is True, resumed
    assert _sh(server, a["id"], "pgrep -x sleep >/dev/null && echo kept").strip() == "kept"
    check = ("import sqlite3; c = sqlite3.connect('/data/app.db'); print(c.execute('pragma integrity_check')"
             ".fetchone()[0], c.execute('select count(*) from t').fetchone()[0])")
    assert _sh(server, a["id"], f'python3 -c "{check}"').split() == ["ok", "10000"]
    assert _sh(server, a["id"], "stat -c '%U' /data/app.db && echo after > /data/after-resume && cat /data/after-resume"
               ).split() == ["user", "after"]

    # -- root inside a sandbox can't reach the metadata or the store
    _attack(server, a["id"], vol["id"])

    # -- refused while mounted; outlives every sandbox
    r = server.sbx("volume", "delete", "shared")
    assert r.returncode == 1 and "volume_in_use" in r.stderr
    for sid in (a["id"], b["id"], fork["id"]):
        server.sbx("delete", sid, "--wait", check=True)
    listed = json.loads(server.sbx("volume", "list", "--json", check=True).stdout)["volumes"]
    assert [(v["name"], v["sandboxes"]) for v in listed] == [("shared", [])]
    c = _new(server, "--volume", "shared:/srv/data:ro")
    assert c["volumes"] == [{"name": "shared", "path": "/srv/data", "readOnly": True}]
    assert sorted(_sh(server, c["id"], "cat /srv/data/log").split()) == sorted(want)
    ro_check = check.replace("connect('/data/app.db')", "connect('file:/srv/data/app.db?immutable=1', uri=True)")
    assert _sh(server, c["id"], f'python3 -c "{ro_check}"').split() == ["ok", "10000"]
    r = server.sbx("exec", c["id"], "echo x > /srv/data/nope 2>&1; echo rc=$?")
    assert "Read-only file system" in r.stdout + r.stderr and "rc=1" in r.stdout
    server.sbx("delete", c["id"], "--wait", check=True)
    server.sbx("volume", "delete", "shared", check=True)
    assert json.loads(server.sbx("volume", "list", "--json", check=True).stdout)["volumes"] == []
    r = server.sbx("volume", "show", "shared")
    assert r.returncode == 1 and "volume_not_found" in r.stderr


def _attack(server: Any, sid: str, volume_id: str) -> None:
    """Root inside ``sid`` looks for the volume's metadata and store and tries to get out of the mount."""
    def root(cmd: str) -> str:
        r = server.sbx("exec", sid, "--user", "root", cmd, timeout=300)
        return str(r.stdout) + str(r.stderr)

    mountinfo = root("cat /proc/self/mountinfo")
    data_lines = [ln for ln in mountinfo.splitlines() if " /data " in ln]
    assert len(data_lines) == 1 and "fuse.juicefs" in data_lines[0], data_lines
    assert VOLUMES_DIR not in mountinfo and volume_id not in mountinfo and "/meta/" not in mountinfo
    # the host's paths do not exist in here, and no file of the volume's metadata is anywhere on its tree
    assert root(f"ls -d {VOLUMES_DIR} {VOLUMES_DIR}/meta {VOLUMES_DIR}/store 2>&1; echo rc=$?").strip().endswith(
        "rc=2")
    found = root(f"find / -xdev \\( -name '{volume_id}.db*' -o -name 'sbx-volume-stage' \\) 2>/dev/null; "
                 "find /data \\( -name '*.db-wal' -o -name 'chunks' \\) 2>/dev/null; echo end")
    assert found.split() == ["end"], found
    # `..` out of the mount is the sandbox's own root; the mount's root is the volume's own tree
    assert root("stat -c %i /data/.. /data/../.. /").split() == [root("stat -c %i /").strip()] * 3
    assert "log" in root("ls /data/../data") and "etc" in root("ls /data/..")
    # JuiceFS's internal files: the config names host paths that do not exist here; nothing else of the host
    cfg = root("cat /data/.config 2>/dev/null")
    if VOLUMES_DIR in cfg:
        assert "rc=2" in root(f"ls {VOLUMES_DIR}/store 2>&1; echo rc=$?")
    # no JuiceFS daemon in its process table; the daemon's root and its namespaces are out of reach
    assert "juicefs" not in root("ps -eo comm,args")
    # mounting the host's things: no block device of the host, no way into another mount namespace
    tried = root("mkdir -p /mnt/t && mount --bind / /mnt/t 2>&1; ls /mnt/t/var/lib/sbx 2>&1; "
                 "nsenter -t 1 -m -- ls /var/lib/sbx 2>&1; mount -t proc proc /mnt/p 2>&1; echo end")
    assert "meta" not in tried and "store" not in tried, tried
    # unmounting the volume leaves the sandbox's own empty folder, and the volume comes back on a remount from the
    # sandbox? no: the sandbox has nothing to mount it from
    after = root("umount /data && ls -A /data; echo end")
    assert after.split() == ["end"], after


@pytest.fixture
def restartable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultServer]:
    fs = FaultServer(tmp_path_factory.mktemp("sbx-volr"), prefix="SBX_VOLR", node="volrestart", bridge="sbxvolr0",
                     subnet="10.140.0.0/16")  # its slots (+20 each) meet no other test server
    fs.start()
    try:
        yield fs
    finally:
        fs.close()


def test_a_volume_is_mounted_again_after_its_daemon_and_the_server_died(restartable: FaultServer) -> None:
    """kill -9 the sandbox's JuiceFS daemon and the server (its node agent): the restarted server's reconcile mounts
    the volume again, with the files written before, and new writes work."""
    srv = restartable.srv
    assert srv is not None
    srv.sbx("volume", "create", "kept", check=True)
    sid = _new(srv, "--volume", "kept:/work", "--ttl", "0")["id"]
    _sh(srv, sid, "echo before > /work/f")
    daemons = json.loads((restartable.sandbox_dir(sid) / "volumes.json").read_text())
    assert list(daemons) == ["/work"]
    os.killpg(int(daemons["/work"]), signal.SIGKILL)
    r = srv.sbx("exec", sid, "cat /work/f")
    assert r.returncode != 0 and "Transport endpoint is not connected" in r.stderr + r.stdout, r
    srv = restartable.restart()
    assert json.loads(srv.sbx("info", sid, "--json", check=True).stdout)["sandbox"]["state"] == "running"
    assert _sh(srv, sid, "cat /work/f && echo after >> /work/f && cat /work/f").split() == ["before", "before",
                                                                                           "after"]
    again = json.loads((restartable.sandbox_dir(sid) / "volumes.json").read_text())
    assert again["/work"] != daemons["/work"]
    assert _sh(srv, sid, "grep -c ' /work ' /proc/self/mountinfo").strip() == "1"
    srv.sbx("delete", sid, "--wait", check=True)
    srv.sbx("volume", "delete", "kept", check=True)
