"""The seed fork guide's experiment, run through the real `sbx` CLI in bash with the guide's commands as written
(only ids and sizes differ: test sizes are small 2 vCPU / 256 MiB and default 4 vCPU / 512 MiB; vCPUs are capped at
the host's cores).

A counter that lives only in memory (``sbx exec --detach``) and a counter that saves its value to disk (an enabled
systemd service installed with ``sudo tee``) run in a small sandbox; a marker is written one second before
``sbx fork $src --type default --wait --json``. The fork must have the disk as it was (marker, the log up to the
fork), none of the processes (no python3), the service running again from the copied value, a later boot time, and
a new identity; the source must keep running with the same in-memory counter (same PID, same token)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.helpers import poll

pytestmark = pytest.mark.e2e

# The guide's commands, verbatim (``$src`` / ``$c`` are set by the test, as the guide's reader sets them).
NEW_SOURCE = "sbx new --type small --name aeo-fork-1"
MEMORY_COUNTER = (
    "sbx exec $src --detach \"python3 -u -c 'import time,itertools,secrets;tok=secrets.token_hex(4);"
    "[print(i,tok) or time.sleep(1) for i in itertools.count()]' > ~/c.log\""
)
DISK_COUNTER = r"""sbx exec $src "sudo tee /etc/systemd/system/counter.service >/dev/null <<'U'
[Unit]
Description=counter that saves its value to disk
[Service]
User=user
ExecStart=/bin/bash -c 'n=\$(cat /home/user/n 2>/dev/null || echo 0); while true; do n=\$((n+1)); echo \$n > /home/user/n; sleep 1; done'
Restart=always
[Install]
WantedBy=multi-user.target
U
sudo systemctl daemon-reload && sudo systemctl enable --now counter.service"
"""  # noqa: E501
MARKER = "sbx exec $src 'tail -1 ~/c.log; echo n=$(cat ~/n); date -u +%T.%N | cut -c1-12 > ~/marker2; cat ~/marker2'"
FORK = "time sbx fork $src --type default --wait --json"
CHECK_FORK = (
    "sbx exec $c 'nproc; cat ~/marker2; tail -1 ~/c.log; pgrep -a python3 || echo \"no python3\"; "
    "echo n=$(cat ~/n); systemctl is-active counter; uptime -s'"
)

# Identity as seen from inside: hostname, machine-id, SSH host key fingerprints, the root filesystem's UUID.
IDENTITY = (
    "hostname; cat /etc/machine-id; "
    "for f in /etc/ssh/ssh_host_*_key.pub; do ssh-keygen -lf $f | cut -d' ' -f2; done | sort | paste -sd,; "
    "findmnt -no UUID / 2>/dev/null || true"
)
LOG_LINE = re.compile(r"^(\d+) ([0-9a-f]{8})$")


def bash(server: Any, script: str, timeout: float = 600, **vars: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with bash -c in the server's client environment, with ``vars`` as shell variables."""
    prelude = "".join(f"{k}={v}\n" for k, v in vars.items())
    return subprocess.run(["bash", "-c", prelude + script], env=server.env, capture_output=True, text=True,
                          timeout=timeout)


def ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    return r.stdout


def run(server: Any, sid: str, command: str) -> str:
    return ok(server.sbx("exec", sid, command))


def info(server: Any, sid: str) -> dict[str, Any]:
    return json.loads(server.sbx("info", sid, "--json", check=True).stdout)["sandbox"]  # type: ignore[no-any-return]


def host_disk(server: Any, sid: str) -> Path:
    """The sandbox's disk image on the host (``<node_dir>/sandboxes/<id>/disk.ext4``)."""
    from sbx.config import load_settings

    settings = load_settings(node_name=server.env["SBX_NODE_NAME"], profile="test")
    return settings.node_dir / "sandboxes" / sid / "disk.ext4"


def host_uuid(path: Path) -> str:
    return subprocess.run(["blkid", "-p", "-o", "value", "-s", "UUID", str(path)], capture_output=True, text=True,
                          check=True).stdout.strip()


@dataclass
class Experiment:
    src: str
    fork: str
    src_pid: str  # the in-memory counter's PID in the source before the fork
    token: str  # its random token
    before_line: int  # its count printed with the marker
    before_n: int  # the disk counter printed with the marker
    marker: str
    events: list[dict[str, Any]]
    fork_seconds: float  # `time` real of the fork command, for the report
    fork_out: list[str]  # the guide's check of the fork, line by line
    src_identity: list[str] = field(default_factory=list)
    fork_identity: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def guide(server: Any) -> Any:
    r = bash(server, NEW_SOURCE)
    src = ok(r).strip()
    assert re.fullmatch(r"sb_[a-z0-9]{10}", src), r.stdout
    assert ok(bash(server, MEMORY_COUNTER, src=src)).strip().startswith("job_")
    ok(bash(server, DISK_COUNTER, src=src))
    # Let both counters run a few seconds (the guide's ran to 254).
    poll(lambda: (o := run(server, src, "cat ~/n 2>/dev/null; tail -1 ~/c.log")).count("\n") >= 2
         and int(o.split()[0]) >= 5, "both counters to count", 60)
    src_pid = run(server, src, "pgrep -x python3").split()[0]
    out = ok(bash(server, MARKER, src=src)).splitlines()
    assert len(out) == 3, out
    m = LOG_LINE.match(out[0])
    assert m, out
    assert out[1].startswith("n=") and re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3}", out[2]), out
    time.sleep(1)  # the guide wrote the marker one second before the fork
    t0 = time.monotonic()
    r = bash(server, FORK, src=src)
    wall = time.monotonic() - t0
    ok(r)
    real = re.search(r"real\s+(\d+)m([\d.]+)s", r.stderr)
    events = [json.loads(line) for line in r.stdout.splitlines()]
    fork = events[0]["id"]
    fork_out = ok(bash(server, CHECK_FORK, c=fork)).splitlines()
    exp = Experiment(
        src=src, fork=fork, src_pid=src_pid, token=m.group(2), before_line=int(m.group(1)),
        before_n=int(out[1][2:]), marker=out[2], events=events,
        fork_seconds=int(real.group(1)) * 60 + float(real.group(2)) if real else wall, fork_out=fork_out,
    )
    exp.src_identity = run(server, src, IDENTITY).splitlines()
    exp.fork_identity = run(server, fork, IDENTITY).splitlines()
    print(f"\nidentity (hostname, machine-id, host keys, root UUID): source {exp.src_identity}, "
          f"fork {exp.fork_identity}")
    print(f"\nfork guide: `time sbx fork --type default --wait --json` real {exp.fork_seconds:.3f} s; "
          f"fork printed {fork_out}")
    yield exp
    server.sbx("delete", fork, "--wait")
    server.sbx("delete", src, "--wait")


