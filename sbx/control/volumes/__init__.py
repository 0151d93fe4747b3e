"""Persistent volumes (issue 34): JuiceFS file systems an account's sandboxes mount, which outlive them.

- ``catalog``: :class:`~sbx.control.volumes.catalog.Volumes`, the ``volumes`` table (names per account) and
  ``volume_mounts`` (which sandbox mounts which volume where), making and destroying a volume's file system
  (:mod:`sbx.storage.juicefs`), and what a sandbox's spec tells its node to mount.

The node mounts them (:mod:`sbx.node.volumes`). May import :mod:`sbx.control.store`, :mod:`sbx.control.errors`,
:mod:`sbx.node` types and :mod:`sbx.storage`; not any room above.
"""
