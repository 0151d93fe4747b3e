"""Live migration of a running sandbox to another node (issue 11), the source's side: :class:`MigrationMixin`
(``migrate_out``: pre-copy, freeze, the dump to the destination's page server, the hand-over, the take-back on a
failure) and its restart in the middle of one (:meth:`MigrationMixin._reconcile_migration`). The steps of a whole move,
and :func:`sbx.node.migration.live.migrate` that drives one, are in :mod:`sbx.node.migration.live`; the destination's
side is :mod:`sbx.node.migration.incoming`.
"""

from __future__ import annotations

import json
import logging
import ssl
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from sbx import tls
from sbx.config import Settings
from sbx.node.migration import filestream
from sbx.node.migration.incoming import IncomingMixin
from sbx.node.steps import Beside
from sbx.node.types import NodeError
from sbx.runtime import criuimages
from sbx.runtime.base import RuntimeError_
from sbx.runtime.pageserver import PageSender
from sbx.runtime.runc import remove_tree
from sbx.storage import delta
from sbx.storage import disk as disks
from sbx.storage.errors import StorageError

log = logging.getLogger("sbx.node")

MIGRATING = "migrating"
HANDOVER = "handover"
CONNECT_TIMEOUT = 5.0
TRANSFER_TIMEOUT = 300.0
"""Seconds any one read or write of a node-to-node transfer may stall before the move fails."""


class _Step(Exception):
    """A failed step of a move: ``step`` names it, the message says why."""

    def __init__(self, step: str, why: str):
        super().__init__(f"{step}: {why}")
        self.step = step


def _destination(url: str, ticket: str, settings: Settings) -> httpx.Client:
    """A client for the destination node at ``url`` with the move's ``ticket``; an ``https://`` destination is
    reached with this node's own certificate (:mod:`sbx.tls`, mutual TLS)."""
    ident = tls.identity(settings.tls_dir)
    verify: ssl.SSLContext | bool = ident.client_context() if ident is not None else True
    return httpx.Client(base_url=url.rstrip("/"), headers={"Authorization": f"Bearer {ticket}"}, verify=verify,
                        timeout=httpx.Timeout(TRANSFER_TIMEOUT, connect=CONNECT_TIMEOUT))


def _answer(resp: httpx.Response, step: str) -> Any:
    if resp.status_code >= 400:
        try:
            err = resp.json()["error"]
            why = f"{err['code']}: {err['message']}"
        except (ValueError, KeyError, TypeError):
            why = f"HTTP {resp.status_code}"
        raise _Step(step, f"the destination answered {why}")
    return resp.json() if resp.content else None


def page_server(http: httpx.Client, id: str, settings: Settings | None = None
                ) -> tuple[str, PageSender | None] | None:
    """Where CRIU sends the memory pages of sandbox ``id``: ``("ADDR:PORT", sender)`` of the page server the
    destination (``http``: its node API with the move's ticket) opened (``POST .../pages``), None when it has none
    (a node of an earlier version answers 404): the pages then go in the memory stream after the dump. When the
    destination takes them in TLS, ``ADDR:PORT`` is a local :class:`sbx.runtime.pageserver.PageSender` (``sender``,
    to close after the dump) that relays them there with this node's certificate. Raises ``_Step`` (another error
    answer, or TLS asked without a certificate here), ``httpx.HTTPError``, ``OSError``."""
    resp = http.post(f"/v1/node/migrate/{id}/pages")
    if resp.status_code == 404:
        return None
    got = _answer(resp, "page server")
    if not got.get("tls"):
        return f"{got['address']}:{got['port']}", None
    ident = tls.identity(settings.tls_dir) if settings is not None else None
    if ident is None:
        raise _Step("page server", "the destination takes pages in TLS and this node has no certificate")
    sender = PageSender(str(got["address"]), int(got["port"]), http.base_url.host, ident.client_context())
    return sender.address, sender


