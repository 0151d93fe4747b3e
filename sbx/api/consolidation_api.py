"""The consolidation route (issue 11, :mod:`sbx.control.consolidate`)::

    GET    /v1/consolidation                      the loop's last plan and drain   200 {"consolidation"}

Nodes are the installation's: an account's key gets 403 ``admin_only``, as for the node routes.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from sbx.api import schemas as S
from sbx.api import schemas_nodes as SN
from sbx.api.auth import principal, require_admin
from sbx.control.accounts import Principal
from sbx.control.consolidate import Consolidator


def register(v1: APIRouter, consolidator: Consolidator) -> None:
    """Add ``GET /v1/consolidation`` to ``v1`` (the authenticated ``/v1`` router)."""
    Who = Depends(principal)

    @v1.get("/consolidation", tags=["nodes"], response_model=SN.ConsolidationOut, responses=S.errors(403))
    def consolidation(who: Principal = Who) -> dict[str, Any]:
        """What the consolidation loop decided last (admin key): whether it runs (``SBX_CONSOLIDATE_SECONDS``, 0 =
        off) and leads on this replica, its thresholds, the last plan (which node it empties and where each
        sandbox goes, or why it empties none: ``no light node``, ``the rest lack room: ...``) with each node's
        memory figures, the last drain it started and the nodes now removable (cordoned, empty, added)."""
        require_admin(who)
        return {"consolidation": consolidator.view()}
