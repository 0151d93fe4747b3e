"""ImageFacts and the readers that fill it: os-release, passwd, the OCI config's Env, WorkingDir and User."""

from __future__ import annotations

import pytest

from sbx.node.images.facts import (
    ImageFacts,
    parse_env,
    parse_os_release,
    parse_passwd,
    user_name,
    users_of,
    workdir_of,
)

KEY = "ab" * 32
PASSWD = """root:x:0:0:root:/root:/bin/bash
daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin
builder:x:1000:1000::/home/builder:/bin/bash
user:x:1001:1001::/home/user:/bin/bash
broken line
"""


def test_facts_round_trip_through_json() -> None:
    facts = ImageFacts(key=KEY, os_id="debian", os_name="Debian GNU/Linux 12 (bookworm)", init="systemd",
                       shell="/bin/bash", env={"PATH": "/usr/bin", "A": "b=c"}, workdir="/opt/app", user="builder",
                       users={"root": [0, 0, "/root"]}, content_bytes=10, size_bytes=20, source="dockerfile",
                       built_at="2026-12-06T23:00:00Z", build_seconds=1.5)
    data = facts.to_json()
    assert data["key"] == KEY and data["env"] == {"PATH": "/usr/bin", "A": "b=c"}
    assert ImageFacts.from_json({**data, "from_a_newer_writer": 1}) == facts


@pytest.mark.parametrize(("field", "value"), [("key", "abc"), ("init", "openrc"), ("source", "ftp")])
def test_facts_refuse_what_no_build_makes(field: str, value: str) -> None:
    good = {"key": KEY, "os_id": "", "os_name": "", "init": "minimal", "shell": "/bin/sh", "source": "archive"}
    with pytest.raises(ValueError):
        ImageFacts(**{**good, field: value})  # type: ignore[arg-type]


def test_os_release_values_quoted_or_not() -> None:
    text = 'ID=debian\nPRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\n# comment\nVERSION_CODENAME=bookworm\nX=\'a b\'\n'
    osr = parse_os_release(text)
    assert osr == {"ID": "debian", "PRETTY_NAME": "Debian GNU/Linux 12 (bookworm)", "VERSION_CODENAME": "bookworm",
                   "X": "a b"}


def test_passwd_skips_malformed_lines() -> None:
    pw = parse_passwd(PASSWD)
    assert pw["builder"] == (1000, 1000, "/home/builder", "/bin/bash") and "broken line" not in pw


def test_env_and_workdir_from_the_config() -> None:
    assert parse_env(["PATH=/usr/bin:/bin", "EMPTY=", "NOEQUALS", "X=a=b"]) == {"PATH": "/usr/bin:/bin", "EMPTY": "",
                                                                                "X": "a=b"}
    assert parse_env(None) == {}
    assert workdir_of({"WorkingDir": "/opt/app/"}) == "/opt/app"
    assert workdir_of({"WorkingDir": "/"}) is None and workdir_of({}) is None


@pytest.mark.parametrize(
    ("spec", "name"),
    [("", None), ("root", None), ("0", None), ("0:0", None), ("builder", "builder"), ("1000", "builder"),
     ("1000:1000", "builder"), ("builder:staff", "builder"), ("4242", "4242")],
)
def test_user_is_a_name_resolved_through_passwd(spec: str, name: str | None) -> None:
    assert user_name(spec, parse_passwd(PASSWD)) == name


def test_an_unknown_user_name_is_an_error() -> None:
    with pytest.raises(ValueError, match="nobody-here"):
        user_name("nobody-here", parse_passwd(PASSWD))


def test_users_lists_root_user_and_the_image_user() -> None:
    assert users_of(parse_passwd(PASSWD), "builder") == {"root": [0, 0, "/root"], "user": [1001, 1001, "/home/user"],
                                                         "builder": [1000, 1000, "/home/builder"]}
    assert set(users_of(parse_passwd(PASSWD), None)) == {"root", "user"}
