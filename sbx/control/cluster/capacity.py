"""Admission: whether this node can take one more sandbox's memory and disk (issue 17, "Admission and space").

``new``, ``resume`` (including a resize, which cold-boots bigger) and ``fork`` are checked while the control
plane holds its lifecycle lock, in the same critical section that writes the new state, so two requests can never
both pass on the last free room; a refusal is ``507 insufficient_capacity`` and changes nothing.

Memory: every sandbox that is not ``stopped`` (running, starting, stopping, resuming, forking, deleting, and
``error``, which may still hold its container) is counted at its size's memory limit. With ``R`` the host's RAM
(``MemTotal``), the limit is ``(R - memory_reserve_mib) x memory_overcommit``; a request passes when the counted
sum plus the new sandbox's memory stays within it. A resumed sandbox is not counted twice (it is stopped, or in
``error`` and excluded by id).

Why the default ratio is 4.0: a sandbox's memory limit is a ceiling, not what it uses. An idle small sandbox
holds ~9 MB of host memory (issue 13), so a ratio of 1.0 would turn a 24 GiB host away after 5 production small
sandboxes (4 GiB each). The idle-density goal (300 idle small sandboxes on a 24 GiB host, measured by ``python -m
bench`` with the test profile's 256 MiB small) needs (24105 - 1024) MiB x r >= 300 x 256 MiB, r >= 3.33; 4.0
admits ~360 of them, and ~22 production small sandboxes (90 GiB promised on 23 GiB), which the 2 cores of such a
host could not keep busy anyway. A node that packs more idle sandboxes raises ``SBX_MEMORY_OVERCOMMIT`` (300
production small ones need 54); what they really use is bounded by the node's parent cgroup either way.

Disk: new disks are reflinks of an image (no room at first) that grow as the sandbox writes, on a sparse volume
whose backing file grows on the host's filesystem. A request passes when the tighter of the host filesystem and
the volume (:func:`sbx.storage.volume.free_space`) keeps ``disk_reserve_gib`` free after the new disk's likely
growth, :data:`DISK_GROWTH_SHARE` of its size (1 GiB for a 20 GiB small disk).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sbx.config import Settings, Size
from sbx.control.errors import ControlError
from sbx.control.store.database import SandboxRow
from sbx.storage.volume import free_space

MiB = 1024 * 1024
GiB = 1024 * MiB

FREE_STATES = frozenset({"stopped", "deleted"})
"""States whose sandboxes hold no memory on the node; every other state counts."""

DISK_GROWTH_SHARE = 0.05
"""Share of a new (or resumed, or forked) sandbox's disk size counted as the room it will soon take."""


@dataclass(frozen=True)
class HostResources:
    """What admission measures on the host: ``memory_mib`` (RAM, ``MemTotal``), ``disk_free_bytes`` (room left
    where the volume runs out first) and ``disk_path`` (that place, for messages)."""

    memory_mib: int
    disk_free_bytes: int
    disk_path: str


def host_memory_mib(meminfo: Path = Path("/proc/meminfo")) -> int:
    """The host's RAM in MiB (``MemTotal`` of ``meminfo``). Raises ``OSError``/``ValueError`` when unreadable."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise ValueError(f"no MemTotal in {meminfo}")


def probe_host(settings: Settings) -> HostResources:
    """Measure the host now: RAM from ``/proc/meminfo``, room from :func:`sbx.storage.volume.free_space`."""
    space = free_space(settings)
    return HostResources(host_memory_mib(), space.free_bytes, space.path)


def holds_memory(state: str) -> bool:
    """True for a state whose sandbox is counted against the node's memory (see the module doc)."""
    return state not in FREE_STATES


def committed_memory_mib(rows: Iterable[SandboxRow], settings: Settings, exclude: str | None = None) -> int:
    """MiB of memory limits of ``rows`` that hold memory, leaving out sandbox ``exclude``; a row of a type no
    longer configured counts as the largest size."""
    biggest = max((s.memory_mib for s in settings.sizes.values()), default=0)
    total = 0
    for row in rows:
        if row.id == exclude or not holds_memory(row.state):
            continue
        size = settings.sizes.get(row.type)
        total += size.memory_mib if size else biggest
    return total


def promised_disk_bytes(rows: Iterable[SandboxRow], settings: Settings) -> int:
    """Bytes the disks of ``rows`` that are not deleted may grow to together (their sizes' ``disk_mib``; a row of a
    type no longer configured counts as the largest size): the overcommit of sparse disks that ``sbx node list`` and
    ``sbx doctor`` state against the room left (issue 36)."""
    biggest = max((s.disk_mib for s in settings.sizes.values()), default=0)
    total = 0
    for row in rows:
        if row.state == "deleted":
            continue
        size = settings.sizes.get(row.type)
        total += (size.disk_mib if size else biggest) * MiB
    return total


def memory_limit_mib(settings: Settings, host: HostResources) -> int:
    """MiB of memory limits the node may promise: ``(RAM - memory_reserve_mib) x memory_overcommit``, at least 0."""
    return max(0, int((host.memory_mib - settings.memory_reserve_mib) * settings.memory_overcommit))


def disk_growth_bytes(size: Size) -> int:
    """Bytes a sandbox of ``size`` is counted to take soon: :data:`DISK_GROWTH_SHARE` of its disk."""
    return int(size.disk_mib * MiB * DISK_GROWTH_SHARE)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def refusal(settings: Settings, host: HostResources, committed_mib: int, size: Size, what: str) -> ControlError | None:
    """The ``507 insufficient_capacity`` error for admitting ``what`` (e.g. "a new small sandbox") of ``size``
    with ``committed_mib`` already counted, or None when it fits. Memory is checked first, then disk; the message
    names which and gives the figures."""
    limit = memory_limit_mib(settings, host)
    if committed_mib + size.memory_mib > limit:
        return ControlError(
            "insufficient_capacity",
            f"not enough memory on this node for {what} ({size.memory_mib} MiB): sandboxes that are not stopped "
            f"already hold {committed_mib} MiB of the {limit} MiB this node may promise (({host.memory_mib} MiB RAM "
            f"- {settings.memory_reserve_mib} MiB reserve) x overcommit {settings.memory_overcommit:g}); stop or "
            "delete a sandbox, or raise SBX_MEMORY_OVERCOMMIT",
            507,
        )
    growth = disk_growth_bytes(size)
    reserve = int(settings.disk_reserve_gib * GiB)
    if host.disk_free_bytes - growth < reserve:
        return ControlError(
            "insufficient_capacity",
            f"not enough disk on this node for {what}: {_gib(host.disk_free_bytes)} free on {host.disk_path}, its "
            f"disk may soon take {_gib(growth)} and {_gib(reserve)} must stay free (SBX_DISK_RESERVE_GIB); delete "
            "sandboxes or snapshots",
            507,
        )
    return None
