"""sbx.node.network.netlink.dump: an interrupted netlink dump is read again (CI: a reconcile failed with "dump
interrupted" while other servers made veths)."""

from __future__ import annotations

import pytest
from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkDumpInterrupted

from sbx.node.network import netlink


def test_an_interrupted_dump_is_read_again_and_a_lasting_one_raises() -> None:
    calls = []

    def flaky(kind: str) -> list[str]:
        calls.append(kind)
        if len(calls) < 3:
            raise NetlinkDumpInterrupted()
        return [kind]

    assert netlink.dump(flaky, "links") == ["links"] and len(calls) == 3

    def never(**_kw: object) -> list[str]:
        raise NetlinkDumpInterrupted()

    with pytest.raises(NetlinkDumpInterrupted):
        netlink.dump(never)


def test_a_real_dump_lists_the_links() -> None:
    with IPRoute() as ipr:
        names = {link.get_attr("IFLA_IFNAME") for link in netlink.dump(ipr.get_links)}
    assert "lo" in names
