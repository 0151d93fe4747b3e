"""Images from a Dockerfile or an OCI image, built for real on this host (issue 32): buildah, skopeo, umoci, the sbx
layer's apt installs from the host's mirror through a build network on a real bridge, mkfs.ext4. Nothing is mocked.

The node is an :class:`sbx.node.images.builds.ImagesMixin` on its own bridge and subnet (moved to the run's test
slot), so every build reserves a uid range and a lease as a node's would. The bases come from
:mod:`tests.imagebases` (cached under /var/cache/sbx-test-bases). A missing tool fails the test, never skips it.
Each built image is read back through a read-only loop mount.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sbx.config import Settings, load_settings
from sbx.guest import minimal, recipe
from sbx.node.container import cgroup
from sbx.node.host import aptsources
from sbx.node.host.image import hold_image
from sbx.node.images import store
from sbx.node.images.builds import ImagesMixin
from sbx.node.images.errors import ImageError
from sbx.node.images.facts import ImageFacts
from sbx.node.network import bridge, egress, resolver
from tests import imagebases
from tests.slots import slotted

TOOLS = ("buildah", "skopeo", "umoci", "mmdebstrap", "mkfs.ext4", "nsenter", "unshare")


class Node(ImagesMixin):
    """The image operations of a node, on a bridge of the test's own."""


@dataclasses.dataclass(frozen=True)
class OwnImages(Settings):
    """Settings whose images folder is this test's own (``<volume>/images-<node>``): other test files build and
    delete images in the shared folder at the same time (``--dist loadfile``), and this file checks that folder's
    whole state before and after a failed build. Uid ranges and leases stay the host's, as a real node's."""

    @property
    def images_dir(self) -> Path:
        return self.volume / f"images-{self.node_name}"


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    if os.geteuid() != 0:
        pytest.fail("image builds need root")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    assert not missing, f"tools missing (sbx setup installs them): {missing}"
    name, br, subnet = slotted("imgs", "sbximg0", "10.73.0.0/16")
    base = load_settings(profile="test", node_name=name, bridge=br, subnet=subnet)
    settings = OwnImages(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
    shutil.rmtree(settings.images_dir, ignore_errors=True)  # a killed run's
    policy = egress.egress_policy(settings.egress_allow, aptsources.mirror_lines_if_any())
    bridge.ensure_bridge(settings.bridge, settings.subnet, settings.node_name, policy)
    gateway = str(bridge.gateway_of(settings.subnet).ip)
    resolver.ensure_resolver(gateway)  # the builds' DNS, as a node's prepare starts it
    try:
        yield Node(settings)
    finally:
        resolver.stop_resolver(gateway)
        bridge.remove_bridge(settings.bridge, settings.node_name)
        shutil.rmtree(settings.node_dir, ignore_errors=True)
        shutil.rmtree(settings.images_dir, ignore_errors=True)
        cgroup.remove_tree(f"/sbx/{settings.node_name}")  # what runc made above the builds' cgroups


@pytest.fixture(scope="module")
def made(node: Node) -> Iterator[list[str]]:
    """Keys of the images the tests made; deleted at the end."""
    keys: list[str] = []
    yield keys
    for key in set(keys):
        try:
            store.delete_image(node.settings, key)
        except ImageError as e:
            assert e.code == "image_not_found", e


def _state(settings: Settings) -> dict[str, object]:
    """What a build may leave behind: image files, scratch folders, build claims, mounts and loop devices of them."""
    d = settings.images_dir
    mounts = Path("/proc/self/mountinfo").read_text()
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    return {
        "files": sorted(p.name for p in d.iterdir() if p.is_file()),
        "work": sorted(p.name for p in (d / ".work").iterdir()) if (d / ".work").exists() else [],
        "claims": sorted(p.name for p in (settings.node_dir / "builds").glob("*")),
        "mounts": [line for line in mounts.splitlines() if str(d) in line],
        "loops": [line for line in loops.splitlines() if str(d) in line],
        "builds": sorted(p.name for p in (d / ".builds").glob("*")) if (d / ".builds").exists() else [],
    }


@contextmanager
def mounted(settings: Settings, key: str) -> Iterator[Path]:
    """The image's ext4, mounted read-only (loop)."""
    point = Path(f"/tmp/sbx-img-test-{os.getpid()}-{key[:8]}")
    point.mkdir(exist_ok=True)
    subprocess.run(["mount", "-o", "ro,loop", str(store.image_file(settings, key)), str(point)], check=True)
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=True)
        point.rmdir()


