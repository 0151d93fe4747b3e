"""Request bodies of the HTTP API (JSON, camelCase field names; snake_case accepted too) and their limits.

Types are strict (``"timeout": false`` or ``"ttl": "5"`` is 422 ``invalid_request``); unknown fields are refused
with 422. A value of the right type outside its limits (a timeout over :data:`TIMEOUT_MAX`, a command over
:data:`COMMAND_MAX_BYTES`, too many env variables, a NUL character) is 400 ``invalid_<field>`` with ``field``
naming it (see :mod:`sbx.api.errors`). Response bodies are described in :mod:`sbx.api.schemas`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi import Query
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
WAIT_TIMEOUT = 900.0
"""Longest ``?wait=true`` of a long operation when the request names no ``timeout``, in seconds."""
WAIT_QUERY: Any = Query(False, alias="wait", description="answer when the operation has finished")
"""The ``?wait=`` parameter of a long operation (create, stop, resume, fork, delete, migrate, drain)."""
TIMEOUT_QUERY: Any = Query(WAIT_TIMEOUT, alias="timeout", ge=0, le=86400,
                           description="longest wait in seconds with wait=true")
"""Its ``?timeout=`` (seconds)."""
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
                                      "not starting with a digit: {key}", {"key": repr(k[:80])})
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
                                      "'/', '-', starting with a letter or digit: {key}", {"key": repr(k[:80])})
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


SECRET_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,62}$"
SECRETS_MAX = 32
"""Most secrets one sandbox may be given at create or fork."""
SecretName = Annotated[str, Field(min_length=1, max_length=63, json_schema_extra={"pattern": SECRET_NAME_PATTERN})]
SecretsField = Field(None, max_length=SECRETS_MAX, description="names of secrets the sandbox may use through the "
                     "egress proxy (see /v1/secrets); it never sees their values")


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


class AddNode(_Body):
    """``POST /v1/nodes``: the ``url`` of a node agent (``sbx node serve``, e.g. ``http://10.0.0.2:7700``) and its
    node ``token``."""

    url: str = Field(min_length=8, max_length=300, pattern=r"^https?://[^\s/]+(:[0-9]+)?/?$")
    token: str = Field(min_length=8, max_length=200)


class VolumeMount(_Body):
    """A volume a new sandbox mounts: the account's volume ``name`` at absolute ``path`` (not over ``/proc``,
    ``/sys``, ``/dev``, ``/run/sbx``), read-only with ``readOnly``."""

    name: str = Field(min_length=1, max_length=100)
    path: str = Field(max_length=1024)
    read_only: bool = Field(False, alias="readOnly")


class CreateVolume(_Body):
    """``POST /v1/volumes``: the new volume's ``name`` (unique in the account) and an optional ``size`` cap in GiB."""

    name: str = Field(min_length=1, max_length=100, description="a lower-case letter or digit, then up to 62 of "
                      "a-z, 0-9, '.', '_', '-'")
    size: int | None = Field(None, description="the most it may hold, GiB (1-65536); none: no cap")


class CreateSandbox(_Body):
    """``POST /v1/sandboxes``: ``type``, ``name``, ``ttl`` seconds of inactivity before an automatic stop (0 =
    never; default 3600), ``fromSnapshot``, ``noSnapshots``, ``env``, ``autoResume`` (an exec, a file call, a shell
    or a request on a hosted port resumes it when stopped), ``labels`` (metadata for list filters), ``cold`` (no
    memory template: boot)."""

    type: SizeType = "small"
    name: str | None = Field(None, min_length=1, max_length=NAME_MAX)
    ttl: int | None = TtlField
    from_snapshot: str | None = Field(None, alias="fromSnapshot", min_length=1, max_length=63)
    no_snapshots: bool = Field(False, alias="noSnapshots")
    env: Env = EnvField
    auto_resume: bool = Field(False, alias="autoResume")
    labels: Labels = Field(None, max_length=LABELS_MAX, description=f"string metadata (at most {LABELS_MAX}; keys "
                           "1-63 characters of letters, digits, '.', '_', '/', '-'), for `GET /v1/sandboxes?label=`")
    cold: bool = Field(False, description="cold boot even when a memory template of the size is ready (by default "
                       "a new sandbox without fromSnapshot is restored from the template, with its own identity)")
    secrets: list[SecretName] | None = SecretsField
    image: str | None = Field(None, min_length=1, max_length=63, pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$",
                              description="start from this image of the account (or a shared one; `sbx image "
                              "list`) instead of sbx's default Debian image")
    runtime: Literal["container", "gvisor"] | None = Field(
        None, description="the runtime class: `container` (runc, the host's kernel; the default) or `gvisor` "
        "(runsc: gVisor's own kernel between the sandbox and the host; no fork with memory, live migration or "
        "detached jobs). Default: the snapshot's sandbox's class with fromSnapshot, else `container`")
    volumes: list[VolumeMount] | None = Field(None, max_length=16, description="the account's volumes to mount "
                                              "(`sbx volume list`); a fork mounts its source's")


