"""The commands a build runs, as argv: buildah's isolation flags, the build network's nsenter, the cgroup; and the apt
source lines the sbx layer gives an image of each codename."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbx.node.host import aptsources
from sbx.node.images import layer
from sbx.node.images.buildah import bud_argv
from sbx.node.images.errors import ImageError


def test_run_steps_are_shifted_limited_and_offline_without_a_network() -> None:
    argv = bud_argv(Path("/w"), Path("/w/Dockerfile"), Path("/ctx"), 1_065_536, None, [], "/sbx/n/build-1")
    assert argv[:7] == ["buildah", "--root", "/w/store", "--runroot", "/w/run", "--storage-driver", "vfs"]
    flags = " ".join(argv)
    for expected in ("--isolation oci", "--runtime runc", "--userns-uid-map 0:1065536:65536",
                     "--userns-gid-map 0:1065536:65536", "--network none", "--memory 4g",
                     "--cgroup-parent /sbx/n/build-1", "-f /w/Dockerfile"):
        assert expected in flags
    assert argv[-1] == "/ctx"


def test_the_build_ca_and_the_hosts_registries_reach_run_steps_only() -> None:
    argv = bud_argv(Path("/w"), Path("/w/D"), Path("/c"), 1_000_000, None, [], "/sbx/n/b", "/etc/host-ca.pem",
                    {"NPM_CONFIG_REGISTRY": "https://npm.invalid/"})
    flags = " ".join(argv)
    assert "--volume /etc/host-ca.pem:/etc/ssl/certs/ca-certificates.crt:ro" in flags
    assert "--build-arg NPM_CONFIG_REGISTRY=https://npm.invalid/" in flags
    assert "--env" not in argv  # nothing of either is written into the image's config
    assert "--volume" not in bud_argv(Path("/w"), Path("/w/D"), Path("/c"), 1_000_000, None, [], "/sbx/n/b")


def test_with_a_network_buildah_runs_inside_it() -> None:
    argv = bud_argv(Path("/w"), Path("/w/D"), Path("/c"), 1_000_000, "/proc/42/ns/net", ["192.0.2.53"], "/sbx/n/b")
    assert argv[:3] == ["nsenter", "--net=/proc/42/ns/net", "--"]
    flags = " ".join(argv)
    assert "--network host" in flags and "--dns 192.0.2.53" in flags


HOST = """Types: deb
URIs: http://mirror.invalid/debian
Suites: bookworm bookworm-updates
Components: main

Types: deb
URIs: http://security.invalid/debian-security
Suites: bookworm-security
Components: main
"""


@pytest.fixture
def host_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = aptsources.parse_deb822_sources(HOST, "test")
    monkeypatch.setattr(aptsources, "read_host_sources", lambda root=Path("/"): entries)


def test_apt_lines_for_the_images_codename(host_sources: None) -> None:
    assert layer._sources({"ID": "debian", "VERSION_CODENAME": "trixie"}) == [
        "http://mirror.invalid/debian trixie main",
        "http://mirror.invalid/debian trixie-updates main",
        "http://security.invalid/debian-security trixie-security main",
    ]


@pytest.mark.parametrize("osr", [{"ID": "ubuntu", "VERSION_CODENAME": "noble"}, {"ID": "debian"}])
def test_no_mirror_for_the_image_is_unsupported(host_sources: None, osr: dict[str, str]) -> None:
    with pytest.raises(ImageError) as e:
        layer._sources(osr)
    assert e.value.code == "unsupported_image"
