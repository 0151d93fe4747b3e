"""Response bodies of the HTTP API as pydantic models, for the OpenAPI document (``/openapi.json``).

The routes build plain dicts (see the ``view`` functions of :mod:`sbx.control`); these models describe them field
by field (camelCase, as sent) so clients can be generated and a schema fuzzer can check every answer. Every error
status shares :class:`ErrorBody`. :func:`errors` builds a route's ``responses=`` entry for the statuses it may
answer besides success.

This module holds the shared parts and what a sandbox answers (sandboxes, snapshots, jobs, routes, files, stats);
:mod:`sbx.api.schemas_nodes` the nodes, drains and consolidation; :mod:`sbx.api.schemas_accounts` accounts, keys,
plans, usage, secrets and console sessions.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SandboxState = Literal["provisioning", "running", "stopping", "stopped", "resuming", "migrating", "forking", "deleting",
                       "deleted", "error"]


NodeStatus = Literal["ready", "cordoned", "unreachable"]


class Out(BaseModel):
    """The base of every response model: fields beyond the declared ones are allowed (answers may grow)."""

    model_config = ConfigDict(extra="allow")


class ErrorDetail(Out):
    """``code``: stable machine-readable code; ``message``: one human sentence; ``field``: the request field at
    fault; ``state``: the sandbox's state when it explains a 409."""

    code: str
    message: str
    field: str | None = None
    state: str | None = None


class ErrorBody(Out):
    """Every error answer: ``{"error": {"code", "message", "field"?, "state"?}}``."""

    error: ErrorDetail


class Stats(Out):
    memoryTotalMb: int
    memoryUsedMb: int
    cpuPercent: float
    diskUsedMb: int
    oomKills: int
    diskAllocatedBytes: int
    diskUniqueBytes: int


class Figures(Out):
    """Metered use: ``runningSeconds``, ``runningGiBHours`` (memory of the size x hours running),
    ``storedGiBHours``, ``cost`` (USD)."""

    runningSeconds: float
    runningGiBHours: float
    storedGiBHours: float
    cost: float


class SandboxVolume(Out):
    """A volume a sandbox mounts."""

    name: str
    path: str
    readOnly: bool


class Sandbox(Out):
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
    image: str | None = Field(None, description="the image its disk came from (`sbx image list`); null: sbx's "
                              "default Debian image")
    runtime: str = Field("container", description="the runtime class: `container` (runc, the host's kernel) or "
                         "`gvisor` (runsc: gVisor's own kernel)")
    node: str = Field(description="the node that holds the sandbox")
    nodeStatus: NodeStatus = Field(description="its node's status; `state` is kept while the node is unreachable")
    replicaNode: str | None = Field(None, description="stopped: the node holding a current copy of its disk and "
                                                      "memory image (it resumes there if its own node is gone)")
    sealStored: bool = Field(False, description="stopped: its current seal (disk and memory image) is in the seal "
                             "store (SBX_SEAL_STORE), where it resumes from should its node and any replica be gone")
    sealStoredAt: str | None = Field(None, description="when the newest seal in the seal store was made (a stop's, "
                                     "or a running sandbox's automatic snapshot: a lost node's running sandbox comes "
                                     "back from it); null when none is stored")
    stats: Stats
    volumes: list[SandboxVolume] = Field(default_factory=list, description="the volumes it mounts")


class SandboxOut(Out):
    sandbox: Sandbox


class SandboxList(Out):
    sandboxes: list[Sandbox]


class Snapshot(Out):
    name: str
    sandboxId: str
    auto: bool
    sizeMB: int
    createdAt: str
    allocatedBytes: int
    uniqueBytes: int


class SnapshotOut(Out):
    snapshot: Snapshot


class SnapshotList(Out):
    snapshots: list[Snapshot]


class Deleted(Out):
    deleted: str | int


class Volume(Out):
    """A persistent volume of the account (``sbx volume create``): it outlives every sandbox that mounts it."""

    id: str
    name: str
    sizeGiB: int | None = Field(description="its size cap, GiB; null: none")
    createdAt: str | None
    sandboxes: list[str] = Field(description="the sandboxes (not deleted) that mount it")


class VolumeOut(Out):
    volume: Volume


class VolumeList(Out):
    volumes: list[Volume]


