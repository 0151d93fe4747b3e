"""The node routes (:mod:`sbx.control.cluster.registry`, drains and consolidation:
:mod:`sbx.control.cluster.consolidate`)::

    GET    /v1/nodes                              the node registry                200 {"nodes": [...]}
    POST   /v1/nodes                              add a node agent                 201 {"node"}
    DELETE /v1/nodes/{name}                       stop driving it                  200 {"node"}
    POST   /v1/nodes/{name}/cordon | /uncordon    no new sandboxes there           200 {"node"}
    POST   /v1/nodes/{name}/drain                 move all off it                  202 {"drain"}
    GET    /v1/nodes/{name}/drain                 its progress                     200 {"drain"}
    GET    /v1/consolidation                      the loop's last plan and drain   200 {"consolidation"}

Nodes are shared by every account: only the installation's admin key sees or changes them (an account's key gets
403 ``admin_only``).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from sbx.api import schemas as S
from sbx.api import schemas_nodes as SN
from sbx.api.auth import principal, require_admin
from sbx.api.models import TIMEOUT_QUERY, WAIT_QUERY, AddNode
from sbx.control.accounts.keys import Principal
from sbx.control.cluster.consolidate import Consolidator
from sbx.control.service import ControlPlane


def register(v1: APIRouter, cp: ControlPlane, consolidator: Consolidator) -> None:
    """Add the node routes and ``GET /v1/consolidation`` to ``v1`` (the authenticated ``/v1`` router)."""
    Who = Depends(principal)
    WaitQ = WAIT_QUERY
    TimeoutQ = TIMEOUT_QUERY

    @v1.get("/nodes", tags=["nodes"], response_model=SN.NodeList, responses=S.errors(403))
    def list_nodes(who: Principal = Who) -> dict[str, Any]:
        """Every registered node agent with its status, capacity, load and fingerprint, by name (admin key)."""
        require_admin(who)
        return {"nodes": cp.registry.views()}

    @v1.post("/nodes", tags=["nodes"], status_code=201, response_model=SN.NodeOut, responses=S.errors(400, 403, 502))
    def add_node(body: AddNode, who: Principal = Who) -> dict[str, Any]:
        """Add the node agent at ``url`` (with its node token) to the nodes every replica drives (admin key). It
        is asked for its heartbeat first: 400 ``node_unauthorized`` for a wrong token, 502 ``node_unreachable``
        (nothing is stored then)."""
        require_admin(who)
        return {"node": cp.add_node(body.url, body.token)}

    @v1.delete("/nodes/{name}", tags=["nodes"], response_model=SN.NodeOut, responses=S.errors(403, 404, 409))
    def remove_node(name: str, who: Principal = Who) -> dict[str, Any]:
        """Stop driving node ``name`` (admin key): 409 ``node_in_use`` while it holds sandboxes (delete or move
        them first), 409 ``node_configured`` for the server's own node (SBX_NODE_URL or the embedded one)."""
        require_admin(who)
        return {"node": cp.remove_node(name)}

    @v1.post("/nodes/{name}/cordon", tags=["nodes"], response_model=SN.NodeOut, responses=S.errors(403, 404))
    def cordon_node(name: str, who: Principal = Who) -> dict[str, Any]:
        """Place no new sandbox on node ``name``; its sandboxes keep running (admin key)."""
        require_admin(who)
        return {"node": cp.registry.cordon(name, True)}

    @v1.post("/nodes/{name}/uncordon", tags=["nodes"], response_model=SN.NodeOut, responses=S.errors(403, 404))
    def uncordon_node(name: str, who: Principal = Who) -> dict[str, Any]:
        """Let new sandboxes go to node ``name`` again (admin key)."""
        require_admin(who)
        return {"node": cp.registry.cordon(name, False)}

    @v1.post("/nodes/{name}/drain", tags=["nodes"], status_code=202, response_model=SN.DrainOut,
             responses={200: {"model": SN.DrainOut, "description": "with `?wait=true`: the drain has finished"},
                        **S.errors(403, 404)})
    def drain_node(name: str, wait_: bool = WaitQ, timeout: float = TimeoutQ, who: Principal = Who
                   ) -> JSONResponse:
        """Cordon node ``name`` and move every sandbox off it (admin key): running ones by live migration, stopped
        ones with their disk and memory image, to nodes placement picks. Answers at once with the drain (each
        sandbox ``pending``); follow it with ``GET /v1/nodes/{name}/drain``; ``?wait=true`` answers 200 when it
        has finished. A sandbox no other node can take stays where it is, its item ``failed`` with
        ``insufficient_capacity``. A drain already running there is returned as it is."""
        require_admin(who)
        drain = cp.drains.start(name)
        if not wait_:
            return JSONResponse({"drain": drain}, status_code=202)
        deadline = time.monotonic() + timeout
        while drain["state"] == "draining" and time.monotonic() < deadline:
            time.sleep(0.5)
            drain = cp.drains.get(name)
        return JSONResponse({"drain": drain}, status_code=200 if drain["state"] == "done" else 202)

    @v1.get("/nodes/{name}/drain", tags=["nodes"], response_model=SN.DrainOut, responses=S.errors(403, 404))
    def drain_status(name: str, who: Principal = Who) -> dict[str, Any]:
        """The last drain of node ``name`` this server ran, with each sandbox's progress (admin key); 404 when it
        ran none."""
        require_admin(who)
        return {"drain": cp.drains.get(name)}

    @v1.get("/consolidation", tags=["nodes"], response_model=SN.ConsolidationOut, responses=S.errors(403))
    def consolidation(who: Principal = Who) -> dict[str, Any]:
        """What the consolidation loop decided last (admin key): whether it runs (``SBX_CONSOLIDATE_SECONDS``, 0 =
        off) and leads on this replica, its thresholds, the last plan (which node it empties and where each
        sandbox goes, or why it empties none: ``no light node``, ``the rest lack room: ...``) with each node's
        memory figures, the last drain it started and the nodes now removable (cordoned, empty, added)."""
        require_admin(who)
        return {"consolidation": consolidator.view()}
