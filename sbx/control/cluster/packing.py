"""The rules of consolidation (issue 11): which node to empty, and where each of its sandboxes goes.

:func:`plan` is a pure function over what the nodes hold (:class:`NodeLoad`), run by the consolidation loop
(:mod:`sbx.control.cluster.consolidate`) every ``SBX_CONSOLIDATE_SECONDS``. Memory here is what admission counts
(:mod:`sbx.control.cluster.capacity`): a node's ``capacity`` is the memory it may promise, ``(RAM -
SBX_MEMORY_RESERVE_MIB)
x SBX_MEMORY_OVERCOMMIT``, and its ``used`` memory is the sum of the memory limits of its sandboxes that are not
stopped (a stopped sandbox holds none).

1. Nothing happens while a node is ``unreachable`` (its sandboxes may need the room when it comes back).
2. A node is *light* when it is ``ready`` (answers, not cordoned), was added with ``sbx node add`` (a server's
   configured node can't be removed: it is never emptied), its used memory is below ``SBX_CONSOLIDATE_LIGHT_FRACTION``
   (0.25) of its capacity, it holds at least one and at most ``SBX_CONSOLIDATE_MAX_MOVES`` (20) sandboxes, each
   ``running`` or ``stopped`` (one in an operation: next time; one in ``error`` can't move: never). An empty node
   is left alone: it has nothing to move and takes new sandboxes (a node just added is not taken away at once).
3. Light nodes are tried lightest first (used fraction, then fewest sandboxes, then name). A node is emptied only
   when each of its sandboxes, biggest first, fits on one of the *other* ready nodes, fullest first (so moves pack
   onto the fullest nodes instead of spreading), where a destination fits when after the moves planned so far it
   still keeps ``SBX_CONSOLIDATE_HEADROOM`` (0.2) of its capacity free and passes admission's disk rule; a running
   sandbox also needs a node that can take a live migration (a node API and the same memory-image fingerprint).
   The ready nodes left must also keep that headroom together (a node holding only stopped sandboxes counts no
   memory, but taking it out takes its room away), and the last ready node is never emptied. The first light node
   that passes is the plan.
4. When no node is emptied and the ready nodes together keep less than the headroom free, a node consolidation
   emptied earlier (still cordoned, still empty) is handed back: :attr:`Plan.action` ``return``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sbx.config import Size
from sbx.control.cluster import capacity
from sbx.control.cluster.placement import fingerprint_matches

CONSOLIDATION_REASON = "consolidation"
"""The ``reason`` of the drain and of each move event consolidation makes."""


@dataclass(frozen=True)
class Held:
    """A sandbox on a node: ``id``, ``state``, ``size`` and whether a stopped one has a memory image."""

    id: str
    state: str
    size: Size
    has_memory: bool = False

    @property
    def memory_mib(self) -> int:
        """Memory it holds on its node now (none while stopped)."""
        return self.size.memory_mib if capacity.holds_memory(self.state) else 0


@dataclass(frozen=True)
class NodeLoad:
    """One node as consolidation sees it: ``status`` (``ready``/``cordoned``/``unreachable``), ``capacity_mib`` (memory
    it may promise), ``used_mib`` (memory its sandboxes that are not stopped hold), ``disk_free_bytes``, ``added``
    (added with ``sbx node add``: may be emptied), ``live`` (may receive a live migration), ``fingerprint``,
    ``consolidated`` (emptied by consolidation and still cordoned), ``sandboxes`` and ``held_back``."""

    name: str
    status: str
    capacity_mib: int
    used_mib: int
    disk_free_bytes: int = 1 << 50
    added: bool = True
    live: bool = True
    fingerprint: dict[str, str] = field(default_factory=dict)
    consolidated: bool = False
    sandboxes: tuple[Held, ...] = ()
    held_back: str = ""
    """Why it is not tried now although it may be light (e.g. its last consolidation failed); empty: it may be."""

    @property
    def fraction(self) -> float:
        """Used memory over capacity (1.0 for a node with no capacity)."""
        return self.used_mib / self.capacity_mib if self.capacity_mib > 0 else 1.0


@dataclass(frozen=True)
class Rules:
    """The thresholds (settings ``consolidate_light_fraction``, ``consolidate_headroom``,
    ``consolidate_max_moves``) and admission's disk reserve in GiB."""

    light_fraction: float = 0.25
    headroom: float = 0.2
    max_moves: int = 20
    disk_reserve_gib: float = 5.0


