"""The one exception the storage layer raises for failures it understands."""

from __future__ import annotations


class StorageError(Exception):
    """A storage operation failed in a way the caller can report.

    ``code`` is stable and machine-readable; ``message`` is for people. Codes used by ``sbx.storage``:

    - ``no_reflink``: the filesystem (or the pair of paths) cannot share blocks; nothing was copied.
    - ``invalid_resize``: a disk was asked to shrink, or to a size that is not a whole positive MiB count.
    - ``not_found``: a path, seal or manifest does not exist.
    - ``exists``: the destination of a clone, seal or import already exists.
    - ``busy``: the disk or mount point is in use (mounted elsewhere, something else mounted there).
    - ``not_mounted``: the path is not a mount point.
    - ``bad_image``: the file holds no usable ext4 filesystem.
    - ``bad_delta``: a delta file is truncated, corrupt, of an unknown version, or made for another parent.
    - ``volume_failed``: the reflink volume could not be made or mounted.
    - ``command_failed``: an external tool (mount, losetup, e2fsck, ...) failed; the message holds its stderr.
    """

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
