"""Fixtures for the security tests: attacks run as root inside real sandboxes on their own server.

``sec_server`` is node ``sec`` on bridge ``sbxsec0`` / 10.95.0.0/16 (SBX_SEC_NODE / SBX_SEC_BRIDGE / SBX_SEC_SUBNET
let two runs share a host). ``new_sandbox`` creates a sandbox and returns its id; ``root`` runs a shell script as
root inside one and returns the completed process."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import Server, start_server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="session")
def sec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server for the security tests, separate from the e2e session server."""
    with start_server(
        tmp_path_factory.mktemp("sbx-sec"),
        node=os.environ.get("SBX_SEC_NODE", "sec"),
        bridge=os.environ.get("SBX_SEC_BRIDGE", "sbxsec0"),
        subnet=os.environ.get("SBX_SEC_SUBNET", "10.95.0.0/16"),
    ) as srv:
        yield srv


def new_sandbox(server: Server, *args: str) -> str:
    """``sbx new --type small ARGS`` on ``server``; returns the new sandbox's id."""
    r = server.sbx("new", "--type", "small", "--json", *args, check=True)
    return str(json.loads(r.stdout)["sandbox"]["id"])


def root(server: Server, sid: str, script: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (bash) as root inside sandbox ``sid`` (``sbx exec -u root``), killed after ``timeout`` seconds;
    returns the completed process (text)."""
    return server.sbx("exec", sid, "-u", "root", "--timeout", str(timeout), "--", script, timeout=timeout + 60)


def info(server: Server, sid: str) -> dict[str, Any]:
    """The sandbox's ``info --json`` document."""
    return json.loads(server.sbx("info", sid, "--json", check=True).stdout)  # type: ignore[no-any-return]
