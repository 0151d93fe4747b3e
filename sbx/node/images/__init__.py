"""Images from a Dockerfile or an OCI image (issue 32): the node-side image library.

What lives here, one module per mechanism:

- ``facts.py``: :class:`~sbx.node.images.facts.ImageFacts`, what the node knows of a built image (its key, OS,
  init, shell, the image config's env, workdir and user, the accounts, sizes, source, build time), read from the
  final root filesystem and the OCI image config (pure parsing, no I/O beyond reading files).
- ``errors.py``: :class:`~sbx.node.images.errors.ImageError` and its stable codes (re-exported by ``store``).
- ``sources.py``: what an archive is (docker-archive, OCI archive, OCI layout, flat rootfs tar), detected by its
  content, copied with skopeo into an OCI layout and unpacked with umoci.
- ``dockerfile.py``: reading a Dockerfile (instructions, ``FROM`` rewriting for named bases) and the build's input
  hash; ``buildah.py``: ``buildah bud`` in a fresh store under a shifted uid map, its output and its failures.
- ``layer.py``: the sbx layer every image gets (systemd and the guest files for Debian-family images, the minimal
  init otherwise), run on the unpacked rootfs inside a user namespace on the image's shifted range
  (``guestrun.py``), never as host root.
- ``store.py``: the public library: :func:`~sbx.node.images.store.import_archive`,
  :func:`~sbx.node.images.store.build_dockerfile`, the image files (``<key>.ext4``, ``<key>.json``,
  ``<key>.oci.tar``), loading and deleting.
- ``buildnet.py``: a network namespace on the node's bridge for a build's RUN steps (a sandbox's egress policy).
- ``builds.py``: :class:`~sbx.node.images.builds.ImagesMixin`, the node's image operations (a build's lease and uid
  range reserved, the build run, both released).

Imports: :mod:`sbx.config`, :mod:`sbx.guest`, :mod:`sbx.storage`, :mod:`sbx.node.types`, :mod:`sbx.node.host`,
:mod:`sbx.node.network`, :mod:`sbx.node.container` and :mod:`sbx.node.agentbase` (the mixin's base, and the build
records it counts leases and uid ranges from). Never :mod:`sbx.node.lifecycle`, ``exec``, ``memory``, ``migration``,
nor :mod:`sbx.control` or :mod:`sbx.api`: in the node's layers (``pyproject.toml``) this room sits between the
mixins and ``agentbase``, so the lifecycle may read an image's facts.
"""
