"""E2B compatibility: E2B's own SDK (``e2b`` on PyPI) runs unchanged against an sbx server.

Point the SDK at sbx with ``E2B_API_URL=http://<server>/e2b`` (the REST control plane: :mod:`sbx.api.e2b.rest`)
and ``E2B_SANDBOX_URL=http://<server>`` (what the SDK calls inside sandboxes, routed by its ``E2b-Sandbox-Id``
header: :mod:`sbx.api.e2b.envd`), with ``E2B_API_KEY`` an sbx API key.
:func:`sbx.api.e2b.mount.mount` adds both to the sbx API.
"""
