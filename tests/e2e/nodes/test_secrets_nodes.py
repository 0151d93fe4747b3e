"""Secrets for sandboxes on node agents (``sbx node serve``): the node's own egress proxy asks the server over its
long-poll link (sbx.node.remote.egresslink), injection follows the sandbox when it resumes on another node and when
it is live-migrated, and a node that asks about a sandbox the store doesn't place on it gets nothing.

The outside world is tests/e2e/accounts/test_secrets.py's (its ``remote`` fixture: HTTPS servers with a test CA in a
network namespace the host routes to); the node agents' proxies trust that CA upstream (``SBX_EGRESS_UPSTREAM_CA``).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.accounts.test_secrets import API_HOST, HOSTS_LINES, OTHER_HOST, Remote, _curl, _set_secret, remote
from tests.e2e.cluster import info, node_cluster, ok
from tests.e2e.conftest import Server
from tests.e2e.helpers import poll
from tests.fakes import FakeNode, served_node
from tests.nodenet import NodeHost
from tests.slots import slot

pytestmark = pytest.mark.e2e
__all__ = ["remote"]  # the fixture, used by name below

HDR = "Authorization: Bearer sbx-secret:apitok"
TIMED = 20  # requests per figure


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, remote: Remote) -> Iterator[tuple[Server, list[NodeHost]]]:
    with node_cluster(tmp_path_factory.mktemp("sbx-secnodes"), [12, 13], "sesrv", "sbxsesv", "10.85.0.0/16",
                      node_env={"SBX_EGRESS_UPSTREAM_CA": str(remote.ca)}, SBX_CONSOLIDATE_SECONDS="0") as c:
        yield c


def _root(srv: Server, sid: str, command: str) -> str:
    return ok(srv, "exec", sid, "--user", "root", command, timeout=120)


def _injected(srv: Server, sid: str) -> None:
    code, body = _curl(srv, sid, f"https://{API_HOST}/whoami", "-H", HDR)
    assert code == 200 and json.loads(body)["header"] is True, body
    code, body = _curl(srv, sid, f"https://{OTHER_HOST}/x", "-H", HDR)  # a host the rule doesn't name
    assert code == 200 and json.loads(body)["authorization"] == "Bearer sbx-secret:apitok", body


def _trusts(srv: Server, sid: str, node: NodeHost, others: list[NodeHost]) -> None:
    """The sandbox's CA file is ``node``'s proxy CA, and its system bundle holds no other node's."""
    ca = (node.state / "egress" / "ca.crt").read_text()
    assert _root(srv, sid, "cat /usr/local/share/ca-certificates/sbx-egress.crt") == ca
    bundle = _root(srv, sid, "cat /etc/ssl/certs/ca-certificates.crt")
    assert ca in bundle
    for other in others:
        assert (other.state / "egress" / "ca.crt").read_text() not in bundle


def _median_ms(srv: Server, sid: str) -> float:
    out = _root(srv, sid, f"for i in $(seq {TIMED}); do curl -sS -o /dev/null -w '%{{http_code}} %{{time_total}}\\n' "
                          f"-H '{HDR}' https://{API_HOST}/t; done")
    rows = [line.split() for line in out.splitlines() if line.strip()]
    assert [r[0] for r in rows] == ["200"] * TIMED, out
    return statistics.median(float(r[1]) for r in rows) * 1000


def test_a_sandbox_on_a_node_agent_gets_its_secret_there_and_after_each_move(
        cluster: tuple[Server, list[NodeHost]], remote: Remote) -> None:
    srv, nodes = cluster
    n12, n13 = nodes
    token = "tok-nodes-" + str(time.time_ns())
    remote.accept(token)
    _set_secret(srv, "apitok", token, "--host", API_HOST)
    listed = {n["name"]: n["egress"] for n in json.loads(ok(srv, "node", "list", "--json"))["nodes"]}
    assert listed == {n12.node_name: True, n13.node_name: True}, listed  # the heartbeat says each runs a proxy
    ok(srv, "node", "cordon", n13.node_name)
    sid = ok(srv, "new", "--type", "small", "--secret", "apitok").strip()
    assert info(srv, sid)["node"] == n12.node_name
    _root(srv, sid, f"printf '{HOSTS_LINES}' >> /etc/hosts")
    _injected(srv, sid)
    _trusts(srv, sid, n12, [n13])
    # the sandbox never holds the value: not in its environment, files or any process's environment
    assert _root(srv, sid, f"env | grep -c {token} || true").strip() == "0"
    assert _root(srv, sid, f"grep -rsl {token} /etc /home /root /tmp /var/lib | wc -l").strip() == "0"
    assert _root(srv, sid, f"cat /proc/*/environ 2>/dev/null | grep -c {token} || true").strip() == "0"
    print(f"\nremote node: median HTTPS request through the proxy {_median_ms(srv, sid):.1f} ms (n={TIMED})")

    # live migration to the other node (a drain of node 12): its secret goes on working there, with that node's CA
    ok(srv, "node", "uncordon", n13.node_name)
    ok(srv, "node", "drain", n12.node_name, "--wait")
    view = info(srv, sid)
    assert (view["state"], view["node"]) == ("running", n13.node_name), view
    _injected(srv, sid)
    _trusts(srv, sid, n13, [n12])

    # stopped with its memory and resumed back on node 12 (node 13 cordoned): the same
    ok(srv, "stop", sid, "--wait")
    ok(srv, "node", "uncordon", n12.node_name)
    ok(srv, "node", "cordon", n13.node_name)
    ok(srv, "resume", sid, "--wait")
    view = info(srv, sid)
    assert (view["state"], view["node"], view["memoryRestored"]) == ("running", n12.node_name, True), view
    _injected(srv, sid)
    _trusts(srv, sid, n12, [n13])
    # node 12's agent killed and started again (its sandboxes keep running; its proxy's redirect set starts empty):
    # the server reaches the new agent process over the link and tells it again which sandboxes go through its proxy
    n12.kill()
    n12.start()
    poll(lambda: _curl(srv, sid, f"https://{API_HOST}/again", "-H", HDR)[0] == 200, "injection after the agent's "
         "restart", timeout=60)
    _injected(srv, sid)

    # every injected request is in the audit (its record reaches the server just after the response)
    uses = poll(lambda: (u := json.loads(ok(srv, "secret", "log", "apitok", "--json"))["uses"]) and
                len(u) >= 5 + TIMED and u, "the audit of every request", timeout=20)
    assert {u["sandbox"] for u in uses} == {sid} and {u["status"] for u in uses} == {200}
    ok(srv, "node", "uncordon", n13.node_name)


