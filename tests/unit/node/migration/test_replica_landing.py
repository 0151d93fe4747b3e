"""The landing side of a seal replica (sbx.node.migration.replicas): files are hash-checked as they land, the replica
becomes whole in one rename only once every file is there, an unfinished one (a copy cut by a crash) is listed as
not whole so the control plane drops it, and ``drop_replica`` removes both."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from sbx.node.migration.replicas import ReplicaMixin
from sbx.node.types import NodeError

SID = "sb_abcdefghij"


class _Holder(ReplicaMixin):
    def __init__(self, root: Path):  # no NodeBase start: only the paths a replica uses
        self.settings = SimpleNamespace(node_dir=root)  # type: ignore[assignment]
        self.sandboxes_dir = root / "sandboxes"


def _manifest(**files: bytes) -> dict:  # type: ignore[type-arg]
    return {"id": SID, "parent": None, "memory": any(n.startswith("memory__") for n in files), "from": "node0",
            "files": {n.replace("__", "/"): {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
                      for n, b in files.items()}}


def test_a_replica_is_whole_or_absent(tmp_path: Path) -> None:
    node = _Holder(tmp_path)
    disk, pages = b"d" * 2_000_000, b"p" * 100_000
    node.begin_replica(_manifest(**{"disk.delta": disk, "memory__pages-1.img": pages}))
    node.replica_stream(SID, "disk.delta", iter([disk[:10], disk[10:]]))
    with pytest.raises(NodeError) as e:  # one bit flipped on the way
        node.replica_stream(SID, "memory/pages-1.img", iter([b"q" + pages[1:]]))
    assert e.value.code == "transfer_corrupt"
    assert node.replicas() == {SID: {"bytes": 0, "memory": False, "from": "node0", "whole": False}}
    with pytest.raises(NodeError) as e:  # a file is missing: it doesn't become a replica
        node.seal_replica(SID)
    assert e.value.code == "transfer_corrupt"
    assert node.replicas() == {} and not (tmp_path / "replicas" / SID).exists()

    node.begin_replica(_manifest(**{"disk.delta": disk, "memory__pages-1.img": pages}))
    node.replica_stream(SID, "disk.delta", iter([disk]))
    node.replica_stream(SID, "memory/pages-1.img", iter([pages]))
    assert node.seal_replica(SID) == {"bytes": len(disk) + len(pages), "memory": True}
    assert (tmp_path / "replicas" / SID / "memory" / "pages-1.img").read_bytes() == pages
    assert node.replicas()[SID] == {"bytes": len(disk) + len(pages), "memory": True, "from": "node0", "whole": True}
    for bad in ("../x", "sb_abcdefghij/../../etc", "."):
        with pytest.raises(NodeError):
            node.drop_replica(bad)
    node.drop_replica(SID)
    assert node.replicas() == {}
    with pytest.raises(NodeError) as e:
        node.promote_replica(SID)
    assert e.value.code == "not_found"


def test_no_replica_of_a_sandbox_this_node_holds(tmp_path: Path) -> None:
    node = _Holder(tmp_path)
    (tmp_path / "sandboxes" / SID).mkdir(parents=True)
    (tmp_path / "sandboxes" / SID / "node.json").write_text("{}")
    with pytest.raises(NodeError) as e:
        node.begin_replica(_manifest(**{"disk.delta": b"x"}))
    assert e.value.code == "exists"
