"""Request bodies of the HTTP API (JSON, camelCase field names; snake_case accepted too). Unknown fields are
rejected with ``422 invalid_request``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\0" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_nul(v) for v in value)
    return False


class _Body(BaseModel):
    """Base of every body. A NUL character anywhere in it (JSON allows ``\\u0000``) is refused with 422: no
    command, path, name or environment variable can carry one to the sandbox's processes."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _no_nul(cls, data: Any) -> Any:
        if _has_nul(data):
            raise ValueError("strings must not contain NUL characters")
        return data


class CreateSandbox(_Body):
    """``POST /v1/sandboxes``: ``type`` (small, default, large, xlarge), ``name``, ``ttl`` seconds of inactivity
    before an automatic stop (0 = never; default 3600), ``fromSnapshot``, ``noSnapshots``, ``env``, ``autoResume``
    (a request on a hosted port resumes it when stopped)."""

    type: str = "small"
    name: str | None = None
    ttl: int | None = None  # a negative one is 400 invalid_ttl from the control plane
    from_snapshot: str | None = Field(None, alias="fromSnapshot")
    no_snapshots: bool = Field(False, alias="noSnapshots")
    env: dict[str, str] | None = None
    auto_resume: bool = Field(False, alias="autoResume")


class StopSandbox(_Body):
    """``POST /v1/sandboxes/{id}/stop``: ``keepMemory`` (default true) checkpoints memory for a later resume."""

    keep_memory: bool = Field(True, alias="keepMemory")


class ResumeSandbox(_Body):
    """``POST /v1/sandboxes/{id}/resume``: ``type`` to grow to, ``requireMemory`` to refuse a cold boot,
    ``ttl`` to replace the sandbox's ttl."""

    type: str | None = None
    require_memory: bool = Field(False, alias="requireMemory")
    ttl: int | None = None  # a negative one is 400 invalid_ttl from the control plane


class ForkSandbox(_Body):
    """``POST /v1/sandboxes/{id}/fork``: ``type``, ``ttl`` (default one hour), ``name`` (default
    ``"<source name> (fork)"``), ``env`` (default the source's)."""

    type: str | None = None
    ttl: int | None = None  # a negative one is 400 invalid_ttl from the control plane
    name: str | None = None
    env: dict[str, str] | None = None


class SnapshotSandbox(_Body):
    """``POST /v1/sandboxes/{id}/snapshot``: the snapshot's ``name``."""

    name: str


class ExecCommand(_Body):
    """``POST /v1/sandboxes/{id}/exec``: ``command`` (run with ``bash -lc``), ``timeout`` seconds (default 30;
    0 or null = none), ``user`` (default ``user``), extra ``env``, ``cwd``."""

    command: str = Field(min_length=1)
    timeout: float | None = Field(30.0, ge=0)
    user: Literal["user", "root"] = "user"
    env: dict[str, str] | None = None
    cwd: str | None = None


class StartJob(_Body):
    """``POST /v1/sandboxes/{id}/jobs``: ``command`` to run detached, ``user``."""

    command: str = Field(min_length=1)
    user: Literal["user", "root"] = "user"


class HostPort(_Body):
    """``POST /v1/sandboxes/{id}/routes``: ``port`` (1-65535) to publish; ``public`` routes need no token."""

    port: int
    public: bool = False
