"""Placement (issue 10): which node a new, forked or resumed sandbox goes to.

A node may take a sandbox when it is ``ready`` (not cordoned, not unreachable: :mod:`sbx.control.cluster.registry`) and
has room for it by the admission rules of :mod:`sbx.control.cluster.capacity` (its memory limits promised so far,
counted per node from the store, and its free disk, from its last heartbeat). Among those:

- a new sandbox goes where the most memory is left to promise, then the most disk (``spread``: sandboxes spread
  over the nodes rather than filling one first);
- ``new --from SNAPSHOT`` goes to the node that holds the snapshot (a snapshot lives on the node that sealed it);
- a fork goes to its source's node (its disk is a reflink of the source's: constant time); when that node is
  full or cordoned, to another ready node with room, its disk copied there as a delta (:func:`choose_fork`;
  a fork with memory only to a node whose memory-image fingerprint matches the source node's);
- a stopped sandbox resumes on its own node when that node may take it; otherwise on another one, preferring a
  node whose memory-image fingerprint (CPU model and flags, kernel, CRIU) matches the one its image was made on
  (:func:`choose_resume`).

Every refusal is ``507 insufficient_capacity`` naming each node and why (nothing changes).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sbx.config import Settings, Size
from sbx.control.cluster import capacity
from sbx.control.cluster.capacity import HostResources
from sbx.control.errors import ControlError
from sbx.control.store.database import SandboxRow


@dataclass(frozen=True)
class Candidate:
    """One node as placement sees it: ``name``, ``status`` (``ready``/``cordoned``/``unreachable``), ``host``
    (its RAM in MiB and free disk in bytes), ``committed_mib`` (memory limits of its sandboxes that hold memory)
    and ``fingerprint`` (what a memory image made there is tied to)."""

    name: str
    status: str
    host: HostResources
    committed_mib: int
    fingerprint: dict[str, str] = field(default_factory=dict)

    def left_mib(self, settings: Settings) -> int:
        """MiB of memory limits the node may still promise."""
        return capacity.memory_limit_mib(settings, self.host) - self.committed_mib


def committed_by_node(rows: Iterable[SandboxRow], settings: Settings, default: str,
                      exclude: str | None = None) -> dict[str, int]:
    """``{node: MiB}`` of memory limits held on each node (:func:`sbx.control.cluster.capacity.committed_memory_mib` per
    node; a row without a node belongs to ``default``), leaving out sandbox ``exclude``."""
    by: dict[str, list[SandboxRow]] = {}
    for r in rows:
        by.setdefault(r.node or default, []).append(r)
    return {n: capacity.committed_memory_mib(rs, settings, exclude) for n, rs in by.items()}


def _why(c: Candidate, settings: Settings, size: Size, what: str) -> ControlError | None:
    if c.status == "cordoned":
        return ControlError("insufficient_capacity",
                            f"node {c.name} is cordoned (`sbx node uncordon` it)", 507)
    if c.status != "ready":
        return ControlError("insufficient_capacity", f"node {c.name} is unreachable", 507)
    return capacity.refusal(settings, c.host, c.committed_mib, size, what)


def _refuse(what: str, reasons: list[tuple[Candidate, ControlError]]) -> ControlError:
    if len(reasons) == 1 and reasons[0][0].status == "ready":
        return reasons[0][1]  # one node without room: admission's own message
    if not reasons:
        return ControlError("insufficient_capacity", f"no node can take {what}: no node is registered", 507)
    parts = [e.message if e.message.startswith("node ") else f"node {c.name}: {e.message}" for c, e in reasons]
    return ControlError("insufficient_capacity", f"no node can take {what}: " + "; ".join(parts), 507)


def fits(candidates: Iterable[Candidate], settings: Settings, size: Size, what: str
         ) -> tuple[list[Candidate], list[tuple[Candidate, ControlError]]]:
    """Split ``candidates`` into those that may take ``what`` at ``size`` and ``(candidate, why not)``."""
    ok: list[Candidate] = []
    no: list[tuple[Candidate, ControlError]] = []
    for c in candidates:
        err = _why(c, settings, size, what)
        if err is None:
            ok.append(c)
        else:
            no.append((c, err))
    return ok, no


def _best(cands: list[Candidate], settings: Settings) -> str:
    """The candidate with the most memory left to promise, then the most free disk, then the first name."""
    return min(cands, key=lambda c: (-c.left_mib(settings), -c.host.disk_free_bytes, c.name)).name


def _pick(cands: list[Candidate], settings: Settings, prefer: str | None) -> str:
    """``prefer`` when it is among ``cands``, else :func:`_best`."""
    return prefer if prefer is not None and any(c.name == prefer for c in cands) else _best(cands, settings)


def choose(candidates: Iterable[Candidate], settings: Settings, size: Size, what: str,
           only: str | None = None) -> str:
    """The node for a new sandbox (or ``new --from``, with ``only`` = the snapshot's node; a fork:
    :func:`choose_fork`): the fitting candidate with the most memory left to promise, then the most free disk,
    then by name. Raises ``507 insufficient_capacity`` when none fits (the message names each node's reason)."""
    pool = [c for c in candidates if only is None or c.name == only]
    if only is not None and not pool:
        raise ControlError("insufficient_capacity", f"no node can take {what}: node {only} is not registered", 507)
    ok, no = fits(pool, settings, size, what)
    if not ok:
        raise _refuse(what, no)
    return _best(ok, settings)


def fingerprint_matches(a: dict[str, str], b: dict[str, str]) -> bool:
    """True when two nodes' memory-image fingerprints agree on every key either has (an empty one matches
    nothing)."""
    if not a or not b:
        return False
    return all(a.get(k) == b.get(k) for k in set(a) | set(b))


@dataclass(frozen=True)
class ResumePlace:
    """Where a stopped sandbox resumes: ``node``; ``moves`` when that is not the node holding it; ``memory`` when
    its memory image can be restored there (same node, or a matching fingerprint)."""

    node: str
    moves: bool
    memory: bool
    replica: bool = False
    """The move takes the seal replica ``node`` already holds (:mod:`sbx.control.cluster.replicas`) instead of a
    copy."""
    archive: bool = False
    """The move takes the sandbox's seal from the seal store (:mod:`sbx.control.cluster.archive`): its node is gone."""


def choose_resume(candidates: Iterable[Candidate], settings: Settings, size: Size, what: str, current: str,
                  has_memory: bool) -> ResumePlace:
    """Where sandbox ``what`` (on node ``current``, with a memory image when ``has_memory``) resumes at ``size``:
    its own node when that one may take it; else the fitting node whose fingerprint matches ``current``'s (most
    room first), else any fitting node (a cold boot there: ``cpu_mismatch``); else its own node when it is only
    cordoned and has room (nowhere else to go). Raises ``507 insufficient_capacity`` when no node fits."""
    cands = list(candidates)
    ok, no = fits(cands, settings, size, what)
    if any(c.name == current for c in ok):
        return ResumePlace(current, moves=False, memory=has_memory)
    src = next((c for c in cands if c.name == current), None)
    if not ok:
        # a cordoned node still runs what it holds: with nowhere else to go, resume there
        if src is not None and src.status == "cordoned" and \
                capacity.refusal(settings, src.host, src.committed_mib, size, what) is None:
            return ResumePlace(current, moves=False, memory=has_memory)
        raise _refuse(what, no)
    fp = src.fingerprint if src is not None else {}
    matching = [c for c in ok if fingerprint_matches(c.fingerprint, fp)]
    if has_memory and matching:
        return ResumePlace(_best(matching, settings), moves=True, memory=True)
    return ResumePlace(_best(ok, settings), moves=True, memory=False)


def choose_move(candidates: Iterable[Candidate], settings: Settings, size: Size, what: str, current: str,
                live: bool, has_memory: bool = False, unusable: dict[str, str] | None = None,
                prefer: str | None = None) -> ResumePlace:
    """Where sandbox ``what`` (on node ``current``, at ``size``) moves to off its node (a live migration when
    ``live``, else the move of a stopped one, with a memory image when ``has_memory``): never ``current``; only
    ``ready`` nodes with room. A live migration needs a node whose memory-image fingerprint matches
    ``current``'s; a stopped move prefers one (its memory image stays usable), else takes any. ``unusable``:
    ``{node: why}`` of nodes that can't take this kind of move at all (e.g. one with no node API to receive a
    migration). The one with most room first, unless ``prefer`` (a node consolidation planned) is among those
    that may take it. Raises ``507 insufficient_capacity`` naming each node's reason (nothing changes)."""
    cands = list(candidates)
    src = next((c for c in cands if c.name == current), None)
    fp = src.fingerprint if src is not None else {}
    unusable = unusable or {}
    pool = [c for c in cands if c.name != current and c.name not in unusable]
    ok, no = fits(pool, settings, size, what)
    no.extend((c, ControlError("insufficient_capacity", f"node {c.name}: {unusable[c.name]}", 507))
              for c in cands if c.name in unusable and c.name != current)
    matching = [c for c in ok if fingerprint_matches(c.fingerprint, fp)]
    if live:
        no.extend((c, ControlError("insufficient_capacity",
                                   f"node {c.name}: its CPU, kernel or CRIU differ from node {current}'s", 507))
                  for c in ok if c not in matching)
        if not matching:
            if not no:
                raise ControlError("insufficient_capacity", f"no node can take {what}: no other node is "
                                                            "registered", 507)
            raise _refuse(what, no)
        return ResumePlace(_pick(matching, settings, prefer), moves=True, memory=True)
    if not ok:
        if not no:
            raise ControlError("insufficient_capacity", f"no node can take {what}: no other node is registered",
                               507)
        raise _refuse(what, no)
    if has_memory and matching:
        return ResumePlace(_pick(matching, settings, prefer), moves=True, memory=True)
    return ResumePlace(_pick(ok, settings, prefer), moves=True, memory=False)


def choose_fork(candidates: Iterable[Candidate], settings: Settings, size: Size, what: str, home: str,
                memory: bool = False) -> ResumePlace:
    """Where fork ``what`` (at ``size``) of a sandbox on node ``home`` goes: ``home`` when it may take it (a
    reflink copy there; ``moves`` False); else, when ``home`` is full or cordoned, the ready node with room with
    the most room (``moves``: made stopped on ``home`` and copied there as a disk delta,
    :mod:`sbx.control.sandboxes.forking`).
    With ``memory`` (the fork restores the source's processes) only a node whose memory-image fingerprint matches
    ``home``'s may take it: never a cold boot instead. An unreachable ``home`` can't make the copy at all. Raises
    ``507 insufficient_capacity`` naming ``home``'s reason first, then each other node's."""
    cands = list(candidates)
    src = next((c for c in cands if c.name == home), None)
    if src is None:
        raise ControlError("insufficient_capacity", f"no node can take {what}: node {home} is not registered", 507)
    err = _why(src, settings, size, what)
    if err is None:
        return ResumePlace(home, moves=False, memory=memory)
    reasons = [(src, err)]
    if src.status != "unreachable":
        ok, no = fits([c for c in cands if c.name != home], settings, size, what)
        if memory:
            differ = [c for c in ok if not fingerprint_matches(c.fingerprint, src.fingerprint)]
            no.extend((c, ControlError("insufficient_capacity", f"node {c.name}: its CPU, kernel or CRIU differ from "
                                       f"node {home}'s, so the source's processes can't be restored there (fork "
                                       "without --memory to boot the copy from its disk)", 507)) for c in differ)
            ok = [c for c in ok if c not in differ]
        if ok:
            return ResumePlace(_best(ok, settings), moves=True, memory=memory)
        reasons.extend(no)
    raise _refuse(what, reasons)
