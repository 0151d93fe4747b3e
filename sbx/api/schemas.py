"""Response bodies of the HTTP API as pydantic models, for the OpenAPI document (``/openapi.json``).

The routes build plain dicts (see the ``view`` functions of :mod:`sbx.control`); these models describe them field
by field (camelCase, as sent) so clients can be generated and a schema fuzzer can check every answer. Every error
status shares :class:`ErrorBody`. :func:`errors` builds a route's ``responses=`` entry for the statuses it may
answer besides success.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SandboxState = Literal["provisioning", "running", "stopping", "stopped", "resuming", "migrating", "forking", "deleting",
                       "deleted", "error"]


NodeStatus = Literal["ready", "cordoned", "unreachable"]


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Out):
    """``code``: stable machine-readable code; ``message``: one human sentence; ``field``: the request field at
    fault; ``state``: the sandbox's state when it explains a 409."""

    code: str
    message: str
    field: str | None = None
    state: str | None = None


class ErrorBody(_Out):
    """Every error answer: ``{"error": {"code", "message", "field"?, "state"?}}``."""

    error: ErrorDetail


class Stats(_Out):
    memoryTotalMb: int
    memoryUsedMb: int
    cpuPercent: float
    diskUsedMb: int
    oomKills: int
    diskAllocatedBytes: int
    diskUniqueBytes: int


class Figures(_Out):
    """Metered use: ``runningSeconds``, ``runningGiBHours`` (memory of the size x hours running),
    ``storedGiBHours``, ``cost`` (USD)."""

    runningSeconds: float
    runningGiBHours: float
    storedGiBHours: float
    cost: float


class Sandbox(_Out):
    """A sandbox as the API shows it; ``memoryRestored``/``resumeReason`` say how its last resume went."""

    id: str
    name: str
    type: str
    state: SandboxState
    memoryGB: float | None
    vcpus: int | None
    diskGB: float | None
    memoryRestored: bool | None
    resumeReason: str | None
    createdAt: str
    updatedAt: str
    subdomain: str
    url: str
    ttl: int
    autoResume: bool
    noSnapshots: bool
    labels: dict[str, str] = Field(default_factory=dict)
    node: str = Field(description="the node that holds the sandbox")
    nodeStatus: NodeStatus = Field(description="its node's status; `state` is kept while the node is unreachable")
    replicaNode: str | None = Field(None, description="stopped: the node holding a current copy of its disk and "
                                                      "memory image (it resumes there if its own node is gone)")
    stats: Stats


class SandboxOut(_Out):
    sandbox: Sandbox


class SandboxList(_Out):
    sandboxes: list[Sandbox]


class NodeCapacity(_Out):
    memoryMiB: int
    diskFreeBytes: int
    vcpus: int


class NodeLoad(_Out):
    load1: float
    running: int


class Node(_Out):
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


class NodeOut(_Out):
    node: Node


class NodeList(_Out):
    nodes: list[Node]


class DrainError(_Out):
    code: str
    message: str


class DrainItem(_Out):
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


class Drain(_Out):
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


class DrainOut(_Out):
    drain: Drain


class ConsolidationNode(_Out):
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


class ConsolidationMove(_Out):
    id: str
    to: str


class ConsolidationPlan(_Out):
    """A pass's decision: ``action`` ``drain`` (empty ``node``, each sandbox to its ``moves`` destination),
    ``return`` (uncordon ``node``, emptied earlier: the ready nodes are short of room) or ``none``; ``reason`` in
    words (e.g. ``no light node``, ``the rest lack room: ...``)."""

    action: Literal["drain", "return", "none"]
    node: str | None
    reason: str
    moves: list[ConsolidationMove]
    nodes: list[ConsolidationNode]


class ConsolidationRules(_Out):
    lightFraction: float
    headroom: float
    maxMoves: int


class Consolidation(_Out):
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


class ConsolidationOut(_Out):
    consolidation: Consolidation


class Snapshot(_Out):
    name: str
    sandboxId: str
    auto: bool
    sizeMB: int
    createdAt: str
    allocatedBytes: int
    uniqueBytes: int


class SnapshotOut(_Out):
    snapshot: Snapshot


class SnapshotList(_Out):
    snapshots: list[Snapshot]


class Deleted(_Out):
    deleted: str | int


class Job(_Out):
    """A detached job: ``exitCode`` is null while it runs (124 after its timeout, 137 when killed)."""

    id: str
    command: str
    running: bool
    exitCode: int | None
    startedAt: str


class JobOut(_Out):
    job: Job


class JobList(_Out):
    jobs: list[Job]


class Route(_Out):
    """A hosted port; ``host`` is the ``Host`` header that reaches it on the proxy listener."""

    port: int = Field(ge=1, le=65535)
    public: bool
    url: str
    host: str
    token: str
    createdAt: str


class RouteOut(_Out):
    route: Route


class RouteList(_Out):
    routes: list[Route]


class FileEntry(_Out):
    """``mode``: the permission bits as an int (``0o644`` is 420); ``mtime``: Unix seconds."""

    name: str
    path: str
    type: Literal["file", "directory", "symlink", "fifo", "socket", "char", "block", "other"]
    size: int
    mode: int
    mtime: float


class FileEntryOut(_Out):
    entry: FileEntry


