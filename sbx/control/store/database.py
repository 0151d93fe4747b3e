"""Persistent state of the control plane: sandboxes, snapshots and events, in SQL through SQLAlchemy 2.

The database lives at ``settings.db_url`` (SQLite by default: ``<state_dir>/sbx.db``; PostgreSQL through psycopg 3
when ``SBX_DATABASE_URL`` is set, shared by several server replicas). The schema is created and
upgraded by the alembic migrations in ``sbx/control/store/migrations`` (:func:`migrate`), run programmatically when
the :class:`Store` opens. Only portable column types are used so the same migrations work on PostgreSQL.

Every method opens its own short session, so the store may be used from any thread.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    delete,
    event,
    select,
    text,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

MIGRATIONS_DIR = Path(__file__).with_name("migrations")


def utcnow() -> dt.datetime:
    """The current time, timezone-aware UTC."""
    return dt.datetime.now(dt.UTC)


def as_utc(value: dt.datetime) -> dt.datetime:
    """``value`` as aware UTC (SQLite hands back naive datetimes; they are stored as UTC)."""
    return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


def iso(value: dt.datetime | None) -> str | None:
    """ISO 8601 UTC with a ``Z`` suffix and millisecond precision, e.g. ``2026-10-27T02:05:38.120Z``."""
    if value is None:
        return None
    return as_utc(value).strftime("%Y-%m-%dT%H:%M:%S.") + f"{as_utc(value).microsecond // 1000:03d}Z"


class Base(DeclarativeBase):
    pass


class SandboxRow(Base):
    """One sandbox. ``state`` is one of :data:`sbx.control.store.state.STATES`; ``ttl`` is seconds of inactivity before
    an automatic stop (0 = never); ``has_memory`` says the last stop wrote a memory image; ``auto_resume``: a request
    on one of its hosted ports resumes it when stopped; ``labels`` string metadata for list filters;
    ``memory_saved``/``stop_reason``/``stop_error`` describe the last stop (whether memory was written, why it
    stopped, what failed); ``node`` the node that holds it (None: the server's only node, rows from before 0007);
    ``image_id``/``image`` the user image its disk came from (``{"name", "key", ...facts}``; None: sbx's default
    image, :mod:`sbx.control.images.catalog`); ``runtime`` its runtime class (:data:`sbx.node.types.RUNTIME_CLASSES`:
    ``container`` or ``gvisor``)."""

    __tablename__ = "sandboxes"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    type: Mapped[str] = mapped_column(String(32))
    state: Mapped[str] = mapped_column(String(16), index=True)
    subdomain: Mapped[str] = mapped_column(String(80), unique=True)
    ttl: Mapped[int] = mapped_column(Integer, default=0)
    env: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    labels: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    no_snapshots: Mapped[bool] = mapped_column(Boolean, default=False)
    memory_restored: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    resume_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    has_memory: Mapped[bool] = mapped_column(Boolean, default=False)
    auto_resume: Mapped[bool] = mapped_column(Boolean, default=False)
    memory_saved: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    stop_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    stop_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    node: Mapped[str | None] = mapped_column(String(64), nullable=True)
    source_id: Mapped[str | None] = mapped_column(String(16), nullable=True)
    from_snapshot: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    account_id: Mapped[str] = mapped_column(String(24), index=True, default="acct_default")
    image_id: Mapped[str | None] = mapped_column(String(24), nullable=True, index=True)
    image: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    runtime: Mapped[str] = mapped_column(String(16), default="container", server_default="container")


class SnapshotRow(Base):
    """A named, sealed copy of a sandbox's disk. ``auto`` marks the reaper's periodic snapshots.

    ``label`` is the name its account gave it, unique within the account (another account may use the same
    one); ``name`` is the installation-wide key the nodes and the usage records know it by: the label itself
    when no other snapshot holds that key, else the label with a random suffix. Rows from before labels got their
    key as their label (migration 0009)."""

    __tablename__ = "snapshots"
    __table_args__ = (UniqueConstraint("account_id", "label", name="uq_snapshots_account_label"),)

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    label: Mapped[str | None] = mapped_column(String(64), nullable=True)
    sandbox_id: Mapped[str] = mapped_column(String(16), index=True)
    auto: Mapped[bool] = mapped_column(Boolean, default=False)
    size_mib: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    account_id: Mapped[str] = mapped_column(String(24), default="acct_default")


class EventRow(Base):
    """One lifecycle event of a sandbox; ``seq`` orders all events; ``payload`` is the JSON event line."""

    __tablename__ = "events"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    sandbox_id: Mapped[str] = mapped_column(String(16), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)


class NodeRow(Base):
    """A node agent in the registry: ``url`` (``local`` for the embedded node), ``cordoned`` (no new sandboxes),
    ``last_seen`` (the last answered heartbeat), ``info`` (that heartbeat's capacity, load and fingerprint),
    ``token`` (an added node's token, sealed: :mod:`sbx.control.cluster.router`; None for the configured node),
    ``consolidated_at`` (when consolidation emptied it, :mod:`sbx.control.cluster.consolidate`; cleared by an
    uncordon)."""

    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    url: Mapped[str] = mapped_column(String(300))
    cordoned: Mapped[bool] = mapped_column(Boolean, default=False)
    registered_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    last_seen: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    info: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    token: Mapped[str | None] = mapped_column(Text, nullable=True)
    consolidated_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


def alembic_config(url: str) -> Config:
    """An alembic :class:`Config` for our migrations against ``url`` (no ini file needed)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


MIGRATE_LOCK = 0x5B7C0DE
"""PostgreSQL advisory lock key that serialises migrations of replicas starting at once."""


def migrate(engine: Engine) -> None:
    """Upgrade the database behind ``engine`` to the newest migration (``alembic upgrade head``). On PostgreSQL
    the upgrade runs under a transaction-level advisory lock, so replicas starting together migrate one at a time
    (the later ones find the schema current)."""
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATE_LOCK})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


StateHook = Callable[[Session, SandboxRow, str, dt.datetime], None]
"""``hook(session, row, old_state, now)``: called inside the transaction that writes a sandbox's new state (``old``
is ``""`` for a new row), so what it writes (metering) commits or vanishes with the state change."""


class Store:
    """Rows of the control plane. ``url`` is a SQLAlchemy URL: ``sqlite:///path`` (the parent folder of the file
    is created) or ``postgresql+psycopg://user@/db?host=/socket/dir`` (a bare ``postgresql://`` is read as psycopg
    3 too). Opening runs the migrations.

    ``clock`` (default :func:`utcnow`) stamps ``updated_at`` and state changes; tests replace it with a fake clock.
    ``state_hooks`` are :data:`StateHook` callables run in the same transaction as every state change."""

    def __init__(self, url: str):
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            self.engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

            @event.listens_for(self.engine, "connect")
            def _pragmas(dbapi_conn: Any, _rec: Any) -> None:
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
                cur.close()
        else:
            if url.startswith(("postgresql://", "postgres://")):
                url = "postgresql+psycopg://" + url.split("://", 1)[1]
            self.engine = create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)
        migrate(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.clock: Callable[[], dt.datetime] = utcnow
        self.state_hooks: list[StateHook] = []

    def close(self) -> None:
        """Release the connection pool."""
        self.engine.dispose()

    def session(self) -> Session:
        return self._sessions()

    # sandboxes -------------------------------------------------------------------------------------------------
    def add_sandbox(self, row: SandboxRow) -> SandboxRow:
        """Insert a new sandbox row and return it (the state hooks see it with old state ``""``)."""
        with self.session() as s, s.begin():
            s.add(row)
            s.flush()
            for hook in self.state_hooks:
                hook(s, row, "", self.clock())
        return row

    def get_sandbox(self, sandbox_id: str) -> SandboxRow | None:
        """The sandbox row, or None (deleted rows are returned too; callers decide)."""
        with self.session() as s:
            return s.get(SandboxRow, sandbox_id)

    def list_sandboxes(self, include_deleted: bool = False, account_id: str | None = None) -> list[SandboxRow]:
        """All sandboxes (only ``account_id``'s when given), oldest first."""
        with self.session() as s:
            q = select(SandboxRow).order_by(SandboxRow.created_at)
            if not include_deleted:
                q = q.where(SandboxRow.state != "deleted")
            if account_id is not None:
                q = q.where(SandboxRow.account_id == account_id)
            return list(s.scalars(q))

    def update_sandbox(self, sandbox_id: str, **fields: Any) -> SandboxRow:
        """Set ``fields`` on the sandbox and bump ``updated_at``; returns the new row. Raises KeyError if absent.
        A change of ``state`` runs the state hooks in the same transaction."""
        with self.session() as s, s.begin():
            row = s.get(SandboxRow, sandbox_id)
            if row is None:
                raise KeyError(sandbox_id)
            old = row.state
            for key, value in fields.items():
                setattr(row, key, value)
            row.updated_at = self.clock()
            if row.state != old:
                for hook in self.state_hooks:
                    hook(s, row, old, row.updated_at)
        return row

    def subdomain_taken(self, subdomain: str) -> bool:
        with self.session() as s:
            return s.scalar(select(SandboxRow.id).where(SandboxRow.subdomain == subdomain)) is not None

    # snapshots -------------------------------------------------------------------------------------------------
    def add_snapshot(self, row: SnapshotRow, also: Callable[[Session], None] | None = None) -> SnapshotRow:
        """Insert a snapshot row; ``also(session)`` runs in the same transaction (its metering)."""
        with self.session() as s, s.begin():
            s.add(row)
            if also is not None:
                also(s)
        return row

    def get_snapshot(self, name: str) -> SnapshotRow | None:
        """The snapshot whose installation-wide key is ``name`` (see :class:`SnapshotRow`), or None."""
        with self.session() as s:
            return s.get(SnapshotRow, name)

    def find_snapshot(self, label: str, account_id: str, any_account: bool = False) -> SnapshotRow | None:
        """Account ``account_id``'s snapshot named ``label``; with ``any_account`` (the admin key), else the oldest
        one of that name in any account. None when there is none."""
        with self.session() as s:
            named = SnapshotRow.label == label
            row = s.scalar(select(SnapshotRow).where(named, SnapshotRow.account_id == account_id))
            if row is None and any_account:
                row = s.scalar(select(SnapshotRow).where(named).order_by(SnapshotRow.created_at).limit(1))
            return row

    def list_snapshots(self, sandbox_id: str | None = None, auto: bool | None = None,
                       account_id: str | None = None) -> list[SnapshotRow]:
        """Snapshots, oldest first, optionally of one sandbox, one account and/or only (non-)automatic ones."""
        with self.session() as s:
            q = select(SnapshotRow).order_by(SnapshotRow.created_at, SnapshotRow.name)
            if account_id is not None:
                q = q.where(SnapshotRow.account_id == account_id)
            if sandbox_id is not None:
                q = q.where(SnapshotRow.sandbox_id == sandbox_id)
            if auto is not None:
                q = q.where(SnapshotRow.auto == auto)
            return list(s.scalars(q))

    def delete_snapshot(self, name: str, also: Callable[[Session], None] | None = None) -> None:
        """Remove a snapshot row; ``also(session)`` runs in the same transaction (its metering)."""
        with self.session() as s, s.begin():
            row = s.get(SnapshotRow, name)
            if row is not None:
                s.delete(row)
                if also is not None:
                    also(s)

    # events ----------------------------------------------------------------------------------------------------
    def add_event(self, sandbox_id: str, payload: dict[str, Any]) -> int:
        """Append an event; returns its ``seq``."""
        row = EventRow(sandbox_id=sandbox_id, created_at=utcnow(), payload=payload)
        with self.session() as s, s.begin():
            s.add(row)
            s.flush()
            return int(row.seq)

    def events(self, sandbox_id: str, after: int = 0) -> list[EventRow]:
        """Events of a sandbox with ``seq > after``, in order."""
        with self.session() as s:
            q = (
                select(EventRow)
                .where(EventRow.sandbox_id == sandbox_id, EventRow.seq > after)
                .order_by(EventRow.seq)
            )
            return list(s.scalars(q))

    def prune_events(self, older_than: dt.datetime) -> int:
        """Delete events created before ``older_than`` (UTC); returns how many. Streams that resume with
        ``after=seq`` are unaffected: sequence numbers are never reused."""
        with self.session() as s, s.begin():
            result = s.execute(delete(EventRow).where(EventRow.created_at < older_than))
            return int(result.rowcount or 0)  # type: ignore[attr-defined]

    # nodes -----------------------------------------------------------------------------------------------------
    def heartbeat_node(self, name: str, url: str, info: dict[str, Any]) -> NodeRow:
        """Record an answered heartbeat of node ``name`` (registering it on the first one): ``url`` and ``info``
        replace the stored ones, ``last_seen`` becomes now; ``cordoned`` is kept. Returns the row."""
        with self.session() as s, s.begin():
            row = s.get(NodeRow, name)
            now = utcnow()
            if row is None:
                row = NodeRow(name=name, url=url, cordoned=False, registered_at=now)
                s.add(row)
            row.url, row.info, row.last_seen = url, info, now
        return row

    def add_node(self, name: str, url: str, token: str, info: dict[str, Any]) -> NodeRow:
        """Register (or re-register) the added node ``name`` at ``url`` with its sealed ``token`` and a first
        heartbeat ``info``; ``cordoned`` is kept for a known node. Returns the row."""
        with self.session() as s, s.begin():
            row = s.get(NodeRow, name)
            now = utcnow()
            if row is None:
                row = NodeRow(name=name, url=url, cordoned=False, registered_at=now)
                s.add(row)
            row.url, row.token, row.info, row.last_seen = url, token, info, now
        return row

    def remove_node(self, name: str) -> None:
        """Forget node ``name``. Raises KeyError for an unknown node."""
        with self.session() as s, s.begin():
            row = s.get(NodeRow, name)
            if row is None:
                raise KeyError(name)
            s.delete(row)

    def list_nodes(self) -> list[NodeRow]:
        """Every registered node, by name."""
        with self.session() as s:
            return list(s.scalars(select(NodeRow).order_by(NodeRow.name)))

    def set_node_cordoned(self, name: str, cordoned: bool) -> NodeRow:
        """Cordon or uncordon node ``name`` (an uncordon clears ``consolidated_at``); returns the row. Raises
        KeyError for an unknown node."""
        with self.session() as s, s.begin():
            row = s.get(NodeRow, name)
            if row is None:
                raise KeyError(name)
            row.cordoned = cordoned
            if not cordoned:
                row.consolidated_at = None
        return row

    def set_node_consolidated(self, name: str, when: dt.datetime | None) -> None:
        """Record that consolidation emptied node ``name`` at ``when`` (None: clear it). Raises KeyError for an
        unknown node."""
        with self.session() as s, s.begin():
            row = s.get(NodeRow, name)
            if row is None:
                raise KeyError(name)
            row.consolidated_at = when

    def bulk_states(self, rows: Iterable[SandboxRow]) -> dict[str, str]:
        return {r.id: r.state for r in rows}
