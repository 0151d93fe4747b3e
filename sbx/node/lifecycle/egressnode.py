"""The node's side of the egress proxy (:mod:`sbx.node.network.egressproxy`): which sandboxes send their outbound
HTTP(S) through it, the environment and CA certificate a sandbox gets so it trusts it, and the control plane's answers
to its questions. Part of :class:`sbx.node.agent.LocalNode`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sbx.node.agentbase import NodeBase
from sbx.node.container import guestfs
from sbx.node.network.egressproxy import CA_BUNDLE_GUEST_PATH, CA_ENV, CA_GUEST_PATH
from sbx.node.types import NodeError


class EgressMixin(NodeBase):
    """The egress proxy's node calls (part of :class:`sbx.node.agent.LocalNode`)."""


    def egress_ready(self) -> bool:
        """True when the egress proxy runs on this node."""
        return self._egress is not None

    def serve_egress(self, handler: Callable[[str, dict[str, Any]], dict[str, Any]]) -> None:
        """Answer the egress proxy's questions with ``handler(sandbox_id, question)`` (the control plane's
        secrets); without a running proxy, nothing happens."""
        if self._egress is not None:
            self._egress.serve(handler)

    def set_egress_proxy(self, id: str, enabled: bool) -> None:
        """Send the sandbox's outbound TCP 80/443 through the egress proxy (``enabled``) or straight out, from its
        next connection on; remembered across its stops and boots. Raises ``NodeError("egress_proxy_unavailable")``
        when asked to enable it on a node whose proxy is off."""
        if enabled and self._egress is None:
            raise NodeError("egress_proxy_unavailable", "this node runs no egress proxy (SBX_EGRESS_PROXY_PORT=0, "
                            "or its virtualenv is missing: run scripts/install.sh)")
        if enabled:
            self._egress_ids.add(id)
        else:
            self._egress_ids.discard(id)
        if self._egress is None:
            return
        try:
            address = self._lease(id).address.split("/")[0]
        except (NodeError, OSError, KeyError, ValueError):
            return  # no record or lease yet: _write_bundle applies it at boot
        self._egress.set(id, address, enabled)

    def _apply_egress(self, sid: str, rec: dict[str, Any]) -> None:
        if self._egress is not None and sid in self._egress_ids:
            self._egress.set(sid, rec["lease"]["address"].split("/")[0], True)

    def close_egress(self) -> None:
        """Stop the egress proxy (server shutdown)."""
        if self._egress is not None:
            self._egress.close()

    def _exec_env(self, rec: dict[str, Any], env: dict[str, str] | None) -> dict[str, str]:
        """Environment of an exec, job or shell beyond the login defaults: the CA variables when the proxy runs
        (:data:`sbx.node.network.egressproxy.CA_ENV`), the sandbox's env, then the call's ``env``."""
        return {**(CA_ENV if self._egress is not None else {}), **rec["spec"].get("env", {}), **(env or {})}

    def _install_ca(self, root: Path) -> None:
        """Write this node's egress proxy CA certificate into a mounted sandbox disk and into its system bundle, at
        every start (boot and restore alike): a sandbox that moved here trusts this node's proxy, and the CA of the
        node it came from (the certificate the file held before) leaves the bundle. Only the certificate: its key
        stays in ``<state_dir>/egress``."""
        if self._egress is None or not self._egress.ca_pem:
            return
        pem = self._egress.ca_pem
        try:
            old = guestfs.read_file(root, CA_GUEST_PATH, limit=64 << 10)
        except (OSError, guestfs.UnsafePath):
            old = b""
        if old != pem:
            guestfs.write_file(root, CA_GUEST_PATH, pem)
        try:
            bundle = guestfs.read_file(root, CA_BUNDLE_GUEST_PATH, limit=8 << 20)
        except (OSError, guestfs.UnsafePath):
            bundle = b""
        kept = bundle.replace(old, b"") if old and old != pem and old.startswith(b"-----BEGIN CERTIFICATE") else bundle
        if pem not in kept:
            kept = kept.rstrip(b"\n") + b"\n" + pem
        if kept != bundle:
            guestfs.write_file(root, CA_BUNDLE_GUEST_PATH, kept)