class Image(Out):
    """An image sandboxes can start from (``sbx new --image NAME``): built from a Dockerfile or imported."""

    id: str
    name: str
    shared: bool = Field(description="visible to every account")
    owned: bool = Field(description="it belongs to the key's account")
    os: str = Field(description="the image's OS (PRETTY_NAME of /etc/os-release)")
    init: str = Field(description="`systemd`, or `minimal` for an image without systemd (sbx's minimal init)")
    shell: str
    env: dict[str, str] = Field(description="its ENV: every exec gets it")
    workdir: str | None = Field(description="its WORKDIR: where execs start")
    user: str | None = Field(description="its USER: who execs run as by default (null: `user`)")
    sizeBytes: int
    source: str = Field(description="`dockerfile`, `archive` or `registry`")
    digest: str
    node: str | None
    createdAt: str | None


class ImageOut(Out):
    image: Image


class ImageList(Out):
    images: list[Image]


class Job(Out):
    """A detached job: ``exitCode`` is null while it runs (124 after its timeout, 137 when killed)."""

    id: str
    command: str
    running: bool
    exitCode: int | None
    startedAt: str


class JobOut(Out):
    job: Job


class JobList(Out):
    jobs: list[Job]


class Route(Out):
    """A hosted port; ``host`` is the ``Host`` header that reaches it on the proxy listener."""

    port: int = Field(ge=1, le=65535)
    public: bool
    url: str
    host: str
    token: str
    createdAt: str


class RouteOut(Out):
    route: Route


class RouteList(Out):
    routes: list[Route]


class FileEntry(Out):
    """``mode``: the permission bits as an int (``0o644`` is 420); ``mtime``: Unix seconds."""

    name: str
    path: str
    type: Literal["file", "directory", "symlink", "fifo", "socket", "char", "block", "other"]
    size: int
    mode: int
    mtime: float


class FileEntryOut(Out):
    entry: FileEntry


class FileList(Out):
    entries: list[FileEntry]


class Written(Out):
    path: str
    size: int


class Health(Out):
    ok: bool
    version: str


_TEXT = {400: "a value outside its limits (`invalid_<field>`)", 401: "missing, wrong, revoked or expired API key "
         "(`unauthorized`), or too many wrong keys from this address (`auth_throttled`, with Retry-After)",
         403: "refused: `plan_limit` (the account's plan; names `limit` and `upgrade`), `admin_only`, "
         "`protected_key`, `protected_account`, `account_suspended` (the account's keys and starts), or in the "
         "sandbox (`permission_denied`, `protected_path`)", 404: "unknown sandbox, job, snapshot or path",
         409: "the sandbox's state does not allow it now (`busy`, `not_running`, ...), or the account's "
         "(`account_deleted`, `account_busy`)",
         413: "request body over the server's limit", 429: "too many requests for this key (`rate_limited`); see "
         "Retry-After",
         422: "not the right shape: invalid JSON, a missing field, a wrong type or an unknown field",
         502: "the node failed", 507: "no space left"}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: each status in ``statuses`` (plus 401, 413, 422 and 429, which any ``/v1`` call
    may answer) with the shared :class:`ErrorBody`."""
    wanted = sorted({401, 413, 422, 429, *statuses})
    return {s: {"model": ErrorBody, "description": _TEXT.get(s, "error")} for s in wanted}


CAPACITY_RESPONSES: dict[int | str, dict[str, Any]] = {
    507: {
        "model": ErrorBody,
        "description": "insufficient_capacity: the node cannot hold the sandbox's memory (sum of memory limits of "
        "sandboxes that are not stopped, against (host RAM - SBX_MEMORY_RESERVE_MIB) x SBX_MEMORY_OVERCOMMIT) or "
        "its disk (free space under the data volume minus SBX_DISK_RESERVE_GIB); nothing was changed",
        "content": {"application/json": {"example": {"error": {
            "code": "insufficient_capacity",
            "message": "not enough memory on this node for a new small sandbox (4096 MiB): sandboxes that are not "
            "stopped already hold 90112 MiB of the 92324 MiB this node may promise ((24105 MiB RAM - 1024 MiB "
            "reserve) x overcommit 4); stop or delete a sandbox, or raise SBX_MEMORY_OVERCOMMIT"}}}},
    }
}
"""OpenAPI ``responses`` of the operations that admit a sandbox (create, resume, fork)."""


class StatsSample(Out):
    """One resource sample: ``at`` (Unix seconds), memory used and limit (MiB), CPU percent (100 = one core)."""

    at: float
    memoryUsedMb: int
    memoryTotalMb: int
    cpuPercent: float


class StatsSeries(Out):
    """``GET /v1/sandboxes/{id}/stats``: the samples of the last ``seconds``, oldest first, taken every
    ``intervalSeconds`` while the sandbox ran (empty when sampling is off or it has not run lately)."""

    sandboxId: str
    intervalSeconds: float
    samples: list[StatsSample]
