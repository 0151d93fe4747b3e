"""SDK calls for images (``sbx image ...``), sans-IO like :mod:`sbx.sdk.protocol`: drive them with
``Client.run`` / ``AsyncClient.run``.

>>> from sbx.sdk import Client, images
>>> with Client() as c:
...     img = c.run(images.build_image("tools", images.tar_folder("./ctx"), on_progress=print))
...     sb = c.run(protocol.create(image="tools"))
"""

from __future__ import annotations

import os
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from sbx.sdk.errors import SbxError
from sbx.sdk.protocol import Call, Request

#: Seconds a build may run before the SDK gives up reading its answer (none: builds take minutes).
BUILD_TIMEOUT: float | None = None

Progress = Callable[[str], None]


def tar_folder(folder: str | os.PathLike[str], extra: dict[str, str | os.PathLike[str]] | None = None
               ) -> IO[bytes]:
    """The folder ``folder`` as an uncompressed tar (paths relative to it), plus each file of ``extra``
    (``{name in the tar: path}``, e.g. a Dockerfile kept elsewhere as ``.sbx-Dockerfile``), in a temporary file
    rewound to its start: a build context for :func:`build_image`. Raises ``SbxError("bad_context")`` if it is
    not a folder."""
    root = Path(folder)
    if not root.is_dir():
        raise SbxError("bad_context", f"{folder} is not a folder")
    f = tempfile.TemporaryFile()
    with tarfile.open(fileobj=f, mode="w") as tf:
        for entry in sorted(root.iterdir()):
            tf.add(entry, arcname=entry.name)
        for name, path in (extra or {}).items():
            tf.add(path, arcname=name)
    f.seek(0)
    return f


def _chunks(body: bytes | IO[bytes]) -> bytes | Iterator[bytes]:
    if isinstance(body, bytes | bytearray):
        return bytes(body)

    def gen() -> Iterator[bytes]:
        while True:
            chunk = body.read(1 << 20)
            if not chunk:
                return
            yield chunk

    return gen()


def _upload(path: str, params: dict[str, Any], body: bytes | IO[bytes], on_progress: Progress | None) -> Call:
    final: dict[str, Any] = {}

    def on_line(obj: dict[str, Any]) -> bool:
        if "progress" in obj:
            if on_progress is not None:
                on_progress(str(obj["progress"]))
            return False
        final.update(obj)
        return True

    yield Request("POST", path, params={**params, "stream": "true"}, content=_chunks(body), stream=True,
                  on_line=on_line, timeout=BUILD_TIMEOUT)
    if "error" in final:
        err = final["error"]
        raise SbxError(str(err.get("code", "image_build_failed")), str(err.get("message", "")), 422)
    if "image" not in final:
        raise SbxError("bad_response", "the server ended the build's answer without a result")
    return dict(final["image"])


def build_image(name: str, context: bytes | IO[bytes], dockerfile: str = "Dockerfile", shared: bool = False,
                on_progress: Progress | None = None) -> Call:
    """``POST /v1/images/build``: build image ``name`` from ``context`` (a tar of the build context:
    :func:`tar_folder`) with the Dockerfile at ``dockerfile`` inside it; ``on_progress`` gets each progress line
    (``STEP 2/5: RUN ...``). Returns the image dict. Raises :class:`SbxError` with the server's code
    (``image_exists``, ``bad_dockerfile``, ``build_step_failed``...)."""
    params: dict[str, Any] = {"name": name, "dockerfile": dockerfile}
    if shared:
        params["shared"] = "true"
    return _upload("/v1/images/build", params, context, on_progress)


def import_image(name: str, archive: bytes | IO[bytes], shared: bool = False,
                 on_progress: Progress | None = None) -> Call:
    """``POST /v1/images/import``: image ``name`` from ``archive`` (``docker save``, an OCI archive, or a flat
    rootfs tar). Returns the image dict. Raises :class:`SbxError` (``bad_archive``, ``image_no_shell``...)."""
    params: dict[str, Any] = {"name": name}
    if shared:
        params["shared"] = "true"
    return _upload("/v1/images/import", params, archive, on_progress)


def images() -> Call:
    """``GET /v1/images``; returns the image dicts by name."""
    resp = yield Request("GET", "/v1/images")
    return list(resp.body["images"])


def image(name: str) -> Call:
    """``GET /v1/images/{name}``; returns the image dict. Raises ``SbxError("image_not_found")``."""
    resp = yield Request("GET", f"/v1/images/{name}")
    return dict(resp.body["image"])


def delete_image(name: str) -> Call:
    """``DELETE /v1/images/{name}``. Raises ``SbxError("image_in_use")`` while sandboxes use it."""
    yield Request("DELETE", f"/v1/images/{name}")
    return None


__all__ = ["build_image", "delete_image", "image", "images", "import_image", "tar_folder"]
