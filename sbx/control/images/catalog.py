"""The image catalog: which images exist, whose they are, where their files live.

An image has a ``name`` unique within its account (``python-data``: a lower-case letter or digit, then up to 62
of letters, digits, ``.``, ``_``, ``-``), an id (``img_`` + 12 characters), the node that built it, and its
**facts** (:class:`sbx.node.images.facts.ImageFacts`: content key, OS, init, shell, the Dockerfile's ``ENV``,
``WORKDIR`` and ``USER``). The admin may mark an image ``shared``: every account then sees it under its name
(an account's own image of the same name comes first).

A sandbox made from an image keeps the image's name, id and facts in its row (``sandboxes.image``), so it can be
resumed, forked and moved without asking the catalog again; the catalog refuses to delete an image while a sandbox
that is not deleted was made from it (409 ``image_in_use``).

The image files are made by the server's own node (``router.agent(None)``); with several nodes, a sandbox of an
image is placed on the node that holds it, as one made from a snapshot is. Building is slow (a minute for a
Dockerfile with ``apt-get install``): callers pass ``progress`` for one-line messages.

Errors are :class:`sbx.control.errors.ControlError`: 400 ``invalid_image_name``, 404 ``image_not_found``, 409
``image_exists``/``image_in_use``, and what the node's build says, as 400 (the input is wrong: ``bad_dockerfile``,
``copy_source_missing``, ``bad_archive``) or 422 (the input is well formed but the build failed:
``build_step_failed``, ``image_no_shell``, ``unsupported_image``, ``image_build_failed``).
"""

from __future__ import annotations

import datetime as dt
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import JSON, Boolean, DateTime, String, UniqueConstraint, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, mapped_column

from sbx.config import Settings
from sbx.control.errors import ControlError
from sbx.control.store.database import Base, SandboxRow, Store, iso, utcnow
from sbx.node.types import NodeAgent, NodeError

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
NAME_PATTERN = NAME_RE.pattern

#: How the node's image errors reach the user: 400 for input that is wrong, 422 for a build that failed.
BUILD_ERROR_STATUS = {
    "bad_dockerfile": 400,
    "copy_source_missing": 400,
    "bad_archive": 400,
    "build_step_failed": 422,
    "image_no_shell": 422,
    "unsupported_image": 422,
    "image_build_failed": 422,
}

Progress = Callable[[str], None]


class ImageRow(Base):
    """One image of account ``account_id``: ``key`` names its file on ``node`` (``<images_dir>/<key>.ext4``),
    ``facts`` is :meth:`sbx.node.images.facts.ImageFacts.to_json`."""

    __tablename__ = "images"
    __table_args__ = (UniqueConstraint("account_id", "name", name="uq_images_account_name"),)

    id: Mapped[str] = mapped_column(String(24), primary_key=True)
    account_id: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(64))
    shared: Mapped[bool] = mapped_column(Boolean, default=False)
    key: Mapped[str] = mapped_column(String(64))
    node: Mapped[str | None] = mapped_column(String(64), nullable=True)
    facts: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class NodeLookup(Protocol):
    """What the catalog asks of the plane's router (:class:`sbx.control.cluster.router.Router`)."""

    def agent(self, name: str | None) -> NodeAgent: ...

    def agents(self) -> dict[str, tuple[str, NodeAgent]]: ...


class ImagesPlane(Protocol):
    """What the catalog reads of the plane (:class:`sbx.control.service.ControlPlane`)."""

    settings: Settings
    store: Store

    @property
    def router(self) -> NodeLookup: ...


