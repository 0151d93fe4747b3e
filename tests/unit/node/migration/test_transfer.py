"""The landing side of a stopped sandbox's move (sbx.node.migration.transfer): every file is hashed as it is written and
refused when its bytes differ from the manifest's (nothing is left of it), a name outside the manifest is refused,
and the base image's content digest sees a change of one byte (not only of the length)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from sbx.node.migration.transfer import TransferMixin, image_digest
from sbx.node.types import NodeError


class _Landing(TransferMixin):
    def __init__(self, root: Path):  # no NodeBase start: only the paths the import uses
        self.settings = SimpleNamespace(node_dir=root)  # type: ignore[assignment]
        self.sandboxes_dir = root / "sandboxes"


def _manifest(data: bytes) -> dict:  # type: ignore[type-arg]
    return {"id": "sb_abcdefghij", "parent": None, "memory": False,
            "files": {"disk.delta": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}


def test_a_file_lands_only_with_its_hash(tmp_path: Path) -> None:
    node = _Landing(tmp_path)
    data = b"x" * 3_000_000
    node.begin_import(_manifest(data))
    bad = bytearray(data)
    bad[1_500_000] ^= 1
    with pytest.raises(NodeError) as e:
        node.import_stream("sb_abcdefghij", "disk.delta", iter([bytes(bad[:1 << 20]), bytes(bad[1 << 20:])]))
    assert e.value.code == "transfer_corrupt"
    inc = tmp_path / "incoming" / "sb_abcdefghij"
    assert not (inc / "disk.delta").exists() and not list(inc.glob("*.part"))
    with pytest.raises(NodeError) as e:  # cut short
        node.import_stream("sb_abcdefghij", "disk.delta", iter([data[:1000]]))
    assert e.value.code == "transfer_corrupt"
    for name in ("../node.json", "memory/../../x", "other"):
        with pytest.raises(NodeError) as e:
            node.import_stream("sb_abcdefghij", name, iter([b""]))
        assert e.value.code == "not_found"
    node.import_stream("sb_abcdefghij", "disk.delta", iter([data[:7], data[7:]]))
    assert (inc / "disk.delta").read_bytes() == data
    node.abort_import("sb_abcdefghij")
    assert not inc.exists()


def test_the_image_digest_is_of_the_content(tmp_path: Path) -> None:
    img = tmp_path / "base.ext4"
    with img.open("wb") as f:
        f.truncate(64 << 20)  # sparse: holes hash as zeros
        f.seek(10 << 20)
        f.write(b"data" * 1000)
    first = image_digest(img)
    assert first == hashlib.sha256(img.read_bytes()).hexdigest()
    assert image_digest(img) == first  # cached
    with img.open("r+b") as f:
        f.seek((10 << 20) + 5)
        f.write(b"X")
    assert image_digest(img) != first and image_digest(img) == hashlib.sha256(img.read_bytes()).hexdigest()
