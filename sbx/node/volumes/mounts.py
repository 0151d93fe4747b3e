"""A sandbox's volumes in its running container (see :mod:`sbx.storage.juicefs` for how and why).

The sandbox's spec lists its volumes (:attr:`sbx.node.types.SandboxSpec.volumes`: ``{"id", "name", "path",
"readOnly", "meta"}``). Each running sandbox has one JuiceFS daemon per volume, made in its user namespace; their
process groups are kept as ``{path: pgid}`` in the sandbox's ``volumes.json`` (beside ``node.json``, which other
steps rewrite from copies of their own). The container must run (its init's pid is given).
"""

from __future__ import annotations

import json
import logging
import os
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


def load(state: Path) -> dict[str, int]:
    """The ``{path: pgid}`` kept in ``state`` (empty when there is none)."""
    try:
        return {str(k): int(v) for k, v in json.loads(state.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _keep(state: Path, daemons: dict[str, int]) -> None:
    if not daemons:
        state.unlink(missing_ok=True)
        return
    tmp = state.with_suffix(".tmp")
    tmp.write_text(json.dumps(daemons))
    tmp.replace(state)


def attach(rec: dict[str, Any], sid: str, init_pid: int, logs: Path, state: Path) -> dict[str, int]:
    """Mount every volume of ``rec``'s spec into the container of ``init_pid`` that is not mounted there yet;
    returns ``{path: pgid}`` of their daemons, also kept in ``state``. A daemon left from an earlier run that no
    longer serves a mount is ended. Raises ``NodeError("volume_mount_failed")`` after unmounting what this call
    mounted."""
    daemons = load(state)
    logs.mkdir(parents=True, exist_ok=True)
    done: list[str] = []
    for vol in volumes_of(rec):
        path = vol["path"]
        pgid = daemons.get(path)
        if pgid is not None and juicefs.daemon_alive(pgid) and juicefs.mounted_in(init_pid, path):
            continue
        if pgid is not None:
            juicefs.stop_daemon(pgid)
        while juicefs.mounted_in(init_pid, path):  # a mount whose daemon died: ENOTCONN, replaced below
            juicefs.unmount_from(init_pid, path)
            if juicefs.mounted_in(init_pid, path):
                break
        try:
            daemons[path] = juicefs.mount_into(init_pid, vol["meta"], path, bool(vol.get("readOnly")),
                                               logs / f"{sid}-{vol.get('id', 'vol')}.log")
            done.append(path)
        except (StorageError, ValueError) as e:
            for p in done:
                juicefs.unmount_from(init_pid, p)
                juicefs.stop_daemon(daemons.pop(p))
            _keep(state, daemons)
            raise NodeError("volume_mount_failed", f"volume {vol.get('name')} at {path}: {e}") from e
        finally:
            _keep(state, daemons)
    return daemons


def detach(rec: dict[str, Any], init_pid: int | None, state: Path) -> None:
    """Unmount the volumes from the container of ``init_pid`` (when it runs: every JuiceFS mount its mount table
    shows, and those of the spec) and end their daemons (those ``state`` keeps; it is removed). Never raises."""
    daemons = load(state)
    for pid in _namespaces(init_pid) if init_pid else []:
        for path in sorted(set(juicefs.mounts_in(pid)), key=len, reverse=True):
            for _ in range(4):  # one umount per mount stacked there
                try:
                    juicefs.unmount_from(pid, path)
                except Exception as e:  # noqa: BLE001 - a stop must go on
                    log.warning("unmounting volume %s: %s", path, e)
                if not juicefs.mounted_in(pid, path):
                    break
        left = juicefs.mounts_in(pid)
        if left:
            log.warning("volumes still mounted in process %d after their unmount: %s", pid, ", ".join(left))
    for pgid in daemons.values():
        juicefs.stop_daemon(int(pgid))
    _keep(state, {})


def _namespaces(init_pid: int) -> list[int]:
    """One process of each mount namespace inside the container of ``init_pid`` (its own first): a service started
    after a volume was mounted (systemd's ``PrivateTmp=``, ``ProtectSystem=``...) has a copy of the mount in a
    namespace of its own, and CRIU dumps every namespace. The container's processes are those in its user and PID
    namespaces (a JuiceFS daemon shares the first only)."""
    def ns(pid: int | str, kind: str) -> str | None:
        try:
            return os.readlink(f"/proc/{pid}/ns/{kind}")
        except OSError:
            return None

    user, pidns = ns(init_pid, "user"), ns(init_pid, "pid")
    seen = {ns(init_pid, "mnt")}
    out = [init_pid]
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or ns(entry, "user") != user or ns(entry, "pid") != pidns:
            continue
        mnt = ns(entry, "mnt")
        if mnt is not None and mnt not in seen:
            seen.add(mnt)
            out.append(int(entry))
    return out