def check_name(name: str) -> None:
    """Raise 400 ``invalid_image_name`` unless ``name`` matches :data:`NAME_RE`."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ControlError("invalid_image_name", f"image names are a lower-case letter or digit, then up to 62 of "
                           f"a-z, 0-9, '.', '_', '-'; got {str(name)[:80]!r}", 400, field="name")


class Images:
    """The catalog (module docstring). Thread-safe: every call is one database session."""

    def __init__(self, plane: ImagesPlane):
        self.plane = plane

    # ------------------------------------------------------------------ reading

    def view(self, row: ImageRow, account_id: str | None = None) -> dict[str, Any]:
        """The API shape of an image: ``{"id", "name", "shared", "owned", "os", "init", "shell", "env",
        "workdir", "user", "sizeBytes", "source", "digest", "node", "createdAt"}`` (``owned``: it belongs to
        ``account_id``; ``digest``: ``sha256:`` + the content key)."""
        f = row.facts or {}
        return {
            "id": row.id,
            "name": row.name,
            "shared": bool(row.shared),
            "owned": account_id is None or row.account_id == account_id,
            "os": f.get("os_name") or f.get("os_id") or "",
            "init": f.get("init", "systemd"),
            "shell": f.get("shell", "/bin/sh"),
            "env": dict(f.get("env") or {}),
            "workdir": f.get("workdir"),
            "user": f.get("user"),
            "sizeBytes": int(f.get("size_bytes") or 0),
            "source": f.get("source", ""),
            "digest": f"sha256:{row.key}",
            "node": row.node,
            "createdAt": iso(row.created_at),
        }

    def list(self, account_id: str, admin: bool = False) -> list[ImageRow]:
        """The images ``account_id`` may use (its own and the shared ones; the admin: every image), by name."""
        with self.plane.store.session() as s:
            q = select(ImageRow)
            if not admin:
                q = q.where(or_(ImageRow.account_id == account_id, ImageRow.shared.is_(True)))
            rows = list(s.scalars(q))
        return sorted(rows, key=lambda r: (r.name, r.account_id != account_id))

    def resolve(self, account_id: str, name: str) -> ImageRow:
        """The image ``name`` as ``account_id`` sees it: its own first, then a shared one. Raises 404
        ``image_not_found`` (also for another account's unshared image) or 400 ``invalid_image_name``."""
        check_name(name)
        with self.plane.store.session() as s:
            rows = list(s.scalars(select(ImageRow).where(ImageRow.name == name)))
        for row in sorted(rows, key=lambda r: r.account_id != account_id):
            if row.account_id == account_id or row.shared:
                return row
        raise ControlError("image_not_found", f"no image named {name!r}", 404)

    def find(self, account_id: str, name: str) -> ImageRow | None:
        """:meth:`resolve` without the 404 (a bad name still raises 400)."""
        try:
            return self.resolve(account_id, name)
        except ControlError as e:
            if e.code == "image_not_found":
                return None
            raise

    def for_sandbox(self, row: ImageRow) -> dict[str, Any]:
        """What a sandbox row keeps of its image (``sandboxes.image``): the facts with ``name`` and ``id``."""
        return {**(row.facts or {}), "name": row.name, "id": row.id, "key": row.key}

    def bases(self, account_id: str) -> dict[str, str]:
        """``{name: content key}`` of the images a Dockerfile of ``account_id`` may name in ``FROM`` (the node
        finds the original image it kept of each key)."""
        out: dict[str, str] = {}
        for row in reversed(self.list(account_id)):  # the account's own last: it wins over a shared one
            out[row.name] = row.key
        return out

    # ------------------------------------------------------------------ making

    def check_new(self, account_id: str, name: str) -> None:
        """Raise 400 ``invalid_image_name`` or 409 ``image_exists`` before a build starts."""
        check_name(name)
        with self.plane.store.session() as s:
            taken = s.scalars(select(ImageRow.id).where(ImageRow.account_id == account_id,
                                                        ImageRow.name == name)).first()
        if taken is not None:
            raise ControlError("image_exists", f"an image named {name!r} exists already: delete it or pick "
                               "another name", 409, field="name")

    def build(self, account_id: str, name: str, dockerfile: Path, context: Path, progress: Progress | None = None,
              shared: bool = False) -> ImageRow:
        """Build image ``name`` for ``account_id`` from ``dockerfile`` with build context ``context`` on the
        server's node (:meth:`sbx.node.images.builds.ImagesMixin.build_image`; ``FROM`` may name the account's
        images). Returns its row. Raises the module's errors; nothing is recorded when the build fails."""
        self.check_new(account_id, name)
        node = self.plane.router.agent(None)
        try:
            facts = node.build_image(dockerfile, context, progress, bases=self.bases(account_id))
        except NodeError as e:
            raise _build_error(e) from e
        return self._add(account_id, name, facts, shared)

    def import_archive(self, account_id: str, name: str, archive: Path, progress: Progress | None = None,
                       shared: bool = False) -> ImageRow:
        """Import image ``name`` for ``account_id`` from ``archive`` (a ``docker save`` or OCI archive, or a flat
        root filesystem tar) on the server's node. Raises the module's errors; nothing is recorded on failure."""
        self.check_new(account_id, name)
        node = self.plane.router.agent(None)
        try:
            facts = node.import_image(archive, progress)
        except NodeError as e:
            raise _build_error(e) from e
        return self._add(account_id, name, facts, shared)

    def _add(self, account_id: str, name: str, facts: Any, shared: bool) -> ImageRow:
        data = facts.to_json() if hasattr(facts, "to_json") else dict(facts)
        row = ImageRow(id="img_" + secrets.token_hex(6), account_id=account_id, name=name, shared=shared,
                       key=str(data["key"]), node=self._local_name(), facts=data, created_at=utcnow())
        try:
            with self.plane.store.session() as s, s.begin():
                s.add(row)
        except IntegrityError as e:  # the same name, made meanwhile by another request
            raise ControlError("image_exists", f"an image named {name!r} exists already", 409, field="name") from e
        return row

    def _local_name(self) -> str | None:
        for name, (_url, agent) in self.plane.router.agents().items():
            if agent is self.plane.router.agent(None):
                return name
        return None

    # ------------------------------------------------------------------ deleting

    def delete(self, account_id: str, name: str, admin: bool = False) -> ImageRow:
        """Delete the account's image ``name`` (the admin may delete a shared one). Its file goes too unless
        another image row has the same content. Raises 404 ``image_not_found``, 409 ``image_in_use`` (names the
        sandboxes made from it that are not deleted; nothing changes)."""
        row = self.resolve(account_id, name)
        if row.account_id != account_id and not admin:
            raise ControlError("image_not_found", f"no image named {name!r} of this account", 404)
        with self.plane.store.session() as s:
            users = list(s.execute(select(SandboxRow.id, SandboxRow.state).where(SandboxRow.image_id == row.id,
                                                                                 SandboxRow.state != "deleted")))
            same = s.scalars(select(ImageRow.id).where(ImageRow.key == row.key, ImageRow.id != row.id)).first()
        if users:
            named = [f"{sid} (being deleted)" if state == "deleting" else sid for sid, state in users]
            shown = ", ".join(named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else "")
            then = ("wait for their deletion (sbx delete --wait)" if all(st == "deleting" for _, st in users)
                    else "delete those sandboxes first")
            raise ControlError("image_in_use", f"image {name!r} is in use by {shown}: {then}", 409)
        with self.plane.store.session() as s, s.begin():
            live = s.get(ImageRow, row.id)
            if live is not None:
                s.delete(live)
        if same is None:
            try:
                self.plane.router.agent(row.node).delete_image(row.key)
            except (NodeError, ControlError):
                pass  # the node cleans unused images of no row later; the name is free already
        return row


def _build_error(e: NodeError) -> ControlError:
    status = BUILD_ERROR_STATUS.get(e.code)
    if status is None:
        return ControlError(e.code if e.code.startswith("image") else "image_build_failed", e.message, 422)
    return ControlError(e.code, e.message, status)
