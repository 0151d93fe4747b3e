"""The resize and fork guides end to end through `sbx` on real sandboxes (test sizes: small 256 MiB, default
512 MiB; the seed task's heavy step holds ~384 MiB, so it is OOM-killed on small and fits on default)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.helpers import poll

pytestmark = pytest.mark.e2e

SEED = Path(__file__).resolve().parents[1] / "seed"


def new_sandbox(server: Any, *args: str) -> str:
    r = server.sbx("new", "--type", "small", *args, check=True)
    sid = r.stdout.strip()
    assert re.fullmatch(r"sb_[a-z0-9]{10}", sid), r.stdout
    return sid


def copy_task(server: Any, sid: str) -> None:
    script = (SEED / "task.py").read_text()
    server.sbx("exec", sid, f"mkdir -p ~/task && cat > ~/task/task.py <<'PYEOF'\n{script}PYEOF", check=True)


def info(server: Any, sid: str) -> dict:  # type: ignore[type-arg]
    return json.loads(server.sbx("info", sid, "--json", check=True).stdout)["sandbox"]  # type: ignore[no-any-return]


def test_task_is_oom_killed_on_small_and_keeps_its_checkpoint(server: Any) -> None:
    sid = new_sandbox(server, "--name", "oom-e2e")
    copy_task(server, sid)
    r = server.sbx("exec", sid, 'python3 ~/task/task.py; echo exit=$?; cat ~/task/state.json', "--timeout", "600")
    lines = r.stdout.splitlines()
    assert lines[:5] == ["run  fetch", "run  parse", "run  index", "run  embed", "exit=137"], r.stdout + r.stderr
    assert json.loads(lines[5])["done"] == ["fetch", "parse", "index"]
    server.sbx("delete", sid, "--wait", check=True)


def test_grow_loop_resizes_and_continues(server: Any) -> None:
    sid = new_sandbox(server, "--name", "grow-e2e")
    before = info(server, sid)
    copy_task(server, sid)
    r = subprocess.run(["bash", str(SEED / "grow.sh"), sid], env=server.env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[:5] == ["run  fetch", "run  parse", "run  index", "run  embed",
                         "OOM-killed on small; moving to default"]
    assert json.loads(lines[5]) == {"type": "default", "memoryGB": 0.5, "memoryRestored": False,
                                    "resumeReason": "resized"}
    assert lines[6:] == ["skip fetch (checkpointed)", "skip parse (checkpointed)", "skip index (checkpointed)",
                         "run  embed", "run  report", "all steps done"]
    after = info(server, sid)
    assert (after["id"], after["subdomain"], after["url"]) == (sid, before["subdomain"], before["url"])
    assert after["stats"]["memoryTotalMb"] == 512  # a fresh sample at the new size
    state = json.loads(server.sbx("exec", sid, "cat ~/task/state.json", check=True).stdout)
    assert state["results"]["embed"] == "384 MB"
    server.sbx("delete", sid, "--wait", check=True)


def test_resize_keeps_files_and_drops_processes(server: Any) -> None:
    sid = new_sandbox(server)
    server.sbx("exec", sid, "echo home > ~/kept; echo tmp > /tmp/gone", check=True)
    server.sbx("exec", sid, "--detach", "python3 -m http.server 8000", check=True)
    server.sbx("exec", sid, "for i in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/8000) 2>/dev/null && exit 0; "
                            "sleep 0.2; done; exit 1", check=True)
    small_disk = info(server, sid)["diskGB"]
    server.sbx("stop", sid, "--wait", check=True)
    server.sbx("resume", sid, "--type", "default", "--wait", check=True)
    sb = info(server, sid)
    assert (sb["type"], sb["memoryRestored"], sb["resumeReason"], sb["diskGB"] > small_disk) == (
        "default", False, "resized", True)
    r = server.sbx("exec", sid, "cat ~/kept; test -e /tmp/gone && echo tmp-kept || echo tmp-gone; "
                                "(exec 3<>/dev/tcp/127.0.0.1/8000) 2>/dev/null && echo listening || echo closed")
    assert r.stdout.split() == ["home", "tmp-gone", "closed"], r.stdout + r.stderr
    server.sbx("delete", sid, "--wait", check=True)


def test_resize_rules(server: Any) -> None:
    sid = new_sandbox(server)
    server.sbx("stop", sid, "--wait", check=True)
    r = server.sbx("resume", sid, "--type", "default", "--require-memory")
    assert r.returncode == 1 and r.stderr.startswith("error: invalid_require_memory: ")
    server.sbx("resume", sid, "--type", "default", "--wait", check=True)
    server.sbx("stop", sid, "--wait", check=True)
    r = server.sbx("resume", sid, "--type", "small")
    assert r.returncode == 1 and r.stderr.startswith("error: invalid_resize: ")
    server.sbx("delete", sid, "--wait", check=True)


def test_memory_resume_keeps_processes(server: Any) -> None:
    sid = new_sandbox(server)
    job = server.sbx("exec", sid, "--detach", "sleep 1000", check=True).stdout.strip()
    # the job's unit answers before its login shell has started the command
    pid = poll(lambda: server.sbx("exec", sid, "pgrep -o -f '[s]leep 1000' || true", check=True).stdout.strip(),
               "sleep to start", 30, 0.1)
    server.sbx("stop", sid, "--wait", check=True)
    server.sbx("resume", sid, "--wait", check=True)
    sb = info(server, sid)
    assert sb["memoryRestored"] is True and sb["resumeReason"] is None
    assert server.sbx("exec", sid, "pgrep -o -f '[s]leep 1000'", check=True).stdout.strip() == pid
    assert job.startswith("job_")
    server.sbx("delete", sid, "--wait", check=True)


def test_fork_a_stopped_sandbox_to_a_bigger_size(server: Any) -> None:
    src = new_sandbox(server, "--name", "fork-src")
    copy_task(server, src)
    server.sbx("exec", src, "python3 ~/task/task.py", "--timeout", "600")  # OOM at embed: 3 steps on disk
    server.sbx("stop", src, "--wait", check=True)
    r = server.sbx("fork", src, "--type", "default", "--ttl", "1800", "--wait", "--json", check=True)
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert [e["event"] for e in events] == ["forking", "state", "ready"]
    assert events[0]["source"] == src and events[1]["state"] == "provisioning"
    ready = events[-1]
    assert (ready["state"], ready["sandbox"]["type"], ready["sandbox"]["memoryRestored"]) == ("ready", "default", None)
    fork = ready["id"]
    assert {k: v for k, v in info(server, src).items() if k in ("state", "type")} == {"state": "stopped",
                                                                                        "type": "small"}
    fsb = info(server, fork)
    assert (fsb["name"], fsb["ttl"], fsb["resumeReason"]) == ("fork-src (fork)", 1800, None)
    r = server.sbx("exec", fork, "python3 ~/task/task.py", "--timeout", "600", check=True)
    assert r.stdout.splitlines()[-3:] == ["run  embed", "run  report", "all steps done"]
    server.sbx("delete", fork, "--wait", check=True)
    server.sbx("delete", src, "--wait", check=True)
