"""The source's ask for the destination's page server (sbx.node.migration.outgoing.page_server): the address it gives,
and the fallback to streaming the pages when the destination is of an earlier version; a destination that takes
the pages in TLS gets them through a local PageSender, or fails the step when this node has no certificate."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from sbx import tls
from sbx.config import load_settings
from sbx.node.migration import outgoing as migration


def client(handler: httpx.MockTransport) -> httpx.Client:
    return httpx.Client(base_url="http://10.1.2.3:7700", transport=handler)


def test_the_destination_answers_where_its_page_server_listens() -> None:
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        return httpx.Response(200, json={"address": "10.1.2.3", "port": 40123})

    with client(httpx.MockTransport(answer)) as http:
        assert migration.page_server(http, "sb_0123456789") == ("10.1.2.3:40123", None)
    assert seen == ["POST /v1/node/migrate/sb_0123456789/pages"]


def test_a_destination_without_the_route_gets_the_pages_streamed() -> None:
    with client(httpx.MockTransport(lambda _r: httpx.Response(404, json={"detail": "Not Found"}))) as http:
        assert migration.page_server(http, "sb_0123456789") is None


def test_a_refusal_fails_the_step() -> None:
    def refuse(_r: httpx.Request) -> httpx.Response:
        return httpx.Response(409, json={"error": {"code": "not_incoming", "message": "sandbox is not arriving"}})

    with client(httpx.MockTransport(refuse)) as http, pytest.raises(migration._Step, match="not_incoming"):
        migration.page_server(http, "sb_0123456789")


def test_a_tls_destination_gets_the_pages_through_a_local_sender(tmp_path: Path) -> None:
    def answer(_r: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"address": "10.1.2.3", "port": 40123, "tls": True})

    with client(httpx.MockTransport(answer)) as http:
        with pytest.raises(migration._Step, match="no certificate"):
            migration.page_server(http, "sb_0123456789", load_settings(state_dir=tmp_path / "plain"))
        folder = tmp_path / "state" / "tls"
        tls.make_ca(folder)
        tls.issue(folder, folder, "node")
        got = migration.page_server(http, "sb_0123456789", load_settings(state_dir=tmp_path / "state"))
    assert got is not None
    address, sender = got
    assert sender is not None and address == sender.address and address.startswith("127.0.0.1:")
    sender.close(timeout=0)
