"""Secrets on several nodes: which node may ask about which sandbox, and what each node's egress proxy is told.

Every node runs its own egress proxy (:mod:`sbx.node.network.egressproxy`); the embedded one asks the control plane in
process, a node agent over its long-poll link (:mod:`sbx.node.remote.egresslink`). The control plane trusts no
node with another node's sandboxes: a question about sandbox S from node N is answered only when the store places
S on N (the row's ``node`` column, the configured node for a row without one) and S is not deleted; otherwise the
request gets nothing (``{"actions": []}``) and the refusal is logged. So a hostile node learns at most the secrets
bound to sandboxes it holds (it holds their disks and memory anyway), and a sandbox moving between nodes gets its
secrets from the destination only from the move's commit point on (``sandboxes.node``).

What goes through a node's proxy is the set of its sandboxes with a binding. A node learns it per sandbox on
bind/unbind (:meth:`sbx.control.secrets.vault.Secrets.bind`), all at once when the server starts (:meth:`sync_all`)
and whenever a server reaches a node process it had not reached before (the agent restarted: its set is empty;
:meth:`sync_node`), and again on the destination after a move (:meth:`reapply`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from sbx.config import Settings
from sbx.control.errors import ControlError
from sbx.control.store.database import SandboxRow, Store
from sbx.node.types import NodeAgent, NodeError

log = logging.getLogger("sbx.control")

Handler = Callable[[str, dict[str, Any]], dict[str, Any]]


class NodeDirectory(Protocol):
    """The node names and agents secrets need (:class:`sbx.control.cluster.router.NodeRouter` is one)."""

    @property
    def default_name(self) -> str: ...
    def node_of(self, sandbox_id: str) -> str: ...
    def agent(self, name: str | None) -> NodeAgent: ...
    def agents(self) -> dict[str, tuple[str, NodeAgent]]: ...
    def egress_nodes(self) -> set[str]: ...


class SecretsPlane(Protocol):
    """What the secrets use of their control plane (:class:`sbx.control.service.ControlPlane` is one): its
    settings and store, the sandbox lookup, and the nodes (``node`` reaches the node that holds a sandbox)."""

    @property
    def settings(self) -> Settings: ...
    @property
    def store(self) -> Store: ...
    @property
    def router(self) -> NodeDirectory: ...
    @property
    def node(self) -> NodeAgent: ...
    def get(self, sandbox_id: str) -> SandboxRow: ...


class Vault(Protocol):
    """What :class:`SecretNodes` uses of the secrets (:class:`sbx.control.secrets.vault.Secrets` is one)."""

    @property
    def cp(self) -> SecretsPlane: ...
    def handle(self, sandbox_id: str, message: dict[str, Any]) -> dict[str, Any]: ...
    def has_bindings(self, sandbox_id: str) -> bool: ...
    def bound_sandboxes(self) -> list[str]: ...
    def sync_node_of(self, sandbox_id: str) -> None: ...


class SecretNodes:
    """The per-node side of ``secrets`` (module docstring); its control plane's router decides node names."""

    def __init__(self, secrets: Vault):
        self.secrets = secrets
        self.cp = secrets.cp

    def _default(self) -> str:
        return self.cp.router.default_name

    def may_ask(self, node: str | None, sandbox_id: str) -> bool:
        """True when node ``node`` (None: the configured node, by its current name) holds sandbox ``sandbox_id``
        according to the store, and the sandbox is not deleted."""
        row = self.cp.store.get_sandbox(sandbox_id)
        if row is None or row.state == "deleted":
            return False
        return (row.node or self._default()) == (node or self._default())

    def handler_for(self, node: str | None) -> Handler:
        """The proxy handler for node ``node``'s questions: :meth:`sbx.control.secrets.vault.Secrets.handle` for the
        sandboxes :meth:`may_ask` allows, ``{"actions": []}`` for any other."""
        def handle(sandbox_id: str, question: dict[str, Any]) -> dict[str, Any]:
            if not self.may_ask(node, sandbox_id):
                log.warning("egress: node %s asked about %s, which the store does not place there: refused",
                            node or self._default(), sandbox_id[:40])
                return {"actions": []}
            return self.secrets.handle(sandbox_id, question)
        return handle

    def ready(self, sandbox_id: str | None = None) -> bool:
        """True when the node of ``sandbox_id`` runs an egress proxy; without a sandbox, when any node does (a
        create or fork checked before placement)."""
        router = self.cp.router
        if sandbox_id is not None:
            return bool(router.agent(router.node_of(sandbox_id)).egress_ready())
        return bool(router.egress_nodes())

    def require(self, sandbox_id: str | None = None) -> None:
        """Raise 409 ``egress_proxy_unavailable`` unless :meth:`ready`."""
        if self.ready(sandbox_id):
            return
        where = f"node {self.cp.router.node_of(sandbox_id)} runs no" if sandbox_id else "no node runs an"
        raise ControlError("egress_proxy_unavailable", f"{where} egress proxy, so secrets can't be bound "
                           "(SBX_EGRESS_PROXY_PORT=0, or scripts/install.sh was not run there)", 409)

    def sync_node(self, node: str | None) -> int:
        """Tell node ``node`` (None: the configured one) every sandbox of its own with a binding; returns how many.
        A node that does not answer is skipped (logged): it is told again when a server next reaches it."""
        name = node or self._default()
        router = self.cp.router
        told = 0
        for sid in self.secrets.bound_sandboxes():
            row = self.cp.store.get_sandbox(sid)
            if row is None or row.state == "deleted" or (row.node or self._default()) != name:
                continue
            try:
                router.agent(name).set_egress_proxy(sid, True)
            except NodeError as e:
                log.warning("node %s can't send %s through its egress proxy: %s", name, sid, e.message)
                if e.code == "node_unreachable":
                    break
                continue
            told += 1
        return told

    def sync_all(self) -> None:
        """:meth:`sync_node` for every node (at server start: a node's redirect set may be empty)."""
        for name in list(self.cp.router.agents()):
            self.sync_node(name)

    def reapply(self, sandbox_id: str) -> None:
        """After a move's commit point: send the sandbox through its new node's proxy when it has a binding (the
        old node dropped it with its copy). A failure is logged, not raised: the sandbox itself moved."""
        if not self.secrets.has_bindings(sandbox_id):
            return
        try:
            self.secrets.sync_node_of(sandbox_id)
        except ControlError as e:
            log.warning("%s moved to %s but its egress-proxy binding could not be set there: %s", sandbox_id,
                        self.cp.router.node_of(sandbox_id), e.message)
