"""What an archive is, told by its content: OCI layout folder, OCI archive, docker save archive, flat rootfs tar;
corrupt, truncated and foreign files are bad archives."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from sbx.node.images.errors import ImageError
from sbx.node.images.sources import detect, transport


def _tar(path: Path, members: dict[str, bytes], mode: str = "w") -> Path:
    with tarfile.open(path, mode) as tar:  # type: ignore[call-overload]
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            if name.endswith("/"):
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
                continue
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_kinds_by_content_not_by_name(tmp_path: Path) -> None:
    layout = {"oci-layout": b'{"imageLayoutVersion":"1.0.0"}', "index.json": b"{}", "blobs/": b""}
    assert detect(_tar(tmp_path / "image.docker.tar", layout)) == "oci-archive"
    assert detect(_tar(tmp_path / "x.oci", {"./oci-layout": b"{}", "./index.json": b"{}"})) == "oci-archive"
    docker = {"manifest.json": json.dumps([{"Layers": []}]).encode(), "repositories": b"{}"}
    assert detect(_tar(tmp_path / "image.oci.tar", docker)) == "docker-archive"
    rootfs = {"./": b"", "./etc/": b"", "./etc/os-release": b"ID=x\n", "./bin/": b""}
    assert detect(_tar(tmp_path / "rootfs.tar.gz", rootfs, "w:gz")) == "rootfs-tar"
    folder = tmp_path / "layout"
    folder.mkdir()
    (folder / "oci-layout").write_text("{}")
    (folder / "index.json").write_text("{}")
    assert detect(folder) == "oci-layout"
    assert detect("docker://registry.invalid/x:1") == "registry"


def test_bad_archives(tmp_path: Path) -> None:
    good = _tar(tmp_path / "good.tar", {"etc/passwd": b"x" * 20000, "bin/sh": b"y" * 20000})
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(good.read_bytes()[:15000])
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"\x01not a tar at all" * 100)
    other = _tar(tmp_path / "other.tar", {"README": b"hello"})
    empty_dir = tmp_path / "dir"
    empty_dir.mkdir()
    for bad in (truncated, junk, other, empty_dir, tmp_path / "missing.tar"):
        with pytest.raises(ImageError) as e:
            detect(bad)
        assert e.value.code == "bad_archive", bad


def test_transports() -> None:
    assert transport("oci-archive", "/a.tar") == "oci-archive:/a.tar"
    assert transport("docker-archive", "/a.tar") == "docker-archive:/a.tar"
    assert transport("oci-layout", "/l") == "oci:/l"
    with pytest.raises(ValueError):
        transport("rootfs-tar", "/a.tar")
