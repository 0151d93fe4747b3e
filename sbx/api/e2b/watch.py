"""envd's directory watchers (``CreateWatcher``, ``GetWatcherEvents``, ``RemoveWatcher``, which the SDK's
synchronous ``files.watch_dir`` polls, and the ``WatchDir`` stream of its asynchronous one), by comparing
listings: sbx runs no watcher of its own in the sandbox, so each poll lists the directory again
(:func:`sbx.api.e2b.fs.list_dir`) and reports what differs from the last listing:

- a new entry: ``EVENT_TYPE_CREATE``, and for a file with content also ``EVENT_TYPE_WRITE`` and
  ``EVENT_TYPE_CHMOD`` (what envd reports for a file it writes: created, written, its mode set);
- a file's changed size or modification time: ``EVENT_TYPE_WRITE`` (a directory's, whose entries changed, is no
  event of its own, as with inotify); changed permissions only: ``EVENT_TYPE_CHMOD``;
- a vanished entry: ``EVENT_TYPE_REMOVE``.

So a change undone between two polls is not seen, and a rename shows as a remove and a create. Watchers live in
the server's memory (lost when it restarts: a poll then answers ``not_found``), at most :data:`MAX_WATCHERS`.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sbx.api.e2b.fs as fs
from sbx.api.e2b.connect import ConnectError

if TYPE_CHECKING:
    from sbx.control.service import ControlPlane

MAX_WATCHERS = 1000
POLL_SECONDS = 0.5
"""How often a ``WatchDir`` stream lists the directory again."""
RECURSIVE_DEPTH = 32


@dataclass
class Watcher:
    """One watcher: its sandbox, directory, depth, whether events carry entries, and the last listing."""

    sandbox_id: str
    path: str
    user: str
    depth: int
    include_entry: bool
    seen: dict[str, dict[str, Any]] = field(default_factory=dict)


def _listing(cp: ControlPlane, w: Watcher) -> dict[str, dict[str, Any]]:
    return {e["path"]: e for e in fs.list_dir(cp, w.sandbox_id, w.path, w.depth, w.user)["entries"]}


def _event(w: Watcher, entry: dict[str, Any], kind: str) -> dict[str, Any]:
    name = entry["path"][len(w.path.rstrip("/")) + 1:]
    event: dict[str, Any] = {"name": name, "type": f"EVENT_TYPE_{kind}"}
    if w.include_entry and kind != "REMOVE":
        event["entry"] = entry
    return event


def diff(w: Watcher, now: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The events between ``w``'s last listing and ``now`` (see the module's doc), in path order."""
    events: list[dict[str, Any]] = []
    for path in sorted(set(w.seen) | set(now)):
        old, new = w.seen.get(path), now.get(path)
        if old is None and new is not None:
            events.append(_event(w, new, "CREATE"))
            if new["type"] == "FILE_TYPE_FILE" and new["size"] != "0":
                events += [_event(w, new, "WRITE"), _event(w, new, "CHMOD")]
        elif new is None and old is not None:
            events.append(_event(w, old, "REMOVE"))
        elif old is not None and new is not None:
            if new["type"] == "FILE_TYPE_FILE" and (old["size"], old["modifiedTime"]) != (new["size"],
                                                                                     new["modifiedTime"]):
                events.append(_event(w, new, "WRITE"))
            elif old["mode"] != new["mode"]:
                events.append(_event(w, new, "CHMOD"))
    return events


class Watchers:
    """The server's watchers, by id (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all: dict[str, Watcher] = {}

    def create(self, cp: ControlPlane, sandbox_id: str, request: dict[str, Any], user: str) -> dict[str, Any]:
        """``CreateWatcherResponse`` ``{"watcherId"}``: watch directory ``path`` (``recursive``: everything under
        it). ``not_found`` for a missing directory, ``invalid_argument`` for a file, ``resource_exhausted`` past
        :data:`MAX_WATCHERS`."""
        recursive = request.get("recursive", False)
        include = request.get("includeEntry", False)
        if not isinstance(recursive, bool) or not isinstance(include, bool):
            raise ConnectError("invalid_argument", "recursive and includeEntry must be true or false")
        w = Watcher(sandbox_id, fs.absolute(request.get("path"), user), user,
                    RECURSIVE_DEPTH if recursive else 1, include)
        w.seen = _listing(cp, w)
        with self._lock:
            if len(self._all) >= MAX_WATCHERS:
                raise ConnectError("resource_exhausted", f"at most {MAX_WATCHERS} watchers at a time")
            wid = "w_" + secrets.token_hex(8)
            self._all[wid] = w
        return {"watcherId": wid}

    def _get(self, sandbox_id: str, request: dict[str, Any]) -> tuple[str, Watcher]:
        wid = request.get("watcherId")
        with self._lock:
            w = self._all.get(wid) if isinstance(wid, str) else None
        if w is None or w.sandbox_id != sandbox_id:
            raise ConnectError("not_found", f"watcher {str(wid)[:40]!r} not found")
        return str(wid), w

    def events(self, cp: ControlPlane, sandbox_id: str, request: dict[str, Any]) -> dict[str, Any]:
        """``GetWatcherEventsResponse`` ``{"events"}`` since the last call; ``not_found`` for an unknown watcher
        (or a watched directory that is gone)."""
        _wid, w = self._get(sandbox_id, request)
        now = _listing(cp, w)
        events = diff(w, now)
        w.seen = now
        return {"events": events}

    def remove(self, sandbox_id: str, request: dict[str, Any]) -> dict[str, Any]:
        """``RemoveWatcherResponse`` ``{}``; ``not_found`` for an unknown watcher."""
        wid, _w = self._get(sandbox_id, request)
        with self._lock:
            self._all.pop(wid, None)
        return {}

    def stream(self, cp: ControlPlane, sandbox_id: str, request: dict[str, Any], user: str,
               gone: Callable[[], bool], every: float = POLL_SECONDS) -> Iterator[dict[str, Any]]:
        """``WatchDir``'s messages: ``{"start": {}}``, then ``{"filesystem": event}`` for each change found by
        polling every ``every`` seconds, until ``gone()`` (the client left). Raises as :meth:`create`."""
        recursive = request.get("recursive", False)
        include = request.get("includeEntry", False)
        if not isinstance(recursive, bool) or not isinstance(include, bool):
            raise ConnectError("invalid_argument", "recursive and includeEntry must be true or false")
        w = Watcher(sandbox_id, fs.absolute(request.get("path"), user), user,
                    RECURSIVE_DEPTH if recursive else 1, include)
        w.seen = _listing(cp, w)
        yield {"start": {}}
        while True:
            deadline = time.monotonic() + every
            while time.monotonic() < deadline:
                if gone():
                    return
                time.sleep(0.05)
            now = _listing(cp, w)
            for event in diff(w, now):
                yield {"filesystem": event}
            w.seen = now

    def forget(self, sandbox_id: str) -> None:
        """Drop the watchers of a sandbox that is gone."""
        with self._lock:
            for wid in [k for k, w in self._all.items() if w.sandbox_id == sandbox_id]:
                del self._all[wid]
