"""The node's image operations: :class:`ImagesMixin`, a mixin of :class:`sbx.node.agent.LocalNode`.

A build reserves what a sandbox would hold (a host uid range and an address on the node's bridge:
:func:`sbx.node.images.reserve.claim`), runs :func:`sbx.node.images.store.build_dockerfile` with its RUN steps in a
network namespace on the bridge (:func:`sbx.node.images.buildnet.build_network`, made only when a step needs it) and
shifted into that range, and releases both however it ends. An import does the same for the sbx layer's package
installs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from sbx.node.agentbase import NodeBase
from sbx.node.images import store
from sbx.node.images.buildnet import build_network
from sbx.node.images.facts import ImageFacts
from sbx.node.images.reserve import Claim, claim
from sbx.node.network import bridge

Progress = Callable[[str], None]


class ImagesMixin(NodeBase):
    """Images on this node: build, import, facts, delete (module docstring)."""

    def build_image(self, dockerfile: Path, context: Path, progress: Progress | None = None,
                    bases: dict[str, Path] | None = None) -> ImageFacts:
        """Build ``dockerfile`` with the build context folder ``context`` into a sandbox image
        (:func:`sbx.node.images.store.build_dockerfile`); ``bases`` maps names a ``FROM`` may use to archives
        (:meth:`base_archive` of images built before). ``progress`` gets buildah's output lines. Returns the image's
        facts (at once for inputs built before). Raises :class:`sbx.node.images.errors.ImageError`."""
        with self._build_claim() as c:
            return store.build_dockerfile(self.settings, dockerfile, context, progress, network=self._build_net(c),
                                          uid_base=c.uid_base, bases=bases)

    def import_image(self, archive: Path | str, progress: Progress | None = None) -> ImageFacts:
        """Make a sandbox image of ``archive`` (docker-archive, OCI archive or layout, flat rootfs tar:
        :func:`sbx.node.images.store.import_archive`). Returns its facts. Raises
        :class:`sbx.node.images.errors.ImageError`."""
        with self._build_claim() as c:
            return store.import_archive(self.settings, archive, progress, network=self._build_net(c),
                                        uid_base=c.uid_base)

    def delete_image(self, key: str) -> None:
        """Remove image ``key`` from this node. Raises ``ImageError("image_in_use")`` while a running node holds it,
        ``ImageError("image_not_found")`` when there is none."""
        if self._image is not None and self._image.name == f"{key}.ext4":
            raise store.ImageError("image_in_use", f"image {key} is this node's base image")
        store.delete_image(self.settings, key)

    def image_facts(self, key: str) -> ImageFacts:
        """The facts of image ``key``. Raises ``ImageError("image_not_found")``."""
        return store.load_facts(self.settings, key)

    def base_archive(self, key: str) -> Path:
        """Image ``key``'s source as an OCI archive, for a later build's ``bases``. Raises
        ``ImageError("image_not_found")``."""
        return store.base_archive(self.settings, key)

    def _build_claim(self) -> AbstractContextManager[Claim]:
        with self._lease_lock:  # two claims (or a claim and a create) must not pick the same address
            return _held(claim(self.settings, self._new_lease))

    def _build_net(self, c: Claim) -> AbstractContextManager[str]:
        assert c.lease is not None
        lease = bridge.Lease(c.lease["address"], c.lease["gateway"], c.lease["host_veth"])
        return build_network(lease, self.settings.bridge, self.settings.node_name)


class _held(AbstractContextManager[Claim]):
    """A claim entered at once (under the caller's lock) and left when the ``with`` block ends."""

    def __init__(self, cm: AbstractContextManager[Claim]):
        self._cm = cm
        self._value = cm.__enter__()

    def __enter__(self) -> Claim:
        return self._value

    def __exit__(self, *exc: object) -> None:
        self._cm.__exit__(None, None, None)
