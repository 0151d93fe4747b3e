"""A sandbox's volumes in its running container (see :mod:`sbx.storage.juicefs` for how and why).

The sandbox's spec lists its volumes (:attr:`sbx.node.types.SandboxSpec.volumes`: ``{"id", "name", "path",
"readOnly", "meta"}``). Each running sandbox has one JuiceFS daemon per volume, made in its user namespace; the
record keeps ``volumeDaemons``: ``{path: process group}``. The container must run (its init's pid is given).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sbx.node.types import NodeError
from sbx.storage import juicefs
from sbx.storage.errors import StorageError

log = logging.getLogger(__name__)


def volumes_of(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The volumes the record's spec lists (empty for a sandbox without volumes)."""
    vols = rec.get("spec", {}).get("volumes") or []
    return [v for v in vols if isinstance(v, dict) and v.get("path") and v.get("meta")]


def attach(rec: dict[str, Any], sid: str, init_pid: int, logs: Path) -> dict[str, int]:
    """Mount every volume of ``rec``'s spec into the container of ``init_pid`` that is not mounted there yet;
    returns the new ``volumeDaemons`` (also set in ``rec``; the caller saves it). A daemon left from an earlier run
    that no longer serves a mount is ended. Raises ``NodeError("volume_mount_failed")`` after unmounting what this
    call mounted."""
    daemons: dict[str, int] = {k: int(v) for k, v in (rec.get("volumeDaemons") or {}).items()}
    logs.mkdir(parents=True, exist_ok=True)
    done: list[str] = []
    for vol in volumes_of(rec):
        path = vol["path"]
        pgid = daemons.get(path)
        if pgid is not None and juicefs.daemon_alive(pgid) and juicefs.mounted_in(init_pid, path):
            continue
        if pgid is not None:
            juicefs.stop_daemon(pgid)
        try:
            daemons[path] = juicefs.mount_into(init_pid, vol["meta"], path, bool(vol.get("readOnly")),
                                               logs / f"{sid}-{vol.get('id', 'vol')}.log")
            done.append(path)
        except (StorageError, ValueError) as e:
            for p in done:
                juicefs.unmount_from(init_pid, p)
                juicefs.stop_daemon(daemons.pop(p))
            rec["volumeDaemons"] = daemons
            raise NodeError("volume_mount_failed", f"volume {vol.get('name')} at {path}: {e}") from e
    rec["volumeDaemons"] = daemons
    return daemons


def detach(rec: dict[str, Any], init_pid: int | None) -> None:
    """Unmount the record's volumes from the container of ``init_pid`` (when it runs) and end their daemons;
    clears ``volumeDaemons`` in ``rec`` (the caller saves it). Never raises."""
    daemons = rec.get("volumeDaemons") or {}
    for path, pgid in list(daemons.items()):
        if init_pid:
            try:
                juicefs.unmount_from(init_pid, path)
            except Exception as e:  # noqa: BLE001 - a stop must go on
                log.warning("unmounting volume %s: %s", path, e)
        juicefs.stop_daemon(int(pgid))
    rec["volumeDaemons"] = {}


def missing(rec: dict[str, Any], init_pid: int) -> bool:
    """True when a volume of the record's spec is not mounted in the container of ``init_pid`` or its daemon died
    (what a restarted node agent's reconcile repairs with :func:`attach`)."""
    daemons = rec.get("volumeDaemons") or {}
    for vol in volumes_of(rec):
        pgid = daemons.get(vol["path"])
        if pgid is None or not juicefs.daemon_alive(int(pgid)) or not juicefs.mounted_in(init_pid, vol["path"]):
            return True
    return False
