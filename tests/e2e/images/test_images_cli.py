"""Images end to end through the CLI, as a user types it (issue 32): a Dockerfile built with `sbx image build` (FROM
a local Debian base archive, RUN apt-get install, COPY, ENV, WORKDIR, USER), a sandbox of it (`sbx new --image`)
that has the files, the environment and the user, keeps its memory across stop and resume, forks, and holds the
image against deletion; archives imported with `sbx image import` (Debian trixie as a docker archive, a busybox
image with no systemd that boots with sbx's minimal init, a flat rootfs tar); and bad input, each refused with its
code and nothing left on disk."""

from __future__ import annotations

import json
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests import imagebases
from tests.e2e.conftest import Server

IMAGES_DIR = Path("/var/lib/sbx/volume/images")

DOCKERFILE = """\
FROM oci-archive:{base}
RUN apt-get update -q && apt-get install -y -q --no-install-recommends tree && rm -rf /var/lib/apt/lists/*
COPY hello.txt /opt/app/hello.txt
ENV GREETING="hi there"
RUN useradd --create-home --shell /bin/bash alice
WORKDIR /opt/app
USER alice
"""


def ok(srv: Server, *args: str, timeout: float = 900) -> str:
    return srv.sbx(*args, timeout=timeout, check=True).stdout


def fails(srv: Server, *args: str) -> subprocess.CompletedProcess[str]:
    r = srv.sbx(*args, timeout=900)
    assert r.returncode != 0, f"sbx {' '.join(args)} should have failed:\n{r.stdout}\n{r.stderr}"
    return r


def images(srv: Server) -> dict[str, dict[str, Any]]:
    return {i["name"]: i for i in json.loads(ok(srv, "image", "list", "--json"))["images"]}


def info(srv: Server, sid: str) -> dict[str, Any]:
    return json.loads(ok(srv, "info", sid, "--json"))["sandbox"]  # type: ignore[no-any-return]


def uploads(server: Server) -> list[Path]:
    """What this server left in the upload folder (only the image routes write there; the library's own tests check
    its work folders). Servers of other test files share the folder: theirs carry their own node name."""
    folder = IMAGES_DIR / ".uploads"
    node = server.env["SBX_NODE_NAME"]
    return sorted(p for p in folder.iterdir() if f"-{node}-" in p.name) if folder.is_dir() else []


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ctx = tmp_path_factory.mktemp("ctx")
    (ctx / "Dockerfile").write_text(DOCKERFILE.format(base=imagebases.bookworm_oci()))
    (ctx / "hello.txt").write_text("hello from the context\n")
    (ctx / "run.txt").write_text(secrets.token_hex(8))  # this run's own inputs: an earlier run's build is cached
    return ctx


def test_a_dockerfile_image_runs_as_its_dockerfile_says(server: Server, context: Path) -> None:
    build = server.sbx("image", "build", str(context), "--name", "app", timeout=900)
    assert build.returncode == 0, build.stderr
    assert "STEP" in build.stderr and "RUN apt-get" in build.stderr  # the steps streamed as they ran
    img = images(server)["app"]
    assert (img["user"], img["workdir"], img["init"]) == ("alice", "/opt/app", "systemd")
    assert img["env"]["GREETING"] == "hi there" and "Debian" in img["os"]

    sid = ok(server, "new", "--image", "app").strip()
    try:
        assert info(server, sid)["image"] == "app"
        out = ok(server, "exec", sid, 'cat hello.txt; echo "$GREETING"; whoami; pwd; tree --version | head -c 9; '
                                      "echo; systemctl is-system-running; sudo -n true && echo sudo-ok")
        assert out.split("\n")[:7] == ["hello from the context", "hi there", "alice", "/opt/app", "tree v2.1",
                                       "running", "sudo-ok"], out
        assert ok(server, "exec", sid, "--user", "root", "whoami").strip() == "root"

        # stop keeps memory: a file on a tmpfs and a process come back
        ok(server, "exec", sid, "echo kept > /dev/shm/mark")
        ok(server, "exec", sid, "--detach", "sleep 100000")
        pid = ok(server, "exec", sid, "pgrep -x sleep").strip()
        ok(server, "stop", sid, "--wait")
        ok(server, "resume", sid, "--wait")
        assert info(server, sid)["memoryRestored"] is True
        assert ok(server, "exec", sid, "cat /dev/shm/mark; pgrep -x sleep").split() == ["kept", pid]

        fork = ok(server, "fork", sid).strip()
        try:
            assert info(server, fork)["image"] == "app"
            assert ok(server, "exec", fork, "cat hello.txt; whoami").split("\n")[:2] == ["hello from the context",
                                                                                          "alice"]
        finally:
            ok(server, "delete", fork)

        r = fails(server, "image", "delete", "app")
        assert "image_in_use" in r.stderr and sid in r.stderr
    finally:
        ok(server, "delete", sid, "--wait")
    ok(server, "image", "delete", "app")
    assert "app" not in images(server)