def test_a_node_asking_about_a_sandbox_it_does_not_hold_gets_nothing(
        cluster: tuple[Server, list[NodeHost]], tmp_path: Path) -> None:
    srv, nodes = cluster
    _set_secret(srv, "victimtok", "tok-victim-" + str(time.time_ns()), "--host", API_HOST)
    victim = ok(srv, "new", "--type", "small", "--secret", "victimtok").strip()
    # a node agent of the test's own (a fake node behind the real node API), added like any node: the server polls
    # its egress link, and the test asks through that link as a hostile node's proxy would
    fake = FakeNode(tmp_path / "fake")
    fake.name = f"sefake{slot()}"
    with served_node(fake, "sbxn_hostile-node-token", fake.name) as url:
        ok(srv, "node", "add", url, "--token", "sbxn_hostile-node-token")
        try:
            ok(srv, "node", "cordon", fake.name)
            link = fake.egress_handler.__self__  # the node's sbx.node.remote.egresslink.EgressLink
            poll(link.listening, "the server's poll of the fake node", timeout=30)
            question = {"op": "resolve", "client": "10.0.0.9", "host": API_HOST, "method": "GET", "path": "/"}
            started = time.monotonic()
            assert fake.egress_handler(victim, dict(question)) == {"actions": []}
            assert time.monotonic() - started < 5, "answered by the server, not timed out"
            assert fake.egress_handler("sb_nosuchthing", dict(question)) == {"actions": []}
            poll(lambda: f"asked about {victim}, which the store does not place there" in srv.log.read_text(),
                 "the refusal in the server's log", timeout=10)
        finally:
            ok(srv, "node", "remove", fake.name)
    fake.close()


def test_a_create_with_a_secret_goes_to_a_node_that_runs_a_proxy(cluster: tuple[Server, list[NodeHost]]) -> None:
    """Node 13 restarted without an egress proxy, with more room than node 12: a plain sandbox goes to 13 (the
    most room), one created with --secret to 12, where its secret can be bound. Before, it went to 13 and the
    create answered 409 egress_proxy_unavailable with the sandbox already made."""
    srv, nodes = cluster
    n12, n13 = nodes
    _set_secret(srv, "placetok", "tok-place-" + str(time.time_ns()), "--host", API_HOST)
    made: list[str] = []
    ok(srv, "node", "cordon", n13.node_name)
    try:
        made += [ok(srv, "new", "--type", "small").strip() for _ in range(2)]  # node 12 fills up a little
    finally:
        ok(srv, "node", "uncordon", n13.node_name)
    n13.kill()  # its sandboxes keep running
    n13.extra_env["SBX_EGRESS_PROXY_PORT"] = "0"
    try:
        n13.start()

        def egress_of_13() -> bool | None:
            listed = {n["name"]: n for n in json.loads(ok(srv, "node", "list", "--json"))["nodes"]}
            row = listed[n13.node_name]
            return row["egress"] if row["status"] == "ready" else None

        poll(lambda: egress_of_13() is False, "node 13 without its proxy", timeout=60)
        plain = ok(srv, "new", "--type", "small").strip()
        made.append(plain)
        assert info(srv, plain)["node"] == n13.node_name
        for _ in range(2):
            r = srv.sbx("new", "--type", "small", "--secret", "placetok", "--json", timeout=300)
            assert r.returncode == 0, r.stdout + r.stderr
            sid = json.loads(r.stdout)["sandbox"]["id"]
            made.append(sid)
            assert info(srv, sid)["node"] == n12.node_name
    finally:
        n13.kill()
        n13.extra_env.pop("SBX_EGRESS_PROXY_PORT", None)
        n13.start()
    for sid in made:
        ok(srv, "delete", sid, "--wait")
