"""The volume routes (issue 34, :mod:`sbx.control.volumes.catalog`)::

    POST   /v1/volumes            {"name", "size"?}                          201 {"volume"}
    GET    /v1/volumes            the account's volumes                      200 {"volumes"}
    GET    /v1/volumes/{name}     one                                        200 {"volume"}
    DELETE /v1/volumes/{name}     delete it and its data (409 while mounted) 200 {"deleted"}

A sandbox mounts volumes from its create (``POST /v1/sandboxes`` with ``"volumes": [{"name", "path",
"readOnly"}]``); its view lists them. Another account's volume answers 404.

Errors: 400 ``invalid_volume_name``, ``invalid_volume_size``; 404 ``volume_not_found``; 409 ``volume_exists``,
``volume_in_use``; 500 ``volume_create_failed``. An error changes nothing.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse

from sbx.api import schemas as S
from sbx.api.auth import principal
from sbx.api.models import CreateVolume
from sbx.control.accounts.keys import Principal
from sbx.control.service import ControlPlane
from sbx.control.volumes.catalog import NAME_PATTERN

Name = Annotated[str, PathParam(min_length=1, max_length=63, pattern=NAME_PATTERN, description="volume name: a "
                                "lower-case letter or digit, then up to 62 of a-z, 0-9, '.', '_', '-'")]


def register(v1: APIRouter, cp: ControlPlane) -> None:
    """Add the volume routes to ``v1`` (the authenticated ``/v1`` router)."""
    Who = Depends(principal)
    volumes = cp.volumes

    @v1.post("/volumes", status_code=201, tags=["volumes"], response_model=S.VolumeOut,
             responses=S.errors(400, 409, 500))
    def create_volume(body: CreateVolume, who: Principal = Who) -> JSONResponse:
        """Make a volume for the key's account: a JuiceFS file system that outlives the sandboxes that mount it
        (``size``: a cap in GiB)."""
        row = volumes.create(who.account_id, body.name, body.size)
        return JSONResponse({"volume": volumes.view(row)}, status_code=201)

    @v1.get("/volumes", tags=["volumes"], response_model=S.VolumeList, responses=S.errors())
    def list_volumes(who: Principal = Who) -> dict[str, Any]:
        """The key's account's volumes, by name, each with the sandboxes that mount it."""
        return {"volumes": [volumes.view(r) for r in volumes.list(who.account_id)]}

    @v1.get("/volumes/{name}", tags=["volumes"], response_model=S.VolumeOut, responses=S.errors(400, 404))
    def get_volume(name: Name, who: Principal = Who) -> dict[str, Any]:
        """One volume of the key's account (404 ``volume_not_found`` for another account's)."""
        return {"volume": volumes.view(volumes.resolve(who.account_id, name))}

    @v1.delete("/volumes/{name}", tags=["volumes"], response_model=S.Deleted, responses=S.errors(400, 404, 409))
    def delete_volume(name: Name, who: Principal = Who) -> dict[str, Any]:
        """Delete a volume and its data; 409 ``volume_in_use`` while a sandbox that is not deleted mounts it."""
        row = volumes.delete(who.account_id, name)
        return {"deleted": row.name}


__all__ = ["register"]
