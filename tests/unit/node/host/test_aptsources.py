"""The host's apt sources (sbx.node.host.aptsources): both formats, the mirror for a suite, the lines an image build
gets, and a clear error when no mirror is listed."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbx.node.host import aptsources
from sbx.node.host.aptsources import NoMirror

ONE_LINE = """\
# a comment line
deb http://mirror.example.org/debian bookworm main contrib
deb-src http://src.example.org/debian bookworm main
deb [arch=amd64 signed-by=/k.gpg] http://mirror.example.org/debian bookworm-updates main
deb [ arch=amd64 ] https://security.example.org/debian-security bookworm-security main # trailing comment

deb http://other.example.org/stuff stable main
"""

DEB822 = """\
Types: deb deb-src
# http://snapshot.example.org/archive/debian/20250520T000000Z
URIs: http://deb.example.net/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.example.net/debian-security
Suites: bookworm-security
Components: main
Signed-By:
 -----BEGIN PGP PUBLIC KEY BLOCK-----
 .
 mQINBGP...
 -----END PGP PUBLIC KEY BLOCK-----

Types: deb
URIs: http://disabled.example.net/debian
Suites: bookworm
Components: main
Enabled: no
"""


def test_one_line_format() -> None:
    entries = aptsources.parse_one_line_sources(ONE_LINE, "x.list")
    assert [e.types for e in entries] == [("deb",), ("deb-src",), ("deb",), ("deb",), ("deb",)]
    first = entries[0]
    assert first.uris == ("http://mirror.example.org/debian",)
    assert first.suites == ("bookworm",) and first.components == ("main", "contrib")
    assert first.origin == "x.list"
    updates = entries[2]
    assert updates.options == {"arch": "amd64", "signed-by": "/k.gpg"}
    assert updates.suites == ("bookworm-updates",)
    security = entries[3]
    assert security.uris == ("https://security.example.org/debian-security",)
    assert security.components == ("main",)


def test_deb822_format() -> None:
    entries = aptsources.parse_deb822_sources(DEB822, "debian.sources")
    assert len(entries) == 2  # the Enabled: no paragraph is dropped
    main, sec = entries
    assert main.types == ("deb", "deb-src")
    assert main.uris == ("http://deb.example.net/debian",)
    assert main.suites == ("bookworm", "bookworm-updates")
    assert main.options["signed-by"] == "/usr/share/keyrings/debian-archive-keyring.gpg"
    assert sec.suites == ("bookworm-security",)
    assert "BEGIN PGP PUBLIC KEY BLOCK" in sec.options["signed-by"]


def test_find_mirror_and_mirror_lines() -> None:
    entries = aptsources.parse_deb822_sources(DEB822)
    assert aptsources.find_mirror("bookworm", entries) == "http://deb.example.net/debian"
    assert aptsources.find_mirror("bookworm-security", entries) == "http://deb.example.net/debian-security"
    assert aptsources.find_mirror("sid", entries) is None
    assert aptsources.mirror_lines(entries) == [
        "deb http://deb.example.net/debian bookworm main",
        "deb http://deb.example.net/debian bookworm-updates main",
        "deb http://deb.example.net/debian-security bookworm-security main",
    ]


def test_deb_src_only_entries_are_not_mirrors() -> None:
    entries = aptsources.parse_one_line_sources("deb-src http://src.example.org/debian bookworm main\n")
    assert aptsources.find_mirror("bookworm", entries) is None


def test_missing_mirror_is_a_clear_error() -> None:
    entries = aptsources.parse_one_line_sources("deb http://other.example.org/x stable main\n")
    with pytest.raises(NoMirror) as err:
        aptsources.debian_mirror("bookworm", entries)
    assert err.value.code == "no_debian_mirror"
    assert "bookworm" in err.value.message


def test_read_host_sources_from_a_tree(tmp_path: Path) -> None:
    apt = tmp_path / "etc/apt"
    (apt / "sources.list.d").mkdir(parents=True)
    (apt / "sources.list").write_text("deb http://first.example.org/debian bookworm main\n")
    (apt / "sources.list.d/debian.sources").write_text(DEB822)
    (apt / "sources.list.d/extra.list").write_text("deb http://extra.example.org/debian trixie main\n")
    (apt / "sources.list.d/off.list.disabled").write_text("deb http://off.example.org/debian bookworm main\n")
    entries = aptsources.read_host_sources(tmp_path)
    uris = [e.uris[0] for e in entries]
    assert uris == [
        "http://first.example.org/debian",
        "http://deb.example.net/debian",
        "http://deb.example.net/debian-security",
        "http://extra.example.org/debian",
    ]
    # sources.list comes first, so it wins
    assert aptsources.find_mirror("bookworm", entries) == "http://first.example.org/debian"
    assert aptsources.find_mirror("trixie", entries) == "http://extra.example.org/debian"


def test_read_host_sources_of_an_empty_tree(tmp_path: Path) -> None:
    assert aptsources.read_host_sources(tmp_path) == []


def test_the_egress_policy_gets_the_image_mirrors_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aptsources, "read_host_sources", lambda: aptsources.parse_deb822_sources(DEB822))
    assert aptsources.mirror_lines_if_any() == aptsources.mirror_lines(aptsources.parse_deb822_sources(DEB822))
    monkeypatch.setattr(aptsources, "read_host_sources",
                        lambda: aptsources.parse_one_line_sources("deb http://other.example.org/x stable main\n"))
    assert aptsources.mirror_lines_if_any() == []
