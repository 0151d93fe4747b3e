"""The node API's wire format: one JSON shape for every call, so a new :class:`sbx.node.types.NodeAgent` method
costs one entry in :data:`CALLS` (server side) and a one-line method in :class:`sbx.node.remote.client.RemoteNode`.

- A call is ``POST /v1/node/call/<method>`` with ``{"args": [...], "kwargs": {...}}``; the answer is 200
  ``{"result": ...}`` or an error (401 ``unauthorized``, 404 ``unknown_method``, 400 ``bad_call``, 409 for a
  :class:`sbx.node.types.NodeError`) shaped ``{"error": {"code", "message"}}``.
- Values: JSON as is; ``bytes`` as ``{"__bytes__": "<base64>"}``; a dataclass of :data:`DATACLASSES` as
  ``{"__type__": "<class name>", <its fields>}`` (nested values encoded the same way); tuples become lists.
- An attached exec is ``POST /v1/node/exec`` answering NDJSON, one encoded :class:`sbx.node.types.ExecEvent` per
  line, and ``{}`` at least twice a second while the command is silent (so the caller notices its own ``stop``);
  an error after the stream started is one line ``{"error": {...}}``.
- A spawned process is the WebSocket ``/v1/node/spawn`` (:mod:`sbx.node.remote.spawned`).
- The node's exit watcher is a long poll, ``GET /v1/node/exits?after=N``.
- A moving sandbox's files (:mod:`sbx.node.migration.transfer`) stream as raw bytes:
  ``GET /v1/node/transfer/<id>/<name>`` (from the source) and ``PUT /v1/node/transfer/<id>/<name>`` (into the
  destination, hash-checked there).
- The egress proxy's questions are a long poll the servers hold, ``POST /v1/node/egress/poll`` and ``.../answer``
  (:mod:`sbx.node.remote.egresslink`).
- Hosted ports of the node's sandboxes are reached through its port relay (:mod:`sbx.node.remote.relay`).

The token is ``Authorization: Bearer <node token>`` on every request (:func:`ensure_node_token`).
"""

from __future__ import annotations

import base64
import dataclasses
import os
import secrets
from pathlib import Path
from typing import Any

from sbx.config import Settings, Size
from sbx.node import types as T

#: Dataclasses that may cross the wire, by class name.
DATACLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (Size, T.SandboxSpec, T.ResumeResult, T.StopResult, T.ExecEvent, T.JobInfo, T.Stats, T.SnapshotInfo,
                T.NodeInfo)
}

#: NodeAgent methods served by ``POST /v1/node/call/<name>`` (plain request and answer). ``exec``, ``spawn``,
#: ``watch`` and ``unwatch`` have their own transports; a new plain method is one name here.
CALLS = frozenset({
    "create", "pool_take", "exec_detached", "kill_job", "jobs", "job_output", "stop", "resume", "fork", "fork_stopped",
    "snapshot",
    "delete_snapshot", "snapshots", "delete", "stats", "status", "address", "reconcile", "info",
    # live migration (sbx.node.migration.outgoing): the destination prepares and may drop an arrival; the source moves
    "migrate_prepare", "migrate_abort", "migrate_out",
    # a stopped sandbox moving between nodes (sbx.node.migration.transfer); its files have their own streaming routes
    "transfer_parent", "export_stopped", "export_snapshot", "end_export", "begin_import", "abort_import",
    "commit_import",
    # seal replicas (sbx.node.migration.replicas); their files stream in on their own route
    "begin_replica", "seal_replica", "drop_replica", "replicas", "promote_replica",
    # which sandboxes go through the egress proxy; its questions have their own routes (sbx.node.remote.egresslink)
    "set_egress_proxy",
    # images: builds and imports stream on their own routes (sbx.node.remote.imagelink)
    "delete_image",
})


def encode(value: Any) -> Any:
    """``value`` as JSON-ready data (see the module docstring). Raises ``TypeError`` for anything else."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = type(value).__name__
        if DATACLASSES.get(name) is not type(value):
            raise TypeError(f"{name} may not cross the node wire")
        return {"__type__": name, **{f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, list | tuple):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    raise TypeError(f"{type(value).__name__} may not cross the node wire")


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`. Raises ``ValueError`` for an unknown type name or bad fields."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__bytes__" in value:
        return base64.b64decode(value["__bytes__"])
    if "__type__" in value:
        cls = DATACLASSES.get(str(value["__type__"]))
        if cls is None:
            raise ValueError(f"unknown type {value['__type__']!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: decode(v) for k, v in value.items() if k != "__type__"}
        if not set(fields) <= names:
            raise ValueError(f"unknown fields for {cls.__name__}: {sorted(set(fields) - names)}")
        return cls(**fields)
    return {k: decode(v) for k, v in value.items()}


def node_token_path(state_dir: Path) -> Path:
    """Where a node keeps its token: ``<state_dir>/node-token`` (mode 0600)."""
    return state_dir / "node-token"


def ensure_node_token(settings: Settings) -> str:
    """The node's token: ``settings.node_token`` (``SBX_NODE_TOKEN``) when set, else ``<state_dir>/node-token``,
    created on first use (``sbxn_`` + 43 URL-safe characters). The servers that use the node are given the same
    token."""
    if settings.node_token.strip():
        return settings.node_token.strip()
    path = node_token_path(settings.state_dir)
    if path.is_file() and (token := path.read_text().strip()):
        return token
    path.parent.mkdir(parents=True, exist_ok=True)
    token = "sbxn_" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token