def test_fork_json_events_have_the_guides_shapes(guide: Experiment) -> None:
    ev = guide.events
    assert [e["event"] for e in ev] == ["forking", "state", "ready"]
    forking, state, ready = ev
    assert set(forking) == {"event", "id", "source", "sandbox"}
    assert forking["source"] == guide.src and forking["id"] == guide.fork != guide.src
    sb = forking["sandbox"]
    assert sb["id"] == guide.fork and sb["memoryRestored"] is None and sb["resumeReason"] is None
    assert (sb["type"], sb["name"], sb["ttl"], sb["state"]) == ("default", "aeo-fork-1 (fork)", 3600, "forking")
    assert state == {"event": "state", "id": guide.fork, "state": "provisioning"}
    assert ready["id"] == guide.fork and ready["state"] == "ready"
    assert ready["url"] == ready["sandbox"]["url"] and ready["url"].startswith("https://")
    assert ready["sandbox"]["memoryRestored"] is None and ready["sandbox"]["state"] == "running"


def test_fork_has_the_disk_at_the_fork_and_none_of_the_processes(server: Any, guide: Experiment) -> None:
    nproc, marker, last, python, n, active, uptime = guide.fork_out
    assert int(nproc) == min(4, os.cpu_count() or 1)  # --type default took effect (4 vCPUs, capped at host cores)
    assert marker == guide.marker  # written one second before the fork
    m = LOG_LINE.match(last)
    assert m and m.group(2) == guide.token and int(m.group(1)) >= guide.before_line, last
    # The log's last line is the source's line at the moment of the fork: the source wrote it, and went on.
    src_log = run(server, guide.src, "cat ~/c.log").splitlines()
    assert last in src_log and src_log.index(last) < len(src_log) - 1
    assert python == "no python3"
    assert active == "active"
    # The service started at boot, read the copied value and kept counting from it.
    assert n.startswith("n=") and int(n[2:]) > guide.before_n, n
    later = int(run(server, guide.fork, "sleep 1.5; cat ~/n"))
    assert later > int(n[2:])
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", uptime)
    src_boot = run(server, guide.src, "uptime -s").strip()
    assert uptime > src_boot, (uptime, src_boot)  # the fork booted fresh, after the source (per-sandbox uptime)
    sb = info(server, guide.fork)
    assert (sb["memoryRestored"], sb["resumeReason"], sb["type"], sb["vcpus"]) == (None, None, "default", 4)


def test_source_keeps_its_in_memory_counter(server: Any, guide: Experiment) -> None:
    assert run(server, guide.src, "pgrep -x python3").split()[0] == guide.src_pid
    before = run(server, guide.src, "tail -1 ~/c.log")
    m = LOG_LINE.match(before.strip())
    assert m and m.group(2) == guide.token
    fork_last = int(LOG_LINE.match(guide.fork_out[2]).group(1))  # type: ignore[union-attr]
    poll(lambda: int(run(server, guide.src, "tail -1 ~/c.log").split()[0]) > max(int(m.group(1)), fork_last),
         "the source's counter to keep counting", 30)
    sb = info(server, guide.src)
    assert (sb["state"], sb["type"], sb["name"], sb["memoryRestored"]) == ("running", "small", "aeo-fork-1", None)
    assert run(server, guide.src, "cat ~/marker2").strip() == guide.marker


def test_fork_has_a_new_identity(server: Any, guide: Experiment) -> None:
    src_host, src_mid, src_keys = guide.src_identity[:3]
    fork_host, fork_mid, fork_keys = guide.fork_identity[:3]
    assert src_host == info(server, guide.src)["subdomain"]
    assert fork_host == info(server, guide.fork)["subdomain"] != src_host
    assert re.fullmatch(r"[0-9a-f]{32}", fork_mid) and fork_mid != src_mid
    assert src_keys and fork_keys and set(fork_keys.split(",")).isdisjoint(src_keys.split(","))
    # The root filesystem's UUID: from inside when the sandbox can see it, else from the disk images on the host.
    src_uuid = guide.src_identity[3] if len(guide.src_identity) > 3 else ""
    fork_uuid = guide.fork_identity[3] if len(guide.fork_identity) > 3 else ""
    if not (src_uuid and fork_uuid):
        src_uuid, fork_uuid = host_uuid(host_disk(server, guide.src)), host_uuid(host_disk(server, guide.fork))
    assert src_uuid and fork_uuid and src_uuid != fork_uuid
    assert info(server, guide.fork)["id"] != guide.src
