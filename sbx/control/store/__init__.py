"""Persistent state of the control plane and the rules of its changes.

- ``database``: :class:`Store`, the SQL tables of sandboxes, snapshots, events, nodes (SQLAlchemy 2; SQLite or
  PostgreSQL) and ``migrations/`` (alembic), applied at open;
- ``state``: the lifecycle state machine (:class:`Lifecycle`: transitions, holds, waits);
- ``locks``: locks shared by the server replicas of one PostgreSQL database (advisory locks, leader loops);
- ``ids`` and ``words``: sandbox ids, subdomains and URLs.

May import :mod:`sbx.control.errors` only, within control.
"""
