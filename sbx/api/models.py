"""Request bodies of the HTTP API (JSON, camelCase field names; snake_case accepted too) and their limits.

Types are strict (``"timeout": false`` or ``"ttl": "5"`` is 422 ``invalid_request``); unknown fields are refused
with 422. A value of the right type outside its limits (a timeout over :data:`TIMEOUT_MAX`, a command over
:data:`COMMAND_MAX_BYTES`, too many env variables, a NUL character) is 400 ``invalid_<field>`` with ``field``
naming it (see :mod:`sbx.api.errors`). Response bodies are described in :mod:`sbx.api.schemas`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

TIMEOUT_MAX = 7 * 86400.0
"""Longest ``timeout`` an exec or a job may ask for, in seconds (one week)."""
TTL_MAX = 10 * 365 * 86400
"""Largest ``ttl`` in seconds (ten years; 0 = never stop)."""
COMMAND_MAX_BYTES = 64 * 1024
"""Longest command, in UTF-8 bytes (one argv entry in the sandbox; Linux takes at most 128 KiB per entry)."""
ENV_MAX_VARS = 128
"""Most environment variables a sandbox, an exec or a job may set."""
ENV_MAX_BYTES = 64 * 1024
"""Largest total of ``len(KEY) + len(VALUE) + 2`` over all variables, in UTF-8 bytes."""
NAME_MAX = 200
"""Longest sandbox name, in characters."""
PATH_MAX = 4096
"""Longest path (``cwd``, files API), in UTF-8 bytes."""
SIZE_TYPES = ("small", "default", "large", "xlarge")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
LABELS_MAX = 32
"""Most labels a sandbox may carry."""
LABEL_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$"
LABEL_VALUE_MAX = 256
SNAPSHOT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"

# the control plane checks the type against the server's sizes (400 invalid_type naming the choices); the enum
# only documents them
SizeType = Annotated[str, Field(json_schema_extra={"enum": list(SIZE_TYPES)})]
User = Literal["user", "root"]


def _nul_path(value: Any, where: str = "") -> str | None:
    """The dotted path of the first string (or key) holding a NUL character, else None."""
    if isinstance(value, str):
        return where if "\0" in value else None
    if isinstance(value, dict):
        for k, v in value.items():
            here = f"{where}.{k}" if where else str(k)
            if isinstance(k, str) and "\0" in k:
                return here
            found = _nul_path(v, here)
            if found is not None:
                return found
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            found = _nul_path(v, f"{where}.{i}" if where else str(i))
            if found is not None:
                return found
    return None


def check_env(env: dict[str, str] | None) -> dict[str, str] | None:
    """Raise ``PydanticCustomError("invalid_env")`` for more than :data:`ENV_MAX_VARS` variables, a key that is not
    a shell name (``[A-Za-z_][A-Za-z0-9_]*``: no ``=``, not empty), or more than :data:`ENV_MAX_BYTES` in all."""
    if env is None:
        return None
    if len(env) > ENV_MAX_VARS:
        raise PydanticCustomError("invalid_env", "at most {n} environment variables", {"n": ENV_MAX_VARS})
    total = 0
    for k, v in env.items():
        if not ENV_KEY_RE.match(k):
            raise PydanticCustomError("invalid_env", "environment variable names are letters, digits and '_', "
                                      "not starting with a digit: {key!r}", {"key": k[:80]})
        total += len(k.encode()) + len(v.encode("utf-8", "surrogatepass")) + 2
    if total > ENV_MAX_BYTES:
        raise PydanticCustomError("invalid_env", "the environment is over {n} bytes", {"n": ENV_MAX_BYTES})
    return env


def check_labels(labels: dict[str, str] | None) -> dict[str, str] | None:
    """Raise ``PydanticCustomError("invalid_labels")`` for a key outside :data:`LABEL_KEY_PATTERN` or a value over
    :data:`LABEL_VALUE_MAX` characters (the count is bounded by the field's ``max_length``)."""
    for k, v in (labels or {}).items():
        if not re.match(LABEL_KEY_PATTERN, k):
            raise PydanticCustomError("invalid_labels", "label keys are 1-63 characters: letters, digits, '.', '_', "
                                      "'/', '-', starting with a letter or digit: {key!r}", {"key": k[:80]})
        if len(v) > LABEL_VALUE_MAX:
            raise PydanticCustomError("invalid_labels", "label values are at most {n} characters",
                                      {"n": LABEL_VALUE_MAX})
    return labels


def check_command(command: str) -> str:
    """Raise ``PydanticCustomError("invalid_command")`` for a command over :data:`COMMAND_MAX_BYTES` bytes."""
    if len(command.encode("utf-8", "surrogatepass")) > COMMAND_MAX_BYTES:
        raise PydanticCustomError("invalid_command", "command is over {n} bytes", {"n": COMMAND_MAX_BYTES})
    return command


Env = Annotated[dict[str, str] | None, AfterValidator(check_env)]
Command = Annotated[str, AfterValidator(check_command)]
Labels = Annotated[dict[str, str] | None, AfterValidator(check_labels)]

EnvField = Field(None, max_length=ENV_MAX_VARS, json_schema_extra={"propertyNames": {"pattern": ENV_KEY_RE.pattern}},
                 description=f"environment variables (names "
                 f"[A-Za-z_][A-Za-z0-9_]*, at most {ENV_MAX_VARS}, {ENV_MAX_BYTES} bytes in all)")
TtlField = Field(None, ge=0, le=TTL_MAX, description="seconds without activity before an automatic stop "
                 "(0 = never)")
TimeoutField = Field(30.0, ge=0, le=TIMEOUT_MAX, allow_inf_nan=False,
                     description=f"seconds before the command is killed (exit 124); 0 or null = none; at most "
                     f"{TIMEOUT_MAX:g}")
CwdField = Field(None, min_length=1, max_length=PATH_MAX, description="working directory: absolute, or relative "
                 "to the user's home (~ allowed); it must exist (else 400 invalid_cwd)")
CommandField = Field(min_length=1, max_length=COMMAND_MAX_BYTES, description="run with `bash -lc` as `user` "
                     f"(at most {COMMAND_MAX_BYTES} bytes)")


class _Body(BaseModel):
    """Base of every body. A NUL character anywhere in it (JSON allows ``\\u0000``) is refused with 400 naming the
    field: no command, path, name or environment variable can carry one to the sandbox's processes."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _no_nul(cls, data: Any) -> Any:
        where = _nul_path(data)
        if where is not None:
            raise PydanticCustomError("nul_character", "{field} must not contain NUL characters", {"field": where})
        return data


class CreateSandbox(_Body):
    """``POST /v1/sandboxes``: ``type``, ``name``, ``ttl`` seconds of inactivity before an automatic stop (0 =
    never; default 3600), ``fromSnapshot``, ``noSnapshots``, ``env``, ``autoResume`` (an exec, a file call, a shell
    or a request on a hosted port resumes it when stopped), ``labels`` (metadata for list filters)."""

    type: SizeType = "small"
    name: str | None = Field(None, min_length=1, max_length=NAME_MAX)
    ttl: int | None = TtlField
    from_snapshot: str | None = Field(None, alias="fromSnapshot", min_length=1, max_length=63)
    no_snapshots: bool = Field(False, alias="noSnapshots")
    env: Env = EnvField
    auto_resume: bool = Field(False, alias="autoResume")
    labels: Labels = Field(None, max_length=LABELS_MAX, description=f"string metadata (at most {LABELS_MAX}; keys "
                           "1-63 characters of letters, digits, '.', '_', '/', '-'), for `GET /v1/sandboxes?label=`")



class StopSandbox(_Body):
    """``POST /v1/sandboxes/{id}/stop``: ``keepMemory`` (default true) checkpoints memory for a later resume."""

    keep_memory: bool = Field(True, alias="keepMemory")


class ResumeSandbox(_Body):
    """``POST /v1/sandboxes/{id}/resume``: ``type`` to grow to, ``requireMemory`` to refuse a cold boot,
    ``ttl`` to replace the sandbox's ttl."""

    type: SizeType | None = None
    require_memory: bool = Field(False, alias="requireMemory")
    ttl: int | None = TtlField


class ForkSandbox(_Body):
    """``POST /v1/sandboxes/{id}/fork``: ``type``, ``ttl`` (default one hour), ``name`` (default
    ``"<source name> (fork)"``), ``env`` (default the source's)."""

    type: SizeType | None = None
    ttl: int | None = TtlField
    name: str | None = Field(None, min_length=1, max_length=NAME_MAX)
    env: Env = EnvField



class SnapshotSandbox(_Body):
    """``POST /v1/sandboxes/{id}/snapshot``: the snapshot's ``name``."""

    # the pattern is checked by the control plane (400 invalid_snapshot_name); here it only documents it
    name: str = Field(json_schema_extra={"pattern": SNAPSHOT_NAME_PATTERN},
                      description="1-63 characters: letters, digits, '.', '_', '-' (else 400 invalid_snapshot_name)")


class ExecCommand(_Body):
    """``POST /v1/sandboxes/{id}/exec``: ``command`` (run with ``bash -lc``), ``timeout`` seconds (default 30;
    0 or null = none), ``user`` (default ``user``), extra ``env``, ``cwd``, ``encoding`` (``"base64"``: output
    frames carry base64 of the exact bytes, with ``"encoding": "base64"``; default ``"utf-8"``: text, invalid
    bytes replaced)."""

    command: Command = CommandField
    timeout: float | None = TimeoutField
    user: User = "user"
    env: Env = EnvField
    cwd: str | None = CwdField
    encoding: Literal["utf-8", "base64"] = "utf-8"



class StartJob(_Body):
    """``POST /v1/sandboxes/{id}/jobs``: ``command`` to run detached, ``user``, ``env``, ``cwd``, ``timeout``
    (seconds after which the job is killed; null or 0 = none), ``stdin`` (text written to its standard input, then
    closed; by default stdin is empty)."""

    command: Command = CommandField
    user: User = "user"
    env: Env = EnvField
    cwd: str | None = CwdField
    timeout: float | None = Field(None, ge=0, le=TIMEOUT_MAX, allow_inf_nan=False,
                                  description="seconds before the job is killed; 0 or null = none")
    stdin: str | None = Field(None, max_length=ENV_MAX_BYTES, description="text fed to the job's standard input")



class HostPort(_Body):
    """``POST /v1/sandboxes/{id}/routes``: ``port`` (1-65535) to publish; ``public`` routes need no token."""

    port: int = Field(ge=1, le=65535)
    public: bool = False
