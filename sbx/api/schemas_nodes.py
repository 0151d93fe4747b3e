"""Response bodies of the node routes (``/v1/nodes``, drains, ``/v1/consolidation``) as pydantic models, for the
OpenAPI document; the shared parts are in :mod:`sbx.api.schemas`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sbx.api.schemas import NodeStatus, Out


class NodeCapacity(Out):
    """``diskFreeBytes``: room where the node's data volume runs out first; ``diskPromisedBytes``: the disk sizes of
    its sandboxes together (sparse disks: what they may grow to, the overcommit against that room)."""

    memoryMiB: int
    diskFreeBytes: int
    diskPromisedBytes: int = 0
    vcpus: int


class NodeLoad(Out):
    load1: float
    running: int


class Node(Out):
    """A node agent in the registry: ``status`` ``unreachable`` when its heartbeats stopped answering, ``cordoned``
    when no new sandbox may go there; ``capacity``, ``load`` and the memory-image ``fingerprint`` are from its last
    answered heartbeat (``lastSeen``); ``sandboxes`` counts the sandboxes it holds. ``removable``: an added node
    that is cordoned and holds no sandbox (``sbx node remove`` takes it); ``consolidatedAt``: when consolidation
    emptied it (null otherwise; an uncordon clears it); ``egress``: it runs an egress proxy, so secrets can be bound
    to its sandboxes (from its last heartbeat)."""

    name: str
    url: str
    status: NodeStatus
    cordoned: bool
    removable: bool
    consolidatedAt: str | None
    lastSeen: str | None
    registeredAt: str | None
    sandboxes: int
    capacity: NodeCapacity
    load: NodeLoad
    fingerprint: dict[str, str]
    egress: bool = False


class NodeOut(Out):
    node: Node


class NodeList(Out):
    nodes: list[Node]


class DrainError(Out):
    code: str
    message: str


class DrainItem(Out):
    """One sandbox of a drain: ``action`` ``migrate`` (it was running: a live migration), ``move`` (stopped: its
    disk and memory image) or ``none``; ``status`` ``pending``, ``moving``, ``done`` (``to`` names the node it is
    on now; a migration's ``pauseS``/``totalS`` in seconds), ``failed`` (``error``: it stays where it was, e.g.
    ``insufficient_capacity`` when no other node has room) or ``gone`` (deleted meanwhile); ``seconds`` it took."""

    id: str
    name: str
    action: Literal["migrate", "move", "none"]
    status: Literal["pending", "moving", "done", "failed", "gone"]
    from_: str = Field(alias="from")
    to: str | None
    error: DrainError | None
    pauseS: float | None
    totalS: float | None
    seconds: float | None


class Drain(Out):
    """A node's drain (it is cordoned first): ``state`` ``draining`` or ``done``; ``empty`` once done: true when
    nothing is left on the node; ``sandboxes`` in the order they are moved; ``reason`` ``drain`` (``sbx node
    drain``) or ``consolidation`` (the consolidation loop), as in the sandboxes' move events."""

    node: str
    reason: str
    state: Literal["draining", "done"]
    startedAt: str
    finishedAt: str | None
    empty: bool | None
    resumes: int = Field(0, description="times a server took this drain over after the one running it was gone "
                                        "(killed, or restarted)")
    sandboxes: list[DrainItem]


class DrainOut(Out):
    drain: Drain


class ConsolidationNode(Out):
    """One node as the last consolidation pass saw it: memory ``usedMiB`` (sandboxes that are not stopped) of
    ``capacityMiB`` (what it may promise), ``fraction`` of it used, ``light`` (a candidate to empty) and ``why``
    not, when it is not."""

    name: str
    status: NodeStatus
    usedMiB: int
    capacityMiB: int
    fraction: float
    sandboxes: int
    light: bool
    why: str | None


class ConsolidationMove(Out):
    id: str
    to: str


class ConsolidationPlan(Out):
    """A pass's decision: ``action`` ``drain`` (empty ``node``, each sandbox to its ``moves`` destination),
    ``return`` (uncordon ``node``, emptied earlier: the ready nodes are short of room) or ``none``; ``reason`` in
    words (e.g. ``no light node``, ``the rest lack room: ...``)."""

    action: Literal["drain", "return", "none"]
    node: str | None
    reason: str
    moves: list[ConsolidationMove]
    nodes: list[ConsolidationNode]


class ConsolidationRules(Out):
    lightFraction: float
    headroom: float
    maxMoves: int


class Consolidation(Out):
    """``GET /v1/consolidation``: whether the loop runs (``enabled``, every ``periodS`` seconds) and leads on this
    replica (``leader``), its ``rules``, the last pass (``lastRunAt``, ``plan``; null before the first), the last
    drain it started (``drain``) and what that ended with (``outcome``), and the nodes now ``removable``."""

    enabled: bool
    periodS: float
    leader: bool
    rules: ConsolidationRules
    lastRunAt: str | None
    plan: ConsolidationPlan | None
    drain: Drain | None
    outcome: str | None
    removable: list[str]


class ConsolidationOut(Out):
    consolidation: Consolidation
