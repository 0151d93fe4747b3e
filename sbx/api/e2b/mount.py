"""Adding the E2B compatibility layer (:mod:`sbx.api.e2b`) to the sbx API."""

from __future__ import annotations

from fastapi import FastAPI

import sbx.api.e2b.envd as envd
import sbx.api.e2b.rest as rest
from sbx.api.auth import Gate
from sbx.api.e2b.tokens import load_secret
from sbx.control.service import ControlPlane

PREFIX = "/e2b"


def mount(app: FastAPI, cp: ControlPlane, gate: Gate) -> None:
    """Serve E2B's REST API under :data:`PREFIX` of ``app`` and envd's calls (requests with ``E2b-Sandbox-Id``)
    on every path of it, keys checked by ``gate``. Makes the access-token secret on first use
    (:func:`sbx.api.e2b.tokens.load_secret`)."""
    secret = load_secret(cp.settings.state_dir)
    app.mount(PREFIX, rest.create_app(cp, secret, gate))
    app.add_middleware(envd.Dispatch, envd=envd.Envd(cp, secret))
