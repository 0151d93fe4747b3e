"""The API shapes of stats samples, jobs and snapshots (a sandbox's own:
:meth:`sbx.control.sandboxes.planebase.PlaneBase.view`)."""

from __future__ import annotations

import logging
from typing import Any

from sbx.control.store.database import SnapshotRow, iso
from sbx.node.types import JobInfo, SnapshotInfo, Stats

log = logging.getLogger("sbx.control")




def stats_view(stats: Stats | None) -> dict[str, Any]:
    """The API shape of a stats sample: ``{"memoryTotalMb","memoryUsedMb","cpuPercent","diskUsedMb","oomKills",
    "diskAllocatedBytes","diskUniqueBytes"}``; the last two are the disk image's bytes on the volume (shared ones
    included) and the bytes only it holds (what deleting the sandbox frees). All zero without a sample."""
    if stats is None:
        return {"memoryTotalMb": 0, "memoryUsedMb": 0, "cpuPercent": 0.0, "diskUsedMb": 0, "oomKills": 0,
                "diskAllocatedBytes": 0, "diskUniqueBytes": 0}
    return {
        "memoryTotalMb": stats.memory_total_mb,
        "memoryUsedMb": stats.memory_used_mb,
        "cpuPercent": round(float(stats.cpu_percent), 1),
        "diskUsedMb": stats.disk_used_mb,
        "oomKills": stats.oom_kills,
        "diskAllocatedBytes": stats.disk_allocated_bytes,
        "diskUniqueBytes": stats.disk_unique_bytes,
    }


def job_view(job: JobInfo) -> dict[str, Any]:
    """The API shape of a detached job: ``{"id","command","running","exitCode","startedAt"}``."""
    return {
        "id": job.id,
        "command": job.command,
        "running": job.running,
        "exitCode": job.exit_code,
        "startedAt": job.started_at,
    }


def snapshot_view(row: SnapshotRow, info: SnapshotInfo | None = None) -> dict[str, Any]:
    """The API shape of a snapshot: ``{"name","sandboxId","auto","sizeMB","createdAt","allocatedBytes",
    "uniqueBytes"}``: bytes its image maps on the volume (shared ones included) and bytes only it holds (what
    deleting it frees), from the node's ``info`` (0 when unknown)."""
    return {
        "name": row.label or row.name,
        "sandboxId": row.sandbox_id,
        "auto": row.auto,
        "sizeMB": row.size_mib,
        "createdAt": iso(row.created_at),
        "allocatedBytes": info.allocated_bytes if info else 0,
        "uniqueBytes": info.unique_bytes if info else 0,
    }