@dataclass
class Plan:
    """The decision: ``action`` ``drain`` (empty ``node``: ``moves`` ``{sandbox id: destination}``), ``return``
    (uncordon ``node``, emptied earlier: the rest are short of room) or ``none``; ``reason`` says why in words;
    ``nodes`` is each node's figures and why it is (not) light."""

    action: str
    node: str | None
    reason: str
    moves: dict[str, str] = field(default_factory=dict)
    nodes: list[dict[str, Any]] = field(default_factory=list)

    def view(self) -> dict[str, Any]:
        """The API shape: ``{"action","node","reason","moves": [{"id","to"}],"nodes": [...]}``."""
        return {"action": self.action, "node": self.node, "reason": self.reason,
                "moves": [{"id": k, "to": v} for k, v in self.moves.items()], "nodes": self.nodes}


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def _not_light(n: NodeLoad, rules: Rules) -> str | None:
    """Why node ``n`` is not light (rule 2), or None when it is."""
    if n.status != "ready":
        return f"it is {n.status}"
    if n.held_back:
        return n.held_back
    if not n.added:
        return "it is a server's configured node (only nodes added with `sbx node add` are emptied)"
    if not n.sandboxes:
        return "it holds no sandbox (nothing to move: it takes new ones; cordon it to remove it)"
    if n.fraction >= rules.light_fraction:
        return f"{_pct(n.fraction)} of its memory is used (light: below {_pct(rules.light_fraction)})"
    if len(n.sandboxes) > rules.max_moves:
        return f"it holds {len(n.sandboxes)} sandboxes (at most {rules.max_moves} are moved at once)"
    stuck = [s for s in n.sandboxes if s.state not in ("running", "stopped")]
    if stuck:
        return f"sandbox {stuck[0].id} is {stuck[0].state}"
    return None


def _pack(src: NodeLoad, others: list[NodeLoad], rules: Rules) -> tuple[dict[str, str], str | None]:
    """Rule 3 for one light node: ``({sandbox id: destination}, None)``, or ``({}, why not)``."""
    if not others:
        return {}, "it is the only ready node (the last one is never emptied)"
    used = {n.name: n.used_mib for n in others}
    disk = {n.name: n.disk_free_bytes for n in others}
    reserve = int(rules.disk_reserve_gib * capacity.GiB)
    moves: dict[str, str] = {}
    for s in sorted(src.sandboxes, key=lambda s: (-s.size.memory_mib, s.id)):
        live = s.state == "running"
        # what the sandbox will hold there: a stopped one holds nothing until it resumes, as admission counts it
        need = s.size.memory_mib if live else 0
        fits = [n for n in others
                if (not live or (n.live and fingerprint_matches(n.fingerprint, src.fingerprint)))
                and used[n.name] + need <= n.capacity_mib * (1 - rules.headroom)
                and used[n.name] + s.size.memory_mib <= n.capacity_mib
                and disk[n.name] - capacity.disk_growth_bytes(s.size) >= reserve]
        if not fits:
            kind = "a live migration of " if live else ""
            return {}, (f"no other ready node can take {kind}{s.id} ({s.size.memory_mib} MiB) and keep "
                        f"{_pct(rules.headroom)} of its memory free")
        if not live and s.has_memory:  # a stopped one's memory image stays usable on a matching node
            fits = [n for n in fits if fingerprint_matches(n.fingerprint, src.fingerprint)] or fits
        dst = max(fits, key=lambda n: (used[n.name] / max(n.capacity_mib, 1), n.name))
        moves[s.id] = dst.name
        used[dst.name] += need
        disk[dst.name] -= capacity.disk_growth_bytes(s.size)
    total = sum(n.capacity_mib for n in others)
    free = total - sum(used.values())
    if total <= 0 or free < rules.headroom * total:
        return {}, (f"the other ready nodes would keep {_pct(free / total) if total > 0 else '0%'} of their "
                    f"memory free (at least {_pct(rules.headroom)} must stay free)")
    return moves, None


def plan(nodes: Iterable[NodeLoad], rules: Rules) -> Plan:
    """What consolidation does now with ``nodes`` (module docstring for the rules). Pure: no node is asked."""
    nodes = sorted(nodes, key=lambda n: n.name)
    figures = [{"name": n.name, "status": n.status, "usedMiB": n.used_mib, "capacityMiB": n.capacity_mib,
                "fraction": round(n.fraction, 4), "sandboxes": len(n.sandboxes), "light": False,
                "why": _not_light(n, rules)} for n in nodes]
    for f in figures:
        f["light"] = f["why"] is None
    down = [n.name for n in nodes if n.status == "unreachable"]
    if down:
        return Plan("none", None, f"node {down[0]} is unreachable: no consolidation until every node answers",
                    nodes=figures)
    ready = [n for n in nodes if n.status == "ready"]
    light = sorted((n for n in nodes if _not_light(n, rules) is None),
                   key=lambda n: (n.fraction, len(n.sandboxes), n.name))
    refusals: list[str] = []
    for src in light:
        moves, why = _pack(src, [n for n in ready if n.name != src.name], rules)
        if why is None:
            what = f"{len(moves)} sandboxes" if moves else "nothing to move"
            return Plan("drain", src.name, f"node {src.name} is light ({_pct(src.fraction)} of its memory used, "
                        f"{len(src.sandboxes)} sandboxes): emptying it ({what})", moves, figures)
        refusals.append(f"{src.name}: {why}")
    total = sum(n.capacity_mib for n in ready)
    free = total - sum(n.used_mib for n in ready)
    back = [n for n in nodes if n.consolidated and n.status == "cordoned" and not n.sandboxes]
    if back and (total <= 0 or free < rules.headroom * total):
        return Plan("return", back[0].name, f"the ready nodes keep {_pct(free / total) if total > 0 else '0%'} of "
                    f"their memory free (below {_pct(rules.headroom)}): node {back[0].name}, emptied by "
                    "consolidation, takes sandboxes again", nodes=figures)
    if not light:
        return Plan("none", None, "no light node", nodes=figures)
    return Plan("none", None, "the rest lack room: " + "; ".join(refusals), nodes=figures)
