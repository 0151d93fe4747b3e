"""What every node-wide operation of the cluster reads of its control plane: :class:`ClusterView`.

The drain, the consolidation loop and the seal replicator each take the plane as a protocol of their own that
extends this one with what only they use (:class:`sbx.control.service.ControlPlane` satisfies them all)."""

from __future__ import annotations

from typing import Protocol

from sbx.config import Settings
from sbx.control.cluster.placement import Candidate
from sbx.control.cluster.registry import NodeRegistry
from sbx.control.cluster.router import NodeRouter
from sbx.control.store.database import Store


class ClusterView(Protocol):
    """The plane as the cluster's operations see it: settings, store, the nodes (registry and router) and
    placement's view of them (``_candidates``: every node with its free room, ``exclude`` left out)."""

    @property
    def settings(self) -> Settings: ...
    @property
    def store(self) -> Store: ...
    @property
    def registry(self) -> NodeRegistry: ...
    @property
    def router(self) -> NodeRouter: ...
    def _candidates(self, exclude: str | None = None) -> list[Candidate]: ...
