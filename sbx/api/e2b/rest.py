"""E2B's control-plane REST API over sbx's control plane, mounted under ``/e2b`` (so ``E2B_API_URL`` is
``http://<server>/e2b``). Shapes, statuses and field names are those E2B's SDK parses (e2b-dev/infra
``spec/openapi.yml``, as used by ``e2b`` 2.45-2.63); what each call does is sbx's:

==============================================  ======================================================  =======
E2B call                                        sbx                                                     success
==============================================  ======================================================  =======
``POST /sandboxes``, ``POST /v2/sandboxes``     create, waited for; ``templateID`` = an image name    201
                                                (``sbx image list``) or a size (``base``: the default),
                                                ``timeout`` = ttl, ``metadata`` = labels,
                                                ``envVars`` = env, ``autoResume.enabled``
``GET /v2/sandboxes``, ``GET /sandboxes``       list (``state`` running/paused, ``metadata``, ``limit``, 200
                                                ``nextToken`` / ``X-Next-Token``, ``order``)
``GET /sandboxes/{id}``                         info                                                    200
``DELETE /sandboxes/{id}``                      delete, waited for                                      204
``POST /sandboxes/{id}/timeout``                set its ttl (0: pause now)                              204
``POST /sandboxes/{id}/pause``                  stop keeping memory (``memory: false``: without),       204
                                                waited for; 409 when already paused
``POST /[v2/]sandboxes/{id}/connect``           resume when stopped (201) or keep (200); the ttl only   200/201
                                                grows
``POST /sandboxes/{id}/resume``                 resume (409 when running)                               201
``GET /sandboxes/{id}/metrics``                 the control plane's samples of the last hour            200
==============================================  ======================================================  =======

Auth: ``X-API-KEY`` is an sbx API key, checked like a bearer key (:meth:`sbx.api.auth.Gate.check`: rate limits,
wrong-key throttle); a key sees only its account's sandboxes (the admin key: all). Every error, whatever its cause,
is E2B's ``{"code": <status>, "message"}``; a body or query that is not what E2B sends is 400.

A sandbox's ``timeout`` becomes sbx's ttl: seconds *without activity* before it stops keeping its memory (E2B:
seconds before it is killed, or paused with ``autoPause``). So by default an E2B sandbox on sbx pauses at its
timeout, and ``connect`` resumes it; one created with ``autoPause: false`` is killed then, as on E2B
(:mod:`sbx.api.e2b.lifecycle`).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import datetime as dt
import logging
from typing import Any
from urllib.parse import parse_qsl, unquote

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

import sbx.api.e2b.lifecycle as lifecycle
from sbx.api.auth import check_sandbox, client_address
from sbx.api.e2b.pool import Pool
from sbx.api.e2b.tokens import access_token, traffic_token
from sbx.api.errors import validation_error
from sbx.api.models import CreateSandbox
from sbx.control.accounts.keys import Principal
from sbx.control.errors import ControlError, from_node
from sbx.control.service import ControlPlane
from sbx.control.store.database import SandboxRow, as_utc, iso

log = logging.getLogger("sbx.api.e2b")

ENVD_VERSION = "0.6.4"
"""The envd version reported: the SDK's default user (0.4.0), octet-stream/gzip uploads (0.5.7), file metadata
(0.6.2) and watchers with entries (0.6.3) work."""
CLIENT_ID = "sbx"
DEFAULT_TEMPLATE = "base"
DEFAULT_SIZE = "small"
"""The size ``templateID: "base"`` (the SDK's default) gets: sbx's own default."""
DEFAULT_TIMEOUT = 300
SETTLE_WAIT = 600.0
LIST_LIMIT = 100
RUNNING = {"running", "provisioning", "resuming", "forking", "migrating"}
PAUSED = {"stopped", "stopping"}


class E2BError(Exception):
    """An answer ``{"code": status, "message"}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def e2b_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """E2B's error body ``{"code": status, "message"}`` with ``status``."""
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


class Api:
    """The routes' shared state: the control plane, the token secret and the ready jobs' keeper."""

    def __init__(self, cp: ControlPlane, secret: bytes, ready: Pool | None = None):
        self.cp = cp
        self.secret = secret
        self.ready = ready

    # helpers -----------------------------------------------------------------------------------------------------
    def who(self, request: Request) -> Principal:
        """The principal of the request's ``X-API-KEY``; 401 (or 429) otherwise."""
        key = request.headers.get("x-api-key")
        if not key:
            raise E2BError(401, "missing X-API-KEY header (an sbx API key)")
        return request.app.state.gate.check(key, client_address(request))  # type: ignore[no-any-return]

    def row(self, who: Principal, sandbox_id: str) -> SandboxRow:
        """The sandbox ``who`` sees; 404 for one it does not, or that is unknown or deleted."""
        row = check_sandbox(self.cp, who, sandbox_id)
        if row is None or row.state in ("deleted", "deleting"):
            raise E2BError(404, f"sandbox {sandbox_id} not found")
        return row

    def size(self, row: SandboxRow) -> tuple[int, int, int]:
        """``(cpuCount, memoryMB, diskSizeMB)`` of the sandbox's size."""
        size = self.cp.settings.sizes.get(row.type)
        if size is None:
            return 0, 0, 0
        return size.vcpus, int(size.memory_gb * 1024), int(size.disk_gb * 1024)

    def sandbox(self, row: SandboxRow) -> dict[str, Any]:
        """E2B's ``Sandbox`` (the create and connect answer); ``trafficAccessToken`` for a sandbox whose ports are
        not public."""
        out = {"templateID": self.template_of(row), "sandboxID": row.id, "clientID": CLIENT_ID,
               "envdVersion": ENVD_VERSION, "envdAccessToken": access_token(self.secret, row.id), "domain": None,
               "alias": self.template_of(row)}
        if (row.labels or {}).get(lifecycle.PORTS) == lifecycle.TRAFFIC_TOKEN:
            out["trafficAccessToken"] = traffic_token(self.secret, row.id)
        return out

    def listed(self, row: SandboxRow) -> dict[str, Any]:
        """E2B's ``ListedSandbox``."""
        cpus, mem, disk = self.size(row)
        started = as_utc(row.created_at)
        end = as_utc(row.updated_at) + dt.timedelta(seconds=row.ttl or 10 * 365 * 86400)
        return {"templateID": self.template_of(row), "alias": self.template_of(row), "sandboxID": row.id,
                "clientID": CLIENT_ID,
                "startedAt": iso(started), "endAt": iso(max(end, started)), "cpuCount": cpus, "memoryMB": mem,
                "diskSizeMB": disk, "state": "paused" if row.state in PAUSED else "running",
                "envdVersion": ENVD_VERSION, "metadata": lifecycle.metadata(row)}

    def detail(self, row: SandboxRow) -> dict[str, Any]:
        """E2B's ``SandboxDetail``."""
        return {**self.listed(row), "envdAccessToken": access_token(self.secret, row.id), "domain": None,
                "allowInternetAccess": True,
                "lifecycle": {"autoResume": bool(row.auto_resume),
                              "onTimeout": "kill" if lifecycle.kills_on_timeout(row) else "pause"}}

    def settle(self, sandbox_id: str) -> SandboxRow:
        """Wait for the sandbox's operation to end; its error as an E2B error."""
        row = self.cp.wait_settled(sandbox_id, SETTLE_WAIT)
        if row.state == "error" and row.error_code:
            raise from_node(row.error_code, row.error_message or row.error_code)
        return row

    def template(self, who: Principal, template: str) -> tuple[str, str | None]:
        """``(size, image name or None)`` of E2B's ``templateID``: ``base`` is sbx's default size and image, a
        size name that size of the default image, any other name one of the account's images (or a shared one,
        ``sbx image list``) at the default size, or the first larger size whose disk holds the image. 400 for
        anything else."""
        if template == DEFAULT_TEMPLATE:
            return DEFAULT_SIZE, None
        if template in self.cp.settings.sizes:
            return template, None
        try:
            found = self.cp.images.find(who.account_id, template)
        except ControlError:
            found = None  # not a name an image could have
        if found is None:
            raise E2BError(400, f"unknown template {template[:80]!r}; sbx templates are 'base', the sizes "
                           f"({', '.join(self.cp.settings.sizes)}) and the account's images (`sbx image list`)")
        need = int((found.facts or {}).get("size_bytes") or 0)
        sizes = list(self.cp.settings.sizes.values())
        start = next((i for i, z in enumerate(sizes) if z.name == DEFAULT_SIZE), 0)
        fits = next((z.name for z in sizes[start:] if need <= z.disk_mib << 20), DEFAULT_SIZE)
        return fits, found.name  # none fits: the create says image_too_large

    @staticmethod
    def template_of(row: SandboxRow) -> str:
        """The ``templateID`` a sandbox answers with: its image's name, else its size."""
        return str((row.image or {}).get("name") or row.type)

    # operations (run in worker threads) --------------------------------------------------------------------------
    def create(self, who: Principal, body: dict[str, Any]) -> dict[str, Any]:
        """Create and wait until it runs; the ``Sandbox`` answer."""
        template = body.get("templateID", DEFAULT_TEMPLATE)
        if not isinstance(template, str) or not template:
            raise E2BError(400, "templateID must be a non-empty string")
        size, image = self.template(who, template)
        timeout = body.get("timeout", DEFAULT_TIMEOUT)
        if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
            raise E2BError(400, "timeout must be a whole number of seconds >= 0")
        for name in ("mcp", "volumeMounts", "iam"):
            if body.get(name):
                raise E2BError(400, f"{name} is not supported by sbx")
        public = _public_traffic(body.get("network"))
        if body.get("allow_internet_access") is False:
            raise E2BError(400, "allow_internet_access=false is not supported by sbx")
        auto_resume = body.get("autoResume") or {}
        if not isinstance(auto_resume, dict) or not isinstance(auto_resume.get("enabled", False), bool):
            raise E2BError(400, "autoResume must be {\"enabled\": bool}")
        auto_pause = body.get("autoPause", True)
        if not isinstance(auto_pause, bool):
            raise E2BError(400, "autoPause must be true or false")
        labels = body.get("metadata") or None
        own = [k for k in lifecycle.OWN_LABELS if isinstance(labels, dict) and k in labels]
        if own:
            raise E2BError(400, f"metadata key {own[0]} is sbx's own (autoPause and network set it)")
        if not auto_pause:  # killed at the timeout, as on E2B (lifecycle.TimeoutKills)
            labels = {**(labels if isinstance(labels, dict) else {}), lifecycle.ON_TIMEOUT: lifecycle.KILL}
        if labels is None or isinstance(labels, dict):  # (anything else: the validation below says what is wrong)
            labels = {**(labels or {}), lifecycle.PORTS: lifecycle.PUBLIC if public else lifecycle.TRAFFIC_TOKEN}
        try:
            spec = CreateSandbox.model_validate({
                "type": size, "ttl": timeout, "env": body.get("envVars") or None,
                "labels": labels, "autoResume": auto_resume.get("enabled", False)})
        except ValidationError as e:
            _status, _code, message, _field = validation_error(list(e.errors()))
            raise E2BError(400, message.replace("labels", "metadata").replace("env", "envVars")) from None
        row = self.cp.create(spec.type, None, spec.ttl, None, False, spec.env, spec.auto_resume, spec.labels,
                             account_id=who.account_id, image=image)
        row = self.settle(row.id)
        if row.state != "running":
            raise E2BError(409, f"sandbox {row.id} is {row.state}, not running")
        if self.ready is not None:  # a new sandbox has no ready job: its first command need not look for one
            self.ready.empty(row.id, refill=False)
        return self.sandbox(row)

    def list_page(self, who: Principal, query: dict[str, str]) -> tuple[list[dict[str, Any]], str | None]:
        """One page of the account's sandboxes, newest first unless ``order=asc``; the next page's token. Filters:
        ``state``, ``metadata`` (all pairs must match), ``template`` (a size), ``startedAfter`` (RFC 3339)."""
        states = {"running", "paused"}
        if "state" in query:
            states = {s.strip() for s in query["state"].split(",") if s.strip()}
            if not states or not states <= {"running", "paused"}:
                raise E2BError(400, "state must be a comma-separated list of running and paused")
        wanted: dict[str, str] = {}
        if query.get("metadata"):
            wanted = {unquote(k): unquote(v) for k, v in parse_qsl(query["metadata"], keep_blank_values=True)}
        try:
            limit = int(query.get("limit", LIST_LIMIT))
        except ValueError:
            raise E2BError(400, "limit must be a whole number from 1 to 100") from None
        if not 1 <= limit <= LIST_LIMIT:
            raise E2BError(400, "limit must be a whole number from 1 to 100")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise E2BError(400, "order must be asc or desc")
        offset = 0
        if query.get("nextToken"):
            try:
                offset = int(base64.urlsafe_b64decode(query["nextToken"].encode()).decode().removeprefix("o:"))
            except (ValueError, binascii.Error, UnicodeDecodeError):
                raise E2BError(400, "nextToken is not one this server gave") from None
            if offset < 0:
                raise E2BError(400, "nextToken is not one this server gave")
        rows = [r for r in self.cp.list_sandboxes(wanted or None, who.scope)
                if ("running" in states and r.state in RUNNING) or ("paused" in states and r.state in PAUSED)]
        if query.get("template"):
            rows = [r for r in rows if query["template"] in (r.type, self.template_of(r))]
        if query.get("startedAfter"):
            try:
                after = as_utc(dt.datetime.fromisoformat(query["startedAfter"].replace("Z", "+00:00")))
            except ValueError:
                raise E2BError(400, "startedAfter must be an RFC 3339 time") from None
            rows = [r for r in rows if as_utc(r.created_at) > after]
        rows.sort(key=lambda r: (as_utc(r.created_at), r.id), reverse=order == "desc")
        page = rows[offset:offset + limit]
        more = offset + limit < len(rows)
        token = base64.urlsafe_b64encode(f"o:{offset + limit}".encode()).decode() if more else None
        return [self.listed(r) for r in page], token

    def kill(self, who: Principal, sandbox_id: str) -> None:
        """Delete the sandbox and wait until it is gone."""
        self.row(who, sandbox_id)
        self.cp.delete(sandbox_id)
        if self.ready is not None:
            self.ready.forget(sandbox_id)
        try:
            self.cp.wait_settled(sandbox_id, SETTLE_WAIT)
        except ControlError as e:
            if e.status != 404:
                raise

    def set_timeout(self, who: Principal, sandbox_id: str, body: dict[str, Any]) -> None:
        """Make ``timeout`` the sandbox's ttl; 0 (E2B: "time out now") does now, in the background, what its
        timeout would: pause a running sandbox, or kill one created with ``autoPause`` false (sbx's ttl 0 would
        mean "never")."""
        timeout = body.get("timeout")
        if not isinstance(timeout, int) or isinstance(timeout, bool) or not 0 <= timeout <= 10 * 365 * 86400:
            raise E2BError(400, "timeout must be a whole number of seconds >= 0")
        row = self.row(who, sandbox_id)
        if timeout == 0:
            if lifecycle.kills_on_timeout(row):
                self.cp.delete(sandbox_id)
            elif row.state == "running":
                self.cp.stop(sandbox_id, keep_memory=True, reason="idle")
            return
        self.cp.store.update_sandbox(sandbox_id, ttl=timeout)

    def pause(self, who: Principal, sandbox_id: str, body: dict[str, Any]) -> None:
        """Stop keeping memory (unless ``memory`` is false) and wait; 409 when already paused."""
        memory = body.get("memory", True)
        if not isinstance(memory, bool):
            raise E2BError(400, "memory must be true or false")
        row = self.row(who, sandbox_id)
        if row.state in PAUSED:
            raise E2BError(409, f"sandbox {sandbox_id} is already paused")
        with self.ready.hold(sandbox_id) if self.ready is not None else contextlib.nullcontext():
            self.cp.stop(sandbox_id, keep_memory=memory)
            self.settle(sandbox_id)

    def connect(self, who: Principal, sandbox_id: str, body: dict[str, Any], resume_only: bool = False
                ) -> tuple[int, dict[str, Any]]:
        """Resume a paused sandbox (201) or keep a running one (200); the ttl becomes at least ``timeout``."""
        timeout = body.get("timeout", DEFAULT_TIMEOUT)
        if not isinstance(timeout, int) or isinstance(timeout, bool) or not 0 <= timeout <= 10 * 365 * 86400:
            raise E2BError(400, "timeout must be a whole number of seconds >= 0")
        row = self.row(who, sandbox_id)
        ttl = row.ttl if row.ttl == 0 or (timeout and timeout <= row.ttl) else timeout
        if row.state in PAUSED:
            self.cp.resume(sandbox_id, ttl=ttl)
            row = self.settle(sandbox_id)
            if row.state != "running":
                raise E2BError(409, f"sandbox {sandbox_id} is {row.state} after resuming")
            return 201, self.sandbox(row)
        if resume_only:
            raise E2BError(409, f"sandbox {sandbox_id} is already running")
        if ttl != row.ttl:
            self.cp.store.update_sandbox(sandbox_id, ttl=ttl)
        row = self.settle(sandbox_id)
        return 200, self.sandbox(row)

    def metrics(self, who: Principal, sandbox_id: str, query: dict[str, str]) -> list[dict[str, Any]]:
        """E2B's ``SandboxMetric`` list from the control plane's samples (between ``start`` and ``end``, Unix
        seconds, when given)."""
        row = self.row(who, sandbox_id)
        bounds = []
        for name in ("start", "end"):
            try:
                bounds.append(float(query[name]) if name in query else None)
            except ValueError:
                raise E2BError(400, f"{name} must be Unix seconds") from None
        cpus, mem, disk = self.size(row)
        out = []
        for x in self.cp.sampler.series(sandbox_id):
            if (bounds[0] is not None and x.at < bounds[0]) or (bounds[1] is not None and x.at > bounds[1]):
                continue
            when = dt.datetime.fromtimestamp(x.at, dt.UTC)
            out.append({"timestamp": iso(when), "timestampUnix": int(x.at), "cpuCount": cpus,
                        "cpuUsedPct": x.cpu_percent / max(cpus, 1), "memUsed": x.memory_used_mb << 20,
                        "memTotal": x.memory_total_mb << 20, "memCache": 0, "diskUsed": 0,
                        "diskTotal": disk << 20})
        return out


def _public_traffic(network: Any) -> bool:
    """Whether E2B's ``network`` leaves the sandbox's ports public (``allowPublicTraffic``, default true); 400 for
    a ``network`` that is not an object, or that sets anything else (egress rules per sandbox are not E2B's on
    sbx: the node's egress policy and the credential proxy apply)."""
    if network is None:
        return True
    if not isinstance(network, dict):
        raise E2BError(400, "network must be an object")
    for key, value in network.items():
        if key != "allowPublicTraffic" and value not in (None, [], {}, False):
            raise E2BError(400, f"network.{key} is not supported by sbx")
    public = network.get("allowPublicTraffic", True)
    if not isinstance(public, bool):
        raise E2BError(400, "network.allowPublicTraffic must be true or false")
    return public
