"""What a restore asks of the restored sandbox before it answers (sbx.node.memory.memcopy ``_after_restore``): a fork's
memory holds its source's running sshd, with the source's host keys, so the restart of sbx-identity and ssh is
queued before the restore returns; a sandbox from a template (no sshd, no keys) gets it from a thread once the
operation has answered, its record saying so until then. The runtime is not involved (the commands are recorded)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from sbx.node.memory import memcopy


class Restored(memcopy.MemoryCopyMixin):
    def __init__(self) -> None:  # only what _after_restore uses, none of NodeBase's host setup
        self.ran: list[tuple[str, list[str]]] = []
        self.lock = threading.RLock()
        self.records: dict[str, dict[str, Any]] = {}

    def _run_root(self, sid: str, argv: list[str], timeout: float = 60.0) -> bytes:
        self.ran.append((sid, argv))
        return b""

    def _lock(self, sid: str) -> threading.RLock:
        return self.lock

    def _is_running(self, sid: str) -> bool:
        return True

    def _dir(self, sid: str) -> Path:
        return Path("/nonexistent") / sid

    def _record(self, sid: str) -> dict[str, Any]:
        return dict(self.records.setdefault(sid, {}))

    def _save(self, sid: str, rec: dict[str, Any]) -> None:
        self.records[sid] = dict(rec)


def _restart_queued(ran: list[tuple[str, list[str]]]) -> bool:
    return any("restart sbx-identity.service ssh.service" in " ".join(argv) for _, argv in ran)


def test_a_fork_queues_the_identity_restart_before_it_answers() -> None:
    node = Restored()
    with node.lock:  # the operation's lock, held by the fork while it restores
        node._after_restore("sb_fork000001", clear_tmp=False)
        assert _restart_queued(node.ran)  # not left to a thread that waits for the lock
        assert node.records["sb_fork000001"]["identityPending"] is True
    # then a thread waits, under the lock, for the restarts to end (no fork or stop dumps it half done)
    deadline = time.monotonic() + 5
    while "identityPending" in node.records["sb_fork000001"]:
        assert time.monotonic() < deadline, (node.ran, node.records)
        time.sleep(0.01)
    assert node.ran[-1][1] == ["systemctl", "start", "sbx-identity.service", "ssh.service"]


def test_a_template_restore_leaves_the_restart_to_a_thread_after_the_answer() -> None:
    node = Restored()
    with node.lock:
        node._after_restore("sb_tmpl000001", clear_tmp=True, holds_sshd=False)
        assert [argv[-1].split()[0] for _, argv in node.ran] == ["find"]  # /tmp emptied before the answer
        time.sleep(0.2)
        assert not _restart_queued(node.ran)  # the thread waits for the operation to let go of the lock
        # recorded before the answer: a node process killed before the thread ran finishes it when it reconciles
        assert node.records["sb_tmpl000001"]["identityPending"] is True
    deadline = time.monotonic() + 5
    while not _restart_queued(node.ran) or "identityPending" in node.records["sb_tmpl000001"]:
        assert time.monotonic() < deadline, (node.ran, node.records)
        time.sleep(0.01)
