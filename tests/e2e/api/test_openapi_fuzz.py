"""Issue 9 item 7: the OpenAPI document describes the API. Schemathesis generates requests from ``/openapi.json``
(valid and invalid ones) and runs every check against the real server with real sandboxes: no 5xx, every status,
content type, header and body as documented, invalid data refused, valid data accepted.

Bounded for a 2-core machine: a few examples per operation, fewer for the operations that boot or stop sandboxes
(create, fork, resume, stop, delete), a wall-clock cap, and a request timeout that ends any long exec the fuzzer
happens to write (the server kills a command whose client went away)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import VENV_BIN

pytestmark = pytest.mark.e2e

MAX_EXAMPLES = 20
SLOW_EXAMPLES = 2
MAX_TIME = 600
"""Seconds the schemathesis run may take at most (it takes far less: the bound is for a loaded machine)."""


def _toml(value: Any) -> str:
    return json.dumps(value)



ST_LAUNCHER = """
import sys
import hypothesis.internal.lambda_sources as sources
# Debian 12's Python 3.11 sometimes raises SystemError ("AST constructor recursion depth mismatch", a CPython bug)
# when hypothesis parses its own source to describe a filter's lambda for a strategy's repr; the description is
# cosmetic, so it is not computed.
sources.lambda_description = lambda f: "lambda: <source not parsed>"
from schemathesis.cli import schemathesis
sys.argv[0] = "st"
sys.exit(schemathesis())
"""
"""Runs the schemathesis CLI (what ``st`` runs) without hypothesis's lambda source parsing."""


def test_schemathesis_finds_no_server_error_and_no_schema_mismatch(server: Any, tmp_path: Path) -> None:
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}, timeout=300)
    with http:
        # the fuzzer's sandbox resumes itself after a fuzzed stop; a second one takes the fuzzed deletes
        main = http.post("/v1/sandboxes?wait=true", json={"type": "small", "autoResume": True, "name": "fuzz",
                                                          "labels": {"fuzz": "1"}}).json()["sandbox"]["id"]
        victim = http.post("/v1/sandboxes?wait=true", json={"type": "small", "name": "fuzz-victim"}
                           ).json()["sandbox"]["id"]
        job = http.post(f"/v1/sandboxes/{main}/jobs", json={"command": "echo fuzz"}).json()["job"]["id"]
        http.post(f"/v1/sandboxes/{main}/routes", json={"port": 8000})
        http.post(f"/v1/sandboxes/{main}/exec", json={"command": "mkdir -p data && echo hi > data/f"})
    slow = "|".join([r"^/v1/sandboxes$", r"/fork$", r"/resume$", r"/stop$", r"/snapshot$"])
    config = "\n".join([
        "[parameters]",
        f'"path.sandbox_id" = {_toml(main)}',
        f'"path.job_id" = {_toml(job)}',
        '"path.port" = 8000',
        '"query.follow" = false  # a followed stream only ends with its client: the fuzzer would wait it out',
        "",
        "[[operations]]",
        f"include-path-regex = {_toml(slow)}",
        "include-method = \"POST\"",
        f"generation.max-examples = {SLOW_EXAMPLES}",
        "phases.coverage.enabled = false",
        "",
        "[[operations]]",
        'include-name = "DELETE /v1/sandboxes/{sandbox_id}"',
        f"generation.max-examples = {SLOW_EXAMPLES}",
        "phases.coverage.enabled = false",
        f'parameters = {{ "path.sandbox_id" = {_toml(victim)} }}',
        "",
        # a schema-valid path can still name a file that is a folder, a missing folder or a name over 255 bytes,
        # and a schema-valid body with archive=tar need not be a tar: the files API answers those with its
        # documented 400 codes (not_a_directory, invalid_path, invalid_archive...), which no schema can rule out
        "[[operations]]",
        'include-path-regex = "/files"',
        'checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409"]',
        "",
        # an image upload's body is a tar (a build context) or an image archive: what the fuzzer makes of a binary
        # body is neither, which the image routes answer with their documented 400 bad_context / bad_archive (or
        # 413, 422 for a body that unpacks but builds nothing)
        "[[operations]]",
        'include-path-regex = "^/v1/images/(build|import)$"',
        'checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409", "413", "422"]',
        "",
        # a secret's rules have constraints across fields (a header action needs a header name and a value holding
        # {secret}, basic auth a username, hosts are DNS names with a dot, not addresses): the control plane
        # answers those with its documented 400 invalid_rules
        "[[operations]]",
        'include-name = "PUT /v1/secrets/{name}"',
        'checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409"]',
        "",
        # an SSH public key is a string only a key generator makes: what the fuzzer writes there is answered with
        # the documented 400 invalid_ssh_key (no schema can say "a parseable OpenSSH public key")
        "[[operations]]",
        'include-name = "POST /v1/ssh-keys"',
        'checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409"]',
        # cordoning the session server's own node would make every later create and fork a (documented) 507:
        # the node routes are fuzzed against a name no node has
        "[[operations]]",
        'include-path-regex = "^/v1/nodes/"',
        'parameters = { "path.name" = "fuzz-no-such-node" }',
        'checks.positive_data_acceptance.expected-statuses = ["2xx", "404"]',
    ]) + "\n"
    cfg = tmp_path / "schemathesis.toml"
    cfg.write_text(config)
    report = tmp_path / "report"
    cmd = [
        str(VENV_BIN / "python"), "-c", ST_LAUNCHER, "--config-file", str(cfg), "run", server.url + "/openapi.json",
        "--checks", "all", "--max-examples", str(MAX_EXAMPLES),
        "--phases", "examples,coverage,fuzzing", "--workers", "2", "--request-timeout", "60",
        "--max-response-time", "300",  # no timing assertion: a loaded 2-core machine may be slow
        "--header", f"Authorization: Bearer {server.token}", "--generation-database", "none",
        "--seed", "9", "--no-color", "--report", "junit", "--report-dir", str(report),
        # two routes whose documented answer here is a 5xx, which the fuzzer counts as a server error whatever
        # the config says: adding a node asks the URL for its heartbeat first (a schema-valid URL with no node
        # agent behind it is 502 node_unreachable), and migrating the session's sandbox on its single node is 507
        # insufficient_capacity; both are tested in tests/unit/api instead
        "--exclude-name", "POST /v1/nodes", "--exclude-name", "POST /v1/sandboxes/{sandbox_id}/migrate",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=MAX_TIME, cwd=tmp_path)
    assert r.returncode == 0, f"schemathesis found problems:\n{r.stdout[-20000:]}\n{r.stderr[-3000:]}"
    assert "passed" in r.stdout.lower()
    # the server is still healthy and the fuzzer's sandbox still answers
    assert httpx.get(server.url + "/healthz", timeout=30).json()["ok"] is True
