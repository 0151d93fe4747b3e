"""Reading a Dockerfile before ``buildah bud`` runs it: its instructions checked (so a typo is a clear
``bad_dockerfile`` before anything is built), ``FROM`` lines naming a caller's base rewritten to the archive's
transport, and the hash of a build's inputs (the cache of builds).

The grammar is the Dockerfile reference's: parser directives (``# escape=``) at the top, ``#`` comment lines,
continuation lines ending with the escape character, one instruction per logical line. Heredocs are not supported
(buildah 1.28 has none either).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from sbx.node.images.errors import ImageError

#: Every instruction buildah 1.28 knows.
INSTRUCTIONS = frozenset({
    "FROM", "RUN", "CMD", "LABEL", "MAINTAINER", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
    "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
})
#: Transports a ``FROM`` may name directly (local archives and layouts; ``docker://`` where a registry is reachable).
TRANSPORTS = ("oci-archive:", "docker-archive:", "oci:", "docker://")
_DIRECTIVE = re.compile(r"^#\s*([a-zA-Z][a-zA-Z0-9]*)\s*=\s*(.+?)\s*$")


@dataclass(frozen=True)
class Instruction:
    """One logical line: ``keyword`` (upper case), ``args`` (the rest, continuations joined), ``line`` (1-based
    line number of its first physical line)."""

    keyword: str
    args: str
    line: int


def parse(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile. Raises ``ImageError("bad_dockerfile")`` for an unknown instruction, an
    instruction without arguments, or no ``FROM`` before the first instruction other than ``ARG``."""
    lines = text.splitlines()
    escape = "\\"
    i = 0
    while i < len(lines):  # parser directives: only at the very top, before any comment, blank line or instruction
        m = _DIRECTIVE.match(lines[i])
        if not m:
            break
        if m.group(1).lower() == "escape":
            if m.group(2) not in ("\\", "`"):
                raise ImageError("bad_dockerfile", f"line {i + 1}: escape must be \\ or `, not {m.group(2)!r}")
            escape = m.group(2)
        i += 1
    out: list[Instruction] = []
    current: list[str] = []
    start = 0
    for n in range(i, len(lines)):
        raw = lines[n]
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and current):
            continue  # comment lines (even inside a continuation) and blank continuation lines are dropped
        if not stripped:
            continue
        if not current:
            start = n + 1
        if raw.rstrip().endswith(escape):
            current.append(raw.rstrip()[:-1])
            continue
        current.append(raw)
        out.append(_instruction(" ".join(part.strip() for part in current), start))
        current = []
    if current:
        out.append(_instruction(" ".join(part.strip() for part in current), start))
    _check(out)
    return out


def _instruction(logical: str, line: int) -> Instruction:
    keyword, _, args = logical.strip().partition(" ")
    word = keyword.upper()
    if word not in INSTRUCTIONS:
        raise ImageError("bad_dockerfile", f"line {line}: unknown instruction {keyword!r}")
    if not args.strip():
        raise ImageError("bad_dockerfile", f"line {line}: {word} needs arguments")
    return Instruction(word, args.strip(), line)


def _check(instructions: list[Instruction]) -> None:
    first = next((ins for ins in instructions if ins.keyword != "ARG"), None)
    if first is None or first.keyword != "FROM":
        where = f"line {first.line}: " if first else ""
        raise ImageError("bad_dockerfile", f"{where}a Dockerfile must start with FROM (after ARG lines only)")
    for ins in instructions:
        if ins.keyword == "ENV" and "=" not in ins.args and len(ins.args.split(None, 1)) < 2:
            raise ImageError("bad_dockerfile", f"line {ins.line}: ENV needs a value ({ins.args!r})")


def from_image(ins: Instruction) -> tuple[str, str | None]:
    """A ``FROM`` instruction's image and stage name (``FROM [--platform=P] IMAGE [AS NAME]``). Raises
    ``ImageError("bad_dockerfile")`` when it has another shape."""
    words = [w for w in ins.args.split() if not w.startswith("--")]
    if len(words) == 1:
        return words[0], None
    if len(words) == 3 and words[1].lower() == "as":
        return words[0], words[2]
    raise ImageError("bad_dockerfile", f"line {ins.line}: FROM {ins.args!r}: expected IMAGE [AS NAME]")


def resolve_bases(text: str, bases: dict[str, Path], kind_of: dict[Path, str]) -> tuple[str, list[Path]]:
    """``text`` with every ``FROM`` that names a key of ``bases`` rewritten to ``oci-archive:<path>`` or
    ``docker-archive:<path>`` (``kind_of[path]``: ``"oci-archive"`` / ``"docker-archive"``), and the archives every
    ``FROM`` uses (rewritten or named directly by path). Stage names and ``scratch`` are left alone."""
    used: list[Path] = []
    stages: set[str] = set()
    out_lines = text.splitlines(keepends=True)
    for ins in parse(text):
        if ins.keyword != "FROM":
            continue
        image, stage = from_image(ins)
        if image in bases and image not in stages:
            path = bases[image]
            new = f"{kind_of[path]}:{path}"
            row = out_lines[ins.line - 1]
            out_lines[ins.line - 1] = re.sub(rf"(?<=\s){re.escape(image)}(?=\s|$)", new.replace("\\", r"\\"), row,
                                             count=1)
            used.append(path)
        elif image.startswith(("oci-archive:", "docker-archive:")) and image not in stages:
            used.append(Path(image.split(":", 1)[1].split(":", 1)[0]))
        if stage:
            stages.add(stage)
    return "".join(out_lines), used


def input_hash(dockerfile_text: str, context: Path, base_digests: list[str]) -> str:
    """sha256 (64 hex) over the Dockerfile as built (bases resolved), every file, link and folder under ``context``
    (its relative path, type, mode, and bytes or link target) and the digests of the bases it uses."""
    h = hashlib.sha256(b"sbx-build\0")
    h.update(dockerfile_text.encode())
    for d in base_digests:
        h.update(b"\0base\0" + d.encode())
    for dirpath, dirnames, filenames in os.walk(context):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            st = p.lstat()
            rel = p.relative_to(context).as_posix()
            h.update(f"\0{rel}\0{st.st_mode:o}\0".encode())
            if p.is_symlink():
                h.update(os.readlink(p).encode())
            elif p.is_file():
                h.update(st.st_size.to_bytes(8, "big"))
                with open(p, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
    return h.hexdigest()


def file_digest(path: Path) -> str:
    """``sha256:<hex>`` of a file's bytes (a base archive, a flat rootfs tar)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()