def reset_connections(init_pid: int, rounds: int = 5) -> list[str]:
    """Destroy every connected TCP socket in the network namespace of ``init_pid`` (``ss -K``; the kernel's
    ``SOCK_DESTROY``): the peer of each gets a reset at once, the sandbox's end reads ``ECONNABORTED`` or EOF.
    Listening sockets stay. A connection ``ss -K`` did not destroy would be restored closed on the destination
    and its peer would wait on it (a silent hang): one a frozen listener's kernel accepted after the pass, or one
    the pass missed. So ``ss`` lists the connected sockets again and ``-K`` runs again, up to ``rounds`` times,
    until none but ones in ``TIME-WAIT`` are left. Returns the destroyed
    sockets as ``ss`` printed them (``"STATE RECV-Q SEND-Q LOCAL PEER"``; empty when ``ss`` can't: the dump then
    keeps them with ``--tcp-established`` and the destination restores them closed)."""
    ns = ["nsenter", f"--net=/proc/{init_pid}/ns/net", "ss", "-t", "-n", "-H"]
    killed: list[str] = []
    for _ in range(rounds):
        p = subprocess.run([*ns, "-K", "state", "connected"], capture_output=True, text=True, timeout=10)
        if p.returncode != 0:
            break
        killed += [" ".join(ln.split()) for ln in p.stdout.splitlines() if ln.strip()]
        left = subprocess.run([*ns, "state", "connected", "exclude", "time-wait"], capture_output=True, text=True,
                              timeout=10)
        if left.returncode != 0 or not left.stdout.strip():
            break
        log.warning("sockets left after ss -K, again: %s", " | ".join(left.stdout.split("\n")))
    return killed


