"""A build's claim: its uid range counts as taken for every node's sandboxes, its address for the node's leases,
and a claim whose process died stops counting."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from sbx.config import Settings
from sbx.node.agentbase import NodeBase
from sbx.node.container import rootfs
from sbx.node.images.reserve import builds_dir, claim, drop_stale
from sbx.storage import idmap


def test_a_claim_holds_a_range_and_an_address_until_it_ends(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, node_name="n1", subnet="10.200.0.0/16")
    node = NodeBase(settings)
    with claim(settings, node._new_lease) as c:
        assert c.uid_base == idmap.uid_base(0)
        assert c.lease is not None and c.lease["host_veth"].startswith("v")
        assert c.uid_base in rootfs.taken_uid_bases(settings.volume)
        with claim(settings) as other:  # the next claim (or sandbox) gets another range
            assert other.uid_base == idmap.uid_base(1) and other.lease is None
        assert node._new_lease("sandbox1")["address"] != c.lease["address"]
        record = json.loads((builds_dir(settings) / f"{c.build_id}.json").read_text())
        assert record["uidBase"] == c.uid_base and record["lease"] == c.lease
    assert not list(builds_dir(settings).iterdir())
    assert rootfs.taken_uid_bases(settings.volume) == set()


def test_a_dead_builds_claim_is_dropped(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, node_name="n1")
    dead = subprocess.Popen(["true"])
    dead.wait()
    folder = builds_dir(settings)
    folder.mkdir(parents=True)
    (folder / "gone.json").write_text(json.dumps({"uidBase": idmap.uid_base(0), "pid": dead.pid, "lease": None}))
    assert drop_stale(settings) == ["gone"]
    with claim(settings) as c:
        assert c.uid_base == idmap.uid_base(0)
