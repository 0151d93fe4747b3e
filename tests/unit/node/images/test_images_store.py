"""The image store's pure parts: keys, buildah's failures mapped to error codes, paths resolved inside an image, and
the files of an image found, refused while held, removed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sbx.config import Settings
from sbx.guest import recipe
from sbx.node.host.image import hold_image
from sbx.node.images import store
from sbx.node.images.buildah import classify
from sbx.node.images.errors import CODES, ImageError
from sbx.node.images.facts import ImageFacts
from sbx.node.images.layer import resolve


def test_the_key_covers_source_recipe_and_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    a = store.image_key("sha256:" + "1" * 64)
    assert len(a) == 64 and a == store.image_key("sha256:" + "1" * 64)
    assert store.image_key("sha256:" + "2" * 64) != a
    monkeypatch.setattr(store, "LAYER_VERSION", store.LAYER_VERSION + 1)
    assert store.image_key("sha256:" + "1" * 64) != a
    monkeypatch.undo()
    monkeypatch.setattr(recipe, "recipe_hash", lambda: "0" * 64)
    assert store.image_key("sha256:" + "1" * 64) != a


RUN_FAILED = [
    "STEP 1/3: FROM oci-archive:/b.tar",
    "Copying config sha256:df67",
    "STEP 2/3: RUN apt-get install nope",
    "Reading package lists...",
    "E: Unable to locate package nope",
    'Error: building at STEP "RUN apt-get install nope": while running runtime: exit status 100',
]


def test_a_failed_run_names_its_step_exit_and_output() -> None:
    e = classify(RUN_FAILED, 1)
    assert e.code == "build_step_failed"
    assert e.message.startswith("step 2/3 RUN apt-get install nope: exit 100")
    assert "Unable to locate package nope" in e.message and "Copying" not in e.message


@pytest.mark.parametrize(
    ("lines", "code", "says"),
    [
        (["STEP 1/2: FROM scratch", "STEP 2/2: COPY nope /x",
          'Error: building at STEP "COPY nope /x": checking on sources under "/c": copier: stat: "/nope": no such file '
          "or directory"], "copy_source_missing", "step 2/2 COPY nope /x"),
        (['Error: building at STEP "RUNN ": Build error: Unknown instruction: "RUNN" &imagebuilder.Step{}'],
         "bad_dockerfile", 'Unknown instruction: "RUNN"'),
        (["STEP 1/1: FROM oci-archive:/x.tar",
          "Error: creating build container: creating temp directory: open /x.tar: no such file or directory"],
         "bad_archive", "/x.tar"),
        (["Error: mkdir /store: permission denied"], "image_build_failed", "permission denied"),
    ],
)
def test_buildah_failures_map_to_codes(lines: list[str], code: str, says: str) -> None:
    e = classify(lines, 125)
    assert e.code == code and says in e.message, e.message


def test_every_code_is_declared() -> None:
    with pytest.raises(ValueError):
        ImageError("no_such_code", "x")
    assert {"bad_dockerfile", "build_step_failed", "copy_source_missing", "bad_archive", "image_no_shell",
            "unsupported_image", "image_build_failed", "image_not_found", "image_in_use"} == set(CODES)


def test_paths_resolve_inside_the_image_never_on_the_host(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/dash").write_text("")
    os.symlink("usr/bin", root / "bin")  # merged /usr, relative
    os.symlink("/usr/bin/dash", root / "usr/bin/sh")  # absolute: the image's root, not the host's
    os.symlink("/etc", root / "etc")  # pointing at the host's /etc if followed on the host
    os.symlink("../../../../../../usr/bin/dash", root / "usr/bin/up")  # ".." stops at the image's root
    os.symlink("loop", root / "loop")
    assert resolve(root, "/bin/sh") == root / "usr/bin/dash"
    assert resolve(root, "/usr/bin/up") == root / "usr/bin/dash"
    assert resolve(root, "/etc/passwd") is None  # the image's /etc is a link to itself: no such file
    assert resolve(root, "/loop") is None
    assert resolve(root, "/usr/bin/dash/x") is None


def _facts(key: str) -> ImageFacts:
    return ImageFacts(key=key, os_id="", os_name="", init="minimal", shell="/bin/sh")


def test_load_hold_and_delete(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    d = settings.images_dir
    d.mkdir(parents=True)
    key = "cd" * 32
    for bad in (key, "not-a-key"):
        with pytest.raises(ImageError) as e:
            store.load_facts(settings, bad)
        assert e.value.code == "image_not_found"
    (d / f"{key}.ext4").write_bytes(b"fs")
    (d / f"{key}.json").write_text(json.dumps(_facts(key).to_json()))
    (d / f"{key}.oci.tar").write_bytes(b"tar")
    assert store.load_facts(settings, key) == _facts(key)
    assert store.base_archive(settings, key) == d / f"{key}.oci.tar"
    hold = hold_image(store.image_file(settings, key))
    try:
        with pytest.raises(ImageError) as e:
            store.delete_image(settings, key)
        assert e.value.code == "image_in_use"
    finally:
        os.close(hold)
    store.delete_image(settings, key)
    assert not list(d.glob(f"{key}*"))
    with pytest.raises(ImageError) as e:
        store.delete_image(settings, key)
    assert e.value.code == "image_not_found"


def test_device_nodes_go_links_stay(tmp_path: Path) -> None:
    from sbx.node.images.layer import drop_device_nodes

    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True)
    (root / "opt").mkdir()
    os.mknod(root / "dev/null", 0o666 | 0o020000, os.makedev(1, 3))
    os.mknod(root / "opt/disk", 0o666 | 0o060000, os.makedev(8, 0))
    os.symlink("/dev/sda", root / "opt/link")
    (root / "opt/file").write_text("x")
    assert drop_device_nodes(root) == 2
    assert sorted(p.name for p in (root / "opt").iterdir()) == ["file", "link"]
