"""sbx.storage: the block copy-on-write disk layer (lowest layer; imports only ``sbx.config``).

- :mod:`sbx.storage.volume`: the reflink XFS data volume (``ensure_volume``, ``volume_status``).
- :mod:`sbx.storage.reflink`: constant-time reflink copies (``clone``), never a silent full copy.
- :mod:`sbx.storage.disk`: sparse ext4 disk images: create, grow, loop mount, freeze, fork, seal chains.
- :mod:`sbx.storage.delta`: incremental checkpoint export/import between volumes.
- :mod:`sbx.storage.space`: allocated / unique bytes of disks and seals (FIEMAP).
- :mod:`sbx.storage.fiemap`, :mod:`sbx.storage.mounts`: extent maps, mount table and loop devices.

Every failure the layer understands is a :class:`StorageError` with a stable ``code``.
"""

from sbx.storage.errors import StorageError

__all__ = ["StorageError"]
