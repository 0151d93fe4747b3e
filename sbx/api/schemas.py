"""Response bodies of the HTTP API as pydantic models, for the OpenAPI document (``/openapi.json``).

The routes build plain dicts (see the ``view`` functions of :mod:`sbx.control`); these models describe them field
by field (camelCase, as sent) so clients can be generated and a schema fuzzer can check every answer. Every error
status shares :class:`ErrorBody`. :func:`errors` builds a route's ``responses=`` entry for the statuses it may
answer besides success.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SandboxState = Literal["provisioning", "running", "stopping", "stopped", "resuming", "forking", "deleting",
                       "deleted", "error"]


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
    stats: Stats


class SandboxOut(_Out):
    sandbox: Sandbox


class SandboxList(_Out):
    sandboxes: list[Sandbox]


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


class Health(_Out):
    ok: bool
    version: str


_TEXT = {400: "a value outside its limits (`invalid_<field>`)", 401: "missing or wrong API token",
         403: "refused in the sandbox (`permission_denied`, `protected_path`)", 404: "unknown sandbox, job, "
         "snapshot or path", 409: "the sandbox's state does not allow it now (`busy`, `not_running`, ...)",
         413: "request body over the server's limit", 422: "not the right shape: invalid JSON, a missing field, "
         "a wrong type or an unknown field", 502: "the node failed", 507: "no space left"}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: each status in ``statuses`` (plus 401, 413 and 422, which any ``/v1`` call may
    answer) with the shared :class:`ErrorBody`."""
    wanted = sorted({401, 413, 422, *statuses})
    return {s: {"model": ErrorBody, "description": _TEXT.get(s, "error")} for s in wanted}