def _passwd(root: Path) -> dict[str, list[str]]:
    return {f[0]: f for f in (line.split(":") for line in (root / "etc/passwd").read_text().splitlines())}


def _assert_systemd_image(root: Path, facts: ImageFacts) -> None:
    assert facts.init == "systemd"
    assert os.readlink(root / "sbin/init").endswith("systemd")
    for f in recipe.GUEST_FILES:
        assert (root / f.dest.lstrip("/")).is_file(), f.dest
    assert (root / "usr/bin/python3").exists() and (root / "usr/bin/sudo").exists()
    assert (root / "usr/sbin/sshd").exists()
    assert "user" in _passwd(root) and facts.users["user"][2] == "/home/user"
    assert "NOPASSWD" in (root / "etc/sudoers.d/user").read_text()
    assert not list((root / "etc/ssh").glob("ssh_host_*"))
    assert (root / "etc/machine-id").read_bytes() == b""
    assert os.readlink(root / "etc/systemd/system/getty@tty1.service") == "/dev/null"
    assert (root / "etc/systemd/system/multi-user.target.wants/ssh.service").is_symlink()
    assert not list((root / "var/lib/apt/lists").glob("*_Packages"))


class Listener:
    """A TCP server on every host address: it counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()


def _host_address() -> str:
    """This host's address on its default route (the host's own services listen there too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))
        return str(s.getsockname()[0])


def _context(tmp: Path, dockerfile: str, files: dict[str, str] | None = None) -> Path:
    ctx = tmp / "ctx"
    ctx.mkdir(exist_ok=True)
    (ctx / "Dockerfile").write_text(dockerfile)
    for name, text in (files or {}).items():
        (ctx / name).parent.mkdir(parents=True, exist_ok=True)
        (ctx / name).write_text(text)
    return ctx


