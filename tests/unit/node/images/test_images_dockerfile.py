"""Reading a Dockerfile: instructions, continuations, the escape directive, bad ones refused; FROM bases rewritten;
the build's input hash."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sbx.node.images.dockerfile import file_digest, input_hash, parse, resolve_bases
from sbx.node.images.errors import ImageError


def test_continuations_comments_and_case() -> None:
    text = """# leading comment
ARG V=1
from base AS build
RUN apt-get update && \\
    # a comment inside a continuation
    apt-get install -y \\

    cowsay
env A=1 B=2
"""
    ins = parse(text)
    assert [(i.keyword, i.line) for i in ins] == [("ARG", 2), ("FROM", 3), ("RUN", 4), ("ENV", 9)]
    assert ins[2].args == "apt-get update && apt-get install -y cowsay"


def test_the_escape_directive() -> None:
    ins = parse("# escape=`\nFROM base\nRUN echo a `\n  b\n")
    assert ins[1].args == "echo a b"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("FROM base\nRUNN x\n", "line 2: unknown instruction 'RUNN'"),
        ("RUN x\n", "must start with FROM"),
        ("", "must start with FROM"),
        ("FROM base\nCOPY\n", "line 2: COPY needs arguments"),
        ("FROM base\nENV ONLYNAME\n", "line 2: ENV needs a value"),
        ("# escape=x\nFROM base\n", "escape must be"),
    ],
)
def test_bad_dockerfiles(text: str, says: str) -> None:
    with pytest.raises(ImageError) as e:
        parse(text)
    assert e.value.code == "bad_dockerfile" and says in e.value.message


def test_from_names_rewritten_to_archives_stages_left_alone(tmp_path: Path) -> None:
    oci, docker = tmp_path / "a.oci.tar", tmp_path / "b.tar"
    text = ("FROM mine AS build\nRUN make\nFROM --platform=linux/amd64 other\nCOPY --from=build /x /x\n"
            "FROM build\nFROM oci-archive:/srv/direct.tar\nFROM scratch\n")
    out, used = resolve_bases(text, {"mine": oci, "other": docker, "build": oci},
                              {oci: "oci-archive", docker: "docker-archive"})
    lines = out.splitlines()
    assert lines[0] == f"FROM oci-archive:{oci} AS build"
    assert lines[2] == f"FROM --platform=linux/amd64 docker-archive:{docker}"
    assert lines[4] == "FROM build"  # a stage, not the base of that name
    assert used == [oci, docker, Path("/srv/direct.tar")]


def test_input_hash_follows_files_modes_and_bases(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "sub").mkdir(parents=True)
    (ctx / "a.txt").write_text("a")
    (ctx / "sub" / "b.sh").write_text("b")
    os.symlink("a.txt", ctx / "link")
    first = input_hash("FROM x\n", ctx, ["sha256:1"])
    assert input_hash("FROM x\n", ctx, ["sha256:1"]) == first
    assert input_hash("FROM y\n", ctx, ["sha256:1"]) != first
    assert input_hash("FROM x\n", ctx, ["sha256:2"]) != first
    (ctx / "sub" / "b.sh").chmod(0o755)
    moded = input_hash("FROM x\n", ctx, ["sha256:1"])
    assert moded != first
    (ctx / "a.txt").write_text("A")
    assert input_hash("FROM x\n", ctx, ["sha256:1"]) not in (first, moded)


def test_file_digest(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"abc")
    assert file_digest(p) == "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
