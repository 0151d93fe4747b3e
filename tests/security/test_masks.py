"""The masks over host facts, attacked as root from inside a real sandbox (issue 33): what a sandbox sees with its
masks in place, and what it sees after taking them away.

runc 1.1 makes the masks inside the sandbox's own user namespace, so the kernel does not lock them: root inside
unmounts them and mounts a fresh sysfs or procfs beside them (measured before and after this change; locking them
would need the mounts made in a more privileged mount namespace before the sandbox's is copied from it, which runc
1.1 does not do and a CRIU restore would not keep). So what they hide is made harmless instead:

- every loop device of a sandbox disk is bound through a detached mount (:mod:`sbx.storage.loopdev`): its
  ``backing_file`` reads ``/disk.ext4`` (before: ``/var/lib/sbx/volume/nodes/<node>/sandboxes/<id>/disk.ext4`` of
  every sandbox on the host);
- the masks of ``/sys`` directories bind the node's read-only ``sbx-masked`` tmpfs (:func:`sbx.runtime.oci.
  ensure_mask_dir`): ``/proc/self/mountinfo`` shows ``/`` of it (before: ``/run/sbx/<node>/bundles/<id>/masked``
  on the host's disk, with the node name and the sandbox's id).

Against main before this change both tests fail: the backing files and mountinfo name the host paths and ids.
Left as it was: the host's kernel command line (``/proc/cmdline`` behind its mask, and in a fresh procfs) is the
host's; no filesystem change can make it the sandbox's."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbx.config import load_settings
from sbx.storage import mounts
from tests.e2e.conftest import Server
from tests.security.conftest import info, new_sandbox, root
from tests.slots import slotted

pytestmark = pytest.mark.e2e

# Takes every mask of /sys and two of /proc away, mounts a fresh sysfs and procfs, and prints what is then visible:
# each loop device's backing file, the mountinfo of the sandbox and of the fresh procfs, the partitions.
UNMASK = r"""
for m in /sys/block /sys/class/block /sys/dev/block /sys/devices/virtual/block /sys/fs/ext4 /sys/fs/xfs \
         /sys/kernel/debug /sys/firmware /proc/partitions /proc/cmdline; do
    umount "$m" 2>/dev/null && echo "unmounted $m"
done
mkdir -p /mnt/sys2 /mnt/proc2
mount -t sysfs -o ro sysfs /mnt/sys2 && echo "mounted a fresh sysfs"
mount -t proc proc /mnt/proc2 && echo "mounted a fresh procfs"
echo "--- backing"
cat /sys/block/*/loop/backing_file /mnt/sys2/block/*/loop/backing_file 2>/dev/null
echo "--- mountinfo"
cat /proc/self/mountinfo /mnt/proc2/self/mountinfo
echo "--- partitions"
cat /proc/partitions /mnt/proc2/partitions 2>/dev/null
ls /sys/fs/ext4 /mnt/sys2/fs/ext4 2>/dev/null
echo "--- end"
"""


def _node() -> str:
    return slotted(os.environ.get("SBX_SEC_NODE", "sec"), "sbxsec0", "10.95.0.0/16")[0]


def _secrets(sids: list[str]) -> list[str]:
    """What must never show inside: the sandboxes' ids and this node's host folders that hold sandbox disks and
    bundles (other servers on a shared test host may run older code: their paths are theirs to hide)."""
    settings = load_settings(node_name=_node())
    return [*sids, f"{settings.node_dir}/", f"/run/sbx/{_node()}/", "/bundles/"]


def _loop_of(sid: str) -> str:
    """The loop device (``loop7``) of sandbox ``sid``'s disk on the host."""
    disk = load_settings(node_name=_node()).node_dir / "sandboxes" / sid / "disk.ext4"
    [dev] = mounts.loop_devices_for(disk)
    return dev.removeprefix("/dev/")


@pytest.fixture(scope="module")
def pair(sec_server: Server) -> Iterator[tuple[str, str]]:
    a, b = new_sandbox(sec_server), new_sandbox(sec_server)
    yield a, b
    for sid in (a, b):
        sec_server.sbx("delete", sid, "--wait")


def _check_masked_view(server: Server, sid: str, others: list[str]) -> None:
    """With its masks in place: the masks are the node's ``sbx-masked`` tmpfs and nothing in mountinfo names a
    host path or an id."""
    r = root(server, sid, "cat /proc/self/mountinfo; ls -A /sys/block /sys/fs/ext4")
    assert r.returncode == 0, r.stderr
    assert " /sys/block ro," in r.stdout and "- tmpfs sbx-masked ro" in r.stdout, r.stdout
    leaked = [s for s in _secrets([sid, *others]) if s in r.stdout]
    assert leaked == [], (leaked, r.stdout)
    assert "sb_" not in r.stdout, r.stdout


def _check_unmasked_view(server: Server, sid: str, others: list[str]) -> None:
    """Masks taken away, fresh sysfs and procfs mounted: the sandboxes' own loop devices name ``/disk.ext4`` only,
    and no output names a host path of this node or an id of its sandboxes."""
    r = root(server, sid, UNMASK)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "--- end" in out, out
    leaked = [s for s in _secrets([sid, *others]) if s in out]
    assert leaked == [], (leaked, out)
    assert not re.search(r"sb_[0-9a-z]{10}", out.split("--- mountinfo")[1]), out  # mountinfo: no id at all
    seen = out.split("--- backing")[1].split("--- mountinfo")[0]
    for s in (sid, *others):  # the sandboxes' own disks show, by file name only
        loop = _loop_of(s)
        text = Path(f"/sys/block/{loop}/loop/backing_file").read_text().strip()
        assert text == "/disk.ext4", (s, loop, text)
    assert "/disk.ext4" in seen.split(), seen


def test_masks_hide_and_what_is_behind_them_names_no_sandbox_or_host_path(sec_server: Server,
                                                                          pair: tuple[str, str]) -> None:
    a, b = pair
    _check_masked_view(sec_server, a, [b])
    _check_unmasked_view(sec_server, a, [b])


def test_after_a_memory_resume_the_masks_and_loop_names_stay_harmless(sec_server: Server,
                                                                      pair: tuple[str, str]) -> None:
    """CRIU restores the masks (external binds of the node's mask filesystem) and the node binds the disk to a
    fresh loop device, again by file name only."""
    a, b = pair
    sid = new_sandbox(sec_server)
    sec_server.sbx("stop", sid, "--wait", check=True)
    sec_server.sbx("resume", sid, "--wait", check=True)
    assert info(sec_server, sid)["sandbox"]["memoryRestored"] is True
    _check_masked_view(sec_server, sid, [a, b])
    _check_unmasked_view(sec_server, sid, [a, b])
    sec_server.sbx("delete", sid, "--wait", check=True)