def test_a_dockerfile_build_has_its_files_env_user_and_the_sbx_layer(node: Node, made: list[str],
                                                                     tmp_path: Path) -> None:
    """FROM the local bookworm base (a name the caller resolves), RUN apt-get install, COPY, ENV, WORKDIR, USER; the
    RUN steps run shifted (their uid_map is the build's range) and reach the mirror but not the host's services (the
    bridge gateway, the host's own address); a second identical build is cached."""
    listener = Listener()
    gw = str(bridge.gateway_of(node.settings.subnet).ip)
    probe = " ; ".join(f"(timeout 4 bash -c 'echo > /dev/tcp/{ip}/{listener.port}' && echo open || echo closed) "
                       f">> /probe/{name}" for name, ip in (("gateway", gw), ("host", _host_address())))
    ctx = _context(tmp_path, f"""# a comment
FROM debian-base
RUN apt-get update -q && apt-get install -y -q --no-install-recommends cowsay \\
    && rm -rf /var/lib/apt/lists/*
RUN mkdir /probe && cat /proc/self/uid_map > /probe/uid_map && {probe} \
    && p=$(grep :memory: /proc/self/cgroup | cut -d: -f3) \
    && cat /sys/fs/cgroup/memory$p/memory.limit_in_bytes > /probe/mem
COPY hello.txt /opt/hello.txt
COPY app/ /opt/app/
ENV GREETING="hi there" APP_HOME=/opt/app
WORKDIR /opt/app
RUN useradd --create-home --shell /bin/bash builder
USER builder
""", {"hello.txt": "hello from the context\n", "app/run.sh": "#!/bin/sh\necho app\n"})
    lines: list[str] = []
    t0 = time.monotonic()
    facts = node.build_image(ctx / "Dockerfile", ctx, lines.append, bases={"debian-base": imagebases.bookworm_oci()})
    cold = time.monotonic() - t0
    made.append(facts.key)
    assert any(line.startswith("STEP 2/9: RUN apt-get update") for line in lines), lines[:20]
    assert facts.source == "dockerfile" and facts.os_id == "debian" and facts.shell == "/bin/bash"
    assert facts.env["GREETING"] == "hi there" and facts.env["APP_HOME"] == "/opt/app" and "PATH" in facts.env
    assert facts.workdir == "/opt/app" and facts.user == "builder"
    assert facts.users["builder"][0] == 1000 and facts.users["root"] == [0, 0, "/root"]
    assert store.load_facts(node.settings, facts.key) == facts
    assert json.loads((node.settings.images_dir / f"{facts.key}.json").read_text()) == facts.to_json()
    assert facts.size_bytes == store.image_file(node.settings, facts.key).stat().st_size
    with mounted(node.settings, facts.key) as root:
        _assert_systemd_image(root, facts)
        assert (root / "opt/hello.txt").read_text() == "hello from the context\n"
        assert (root / "opt/app/run.sh").is_file() and (root / "usr/games/cowsay").is_file()
        assert "NOPASSWD" in (root / "etc/sudoers.d/sbx-builder").read_text()
        inside, outside, count = (root / "probe/uid_map").read_text().split()
        assert (inside, count) == ("0", "65536") and int(outside) >= 1_000_000  # never host root
        assert (root / "probe/gateway").read_text().strip() == "closed"
        assert (root / "probe/host").read_text().strip() == "closed"
        assert int((root / "probe/mem").read_text()) == 4 << 30  # buildah.RUN_MEMORY, in the node's cgroup
    assert listener.accepted == 0
    before = _state(node.settings)
    t0 = time.monotonic()
    lines.clear()
    again = node.build_image(ctx / "Dockerfile", ctx, lines.append, bases={"debian-base": imagebases.bookworm_oci()})
    cached = time.monotonic() - t0
    assert again == facts and any("cached build" in line for line in lines) and cached < 5
    assert _state(node.settings) == before
    print(f"\nbuild: cold {cold:.1f} s, cached {cached:.2f} s; {facts.content_bytes // 2**20} MiB of files in a "
          f"{facts.size_bytes // 2**20} MiB ext4")
    # an image built before is a base for the next build (its source kept as an OCI archive)
    assert store.base_archive(node.settings, facts.key).is_file()


@pytest.mark.parametrize(
    ("dockerfile", "files", "code", "says"),
    [
        ("FROM base\nRUNN echo hi\n", {}, "bad_dockerfile", "line 2: unknown instruction 'RUNN'"),
        ("RUN echo hi\n", {}, "bad_dockerfile", "must start with FROM"),
        ("FROM base\nCOPY nope.txt /x\n", {}, "copy_source_missing", "step 2/2 COPY nope.txt /x"),
        ("FROM base\nRUN true\nRUN echo about to fail; exit 7\nRUN true\n", {}, "build_step_failed",
         "step 3/4 RUN echo about to fail; exit 7: exit 7"),
        ("FROM oci-archive:/nonexistent/base.tar\n", {}, "bad_archive", "no such archive"),
    ],
)
def test_a_bad_build_says_why_and_leaves_nothing(node: Node, tmp_path: Path, dockerfile: str, files: dict[str, str],
                                                 code: str, says: str) -> None:
    before = _state(node.settings)
    ctx = _context(tmp_path, dockerfile, files)
    with pytest.raises(ImageError) as e:
        node.build_image(ctx / "Dockerfile", ctx, bases={"base": imagebases.busybox_oci()})
    assert e.value.code == code and says in e.value.message, e.value.message
    if code == "build_step_failed":
        assert "about to fail" in e.value.message  # the step's last output lines
    assert _state(node.settings) == before


