"""The image routes (issue 32, :mod:`sbx.control.images.catalog`)::

    POST   /v1/images/build?name=N[&dockerfile=P][&shared=true]   body: the build context as a tar    201 {"image"}
    POST   /v1/images/import?name=N[&shared=true]                 body: a docker/OCI archive or a     201 {"image"}
                                                                  flat rootfs tar
    GET    /v1/images                                             the account's and shared images     200 {"images"}
    GET    /v1/images/{name}                                      one                                 200 {"image"}
    DELETE /v1/images/{name}                                      delete (409 while sandboxes use it) 200 {"deleted"}

A build or import takes from seconds (cached) to minutes. With ``?stream=true`` (or ``Accept:
application/x-ndjson``) the answer is a
stream of JSON lines, ``{"progress": "STEP 2/5: RUN apt-get ..."}`` as the build goes, then one
``{"image": {...}}`` or ``{"error": {"code", "message"}}`` (the status is 200 once the stream has begun; errors
found before it begins, such as a bad name or a name clash, keep their own status). Without it, the call answers
when the image is ready, 201, or with the error's status.

Uploads are capped at :data:`MAX_UPLOAD_BYTES` (413 ``body_too_large``). A build context is a tar (``tar -C DIR -c
.``) of files, folders and relative symlinks that stay inside it (nothing else is unpacked); ``dockerfile``
is the Dockerfile's path inside it (default ``Dockerfile``). Only the admin may make an image ``shared``.

Errors: 400 ``invalid_image_name``, ``bad_context``, ``dockerfile_missing``, ``bad_dockerfile``,
``copy_source_missing``, ``bad_archive``; 403 ``admin_only``; 404 ``image_not_found``; 409 ``image_exists``,
``image_in_use``; 413 ``body_too_large``; 422 ``build_step_failed``, ``image_no_shell``, ``unsupported_image``,
``image_build_failed``. A failed build or import leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse, StreamingResponse

from sbx.api import schemas as S
from sbx.api.auth import principal
from sbx.control.accounts.keys import Principal
from sbx.control.errors import ControlError
from sbx.control.images.catalog import NAME_PATTERN, ImageRow
from sbx.control.service import ControlPlane
from sbx.node.images.contexttar import BadContext, unpack_context
from sbx.node.images.progress import ndjson_progress

#: Largest build context or archive an upload may be (bytes).
MAX_UPLOAD_BYTES = 16 << 30

Name = Annotated[str, PathParam(min_length=1, max_length=63, pattern=NAME_PATTERN,
                                description="image name: a lower-case letter or digit, then up to 62 of a-z, 0-9, "
                                "'.', '_', '-'")]
NameQ = Annotated[str, Query(min_length=1, max_length=63, pattern=NAME_PATTERN, description="the new image's name")]
SharedQ = Annotated[bool, Query(description="visible to every account (admin only)")]
DockerfileQ = Annotated[str, Query(min_length=1, max_length=255, description="the Dockerfile's path inside the "
                                   "build context")]
StreamQ = Annotated[bool, Query(description="answer with NDJSON progress lines (as `Accept: application/x-ndjson`)")]

_NDJSON = "application/x-ndjson"
_BUILD_RESPONSES = {**S.errors(400, 403, 409, 413, 422), 200: {"description": "with `Accept: application/x-ndjson`: "
                    "progress lines, then the image or an error", "content": {_NDJSON: {}}}}


def register(v1: APIRouter, cp: ControlPlane) -> None:
    """Add the image routes to ``v1`` (the authenticated ``/v1`` router)."""
    Who = Depends(principal)
    images = cp.images

    def view(row: ImageRow, who: Principal) -> dict[str, Any]:
        return images.view(row, who.account_id)

    @v1.post("/images/build", status_code=201, tags=["images"], response_model=S.ImageOut,
             responses=_BUILD_RESPONSES, openapi_extra=_body("application/octet-stream", "the build context as a tar"))
    async def build_image(request: Request, name: NameQ, dockerfile: DockerfileQ = "Dockerfile",
                          shared: SharedQ = False, stream: StreamQ = False, who: Principal = Who) -> Any:
        """Build image ``name`` from the Dockerfile at ``dockerfile`` in the build context the body holds (a tar).
        ``FROM`` may name one of the account's images, ``oci-archive:`` or ``docker-archive:`` paths on the
        server. RUN steps run as a sandbox's code would: shifted uids, the sandbox network's egress rules."""
        _check_shared(shared, who)
        images.check_new(who.account_id, name)
        work = _upload_dir(cp)
        try:
            await _receive(request, work / "context.tar")
            context = work / "context"
            _unpack_context(work / "context.tar", context)
            (work / "context.tar").unlink()
            df = _inside(context, dockerfile)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        return _answer(stream, request, work, lambda say: images.build(who.account_id, name, df, context, say, shared),
                       lambda row: view(row, who))

    @v1.post("/images/import", status_code=201, tags=["images"], response_model=S.ImageOut,
             responses=_BUILD_RESPONSES, openapi_extra=_body("application/octet-stream", "a docker save or OCI "
                                                             "archive, or a flat root filesystem tar"))
    async def import_image(request: Request, name: NameQ, shared: SharedQ = False, stream: StreamQ = False,
                           who: Principal = Who) -> Any:
        """Import image ``name`` from the body: a ``docker save`` archive, an OCI image archive (an OCI layout
        as a tar) or a flat root filesystem tar (``docker export``)."""
        _check_shared(shared, who)
        images.check_new(who.account_id, name)
        work = _upload_dir(cp)
        try:
            await _receive(request, work / "archive.tar")
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        return _answer(stream, request, work,
                       lambda say: images.import_archive(who.account_id, name, work / "archive.tar", say, shared),
                       lambda row: view(row, who))

    @v1.get("/images", tags=["images"], response_model=S.ImageList, responses=S.errors())
    def list_images(who: Principal = Who) -> dict[str, Any]:
        """The images the key's account may start sandboxes from: its own and the shared ones (the admin: all)."""
        return {"images": [view(r, who) for r in images.list(who.account_id, who.admin)]}

    @v1.get("/images/{name}", tags=["images"], response_model=S.ImageOut, responses=S.errors(400, 404))
    def get_image(name: Name, who: Principal = Who) -> dict[str, Any]:
        """One image by name (the account's own first, then a shared one)."""
        return {"image": view(images.resolve(who.account_id, name), who)}

    @v1.delete("/images/{name}", tags=["images"], response_model=S.Deleted, responses=S.errors(400, 404, 409))
    def delete_image(name: Name, who: Principal = Who) -> dict[str, Any]:
        """Delete one of the account's images (the admin: a shared one too). 409 ``image_in_use`` while a sandbox
        made from it is not deleted; nothing changes then."""
        images.delete(who.account_id, name, admin=who.admin)
        return {"deleted": name}