class MigrationMixin(IncomingMixin):
    """The source of a live migration (part of :class:`sbx.node.agent.LocalNode`); also a destination
    (:class:`sbx.node.migration.incoming.IncomingMixin`)."""

    def migrate_out(self, id: str, target: str, ticket: str, image: dict[str, str] | None = None) -> dict[str, Any]:
        """Move the running sandbox ``id`` to the node at ``target`` (its API URL), which prepared for it and gave
        ``ticket`` and its base image's ``{"name", "sha256"}`` (``migrate_prepare``). See the module docstring.

        Returns figures: ``{"precopyS", "pauseS" (pause to the destination's confirmation: it runs there),
        "finalDiskS" (pause to the disk's last delta made), "dumpS" (pause to the disk delta and memory image made;
        with a page server the pages are sent meanwhile), "freezeToSentS" (pause to everything sent),
        "restoredS" (pause to the destination's restore answered), "diskS" and "restoreS" (the destination's disk
        rebuild and its ``runc restore``), "baseBytes", "finalBytes", "memoryBytes", "resetConnections",
        "resetSockets" (as ``ss`` printed them), "fullDisk"}`` (seconds, bytes).
        Afterwards the sandbox runs on the destination; its copy here, paused, is deleted in the background
        (:meth:`_depart`).

        Raises ``NodeError``: ``not_found``, ``not_running``, ``migration_failed`` (the sandbox runs on here; the
        message names the step: ``pre-copy``, ``freeze``, ``dump``, ``send``, ``restore``, ``confirm``),
        ``migration_unconfirmed`` (the destination can't be asked whether it took over: the sandbox stays paused
        here, never running on two nodes)."""
        if self.runtime.gvisor(id):  # runsc has no page server, and its image is not moved between hosts here
            raise NodeError("not_supported", f"sandbox {id} is of the gvisor runtime class, which can't live-migrate")
        with self._lock(id):
            self._require_running(id)
            work = self._dir(id) / "migrate-out"
            remove_tree(work)
            work.mkdir(mode=0o700)
            figures: dict[str, Any] = {}
            http = _destination(target, ticket, self.settings)
            try:
                return self._move(id, target, ticket, image, work, http, figures)
            finally:
                http.close()
                remove_tree(work)

    def _move(self, id: str, target: str, ticket: str, image: dict[str, str] | None, work: Path,
              http: httpx.Client, figures: dict[str, Any]) -> dict[str, Any]:
        t0 = time.monotonic()
        # a sandbox of a user image sends its whole disk: the destination's parent is the default image
        full = (not image or image.get("sha256") != self.base_image_digest()["sha256"]
                or self._image_of(self._record(id)) is not None)
        pre = work / "pre.ext4"
        try:
            # under fsfreeze (every acknowledged write is in the copy), keeping its ext4 UUID: the same disk, moving
            self._clone_live(id, pre, fresh_uuid=False, mode=0o600, mounted=True)
            base = delta.export_delta(pre, None if full else self.image, work / "base.delta")
            self._send(http, id, "base", [base.path])
            pages = page_server(http, id, self.settings)
            pages_to, sender = pages if pages is not None else (None, None)
        except (StorageError, OSError, httpx.HTTPError, _Step) as e:
            raise NodeError("migration_failed", f"pre-copy: {e}") from e
        figures.update(precopyS=time.monotonic() - t0, baseBytes=base.file_bytes, fullDisk=full)

        self._set_phase(id, MIGRATING, migratingTo=target)
        # CRIU can't dump a connection to the host: commands still attached end (detached jobs move along)
        self._quiesce_channel(id, why=("moved", f"sandbox {id} moved to another node while the command ran: a live "
                                       "migration ends attached commands (run long ones with --detach: detached "
                                       "jobs keep running through a move)"))
        t_pause = time.monotonic()
        try:
            self.runtime.pause(id)
        except RuntimeError_ as e:
            if sender is not None:  # no dump will connect to it
                sender.close(timeout=0)
            self._take_back(id, http, unpause=False)
            raise NodeError("migration_failed", f"freeze: {e.detail}") from e
        try:
            pid = self.runtime.init_pid(id)
            reset = reset_connections(pid) if pid else []
            figures.update(resetConnections=len(reset), resetSockets=reset)
            step = "dump"
            finals: list[delta.DeltaInfo] = []

            def last_delta() -> None:
                """The disk's last copy (:func:`sbx.storage.disk.clone_synced`: nothing in the sandbox runs; the
                destination's mount replays the copy's journal) and delta, made and sent while CRIU dumps."""
                disks.clone_synced(self._disk(id), work / "final.ext4", mode=0o600)
                finals.append(delta.export_delta(work / "final.ext4", pre, work / "final.delta"))
                figures["finalDiskS"] = time.monotonic() - t_pause
                self._send(http, id, "final", [finals[0].path])

            beside = Beside(last_delta)
            mem = work / "memory"
            try:
                self.runtime.checkpoint(id, mem, work / "criu-work", image_gid=0, leave_running=True,
                                        page_server=pages_to)
            finally:
                if sender is not None:
                    sender.close()
                beside.join(quiet=True)
            beside.join()  # the delta's error, once the dump went well
            final = finals[0]
            criuimages.mark_own_time_namespace(mem, pid)  # a resumed sandbox's dump keeps its time namespace
            (mem / "migration.json").write_text(json.dumps({"uidBase": self._uid_base(id)}))
            figures["dumpS"] = time.monotonic() - t_pause
            step = "send"
            files = sorted(p for p in mem.iterdir() if p.is_file())
            self._send(http, id, "memory", files)
            figures.update(finalBytes=final.file_bytes, memoryBytes=sum(p.stat().st_size for p in files),
                           freezeToSentS=time.monotonic() - t_pause)
            step = "restore"
            restored = _answer(http.post(f"/v1/node/migrate/{id}/restore"), "restore") or {}
            figures.update(restoreS=restored.get("restoreS"), diskS=restored.get("diskS"),
                           restoredS=time.monotonic() - t_pause, pageServer=pages_to is not None,
                           pageTLS=sender is not None)
            figures["memoryBytes"] += int(restored.get("pageBytes") or 0)
        except (StorageError, OSError, RuntimeError_, httpx.HTTPError, _Step) as e:
            why = e.detail if isinstance(e, RuntimeError_) else str(e)
            log.warning("%s: migration to %s failed (%s), the sandbox runs on here", id, target, why)
            if sender is not None:  # idempotent: a failure before the dump leaves it listening
                sender.close(timeout=0)
            self._take_back(id, http)
            raise NodeError("migration_failed", f"{step}: {why}") from e
        self._set_phase(id, HANDOVER, migratingTo=target, migrationTicket=ticket)
        confirmed: list[float] = []
        if not self._hand_over(id, http, on_confirmed=lambda: confirmed.append(time.monotonic())):
            raise NodeError("migration_unconfirmed",
                            f"the destination {target} restored sandbox {id} but can't be asked whether it took "
                            "over; it stays paused here until the destination answers")
        figures["pauseS"] = (confirmed[0] if confirmed else time.monotonic()) - t_pause
        return figures

    def _send(self, http: httpx.Client, id: str, stage: str, files: list[Path]) -> None:
        _answer(http.put(f"/v1/node/migrate/{id}/{stage}", content=filestream.pack(files),
                         headers={"Content-Type": "application/octet-stream"}), f"sending {stage}")

    def _take_back(self, id: str, http: httpx.Client | None, unpause: bool = True) -> None:
        """The move failed before the destination took over: abort the arrival there (best effort), thaw the
        container here, and let the sandbox run on (phase ``running``)."""
        if http is not None:
            try:
                http.post(f"/v1/node/migrate/{id}/abort", timeout=10.0)
            except httpx.HTTPError as e:
                log.warning("%s: the destination could not be told to drop the arrival: %s", id, e)
        if unpause and self.runtime.state(id) == "paused":
            try:
                self.runtime.unpause(id)
            except RuntimeError_ as e:
                log.error("%s stays paused after a failed migration: %s", id, e.detail)
        self._channel_resume(id)
        rec = self._record(id)
        for key in ("migratingTo", "migrationTicket"):
            rec.pop(key, None)
        self._save(id, rec)
        self._set_phase(id, "running")

    def _hand_over(self, id: str, http: httpx.Client, wait: float = 15.0,
                   on_confirmed: Callable[[], None] | None = None) -> bool:
        """Tell the destination to go on and settle who runs the sandbox: True when the destination took over
        (this node's copy is being deleted: :meth:`_depart`), False when it can't be asked (the copy stays
        paused, phase ``handover``).
        A destination that says it did not take over gets the sandbox back here (``migration_failed``).
        ``on_confirmed`` is called once the destination said it runs the sandbox."""
        confirmed = on_confirmed or (lambda: None)
        deadline = time.monotonic() + wait
        sent = False
        while True:
            try:
                if not sent:
                    _answer(http.post(f"/v1/node/migrate/{id}/confirm"), "confirm")
                    confirmed()
                    self._depart(id)
                    return True
                state = (_answer(http.get(f"/v1/node/migrate/{id}"), "state") or {}).get("state")
            except httpx.ConnectError as e:
                if not sent:  # never reached the destination: nothing was confirmed
                    self._take_back(id, None)
                    raise NodeError("migration_failed",
                                    "confirm: the destination went away before it took over") from e
                state = None
            except (httpx.HTTPError, _Step) as e:
                log.warning("%s: confirmation to the destination is uncertain: %s", id, e)
                sent, state = True, None
            if state == "running":
                confirmed()
                self._depart(id)
                return True
            if state is not None:
                self._take_back(id, http)
                raise NodeError("migration_failed", f"confirm: the destination reports the sandbox {state}")
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)

    def _depart(self, id: str) -> None:
        """Delete this node's copy of ``id``, which the destination now runs, in a thread of its own: it waits for
        the sandbox's lock (the move's caller holds it until it answers) and takes 0.1–0.3 s (the container's
        kill, its network and mounts) that the move's caller no longer waits for. The copy is paused and in phase
        ``handover`` until then; an agent killed before the delete finds it at its next start and settles it
        with the destination (:meth:`_reconcile_migration`). :meth:`departed` waits for it."""
        def run() -> None:
            try:
                self.delete(id)
            except Exception:  # noqa: BLE001 (a thread's last resort: the reconcile at start retries)
                log.exception("%s: deleting the copy left by its migration failed", id)
            finally:
                with self._departing_guard:
                    if self._departing.get(id) is thread:
                        del self._departing[id]

        thread = threading.Thread(target=run, name=f"sbx-depart-{id}", daemon=True)
        with self._departing_guard:
            self._departing[id] = thread
        thread.start()

    def departed(self, id: str, timeout: float = 60.0) -> None:
        """Wait (up to ``timeout`` seconds) until the copy of ``id`` a migration left here is deleted
        (:meth:`_depart`); at once when there is none. A migration back to this node waits for it first."""
        with self._departing_guard:
            thread = self._departing.get(id)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _reconcile_migration(self, sid: str, rec: dict[str, Any]) -> str | None:
        """After a restart of this agent: a sandbox caught in ``migrating`` is thawed and runs on here; one in
        ``handover`` is settled by asking the destination (:meth:`_hand_over`'s rules). Returns ``"running"``,
        ``"absent"`` (the destination has it) or None (nothing to do / still unsettled)."""
        phase = rec.get("phase")
        if phase == MIGRATING:
            log.warning("%s: a migration was interrupted before the handover: it runs on here", sid)
            self._take_back(sid, None)
            return "running"
        if phase == HANDOVER and rec.get("migratingTo") and rec.get("migrationTicket"):
            with _destination(str(rec["migratingTo"]), str(rec["migrationTicket"]), self.settings) as http:
                try:
                    state = (_answer(http.get(f"/v1/node/migrate/{sid}"), "state") or {}).get("state")
                except (httpx.HTTPError, _Step) as e:
                    log.warning("%s: handover to %s still unsettled: %s", sid, rec["migratingTo"], e)
                    return None
                if state == "running":
                    self.delete(sid)
                    return "absent"
                self._take_back(sid, http)
                return "running"
        return None
