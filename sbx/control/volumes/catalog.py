"""The volume catalog: which volumes exist, whose they are, and which sandbox mounts which where.

A volume has a ``name`` unique within its account (a lower-case letter or digit, then up to 62 of letters, digits,
``.``, ``_``, ``-``), an id (``vol_`` + 12 hex digits), an optional size cap in GiB and a JuiceFS file system of its
own (:func:`sbx.storage.juicefs.format_volume`: metadata in ``volumes_dir/meta/<id>.db``, data in the local store
or the configured S3 bucket). Another account's volume does not exist for an account (404).

A sandbox lists its volumes at create (``[{"name", "path", "readOnly"}]``); ``volume_mounts`` keeps them, a fork
copies its source's, and the node mounts them on every start (:mod:`sbx.node.volumes.mounts`). A volume outlives
every sandbox; it can't be deleted while a sandbox that is not deleted mounts it (409 ``volume_in_use``).

Errors are :class:`sbx.control.errors.ControlError`: 400 ``invalid_volume_name``/``invalid_volume_size``/
``invalid_volume_path``/``invalid_volume``, 404 ``volume_not_found``, 409 ``volume_exists``/``volume_in_use``,
500 ``volume_create_failed``. An error changes nothing.
"""

from __future__ import annotations

import builtins
import datetime as dt
import re
import secrets
from typing import Any, Protocol

from sqlalchemy import Boolean, DateTime, Integer, String, UniqueConstraint, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, mapped_column

from sbx.config import Settings
from sbx.control.errors import ControlError
from sbx.control.store.database import Base, SandboxRow, Store, iso, utcnow
from sbx.storage import juicefs
from sbx.storage.errors import StorageError

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
NAME_PATTERN = NAME_RE.pattern
#: The largest size cap a volume may have, GiB.
MAX_SIZE_GIB = 65536
#: How many volumes one sandbox may mount.
MAX_MOUNTS = 16


class VolumeRow(Base):
    """One volume of account ``account_id``; ``size_gib`` None: no cap."""

    __tablename__ = "volumes"
    __table_args__ = (UniqueConstraint("account_id", "name", name="uq_volumes_account_name"),)

    id: Mapped[str] = mapped_column(String(24), primary_key=True)
    account_id: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(64))
    size_gib: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class VolumeMountRow(Base):
    """Volume ``volume_id`` mounted at ``path`` in sandbox ``sandbox_id``."""

    __tablename__ = "volume_mounts"

    sandbox_id: Mapped[str] = mapped_column(String(24), primary_key=True)
    path: Mapped[str] = mapped_column(String(1024), primary_key=True)
    volume_id: Mapped[str] = mapped_column(String(24), index=True)
    read_only: Mapped[bool] = mapped_column(Boolean, default=False)


class VolumesPlane(Protocol):
    """What the catalog reads of the plane (:class:`sbx.control.service.ControlPlane`)."""

    settings: Settings
    store: Store


