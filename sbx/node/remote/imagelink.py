"""Images built on a node that the server reaches over the network: the node's routes and the client's calls.

A server whose configured node is another machine (``SBX_NODE_URL``) sends the build there (the node holds the image
files, :mod:`sbx.node.images`). Routes, under the node token like every node route:

- ``POST /v1/node/images/build?dockerfile=REL&bases=JSON``: body: the build context as a tar
  (:func:`sbx.node.images.contexttar.pack_context`); ``bases`` is ``{name: image key}``;
- ``POST /v1/node/images/import``: body: the archive.

Both answer NDJSON: ``{"progress": "..."}`` lines as the build goes, then ``{"result": <ImageFacts as JSON>}`` or
``{"error": {"code", "message"}}``. A body that is not a usable tar is ``{"error": {"code": "bad_context"}}`` (400
before the stream). Deleting an image is the plain call ``delete_image`` (:data:`sbx.node.remote.wire.CALLS`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from sbx.node.images.contexttar import BadContext, pack_context, unpack_context
from sbx.node.images.progress import ndjson_progress
from sbx.node.types import NodeError

Progress = Callable[[str], None]


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def image_routes(app: FastAPI, node: Any) -> None:
    """Add the two image routes for ``node`` (a :class:`sbx.node.agent.LocalNode`) to the node's ``app``."""

    def workdir() -> Path:
        base = Path(node.settings.images_dir) / ".uploads"
        base.mkdir(parents=True, exist_ok=True)
        base.chmod(0o700)
        for stale in base.glob("node-upload-*"):  # of a node process that died mid-build
            pid = stale.name.split("-")[2]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                shutil.rmtree(stale, ignore_errors=True)
        return Path(tempfile.mkdtemp(prefix=f"node-upload-{os.getpid()}-", dir=base))

    async def receive(request: Request, dest: Path) -> None:
        with open(dest, "wb") as f:
            async for chunk in request.stream():
                f.write(chunk)

    @app.post("/v1/node/images/build")
    async def build(request: Request, dockerfile: str = "Dockerfile", bases: str = "{}") -> Any:
        work = workdir()
        try:
            await receive(request, work / "context.tar")
            unpack_context(work / "context.tar", work / "context")
            df = (work / "context" / dockerfile).resolve()
            if not df.is_relative_to((work / "context").resolve()) or not df.is_file():
                raise BadContext(f"no Dockerfile at {dockerfile!r} in the context")
            named = {str(k): str(v) for k, v in json.loads(bases).items()}
        except (BadContext, ValueError, AttributeError) as e:
            shutil.rmtree(work, ignore_errors=True)
            return _error(400, "bad_context", str(e))
        return StreamingResponse(_run(work, lambda say: node.build_image(df, work / "context", say, bases=named)),
                                 media_type="application/x-ndjson")

    @app.post("/v1/node/images/import")
    async def import_(request: Request) -> Any:
        work = workdir()
        await receive(request, work / "archive.tar")
        return StreamingResponse(_run(work, lambda say: node.import_image(work / "archive.tar", say)),
                                 media_type="application/x-ndjson")


def _run(work: Path, run: Callable[[Progress], Any]) -> Iterator[bytes]:
    def failed(e: Exception) -> dict[str, Any]:
        if isinstance(e, NodeError):
            return {"error": {"code": e.code, "message": e.message}}
        return {"error": {"code": "image_build_failed", "message": f"{type(e).__name__}: {e}"}}

    return ndjson_progress(work, run, lambda facts: {"result": facts.to_json() if hasattr(facts, "to_json")
                                                     else dict(facts)}, failed)


def _chunks(f: IO[bytes]) -> Iterator[bytes]:
    with f:
        while chunk := f.read(1 << 20):
            yield chunk


def call_build(http: httpx.Client, dockerfile: Path, context: Path, progress: Progress | None,
               bases: dict[str, str] | None) -> dict[str, Any]:
    """Send a build to the node behind ``http`` (the node client's connection): the context folder as a tar,
    ``dockerfile`` (inside ``context``) by its relative path. Returns the image's facts as JSON. Raises
    ``NodeError`` (the node's code, or ``bad_context``/``node_unreachable``)."""
    try:
        rel = dockerfile.resolve().relative_to(context.resolve())
    except ValueError as e:
        raise NodeError("bad_context", f"the Dockerfile {dockerfile} is not inside the context {context}") from e
    params = {"dockerfile": rel.as_posix(), "bases": json.dumps(bases or {})}
    return _send(http, "/v1/node/images/build", params, _chunks(pack_context(context)), progress)


def call_import(http: httpx.Client, archive: Path, progress: Progress | None) -> dict[str, Any]:
    """Send an import of ``archive`` to the node behind ``http``. Returns the facts as JSON; raises ``NodeError``."""
    return _send(http, "/v1/node/images/import", {}, _chunks(open(archive, "rb")), progress)  # noqa: SIM115


def _send(http: httpx.Client, path: str, params: dict[str, str], body: Iterator[bytes],
          progress: Progress | None) -> dict[str, Any]:
    try:
        with http.stream("POST", path, params=params, content=body, timeout=httpx.Timeout(30.0, read=None)) as resp:
            if resp.status_code >= 400:
                err = json.loads(resp.read() or b"{}").get("error", {})
                raise NodeError(str(err.get("code", "image_build_failed")), str(err.get("message", resp.text)))
            for raw in resp.iter_lines():
                if not raw.strip():
                    continue
                obj = json.loads(raw)
                if "progress" in obj:
                    if progress is not None:
                        progress(str(obj["progress"]))
                elif "result" in obj:
                    return dict(obj["result"])
                elif "error" in obj:
                    raise NodeError(str(obj["error"].get("code")), str(obj["error"].get("message")))
    except httpx.HTTPError as e:
        raise NodeError("node_unreachable", f"the node went away during the build: {e}") from e
    raise NodeError("image_build_failed", "the node ended the build's answer without a result")