def test_a_bad_archive_says_why_and_leaves_nothing(node: Node, tmp_path: Path) -> None:
    before = _state(node.settings)
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(imagebases.bookworm_oci().read_bytes()[: 3 << 20])
    junk = tmp_path / "junk.oci"
    junk.write_bytes(os.urandom(1 << 16))
    for bad in (truncated, junk, tmp_path / "missing.tar"):
        with pytest.raises(ImageError) as e:
            node.import_image(bad)
        assert e.value.code == "bad_archive", e.value.message
    with pytest.raises(ImageError) as e:
        node.import_image(imagebases.no_shell_oci())
    assert e.value.code == "image_no_shell" and "/bin/sh" in e.value.message
    assert _state(node.settings) == before


def test_import_a_bookworm_oci_archive_adds_systemd(node: Node, made: list[str]) -> None:
    facts = node.import_image(imagebases.bookworm_oci())
    made.append(facts.key)
    assert facts.source == "archive" and facts.os_id == "debian" and "bookworm" in facts.os_name
    assert facts.env == {"PATH": imagebases.PATH_ENV.split("=", 1)[1]} and facts.user is None
    with mounted(node.settings, facts.key) as root:
        _assert_systemd_image(root, facts)
        assert facts.users["user"][:2] == [1000, 1000]
    assert node.import_image(imagebases.bookworm_oci()) == facts  # same source: the same image, at once


def test_import_a_trixie_docker_archive(node: Node, made: list[str]) -> None:
    """The second family member, through `docker save`'s format; its packages come from trixie (Ubuntu's archive is
    not reachable from these machines)."""
    facts = node.import_image(imagebases.trixie_docker())
    made.append(facts.key)
    assert facts.os_id == "debian" and "trixie" in facts.os_name
    with mounted(node.settings, facts.key) as root:
        _assert_systemd_image(root, facts)


def test_import_a_busybox_image_gets_the_minimal_init(node: Node, made: list[str], tmp_path: Path) -> None:
    facts = node.import_image(imagebases.busybox_oci())
    made.append(facts.key)
    assert facts.init == "minimal" and facts.os_id == "sbx-busybox" and facts.shell == "/bin/sh"
    with mounted(node.settings, facts.key) as root:
        assert (root / minimal.MINIMAL_TINI.lstrip("/")).read_bytes() == Path("/usr/bin/tini-static").read_bytes()
        assert os.access(root / minimal.MINIMAL_INIT_SCRIPT.lstrip("/"), os.X_OK)
        assert (root / "usr/lib/sbx/sbx-agent").is_file()
        assert _passwd(root)["user"][2:4] == ["1000", "1000"]
        assert not (root / "lib/systemd/systemd").exists()
    # a later build uses it as its FROM base, by name
    ctx = _context(tmp_path, "FROM mine\nRUN echo built > /built\n")
    child = node.build_image(ctx / "Dockerfile", ctx,
                             bases={"mine": node.base_archive(facts.key)})
    made.append(child.key)
    assert child.init == "minimal" and child.key != facts.key
    with mounted(node.settings, child.key) as root:
        assert (root / "built").read_text() == "built\n"


def test_import_a_flat_rootfs_tar(node: Node, made: list[str]) -> None:
    """`docker export`'s shape: no image config, so no env, workdir or user."""
    facts = node.import_image(imagebases.flat_tar())
    made.append(facts.key)
    assert facts.source == "archive" and facts.env == {} and facts.workdir is None and facts.user is None
    with mounted(node.settings, facts.key) as root:
        _assert_systemd_image(root, facts)
    assert store.base_archive(node.settings, facts.key).is_file()


def test_delete_refuses_an_image_a_node_holds(node: Node, made: list[str]) -> None:
    facts = node.import_image(imagebases.busybox_oci())
    made.append(facts.key)
    hold = hold_image(store.image_file(node.settings, facts.key))
    try:
        with pytest.raises(ImageError) as e:
            node.delete_image(facts.key)
        assert e.value.code == "image_in_use"
    finally:
        os.close(hold)
    node.delete_image(facts.key)
    with pytest.raises(ImageError) as e:
        node.image_facts(facts.key)
    assert e.value.code == "image_not_found"
    assert not list(node.settings.images_dir.glob(f"{facts.key}*"))
