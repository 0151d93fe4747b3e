"""The egress policy's parsing and the nftables rulesets the network module loads (checked by nft, not applied)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sbx.config import load_settings
from sbx.node.network import bridge as network
from sbx.node.network import egress, ruleset


def test_parse_allow_normalises_and_names_the_bad_item() -> None:
    assert egress.parse_allow("10.1.0.0/16, 192.168.5.7,,") == ("10.1.0.0/16", "192.168.5.7/32")
    assert egress.parse_allow(["172.16.0.0/12"]) == ("172.16.0.0/12",)
    assert egress.parse_allow("") == ()
    for bad in ("10.1.0.1/16", "fc00::/7", "nonsense", "10.0.0.0/33"):
        with pytest.raises(egress.EgressConfigError, match=f"egress_allow: '{bad}'") as e:
            egress.parse_allow(f"10.0.0.0/8,{bad}")
        assert e.value.code == "invalid_egress_allow"


def test_nameservers_skip_loopback_ipv6_and_junk(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("# x\nnameserver 127.0.0.53\nnameserver 10.255.255.53\nnameserver fd00::1\n"
                    "nameserver bogus\nsearch example\nnameserver 1.1.1.1\n")
    assert egress.host_nameservers(conf) == ["10.255.255.53", "1.1.1.1"]
    assert egress.host_nameservers(tmp_path / "missing") == []


def test_mirror_endpoints_from_apt_lines() -> None:
    lines = ["deb http://mirror.internal/debian bookworm main",
             "deb http://mirror.internal/debian bookworm-updates main",
             "deb https://sec.example:8443/debian-security bookworm-security main", "deb file:/srv/repo bookworm main",
             "deb [trusted=yes] http://10.0.0.9:3142/debian bookworm main"]
    assert egress.mirror_endpoints(lines) == [("mirror.internal", 80), ("sec.example", 8443), ("10.0.0.9", 3142)]


def test_policy_allows_mirror_addresses_and_names_the_nameservers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's nameservers are no service a sandbox reaches any more (issue 33): they are the policy's
    ``nameservers``, whose port 53 the node redirects to its own resolver, with the resolver's non-loopback
    upstreams."""
    monkeypatch.setattr(egress, "host_nameservers", lambda: ["10.255.255.53"])
    monkeypatch.setattr(egress, "host_networks", lambda: ["192.0.2.0/24"])
    p = egress.egress_policy("172.31.0.0/16", apt_lines=["deb http://10.20.30.40/debian bookworm main"],
                             dns_upstreams=["127.0.0.53", "198.51.100.53", "10.255.255.53"])
    assert p.allow == ("172.31.0.0/16",)
    assert set(p.services) == {("10.20.30.40", "tcp", 80)}
    assert p.nameservers == ("10.255.255.53", "198.51.100.53")
    assert "169.254.0.0/16" in p.deny and "10.0.0.0/8" in p.deny and "192.0.2.0/24" in p.deny


def test_settings_read_egress_allow_from_env_and_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "server.toml"
    cfg.write_text('egress_allow = ["10.1.0.0/16", "10.2.0.0/16"]\n')
    monkeypatch.setenv("SBX_CONFIG", str(cfg))
    monkeypatch.delenv("SBX_EGRESS_ALLOW", raising=False)
    assert load_settings().egress_allow == "10.1.0.0/16,10.2.0.0/16"
    monkeypatch.setenv("SBX_EGRESS_ALLOW", "10.3.0.0/16")
    assert load_settings().egress_allow == "10.3.0.0/16"


def test_node_group_is_stable_and_never_the_default_group() -> None:
    assert ruleset.node_group("net") == ruleset.node_group("net")
    assert ruleset.node_group("a") != ruleset.node_group("b")
    assert all(1 <= ruleset.node_group(n) < 2**31 for n in ("", "node0", "x" * 64))


def _nft_check(script: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["nft", "-c", "-f", "-"], input=script.encode(), capture_output=True)


@pytest.mark.skipif(shutil.which("nft") is None, reason="nft is a host package of sbx setup")
def test_rulesets_pass_nft_check() -> None:
    """nft parses and the kernel accepts both tables (``-c``: checked, nothing applied)."""
    pol = egress.EgressPolicy(allow=("172.31.0.0/16",), services=(("10.20.30.40", "tcp", 80),),
                              nameservers=("10.255.255.53",))
    r = _nft_check(ruleset.inet_ruleset("sbx_unit", "sbxunit0", "10.77.0.0/16", pol, proxy_port=7443,
                                        max_connections=4096, connection_rate=200, dns_rate=50, dns_burst=200))
    assert r.returncode == 0, r.stderr.decode()
    r = _nft_check(ruleset.inet_ruleset("sbx_unit", "sbxunit0", "10.77.0.0/16", egress.EgressPolicy()))
    assert r.returncode == 0, r.stderr.decode()
    lease = network.Lease("10.77.0.2/16", "10.77.0.1", "vabcdefghij")
    r = _nft_check(ruleset.bridge_ruleset("sbx_unit", 7) +
                   f"add element bridge sbx_unit pins {{ {network._pin(lease)} }}\n")
    assert r.returncode == 0, r.stderr.decode()


@pytest.mark.skipif(shutil.which("nft") is None, reason="nft is a host package of sbx setup")
def test_nft_batches_apply_whole_or_not_at_all() -> None:
    from sbx.node.network import nft

    table = f"sbxunit_{os.getpid()}"
    try:
        with pytest.raises(nft.NftError, match="Error"):  # the second line fails: the table is not made either
            nft.run(f"add table bridge {table}\nadd rule bridge {table} nosuch drop\n")
        assert table not in subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
        nft.run(f"add table bridge {table}\n")
        assert table in subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["nft", "delete", "table", "bridge", table], capture_output=True)