def test_the_same_build_again_is_cached(server: Server, context: Path) -> None:
    ok(server, "image", "build", str(context), "--name", "app-a")
    again = server.sbx("image", "build", str(context), "--name", "app-b", timeout=900)
    assert again.returncode == 0, again.stderr
    assert "STEP" not in again.stderr  # nothing ran: the image of these inputs exists
    both = images(server)
    assert both["app-a"]["digest"] == both["app-b"]["digest"]
    ok(server, "image", "delete", "app-a")
    ok(server, "image", "delete", "app-b")


def test_imported_archives_boot(server: Server) -> None:
    try:
        _imported_archives_boot(server)
    finally:
        for name in set(images(server)) & {"trixie", "busybox", "flat"}:
            server.sbx("image", "delete", name)


def _imported_archives_boot(server: Server) -> None:
    ok(server, "image", "import", str(imagebases.trixie_docker()), "--name", "trixie")
    ok(server, "image", "import", str(imagebases.busybox_oci()), "--name", "busybox")
    ok(server, "image", "import", str(imagebases.flat_tar()), "--name", "flat")
    got = images(server)
    assert (got["trixie"]["init"], got["busybox"]["init"], got["flat"]["init"]) == ("systemd", "minimal", "systemd")

    sid = ok(server, "new", "--image", "trixie").strip()
    out = ok(server, "exec", sid, "cut -d. -f1 /etc/debian_version; systemctl is-system-running; whoami")
    assert out.split() == ["13", "running", "user"], out
    ok(server, "delete", sid, "--wait")

    sid = ok(server, "new", "--image", "busybox").strip()
    try:
        out = ok(server, "exec", sid, ". /etc/os-release; echo $ID; whoami; echo $$")
        assert out.split()[:2] == ["sbx-busybox", "user"], out
        ok(server, "exec", sid, "echo kept > /dev/shm/mark || echo kept > /tmp/mark")
        ok(server, "stop", sid, "--wait")
        ok(server, "resume", sid, "--wait")
        assert info(server, sid)["memoryRestored"] is True
        assert ok(server, "exec", sid, "cat /dev/shm/mark 2>/dev/null || cat /tmp/mark").strip() == "kept"
        r = fails(server, "exec", sid, "--detach", "true")
        assert "not_supported" in r.stderr, r.stderr
    finally:
        ok(server, "delete", sid, "--wait")

    sid = ok(server, "new", "--image", "flat").strip()
    assert ok(server, "exec", sid, "systemctl is-system-running").strip() == "running"
    ok(server, "delete", sid, "--wait")
    for name in ("trixie", "busybox", "flat"):
        ok(server, "image", "delete", name)


def test_bad_input_is_refused_with_its_reason_and_leaves_nothing(server: Server, tmp_path: Path) -> None:
    base = imagebases.bookworm_oci()
    cases = {
        "syntax": (f"FROM oci-archive:{base}\nRUNN echo hi\n", "bad_dockerfile"),
        "missing": (f"FROM oci-archive:{base}\nCOPY nothere.txt /x\n", "copy_source_missing"),
        "failing": (f"FROM oci-archive:{base}\nRUN echo about to fail && false\n", "build_step_failed"),
    }
    for name, (text, code) in cases.items():
        ctx = tmp_path / name
        ctx.mkdir()
        (ctx / "Dockerfile").write_text(text)
        r = fails(server, "image", "build", str(ctx), "--name", name)
        assert code in r.stderr, r.stderr
    r = fails(server, "image", "build", str(tmp_path / "failing"), "--name", "failing")
    assert "RUN echo about to fail" in r.stderr  # the failing step is named

    corrupt = tmp_path / "corrupt.tar"
    corrupt.write_bytes(b"this is no archive" * 100)
    assert "bad_archive" in fails(server, "image", "import", str(corrupt), "--name", "corrupt").stderr
    assert "image_no_shell" in fails(server, "image", "import", str(imagebases.no_shell_oci()),
                                     "--name", "noshell").stderr

    ok(server, "image", "import", str(imagebases.flat_tar()), "--name", "taken")
    assert "image_exists" in fails(server, "image", "import", str(imagebases.flat_tar()), "--name", "taken").stderr
    assert "image_not_found" in fails(server, "new", "--image", "nope").stderr
    ok(server, "image", "delete", "taken")

    assert not set(images(server)) & {*cases, "corrupt", "noshell", "taken"}
    assert uploads(server) == []  # no upload or unpacked context left
