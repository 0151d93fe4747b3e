"""Issue 31 end to end: ``Sandbox.get_host(port)`` of E2B's own SDK (``<port>-<sandboxID>.<E2B_DOMAIN>``) reaches a
server started in the sandbox through the SDK, on sbx's hosted-port proxy, with ``E2B_DOMAIN=sbx.localhost:<proxy
port>`` as on one machine. As on E2B, every port of a sandbox made through E2B's API is public under that name by
default, and with ``network.allowPublicTraffic`` false reachable only with the sandbox's ``trafficAccessToken`` (never
with its envd token or another account's key); sbx's own name of the port still needs it hosted, and a port hosted
with sbx's routes keeps its route's rule under either name."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.api.test_e2b_sdk import (
    _second_key,
    e2b_env,  # noqa: F401  (a fixture: the SDK's URLs and key)
)
from tests.e2e.conftest import Server

e2b = pytest.importorskip("e2b")

pytestmark = pytest.mark.e2e


@pytest.fixture
def e2b_domain(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """``e2b_env`` and ``E2B_DOMAIN`` as a user of one machine sets it: sbx's domain and the proxy's port."""
    server: Server = request.getfixturevalue("e2b_env")
    monkeypatch.setenv("E2B_DOMAIN", f"sbx.localhost:{server.proxy_port}")
    yield server


def _get(host: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """GET ``http://<host>/``: by name when this machine resolves ``*.localhost`` (nss-myhostname,
    systemd-resolved), else at 127.0.0.1 with that ``Host``, as curl and browsers do by themselves."""
    name, _, port = host.rpartition(":")
    try:
        socket.getaddrinfo(name, int(port))
        return httpx.get(f"http://{host}/", headers=headers, timeout=30)
    except socket.gaierror:
        return httpx.get(f"http://127.0.0.1:{port}/", headers={"Host": host, **(headers or {})}, timeout=30)


def _until_served(host: str, headers: dict[str, str]) -> httpx.Response:
    deadline = time.monotonic() + 30
    while True:
        r = _get(host, headers)
        if r.status_code != 502 or time.monotonic() > deadline:
            return r
        time.sleep(0.3)


def test_get_host_reaches_a_server_started_through_the_sdk_as_the_hosted_port_allows(e2b_domain: Server) -> None:
    from e2b import Sandbox

    server = e2b_domain
    native = {"Authorization": f"Bearer {server.token}"}
    sbx = Sandbox.create(timeout=300)
    sid = sbx.sandbox_id
    try:
        sbx.files.write("/home/user/site/index.html", "hello through get_host\n")
        sbx.commands.run("cd /home/user/site && python3 -m http.server 8000", background=True)
        host = sbx.get_host(8000)
        assert host == f"8000-{sid}.sbx.localhost:{server.proxy_port}"

        # E2B's default: public under E2B's name, hosted or not; sbx's own name needs the port hosted
        served = _until_served(host, {})
        assert served.status_code == 200 and served.text == "hello through get_host\n"
        subdomain = httpx.get(f"{server.url}/v1/sandboxes/{sid}", headers=native).json()["sandbox"]["subdomain"]
        assert _get(f"8000-{subdomain}.sbx.localhost:{server.proxy_port}").status_code == 404
        unserved = _get(sbx.get_host(8001))  # nothing listens there
        assert unserved.status_code == 502 and unserved.json()["error"]["code"] == "upstream_unreachable"
        assert sbx.get_info().metadata == {}  # the ports label is sbx's own

        r = httpx.post(f"{server.url}/v1/sandboxes/{sid}/routes", json={"port": 8000}, headers=native)
        assert r.status_code in (200, 201), r.text
        token = r.json()["route"]["token"]
        assert _get(host).status_code == 401  # private: no token
        other = _second_key(server)
        assert _get(host, {"X-Sbx-Token": other}).status_code == 401
        assert _get(host, {"X-Sbx-Token": sbx._envd_access_token or "x"}).status_code == 401
        served = _until_served(host, {"X-Sbx-Token": token})
        assert served.status_code == 200 and served.text == "hello through get_host\n"
        # the same port under the DNS-safe spelling (TLS certificates match no name with "_")
        dns_safe = host.replace(f"-{sid}.", f"-{sid.replace('_', '-')}.")
        assert _get(dns_safe, {"X-Sbx-Token": token}).text == "hello through get_host\n"

        # another account can neither host the port nor reach it
        r = httpx.post(f"{server.url}/v1/sandboxes/{sid}/routes", json={"port": 8000, "public": True},
                       headers={"Authorization": f"Bearer {other}"})
        assert r.status_code == 404
        assert _get(host).status_code == 401

        r = httpx.post(f"{server.url}/v1/sandboxes/{sid}/routes", json={"port": 8000, "public": True},
                       headers=native)
        assert r.status_code in (200, 201), r.text
        assert _get(host).text == "hello through get_host\n"  # public now: no token needed
    finally:
        sbx.kill()
    assert _get(host).status_code == 404


def test_without_public_traffic_ports_need_the_traffic_token(e2b_domain: Server) -> None:
    from e2b import Sandbox

    server = e2b_domain
    sbx = Sandbox.create(timeout=300, network={"allow_public_traffic": False})
    try:
        token = sbx.traffic_access_token
        assert token and token != sbx._envd_access_token
        sbx.commands.run("mkdir -p ~/s && echo private > ~/s/index.html && cd ~/s && python3 -m http.server 8000",
                         background=True)
        host = sbx.get_host(8000)
        assert _until_served(host, {"E2B-Traffic-Access-Token": token}).text == "private\n"
        wrong = token[:-1] + ("1" if token.endswith("0") else "0")
        for refused in ({}, {"E2B-Traffic-Access-Token": sbx._envd_access_token or "x"},
                        {"E2B-Traffic-Access-Token": _second_key(server)}, {"X-Sbx-Token": wrong}):
            r = _get(host, refused)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", (refused, r.text)
        assert Sandbox.connect(sbx.sandbox_id).traffic_access_token == token  # connect answers it again
    finally:
        sbx.kill()
    assert _get(host, {"E2B-Traffic-Access-Token": token}).status_code == 404

