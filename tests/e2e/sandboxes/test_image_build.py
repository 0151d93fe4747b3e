"""The image build (mmdebstrap, root mode) mounts nothing in the host's mount namespace.

mmdebstrap mounts proc, sys, dev and a tmpfs for /dev/shm while it bootstraps; on this host a build once left a
tmpfs over the host's own /dev/shm, which hid PostgreSQL's shared memory from every new connection ("could not
open shared memory segment") and let the next build's cleanup delete files in it. The build now runs in a mount
namespace of its own. This test bootstraps a small image (the ``essential`` variant, one package) and watches the
host's mount table the whole time.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from sbx.guest import recipe
from sbx.node.host import image
from sbx.storage import mounts

pytestmark = pytest.mark.e2e


def test_an_image_build_mounts_nothing_on_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recipe, "VARIANT", "essential")
    monkeypatch.setattr(recipe, "PACKAGES", ("ca-certificates",))
    rootfs = tmp_path / "rootfs"
    shm_before = sum(1 for m in mounts.mounts() if str(m.mountpoint) == "/dev/shm")
    seen: set[tuple[Path, str]] = set()
    done = threading.Event()

    def watch() -> None:
        # only what the build could mount: below its rootfs, or over /dev/shm (other tests' sandboxes mount and
        # unmount their own disks meanwhile)
        while not done.is_set():
            ms = mounts.mounts()
            seen.update((m.mountpoint, m.fstype) for m in ms if str(m.mountpoint).startswith(str(rootfs) + "/"))
            if sum(1 for m in ms if str(m.mountpoint) == "/dev/shm") != shm_before:
                seen.add((Path("/dev/shm"), "another mount"))
            done.wait(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        image._bootstrap(rootfs, image.mirror_lines(), lambda _msg: None)
    finally:
        done.set()
        t.join()
    assert (rootfs / "usr" / "bin").is_dir()  # the bootstrap really ran
    assert seen == set(), f"the build mounted these in the host's namespace: {sorted(seen)}"