class StopSandbox(_Body):
    """``POST /v1/sandboxes/{id}/stop``: ``keepMemory`` (default true) checkpoints memory for a later resume."""

    keep_memory: bool = Field(True, alias="keepMemory")


class MigrateSandbox(_Body):
    """``POST /v1/sandboxes/{id}/migrate``: ``to``, the node to move to (a NAME of ``GET /v1/nodes``); without it
    placement picks one."""

    to: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                           description="the destination node; default: the ready node with the most room")


class ResumeSandbox(_Body):
    """``POST /v1/sandboxes/{id}/resume``: ``type`` to grow to, ``requireMemory`` to refuse a cold boot,
    ``ttl`` to replace the sandbox's ttl."""

    type: SizeType | None = None
    require_memory: bool = Field(False, alias="requireMemory")
    ttl: int | None = TtlField


class ForkSandbox(_Body):
    """``POST /v1/sandboxes/{id}/fork``: ``type``, ``ttl`` (default one hour), ``name`` (default
    ``"<source name> (fork)"``), ``env`` (default the source's), ``memory`` (the running source's processes and
    memory go along; the fork's ``memoryRestored`` is true)."""

    type: SizeType | None = None
    ttl: int | None = TtlField
    name: str | None = Field(None, min_length=1, max_length=NAME_MAX)
    env: Env = EnvField
    memory: bool = Field(False, description="fork with memory: the running source is paused for the dump only "
                         "and keeps its PIDs; the fork gets its processes and memory and a new identity")
    secrets: list[SecretName] | None = SecretsField



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


class CreateAccount(_Body):
    """``POST /v1/accounts`` (admin): ``name`` (1-63 letters, digits, ``.``, ``_``, ``-``) and ``plan`` (default:
    the server's ``default_plan``)."""

    name: str = Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    plan: str | None = Field(None, min_length=1, max_length=32)


class UpdateAccount(_Body):
    """``PATCH /v1/accounts/{id}`` (admin): move the account to ``plan``. The API narrows ``plan`` (here and in
    :class:`CreateAccount`) to the server's plan names (:func:`with_plans`)."""

    plan: str = Field(min_length=1, max_length=32)


class CreateKey(_Body):
    """``POST /v1/accounts/{id}/keys``: ``name`` of the key and ``expiresIn`` seconds (none: never expires)."""

    name: str = Field("default", min_length=1, max_length=100, pattern=r"\S")
    expires_in: int | None = Field(None, alias="expiresIn", ge=1, le=10 * 365 * 86400)


def with_plans(names: list[str]) -> tuple[type[CreateAccount], type[UpdateAccount]]:
    """:class:`CreateAccount` and :class:`UpdateAccount` whose ``plan`` is one of ``names`` (the server's plan
    table), so the OpenAPI document lists them and anything else is 400 ``invalid_plan``."""
    choice: Any = Literal[tuple(names)]  # type: ignore[valid-type]

    class CreateAccountIn(CreateAccount):
        plan: choice | None = None  # type: ignore[valid-type]

    class UpdateAccountIn(UpdateAccount):
        plan: choice  # type: ignore[valid-type]

    return CreateAccountIn, UpdateAccountIn
class SecretRule(_Body):
    """Where a secret may go and what the proxy does there: ``hosts`` (exact ``api.example.com`` or
    ``*.example.com``), optional ``pathPrefix`` and ``methods``; ``action`` ``replace`` (the placeholder
    ``sbx-secret:NAME`` in headers, query and bodies up to 1 MiB; the default), ``header`` (set ``header`` to
    ``value`` with ``{secret}`` filled in) or ``basic`` (HTTP basic auth as ``username``)."""

    hosts: list[Annotated[str, Field(min_length=1, max_length=253)]] = Field(min_length=1, max_length=32)
    path_prefix: str | None = Field(None, alias="pathPrefix", min_length=1, max_length=PATH_MAX)
    methods: list[Annotated[str, Field(min_length=1, max_length=16)]] | None = Field(None, max_length=16)
    action: Literal["replace", "header", "basic"] = "replace"
    header: str | None = Field(None, min_length=1, max_length=128)
    value: str | None = Field(None, min_length=1, max_length=4096, description="header value holding {secret}")
    username: str | None = Field(None, min_length=1, max_length=256)


class PutSecret(_Body):
    """``PUT /v1/secrets/{name}``: the ``value`` (at most 64 KiB) and the ``rules`` (required for a new secret;
    omitted on a rotation, the old rules stay)."""

    value: str = Field(min_length=1, max_length=64 * 1024)
    rules: list[SecretRule] | None = Field(None, min_length=1, max_length=32)


class SignIn(_Body):
    """``POST /v1/console/session``: the API ``key`` to sign the web console in with."""

    key: str = Field(min_length=1, max_length=512,
                     description="an API key (an account's key, or the installation's admin key)")
