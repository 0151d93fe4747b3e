"""The egress proxy's long-poll link from a node agent to its servers (sbx.node.remote.egresslink): the node API
served over real HTTP around a fake node, a RemoteNode polling it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sbx.node.remote.client import RemoteNode
from sbx.node.remote.egresslink import EgressLink
from sbx.node.types import NodeError
from tests.fakes import FakeNode, served_node, wait_until

TOKEN = "sbxn_egress-link-test-token"
ASK = {"op": "resolve", "client": "10.0.0.7", "host": "api.example.com", "method": "GET", "path": "/"}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[FakeNode, RemoteNode, str]]:
    fake = FakeNode(tmp_path / "node")
    with served_node(fake, TOKEN) as url:
        remote = RemoteNode(url, TOKEN)
        try:
            yield fake, remote, url
        finally:
            remote.close()
    fake.close()


def test_a_question_is_answered_by_the_polling_server_and_each_node_process_is_announced(
        served: tuple[FakeNode, RemoteNode, str]) -> None:
    fake, remote, _url = served
    # before any server polls, the proxy's question passes at once without secrets
    started = time.monotonic()
    assert fake.egress_handler("sb_a", dict(ASK)) == {"actions": []}
    assert time.monotonic() - started < 1.0
    asked: list[tuple[str, dict[str, Any]]] = []
    links: list[int] = []

    def handler(sid: str, q: dict[str, Any]) -> dict[str, Any]:
        asked.append((sid, q))
        return {"actions": [{"secret": "tok", "action": "header", "header": "X", "value": f"for {sid}"}]}

    remote.serve_egress(handler, on_link=lambda: links.append(1))
    wait_until(lambda: links == [1], timeout=10)
    answers: dict[str, Any] = {}

    def ask(sid: str) -> None:
        answers[sid] = fake.egress_handler(sid, dict(ASK))

    threads = [threading.Thread(target=ask, args=(f"sb_{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert {sid: a["actions"][0]["value"] for sid, a in answers.items()} == {f"sb_{i}": f"for sb_{i}" for i in
                                                                            range(8)}
    assert sorted(sid for sid, _q in asked) == sorted(answers) and asked[0][1]["host"] == "api.example.com"
    assert links == [1]  # the same node process: announced once
    # the node says it runs a proxy (its health), and a binding crosses the wire as a plain call
    assert remote.egress_ready() is True
    remote.set_egress_proxy("sb_a", True)
    assert fake.egress == {"sb_a": True}
    remote.close_egress()


def test_the_links_routes_need_the_node_token(served: tuple[FakeNode, RemoteNode, str]) -> None:
    _fake, _remote, url = served
    for path, body in (("/v1/node/egress/poll", {"wait": 0}), ("/v1/node/egress/answer", {"answers": []})):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(url + path, json=body, headers=headers, timeout=10)
            assert (r.status_code, r.json()["error"]["code"]) == (401, "unauthorized"), path
    r = httpx.post(url + "/v1/node/egress/poll", json={"wait": 0}, headers={"Authorization": f"Bearer {TOKEN}"},
                   timeout=10)
    assert r.status_code == 200 and r.json()["questions"] == []


def test_an_unanswered_question_passes_without_secrets_and_a_late_answer_is_refused() -> None:
    now = [100.0]
    link = EgressLink(clock=lambda: now[0])
    assert link.poll(0)["questions"] == []  # a server is listening from now on
    got: list[dict[str, Any]] = []
    t = threading.Thread(target=lambda: got.append(link.ask("sb_a", dict(ASK), timeout=0.5)))
    t.start()
    batch = link.poll(5)["questions"]
    assert [(q["sandbox"], q["question"]["host"]) for q in batch] == [("sb_a", "api.example.com")]
    t.join(5)
    assert got == [{"actions": []}]
    assert link.answer(batch[0]["qid"], {"actions": [{"value": "late"}]}) is False
    assert link.answer("nonesuch", {"actions": []}) is False
    # a server that stopped polling: questions pass at once instead of waiting
    now[0] += 31
    started = time.monotonic()
    assert link.ask("sb_a", dict(ASK)) == {"actions": []}
    assert time.monotonic() - started < 0.2


def test_a_node_without_the_route_or_a_proxy_is_not_ready(tmp_path: Path) -> None:
    remote = RemoteNode("http://127.0.0.1:1", TOKEN)
    try:
        assert remote.egress_ready() is False
        with pytest.raises(NodeError) as e:
            remote.set_egress_proxy("sb_a", True)
        assert e.value.code == "node_unreachable"
    finally:
        remote.close()


def test_an_audit_record_does_not_wait_for_the_server() -> None:
    link = EgressLink()
    link.poll(0)
    used = {"op": "used", "client": "10.0.0.7", "secrets": ["tok"], "host": "api.example.com", "method": "GET",
            "path": "/", "status": 200}
    started = time.monotonic()
    assert link.ask("sb_a", dict(used)) == {}
    assert time.monotonic() - started < 0.2
    batch = link.poll(0)["questions"]
    assert [(q["sandbox"], q["question"]["op"]) for q in batch] == [("sb_a", "used")]
    assert link.poll(0)["questions"] == [] and link.answer(batch[0]["qid"], {}) is False