class FileList(_Out):
    entries: list[FileEntry]


class Written(_Out):
    path: str
    size: int


class Account(_Out):
    id: str
    name: str
    plan: str
    createdAt: str


class ApiKey(_Out):
    """An API key; ``token`` only in the answer that made it (it is stored hashed)."""

    id: str
    account: str
    name: str
    prefix: str
    admin: bool
    createdAt: str
    expiresAt: str | None
    revokedAt: str | None
    token: str | None = None


class AccountList(_Out):
    accounts: list[Account]


class AccountCreated(_Out):
    account: Account
    key: ApiKey


class AccountOut(_Out):
    account: Account


class KeyOut(_Out):
    key: ApiKey


class KeyList(_Out):
    keys: list[ApiKey]


class Plan(_Out):
    """A plan: ``sizes`` it runs, ``startsPerHour`` (create, resume, fork), ``running`` at once, ``storageGiB``
    included (0 = no limit), ``priceUsdMonth``."""

    name: str
    priceUsdMonth: float
    sizes: list[str]
    startsPerHour: int
    running: int
    storageGiB: float


class PlanList(_Out):
    plans: list[Plan]


class PlanUse(_Out):
    startsLastHour: int
    running: int
    storedGiB: float


class AccountPlan(_Out):
    """``GET /v1/account``: the key's account, its plan and what it uses now."""

    account: Account
    plan: Plan
    used: PlanUse


class UsageGroup(Figures):
    key: str
    bySize: dict[str, Figures]


class Usage(_Out):
    """``GET /v1/usage``: totals, totals per size (``storage`` for stored data) and, with ``by``, one group per
    sandbox / size / UTC day, each with its per-size split (what a console plots per day and per size)."""

    account: str | None
    from_: str = Field(alias="from")
    to: str
    by: str | None
    priceModel: str
    currency: str
    total: Figures
    bySize: dict[str, Figures]
    groups: list[UsageGroup]


class Health(_Out):
    ok: bool
    version: str


_TEXT = {400: "a value outside its limits (`invalid_<field>`)", 401: "missing, wrong, revoked or expired API key "
         "(`unauthorized`), or too many wrong keys from this address (`auth_throttled`, with Retry-After)",
         403: "refused: `plan_limit` (the account's plan; names `limit` and `upgrade`), `admin_only`, "
         "`protected_key`, or in the sandbox (`permission_denied`, `protected_path`)", 404: "unknown sandbox, job, "
         "snapshot or path", 409: "the sandbox's state does not allow it now (`busy`, `not_running`, ...)",
         413: "request body over the server's limit", 429: "too many requests for this key (`rate_limited`); see "
         "Retry-After",
         422: "not the right shape: invalid JSON, a missing field, a wrong type or an unknown field",
         502: "the node failed", 507: "no space left"}


class SecretRuleOut(_Out):
    hosts: list[str]
    pathPrefix: str | None
    methods: list[str]
    action: Literal["replace", "header", "basic"]
    header: str | None
    value: str | None
    username: str | None


class Secret(_Out):
    """A secret as the API shows it: never its value. ``placeholder`` is what a sandbox writes where the value
    should go; ``version`` grows with each new value; ``sandboxes`` are the ones bound to it."""

    name: str
    version: int
    placeholder: str
    rules: list[SecretRuleOut]
    sandboxes: list[str]
    createdAt: str
    updatedAt: str


class SecretOut(_Out):
    secret: Secret


class SecretList(_Out):
    secrets: list[Secret]


class SecretUse(_Out):
    """One request the egress proxy put the secret into: ``status`` is the upstream's (null: it never answered)."""

    at: str
    sandbox: str
    host: str
    method: str
    path: str
    status: int | None


class SecretLog(_Out):
    uses: list[SecretUse]


class Bindings(_Out):
    """The names of the secrets bound to a sandbox."""

    sandbox: str
    secrets: list[str]


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: each status in ``statuses`` (plus 401, 413, 422 and 429, which any ``/v1`` call
    may answer) with the shared :class:`ErrorBody`."""
    wanted = sorted({401, 413, 422, 429, *statuses})
    return {s: {"model": ErrorBody, "description": _TEXT.get(s, "error")} for s in wanted}


class StatsSample(_Out):
    """One resource sample: ``at`` (Unix seconds), memory used and limit (MiB), CPU percent (100 = one core)."""

    at: float
    memoryUsedMb: int
    memoryTotalMb: int
    cpuPercent: float


class StatsSeries(_Out):
    """``GET /v1/sandboxes/{id}/stats``: the samples of the last ``seconds``, oldest first, taken every
    ``intervalSeconds`` while the sandbox ran (empty when sampling is off or it has not run lately)."""

    sandboxId: str
    intervalSeconds: float
    samples: list[StatsSample]


class ConsoleSession(_Out):
    """A web console session: ``csrf`` goes in the ``X-Sbx-Csrf`` header of every request that changes something;
    ``keyId`` names the key it was opened with, ``account`` its account (``admin``: the installation's key, which
    sees every account); ``expiresAt`` is ISO 8601 UTC."""

    keyId: str
    account: str
    admin: bool
    csrf: str
    expiresAt: str


class ConsoleSessionOut(_Out):
    session: ConsoleSession


class SignedOut(_Out):
    signedOut: bool
