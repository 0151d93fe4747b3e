"""The error every image operation raises: :class:`ImageError`, a :class:`sbx.node.types.NodeError` with a stable
code."""

from __future__ import annotations

from sbx.node.types import NodeError

#: The stable codes of :class:`ImageError` and what each means.
CODES = {
    "bad_dockerfile": "the Dockerfile does not parse (syntax, unknown instruction, no FROM)",
    "build_step_failed": "a step of the build failed (the message names it and ends with its last output lines)",
    "copy_source_missing": "a COPY or ADD source is not in the build context",
    "bad_archive": "the archive is corrupt or of no known kind",
    "image_no_shell": "the image has no /bin/sh",
    "unsupported_image": "the image cannot become a sandbox image (e.g. another architecture)",
    "image_build_failed": "anything else went wrong while building or importing",
    "image_not_found": "no image with that key on this node",
    "image_in_use": "a running node holds the image",
}


class ImageError(NodeError):
    """An image build, import or deletion failed: ``code`` is one of :data:`CODES`, ``message`` says why in one
    or a few lines a user can act on."""

    def __init__(self, code: str, message: str):
        if code not in CODES:
            raise ValueError(f"unknown image error code {code!r}")
        super().__init__(code, message)
