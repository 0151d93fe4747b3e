"""The node agent for this machine: sandboxes as runc containers on reflink-cloned ext4 disks.

:class:`LocalNode` implements :class:`sbx.node.types.NodeAgent`. Where things live (``settings`` from
:mod:`sbx.config`):

- ``<node_dir>/sandboxes/<id>/disk.ext4``: the sandbox's root disk (sparse ext4 on the reflink XFS volume);
- ``<node_dir>/sandboxes/<id>/memory/``: the CRIU image of a stop that kept memory, with ``host.json`` (the host
  fingerprint) written last, so an image without it is incomplete and never restored;
- ``<node_dir>/sandboxes/<id>/seals/``: sealed disk checkpoints (one per stop), for incremental export;
- ``<node_dir>/sandboxes/<id>/node.json``: the node's record (spec, lease, phase) written before and after every
  side effect, so :meth:`LocalNode.reconcile` can put a sandbox back in a consistent state after a crash;
- ``<node_dir>/snapshots/<name>.ext4`` (+ ``.json``): named snapshots;
- ``/run/sbx/<node>/``: runc's state root and the OCI bundles: ``config.json``, the disk's plain mount
  ``bundles/<id>/disk`` (the host's view, where every host-side write goes) and its idmapped view
  ``bundles/<id>/rootfs`` (the container's root: owners shifted into the sandbox's own host uid range).

uid/gid map (issue 17): each sandbox maps its uids/gids 0..65535 to a host range of its own (``uidBase`` in
``node.json``; :mod:`sbx.node.container.rootfs`). Records made before shifted maps have no ``uidBase``: they keep the
identity map while their memory image is restored and get a range of their own at their next cold boot.

Memory: a stop checkpoints with CRIU (runc ``checkpoint``), a resume restores (runc ``restore``). A memory image
is used once: after a restore or any cold boot it is deleted, because the disk moves on from the state it matches.

The agent is split by mechanism; :class:`LocalNode` combines the parts:

- :mod:`sbx.node.agentbase`: node state, paths, the record ``node.json``, helpers the parts share;
- :mod:`sbx.node.lifecycle.containers`: create, bundle, identity, cold boot, delete;
- :mod:`sbx.node.memory.stopresume`: stop (checkpoint or halt), resume, memory restore;
- :mod:`sbx.node.exec.jobs`: attached execs, detached jobs, spawned processes;
- :mod:`sbx.node.lifecycle.snapshots`: fork and named snapshots;
- :mod:`sbx.node.memory.memcopy`: a new sandbox from another's memory (fork with memory, templates), new identity;
- :mod:`sbx.node.memory.templates`: memory templates of the base image, per size;
- :mod:`sbx.node.memory.warmpool`: warm sandboxes, restored from their template before a create asks;
- :mod:`sbx.node.lifecycle.stats`: status and resource samples;
- :mod:`sbx.node.lifecycle.watching`: the watcher of sandboxes that ended on their own;
- :mod:`sbx.node.lifecycle.reconcile`: reconcile after a crash, server shutdown, leftovers;
- :mod:`sbx.node.lifecycle.egressnode`: which sandboxes go through the egress proxy, their CA and environment;
- :mod:`sbx.node.migration.outgoing` and :mod:`sbx.node.migration.incoming`: live migration to and from another node;
- :mod:`sbx.node.migration.transfer`: a stopped sandbox's export to another node and its import there;
- :mod:`sbx.node.migration.replicas`: seal replicas, copies of other nodes' stopped sandboxes kept here until needed.

The mixins' rooms don't import each other (:mod:`sbx.node` has the map of the rooms).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sbx.node.exec.jobs import ExecMixin
from sbx.node.images import defaultbase, refs
from sbx.node.images.builds import ImagesMixin
from sbx.node.images.facts import ImageFacts
from sbx.node.lifecycle.containers import LifecycleMixin
from sbx.node.lifecycle.egressnode import EgressMixin
from sbx.node.lifecycle.reconcile import ReconcileMixin
from sbx.node.lifecycle.snapshots import SnapshotMixin
from sbx.node.lifecycle.stats import StatsMixin
from sbx.node.lifecycle.watching import WatchMixin
from sbx.node.memory.memcopy import MemoryCopyMixin
from sbx.node.memory.stopresume import StopResumeMixin
from sbx.node.memory.templates import TemplateMixin
from sbx.node.memory.warmpool import WarmPoolMixin
from sbx.node.migration.outgoing import MigrationMixin
from sbx.node.migration.replicas import ReplicaMixin
from sbx.node.types import NodeError


class LocalNode(
    LifecycleMixin,
    TemplateMixin,
    WarmPoolMixin,
    MemoryCopyMixin,
    StopResumeMixin,
    ExecMixin,
    SnapshotMixin,
    StatsMixin,
    WatchMixin,
    ReconcileMixin,
    MigrationMixin,
    ReplicaMixin,
    EgressMixin,
    ImagesMixin,
):
    """Sandboxes on this host (runc + CRIU + reflink disks). Thread-safe: each sandbox has its own lock, and
    operations on different sandboxes run in parallel."""

    def build_image(self, dockerfile: Path, context: Path, progress: Any = None,  # type: ignore[override]
                    bases: dict[str, str] | None = None) -> ImageFacts:
        """:meth:`sbx.node.images.builds.ImagesMixin.build_image` with ``bases`` given as ``{name: image key}``
        (what the control plane knows, :meth:`sbx.node.types.NodeAgent.build_image`): each becomes the original
        image this node kept of that key; a key whose original is gone is left out (its ``FROM`` then fails).
        ``FROM sbx-debian`` is sbx's default image (:mod:`sbx.node.images.defaultbase`)."""
        paths: dict[str, Path] = {}
        try:
            text = dockerfile.read_text(errors="replace")
        except OSError:
            text = ""
        if defaultbase.wanted(text):
            paths[defaultbase.NAME] = defaultbase.default_base_archive(self.settings, self.image)
        for name, key in (bases or {}).items():
            try:
                paths[name] = self.base_archive(key)
            except NodeError:
                continue
        facts = super().build_image(dockerfile, context, progress, bases=paths)
        refs.add_ref(self.settings, facts.key, self.settings.node_name)
        return facts

    def import_image(self, archive: Path, progress: Any = None) -> ImageFacts:  # type: ignore[override]
        """:meth:`sbx.node.images.builds.ImagesMixin.import_image`, marking the image as kept by this node
        (:mod:`sbx.node.images.refs`)."""
        facts = super().import_image(archive, progress)
        refs.add_ref(self.settings, facts.key, self.settings.node_name)
        return facts

    def delete_image(self, key: str) -> None:
        """:meth:`sbx.node.images.builds.ImagesMixin.delete_image`, with the image's memory templates, once no
        other node on this host keeps the same image (:mod:`sbx.node.images.refs`); an image that is not here is
        nothing to do."""
        from sbx.runtime.runc import remove_tree

        try:
            last = refs.drop_ref(self.settings, key, self.settings.node_name)
        except ValueError as e:
            raise NodeError("image_not_found", str(e)) from e
        if not last:
            return
        for d in self.templates_dir.glob(f"{key}-*"):
            remove_tree(d)
        try:
            super().delete_image(key)
        except NodeError as e:
            if e.code != "image_not_found":
                raise
