"""Commands in a sandbox: attached execs (streamed) and detached jobs (:class:`ExecOps`)."""

from __future__ import annotations

import base64
import codecs
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from sbx import metrics
from sbx.control.errors import ControlError, from_node, not_found
from sbx.control.sandboxes.planebase import PlaneBase
from sbx.control.store.database import SandboxRow
from sbx.node.types import JobInfo, NodeError

log = logging.getLogger("sbx.control")

DEFAULT_EXEC_TIMEOUT = 30.0
"""Seconds an exec may run when the caller gives no timeout (the seed: "The default is 30 seconds")."""


class ExecOps(PlaneBase):
    """exec, exec_detached, jobs, job logs, kill and wait."""

    def exec(
        self,
        sandbox_id: str,
        command: str,
        timeout: float | None = DEFAULT_EXEC_TIMEOUT,
        user: str = "user",
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        encoding: str = "utf-8",
        stop: Callable[[], bool] | None = None,
        row: SandboxRow | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Run ``command`` in the sandbox (waiting for a provisioning/resuming one to be running, resuming a stopped
        ``autoResume`` one). Checks happen now (404, 409 ``not_running``/``busy``, 400 ``invalid_cwd`` when ``cwd``
        is not a directory in the sandbox); the returned iterator then yields ``{"stream": "stdout"|"stderr",
        "data": text}`` pieces and finally ``{"exitCode": N, "timedOut": bool}`` (or ``{"error": {"code",
        "message"}}`` if the node fails mid-way). ``encoding`` ``"utf-8"``: text, invalid bytes replaced;
        ``"base64"``: ``data`` is base64 of the exact bytes and the piece carries ``"encoding": "base64"``.
        ``timeout`` in seconds (0 or None: none). ``stop``: polled while the command runs; True (the client went
        away) kills it. ``row``: the sandbox's row as the caller just read it (:meth:`wait_running`). The run counts
        as activity."""
        if not command:
            raise ControlError("invalid_command", "command must not be empty", 400, field="command")
        row = self.wait_running(sandbox_id, row)
        cwd_path = self.files.check_dir(sandbox_id, cwd, user, field="cwd") if cwd is not None else None
        return self._exec(sandbox_id, command, timeout if timeout else None, user, env, cwd_path, encoding, stop,
                          node=row.node)

    def _exec(
        self, sandbox_id: str, command: str, timeout: float | None, user: str, env: dict[str, str] | None,
        cwd: str | None, encoding: str = "utf-8", stop: Callable[[], bool] | None = None, node: str | None = None,
    ) -> Iterator[dict[str, Any]]:
        """The lines of :meth:`exec` (after its checks); ``node``: the node the sandbox's row names, read by
        those checks (None: the configured node), so the exec needs no further read of the row."""
        decoders = {k: codecs.getincrementaldecoder("utf-8")("replace") for k in ("stdout", "stderr")}
        raw = encoding == "base64"
        # begin/end both run inside this generator: a response the client dropped before its first chunk never
        # starts it, and then neither runs (an eager begin would leave the sandbox "active" for ever).
        self.activity.begin(sandbox_id)
        t0, outcome = time.monotonic(), "error"  # sbx_exec_seconds: to the exit line (ok), or to a failure
        try:
            agent = self.router.agent(node or self.router.default_name)
            for ev in agent.exec(sandbox_id, command, user=user, timeout=timeout, env=env, cwd=cwd, stop=stop):
                self.activity.touch(sandbox_id)
                if ev.kind == "exit":
                    for kind, dec in decoders.items():
                        tail = "" if raw else dec.decode(b"", final=True)
                        if tail:
                            yield {"stream": kind, "data": tail}
                    outcome = "ok"
                    metrics.EXEC_SECONDS.labels(outcome=outcome).observe(time.monotonic() - t0)
                    yield {"exitCode": ev.exit_code, "timedOut": ev.timed_out}
                    return
                if raw:
                    if ev.data:
                        yield {"stream": ev.kind, "data": base64.b64encode(ev.data).decode(), "encoding": "base64"}
                    continue
                text = decoders[ev.kind].decode(ev.data)
                if text:
                    yield {"stream": ev.kind, "data": text}
            yield {"error": {"code": "exec_failed", "message": "the command ended without an exit status"}}
        except NodeError as e:
            yield {"error": {"code": e.code, "message": e.message}}
        finally:
            if outcome != "ok":
                metrics.EXEC_SECONDS.labels(outcome=outcome).observe(time.monotonic() - t0)
            self.activity.end(sandbox_id)

    def exec_detached(
        self, sandbox_id: str, command: str, user: str = "user", env: dict[str, str] | None = None,
        cwd: str | None = None, timeout: float | None = None, stdin: str | None = None,
    ) -> JobInfo:
        """Start ``command`` as a detached job; returns its :class:`JobInfo`. ``env`` adds variables, ``cwd`` is
        its working directory (checked as for :meth:`exec`), ``timeout`` seconds after which it is killed (None or
        0: never; a job killed so ends with exit 124, as an exec does), ``stdin`` text fed to it. Raises 404, 409
        ``not_running``, 400 ``invalid_cwd``."""
        if not command:
            raise ControlError("invalid_command", "command must not be empty", 400, field="command")
        self.wait_running(sandbox_id)
        cwd_path = self.files.check_dir(sandbox_id, cwd, user, field="cwd") if cwd is not None else None
        self.activity.touch(sandbox_id)
        try:
            return self.node.exec_detached(sandbox_id, command, user=user, env=env, cwd=cwd_path,
                                           timeout=timeout or None, stdin=stdin)
        except NodeError as e:
            raise from_node(e.code, e.message) from None

    def kill_job(self, sandbox_id: str, job_id: str) -> JobInfo:
        """Kill a detached job (SIGKILL to its whole process tree); answers the job as it is afterwards. A job
        that has already ended is answered as is. Raises 404 for an unknown sandbox or job."""
        job = self.job(sandbox_id, job_id)
        if not job.running:
            return job
        try:
            self.node.kill_job(sandbox_id, job_id)
        except NodeError as e:
            raise from_node(e.code, e.message) from None
        return self.job_wait(sandbox_id, job_id, timeout=10.0, poll=0.1)

    def jobs(self, sandbox_id: str) -> list[JobInfo]:
        """The sandbox's detached jobs, oldest first (empty when it is not running)."""
        row = self.get(sandbox_id)
        if row.state != "running":
            return []
        try:
            return self.node.jobs(sandbox_id)
        except NodeError as e:
            raise from_node(e.code, e.message) from None

    def job(self, sandbox_id: str, job_id: str) -> JobInfo:
        """One job; 404 ``not_found`` if the sandbox or job is unknown."""
        for job in self.jobs(sandbox_id):
            if job.id == job_id:
                return job
        raise not_found(f"job {job_id}")

    def job_logs(
        self, sandbox_id: str, job_id: str, follow: bool = False, poll: float = 0.25,
        stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[dict[str, Any]]:
        """A job's output as exec-style lines (``{"stream","data"}``), then ``{"exitCode": N, "timedOut":
        false}`` once it has ended. With ``follow``, keeps streaming until the job ends (this counts as activity).
        Raises 404 for an unknown sandbox or job."""
        self.job(sandbox_id, job_id)
        return self._job_logs(sandbox_id, job_id, follow, poll, stop)

    def _job_logs(
        self, sandbox_id: str, job_id: str, follow: bool, poll: float, stop: Callable[[], bool]
    ) -> Iterator[dict[str, Any]]:
        offsets = {"stdout": 0, "stderr": 0}
        decoders = {k: codecs.getincrementaldecoder("utf-8")("replace") for k in offsets}
        if follow:
            self.activity.begin(sandbox_id)
        try:
            while True:
                try:
                    job = self.job(sandbox_id, job_id)
                except ControlError:
                    return
                for kind in offsets:
                    try:
                        data = self.node.job_output(sandbox_id, job_id, kind, offsets[kind])
                    except NodeError as e:
                        yield {"error": {"code": e.code, "message": e.message}}
                        return
                    offsets[kind] += len(data)
                    text = decoders[kind].decode(data, final=not job.running)
                    if text:
                        yield {"stream": kind, "data": text}
                if not job.running:
                    yield {"exitCode": job.exit_code, "timedOut": False}
                    return
                if not follow or stop():
                    return
                self.activity.touch(sandbox_id)
                time.sleep(poll)
        finally:
            if follow:
                self.activity.end(sandbox_id)

    def job_wait(self, sandbox_id: str, job_id: str, timeout: float = 300.0, poll: float = 0.25) -> JobInfo:
        """Wait until the job ends (at most ``timeout`` seconds; the job may still be running then)."""
        deadline = time.monotonic() + timeout
        self.activity.begin(sandbox_id)
        try:
            while True:
                job = self.job(sandbox_id, job_id)
                if not job.running or time.monotonic() >= deadline:
                    return job
                time.sleep(poll)
        finally:
            self.activity.end(sandbox_id)

