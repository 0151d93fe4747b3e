"""The control plane: what a user asks of sandboxes, decided here and carried out by node agents (:mod:`sbx.node`).

Rooms, top to bottom; each imports only the rooms below it (import-linter contract "Control layers" in
``pyproject.toml``, ``if TYPE_CHECKING`` imports included):

- :mod:`sbx.control.reaper`: the plane's background duties (TTL stops, automatic snapshots, event pruning);
- :mod:`sbx.control.service`: :class:`~sbx.control.service.ControlPlane`, the operation mixins in one class, and
  what it does at start and close;
- :mod:`sbx.control.sandboxes`: the plane's operations on sandboxes, snapshots, execs, files and hosted ports;
- :mod:`sbx.control.cluster`: the nodes (router, registry, placement, capacity, replicas, trim) and node-wide
  operations (drains, consolidation, orphaned operations), which reach the plane only through protocols;
- :mod:`sbx.control.accounts` and :mod:`sbx.control.secrets`, independent of each other: accounts, keys, plans,
  prices and usage; secrets for the egress proxy;
- :mod:`sbx.control.store`: the database, its migrations, the lifecycle state machine, locks, ids;
- :mod:`sbx.control.errors`: :class:`~sbx.control.errors.ControlError`, the errors every room raises.

Nothing here imports :mod:`sbx.api` or :mod:`sbx.cli`; below control come :mod:`sbx.node`, :mod:`sbx.runtime` and
:mod:`sbx.storage` (contract "Layers point down").
"""
