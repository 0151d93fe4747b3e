"""Helpers shared by the end-to-end tests."""

from __future__ import annotations

import time
from typing import Any


def poll(fn: Any, what: str, timeout: float = 60.0, interval: float = 0.5) -> Any:
    """Call ``fn`` every ``interval`` seconds until it returns something truthy (returned), for at most ``timeout``
    seconds; then fail with ``what`` and the last value. A bound for tests that wait on background work, not a speed
    assertion (the unit tests' ``wait_until`` is this with a shorter interval)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} (last: {value!r})")
        time.sleep(interval)


IDENTITY = ("hostname; cat /etc/hostname; cat /etc/machine-id; ip -4 -o addr show eth0 | awk '{print $4}'; "
            "cat /sys/class/net/eth0/address; cat /etc/ssh/ssh_host_ed25519_key.pub | cut -d' ' -f2")
"""What makes a sandbox itself, one per line: hostname (UTS), /etc/hostname, machine-id, IPv4/prefix, MAC, SSH host
key (ed25519, base64)."""


def new_small(fs: Any, *args: str) -> str:
    """``sbx new --type small ARGS`` on the fault server ``fs`` (:class:`tests.e2e.faultsrv.FaultServer`); its id."""
    assert fs.srv is not None
    return str(fs.srv.sbx("new", "--type", "small", *args, check=True).stdout.strip())


def sh(fs: Any, sid: str, cmd: str) -> str:
    """``sbx exec SID CMD`` on ``fs``'s server; its stdout (a non-zero exit fails)."""
    assert fs.srv is not None
    return str(fs.srv.sbx("exec", sid, cmd, check=True).stdout)


def identity(fs: Any, sid: str) -> dict[str, str]:
    """The sandbox's :data:`IDENTITY` as ``{hostname, etc_hostname, machine_id, ip, mac, ssh_key}``, read once its
    sshd runs with its own host keys (sbx-identity makes them a moment after the sandbox answers)."""
    try:
        poll(lambda: fs.srv is not None and fs.srv.sbx("exec", sid, "systemctl -q is-active ssh.service && "
                                                       "test -s /etc/ssh/ssh_host_ed25519_key.pub").returncode == 0,
             f"{sid}'s sshd with its own host keys", timeout=60)
    except AssertionError as e:  # say what the units did, for a failure seen only in CI
        why = fs.srv.sbx("exec", sid, "systemctl status --no-pager -n 20 sbx-identity.service ssh.service; "
                                      "ls -l /etc/ssh; systemctl is-system-running") if fs.srv else None
        raise AssertionError(f"{e}\n{why.stdout if why else ''}{why.stderr if why else ''}") from None
    lines = sh(fs, sid, IDENTITY).split("\n")
    keys = ("hostname", "etc_hostname", "machine_id", "ip", "mac", "ssh_key")
    return dict(zip(keys, lines[:6], strict=True))
