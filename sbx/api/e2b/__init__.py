"""E2B compatibility: E2B's own SDK (``e2b`` on PyPI) runs unchanged against an sbx server.

Point the SDK at sbx with ``E2B_API_URL=http://<server>/e2b`` (the REST control plane: :mod:`sbx.api.e2b.rest`)
and ``E2B_SANDBOX_URL=http://<server>`` (what the SDK calls inside sandboxes, routed by its ``E2b-Sandbox-Id``
header: :mod:`sbx.api.e2b.envd`), with ``E2B_API_KEY`` an sbx API key.
:func:`sbx.api.e2b.mount.mount` adds both to the sbx API.

- :mod:`~sbx.api.e2b.routes` (the REST routes) over :mod:`~sbx.api.e2b.rest` (what they do: create, list, kill,
  timeouts, pause, connect, metrics) and :mod:`~sbx.api.e2b.lifecycle` (sandboxes killed at their timeout);
- :mod:`~sbx.api.e2b.envd` (the in-sandbox calls: Connect RPCs, ``/health``) with :mod:`~sbx.api.e2b.files`
  (``/files``), :mod:`~sbx.api.e2b.procs` (processes and terminals: sbx jobs), :mod:`~sbx.api.e2b.starts` (how a
  process starts), :mod:`~sbx.api.e2b.pool` (ready jobs), :mod:`~sbx.api.e2b.follower` (the shell that follows a
  job), :mod:`~sbx.api.e2b.fs` (filesystem calls, file metadata), :mod:`~sbx.api.e2b.watch` (watchers),
  :mod:`~sbx.api.e2b.connect` (the Connect protocol's JSON framing) and :mod:`~sbx.api.e2b.tokens` (access
  tokens, signed URLs);
- :mod:`~sbx.api.e2b.hosts`: E2B's per-port host names (``Sandbox.get_host``) on sbx's hosted-port proxy;
- :mod:`~sbx.api.e2b.mount`: both added to the sbx API, and the middleware that sends envd's requests aside.
"""
