"""The host's apt sources, read at run time: which Debian mirror the image build (:mod:`sbx.node.host.image`), the sid
CRIU install (:mod:`sbx.node.host.criuinstall`) and the egress policy's mirror allowance
(:mod:`sbx.node.network.egress`) use.

Both formats apt reads: one-line (``/etc/apt/sources.list``, ``/etc/apt/sources.list.d/*.list``) and deb822
(``*.sources``), as sources.list(5) describes them. No mirror is ever written into sbx itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sbx.guest import recipe
from sbx.node.types import NodeError


class NoMirror(NodeError):
    """The host's apt sources list no Debian archive for a suite (code ``no_debian_mirror``)."""

    def __init__(self, message: str):
        super().__init__("no_debian_mirror", message)


@dataclass(frozen=True)
class AptSource:
    """One apt source entry: ``types`` (``deb``/``deb-src``), ``uris``, ``suites``, ``components``,
    ``options`` (lower-cased option names such as ``signed-by`` or ``arch``) and ``origin`` (the file it came
    from)."""

    types: tuple[str, ...]
    uris: tuple[str, ...]
    suites: tuple[str, ...]
    components: tuple[str, ...]
    options: dict[str, str] = field(default_factory=dict)
    origin: str = ""


def parse_one_line_sources(text: str, origin: str = "") -> list[AptSource]:
    """Parse the one-line format (``sources.list``, ``*.list``):
    ``deb [opt=val ...] URI SUITE [COMPONENT...]``. Comments, blank lines and malformed lines are skipped."""
    out: list[AptSource] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        options: dict[str, str] = {}
        m = re.match(r"^(\S+)\s*\[([^\]]*)\]\s*(.*)$", line)
        if m:
            kind, opts, rest = m.group(1), m.group(2), m.group(3)
            for opt in opts.split():
                if "=" in opt:
                    key, value = opt.split("=", 1)
                    options[key.strip().lower()] = value.strip()
            words = [kind, *rest.split()]
        else:
            words = line.split()
        if len(words) < 3 or words[0] not in ("deb", "deb-src"):
            continue
        out.append(
            AptSource(
                types=(words[0],),
                uris=(words[1],),
                suites=(words[2],),
                components=tuple(words[3:]),
                options=options,
                origin=origin,
            )
        )
    return out


def _deb822_paragraphs(text: str) -> Iterator[dict[str, str]]:
    fields: dict[str, str] = {}
    key: str | None = None
    for raw in text.splitlines():
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if fields:
                yield fields
            fields, key = {}, None
            continue
        if raw[0] in " \t":
            if key is not None:
                fields[key] += "\n" + raw.strip()
            continue
        if ":" not in raw:
            continue
        name, value = raw.split(":", 1)
        key = name.strip().lower()
        fields[key] = value.strip()
    if fields:
        yield fields


def parse_deb822_sources(text: str, origin: str = "") -> list[AptSource]:
    """Parse the deb822 format (``*.sources``): paragraphs of ``Types``/``URIs``/``Suites``/``Components``
    fields, separated by blank lines. Paragraphs with ``Enabled: no`` or without types, URIs or suites are
    skipped."""
    out: list[AptSource] = []
    for para in _deb822_paragraphs(text):
        if para.get("enabled", "yes").strip().lower() in ("no", "false", "0"):
            continue
        types = tuple(para.get("types", "").split())
        uris = tuple(para.get("uris", "").split())
        suites = tuple(para.get("suites", "").split())
        if not (types and uris and suites):
            continue
        options = {k: v for k, v in para.items() if k not in ("types", "uris", "suites", "components", "enabled")}
        out.append(
            AptSource(
                types=types,
                uris=uris,
                suites=suites,
                components=tuple(para.get("components", "").split()),
                options=options,
                origin=origin,
            )
        )
    return out


def read_host_sources(root: Path = Path("/")) -> list[AptSource]:
    """All entries of the apt sources under ``root`` (``etc/apt/sources.list``,
    ``etc/apt/sources.list.d/*.list`` and ``*.sources``), in apt's reading order. Unreadable files are
    skipped."""
    etc = root / "etc" / "apt"
    entries: list[AptSource] = []
    main = etc / "sources.list"
    if main.is_file():
        entries += parse_one_line_sources(main.read_text(errors="replace"), str(main))
    parts = etc / "sources.list.d"
    if parts.is_dir():
        for path in sorted(parts.iterdir()):
            try:
                if path.suffix == ".list" and path.is_file():
                    entries += parse_one_line_sources(path.read_text(errors="replace"), str(path))
                elif path.suffix == ".sources" and path.is_file():
                    entries += parse_deb822_sources(path.read_text(errors="replace"), str(path))
            except OSError:
                continue
    return entries


def find_mirror(suite: str, sources: Iterable[AptSource] | None = None, component: str = "main") -> str | None:
    """The URI of the first binary (``deb``) entry that serves ``suite`` with ``component``; ``None`` if no
    entry does. ``sources`` defaults to :func:`read_host_sources`."""
    entries = list(sources) if sources is not None else read_host_sources()
    for entry in entries:
        serves = suite in entry.suites and (not entry.components or component in entry.components)
        if "deb" in entry.types and serves:
            for uri in entry.uris:
                if uri.startswith(("http://", "https://", "file:", "ftp://")):
                    return uri.rstrip("/")
    return None


def debian_mirror(suite: str = recipe.SUITE, sources: Iterable[AptSource] | None = None) -> str:
    """The host's Debian archive URI for ``suite`` (e.g. the URI of the entry listing ``bookworm``).

    Raises :class:`NoMirror` when the host's apt sources list no such entry."""
    uri = find_mirror(suite, sources)
    if uri is None:
        raise NoMirror(
            f"no Debian archive for suite {suite!r} in the host's apt sources "
            "(/etc/apt/sources.list, /etc/apt/sources.list.d/*.list, *.sources)"
        )
    return uri


def mirror_lines(sources: Iterable[AptSource] | None = None) -> list[str]:
    """The one-line apt sources mmdebstrap gets (and writes into the image): the main suite and its update
    suites from the host's archive URI, and the security suite when the host lists one. Raises :class:`NoMirror`."""
    entries = list(sources) if sources is not None else read_host_sources()
    archive = debian_mirror(recipe.SUITE, entries)
    components = " ".join(recipe.COMPONENTS)
    lines = [f"deb {archive} {recipe.SUITE} {components}"]
    for suite in recipe.UPDATE_SUITES:
        uri = find_mirror(suite, entries)
        if uri is not None:
            lines.append(f"deb {uri} {suite} {components}")
    security = find_mirror(recipe.SECURITY_SUITE, entries)
    if security is not None:
        lines.append(f"deb {security} {recipe.SECURITY_SUITE} {components}")
    return lines


def mirror_lines_if_any() -> list[str]:
    """:func:`mirror_lines` of the host's sources, or ``[]`` when the host lists no Debian mirror: the mirrors the
    egress policy lets sandboxes reach (:func:`sbx.node.network.egress.egress_policy`)."""
    try:
        return mirror_lines()
    except NoMirror:
        return []
