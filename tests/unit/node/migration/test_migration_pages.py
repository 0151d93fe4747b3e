"""The source's ask for the destination's page server (sbx.node.migration.outgoing.page_server): the address it gives,
and the fallback to streaming the pages when the destination is of an earlier version."""

from __future__ import annotations

import httpx
import pytest

from sbx.node.migration import outgoing as migration


def client(handler: httpx.MockTransport) -> httpx.Client:
    return httpx.Client(base_url="http://10.1.2.3:7700", transport=handler)


def test_the_destination_answers_where_its_page_server_listens() -> None:
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        return httpx.Response(200, json={"address": "10.1.2.3", "port": 40123})

    with client(httpx.MockTransport(answer)) as http:
        assert migration.page_server(http, "sb_0123456789") == "10.1.2.3:40123"
    assert seen == ["POST /v1/node/migrate/sb_0123456789/pages"]


def test_a_destination_without_the_route_gets_the_pages_streamed() -> None:
    with client(httpx.MockTransport(lambda _r: httpx.Response(404, json={"detail": "Not Found"}))) as http:
        assert migration.page_server(http, "sb_0123456789") is None


def test_a_refusal_fails_the_step() -> None:
    def refuse(_r: httpx.Request) -> httpx.Response:
        return httpx.Response(409, json={"error": {"code": "not_incoming", "message": "sandbox is not arriving"}})

    with client(httpx.MockTransport(refuse)) as http, pytest.raises(migration._Step, match="not_incoming"):
        migration.page_server(http, "sb_0123456789")