def _body(media: str, what: str) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of an upload route: required, raw bytes of ``media``."""
    return {"requestBody": {"required": True, "description": what,
                            "content": {media: {"schema": {"type": "string", "format": "binary"}}}}}


def _check_shared(shared: bool, who: Principal) -> None:
    if shared and not who.admin:
        raise ControlError("admin_only", "only the admin key may make a shared image", 403, field="shared")


def _upload_dir(cp: ControlPlane) -> Path:
    """A new folder for one upload: ``<images_dir>/.uploads/upload-<pid>-<node name>-<random>`` (servers of
    several nodes share the images folder; each one's uploads carry its process id and node name)."""
    return Path(tempfile.mkdtemp(prefix=f"upload-{os.getpid()}-{cp.settings.node_name}-", dir=_uploads(cp)))


def _uploads(cp: ControlPlane) -> Path:
    """``<images_dir>/.uploads`` (made ``0700``), after removing uploads whose server process died (a server
    killed mid-build leaves its upload there; each one's folder starts with its process id)."""
    d = cp.settings.images_dir / ".uploads"
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    for stale in d.iterdir():
        pid = stale.name.split("-")[1] if stale.name.count("-") >= 2 else ""
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)
    return d


async def _receive(request: Request, dest: Path) -> None:
    """Write the request body to ``dest``; 413 ``body_too_large`` past :data:`MAX_UPLOAD_BYTES`."""
    seen = 0
    with open(dest, "wb") as f:
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > MAX_UPLOAD_BYTES:
                raise ControlError("body_too_large", f"an image upload is at most {MAX_UPLOAD_BYTES >> 30} GiB",
                                   413)
            f.write(chunk)
    if seen == 0:
        raise ControlError("bad_context" if dest.name == "context.tar" else "bad_archive",
                           "the request body is empty: send the build context as a tar, or the archive", 400)


def _unpack_context(tar_path: Path, dest: Path) -> None:
    """Unpack the build context (:func:`sbx.node.images.contexttar.unpack_context`). Raises 400 ``bad_context``."""
    try:
        unpack_context(tar_path, dest)
    except BadContext as e:
        raise ControlError("bad_context", f"the build context is not usable: {e}", 400) from e


def _inside(context: Path, rel: str) -> Path:
    """The Dockerfile ``rel`` inside ``context``; 400 ``dockerfile_missing`` when it is not a file there."""
    p = (context / rel).resolve()
    if not p.is_relative_to(context.resolve()) or not p.is_file():
        raise ControlError("dockerfile_missing", f"no Dockerfile at {rel!r} in the build context", 400,
                           field="dockerfile")
    return p


def _answer(stream: bool, request: Request, work: Path, run: Callable[[Callable[[str], None]], ImageRow],
            show: Callable[[ImageRow], dict[str, Any]]) -> Any:
    """Run ``run(progress)`` (a build or import) and answer: as an NDJSON stream when the client asked for one,
    else 201 with the image once it is ready. ``work`` (the upload) is removed either way."""
    if not stream and _NDJSON not in request.headers.get("accept", ""):
        try:
            row = run(lambda _msg: None)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return JSONResponse({"image": show(row)}, status_code=201)
    return StreamingResponse(_stream(work, run, show), media_type=_NDJSON)


def _stream(work: Path, run: Callable[[Callable[[str], None]], ImageRow],
            show: Callable[[ImageRow], dict[str, Any]]) -> Iterator[bytes]:
    def failed(e: Exception) -> dict[str, Any]:
        if isinstance(e, ControlError):
            return {"error": {"code": e.code, "message": e.message}}
        return {"error": {"code": "image_build_failed", "message": f"{type(e).__name__}: {e}"}}

    return ndjson_progress(work, run, lambda row: {"image": show(row)}, failed)


__all__ = ["MAX_UPLOAD_BYTES", "register"]