def check_name(name: str) -> None:
    """Raise 400 ``invalid_volume_name`` unless ``name`` matches :data:`NAME_RE`."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ControlError("invalid_volume_name", f"volume names are a lower-case letter or digit, then up to 62 of "
                           f"a-z, 0-9, '.', '_', '-'; got {str(name)[:80]!r}", 400, field="name")


class Volumes:
    """The catalog (module docstring). Thread-safe: every call is one database session."""

    def __init__(self, plane: VolumesPlane):
        self.plane = plane

    # ------------------------------------------------------------------ reading

    def view(self, row: VolumeRow) -> dict[str, Any]:
        """The API shape of a volume: ``{"id", "name", "sizeGiB", "createdAt", "sandboxes"}`` (``sandboxes``: the
        ids of the sandboxes, not deleted, that mount it)."""
        return {"id": row.id, "name": row.name, "sizeGiB": row.size_gib, "createdAt": iso(row.created_at),
                "sandboxes": self.users(row.id)}

    def list(self, account_id: str) -> list[VolumeRow]:
        """The account's volumes, by name."""
        with self.plane.store.session() as s:
            rows = list(s.scalars(select(VolumeRow).where(VolumeRow.account_id == account_id)))
        return sorted(rows, key=lambda r: r.name)

    def resolve(self, account_id: str, name: str) -> VolumeRow:
        """The account's volume ``name``. Raises 400 ``invalid_volume_name``, 404 ``volume_not_found`` (also for
        another account's)."""
        check_name(name)
        with self.plane.store.session() as s:
            row = s.scalars(select(VolumeRow).where(VolumeRow.account_id == account_id,
                                                    VolumeRow.name == name)).first()
        if row is None:
            raise ControlError("volume_not_found", f"no volume named {name!r}", 404)
        return row

    def users(self, volume_id: str) -> builtins.list[str]:
        """The sandboxes (not deleted) that mount volume ``volume_id``."""
        with self.plane.store.session() as s:
            q = (select(VolumeMountRow.sandbox_id).join(SandboxRow, SandboxRow.id == VolumeMountRow.sandbox_id)
                 .where(VolumeMountRow.volume_id == volume_id, SandboxRow.state != "deleted"))
            return sorted(set(s.scalars(q)))

    # ------------------------------------------------------------------ making and deleting

    def create(self, account_id: str, name: str, size_gib: int | None = None) -> VolumeRow:
        """Make volume ``name`` of ``account_id`` (its JuiceFS file system; ``size_gib`` caps it). Raises 400
        ``invalid_volume_name``/``invalid_volume_size``, 409 ``volume_exists``, 500 ``volume_create_failed``."""
        check_name(name)
        if size_gib is not None and (isinstance(size_gib, bool) or not isinstance(size_gib, int)
                                     or not 1 <= size_gib <= MAX_SIZE_GIB):
            raise ControlError("invalid_volume_size", f"a volume's size is 1 to {MAX_SIZE_GIB} GiB; got "
                               f"{str(size_gib)[:40]}", 400, field="size")
        with self.plane.store.session() as s:
            taken = s.scalars(select(VolumeRow.id).where(VolumeRow.account_id == account_id,
                                                         VolumeRow.name == name)).first()
        if taken is not None:
            raise ControlError("volume_exists", f"a volume named {name!r} exists already", 409, field="name")
        row = VolumeRow(id="vol_" + secrets.token_hex(6), account_id=account_id, name=name, size_gib=size_gib,
                        created_at=utcnow())
        try:
            with self.plane.store.session() as s, s.begin():
                s.add(row)
        except IntegrityError as e:  # the same name, made meanwhile by another request
            raise ControlError("volume_exists", f"a volume named {name!r} exists already", 409, field="name") from e
        try:
            juicefs.format_volume(self.plane.settings.volumes_dir, row.id, size_gib, self._s3())
        except StorageError as e:
            self._forget(row.id)
            raise ControlError("volume_create_failed", f"making volume {name!r}: {e}", 500) from e
        return row

    def delete(self, account_id: str, name: str) -> VolumeRow:
        """Delete the account's volume ``name`` and its data. Raises 404 ``volume_not_found``, 409
        ``volume_in_use`` (names the sandboxes that mount it; nothing changes)."""
        row = self.resolve(account_id, name)
        users = self.users(row.id)
        if users:
            shown = ", ".join(users[:5]) + (f" and {len(users) - 5} more" if len(users) > 5 else "")
            raise ControlError("volume_in_use", f"volume {name!r} is mounted by {shown}: delete those sandboxes "
                               "first", 409)
        self._forget(row.id)
        juicefs.destroy_volume(self.plane.settings.volumes_dir, row.id)
        return row

    def _forget(self, volume_id: str) -> None:
        with self.plane.store.session() as s, s.begin():
            live = s.get(VolumeRow, volume_id)
            if live is not None:
                s.delete(live)
            for m in s.scalars(select(VolumeMountRow).where(VolumeMountRow.volume_id == volume_id)):
                s.delete(m)

    def _s3(self) -> dict[str, str] | None:
        st = self.plane.settings
        if not st.s3_bucket:
            return None
        return {"endpoint": st.s3_endpoint, "bucket": st.s3_bucket, "access_key": st.s3_access_key,
                "secret_key": st.s3_secret_key}

    # ------------------------------------------------------------------ sandboxes' mounts

    def plan(self, account_id: str, requested: builtins.list[dict[str, Any]] | None
             ) -> builtins.list[tuple[VolumeRow, str, bool]]:
        """Check the volumes a new sandbox asks for (``[{"name", "path", "readOnly"}]``); returns ``(row, path,
        read_only)`` each. Raises 400 ``invalid_volume`` (malformed, too many, one path twice),
        ``invalid_volume_path`` (not absolute, ``..``, over ``/proc``, ``/sys``, ``/dev``, ``/run/sbx``...), the
        name's 400, 404 ``volume_not_found``."""
        out: builtins.list[tuple[VolumeRow, str, bool]] = []
        if not requested:
            return out
        if not isinstance(requested, list) or len(requested) > MAX_MOUNTS:
            raise ControlError("invalid_volume", f"a sandbox mounts at most {MAX_MOUNTS} volumes", 400,
                               field="volumes")
        seen: set[str] = set()
        for item in requested:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise ControlError("invalid_volume", "each volume is {\"name\", \"path\", \"readOnly\"}", 400,
                                   field="volumes")
            try:
                path = juicefs.check_path(item.get("path"))  # type: ignore[arg-type]
            except ValueError as e:
                raise ControlError("invalid_volume_path", f"{e}: {str(item.get('path'))[:200]!r}", 400,
                                   field="volumes") from e
            if any(path == p or path.startswith(p + "/") or p.startswith(path + "/") for p in seen):
                raise ControlError("invalid_volume", f"two volumes at or inside {path}", 400, field="volumes")
            seen.add(path)
            out.append((self.resolve(account_id, item["name"]), path, bool(item.get("readOnly"))))
        return out

    def record(self, sandbox_id: str, planned: builtins.list[tuple[VolumeRow, str, bool]]) -> None:
        """Keep ``planned`` (from :meth:`plan`) as sandbox ``sandbox_id``'s mounts."""
        if not planned:
            return
        with self.plane.store.session() as s, s.begin():
            for row, path, ro in planned:
                s.add(VolumeMountRow(sandbox_id=sandbox_id, path=path, volume_id=row.id, read_only=ro))

    def copy(self, source_id: str, sandbox_id: str) -> None:
        """Give sandbox ``sandbox_id`` (a fork) the mounts of ``source_id``."""
        with self.plane.store.session() as s, s.begin():
            for m in list(s.scalars(select(VolumeMountRow).where(VolumeMountRow.sandbox_id == source_id))):
                s.add(VolumeMountRow(sandbox_id=sandbox_id, path=m.path, volume_id=m.volume_id,
                                     read_only=m.read_only))

    def _mounts(self, sandbox_id: str) -> builtins.list[tuple[VolumeMountRow, VolumeRow]]:
        with self.plane.store.session() as s:
            q = (select(VolumeMountRow, VolumeRow).join(VolumeRow, VolumeRow.id == VolumeMountRow.volume_id)
                 .where(VolumeMountRow.sandbox_id == sandbox_id))
            return [(m, v) for m, v in s.execute(q).all()]

    def of_sandbox(self, sandbox_id: str) -> builtins.list[dict[str, Any]]:
        """The API shape of a sandbox's volumes: ``[{"name", "path", "readOnly"}]`` by path."""
        return [{"name": v.name, "path": m.path, "readOnly": bool(m.read_only)}
                for m, v in sorted(self._mounts(sandbox_id), key=lambda mv: mv[0].path)]

    def specs(self, sandbox_id: str) -> builtins.list[dict[str, Any]]:
        """What the node mounts for sandbox ``sandbox_id`` (:attr:`sbx.node.types.SandboxSpec.volumes`)."""
        vdir = self.plane.settings.volumes_dir
        return [{"id": v.id, "name": v.name, "path": m.path, "readOnly": bool(m.read_only),
                 "meta": juicefs.meta_url(vdir, v.id)}
                for m, v in sorted(self._mounts(sandbox_id), key=lambda mv: mv[0].path)]
