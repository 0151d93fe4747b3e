"""Results of a benchmark run: rows with median and spread, the seed guides' anchors next to them, a rich table
and a JSON document.

A :class:`Row` is one measured figure (``samples`` in its ``unit``: ``"s"`` or ``"ms"``). When the seed guides
(``/work/shared/seeds/resize-guide.txt``, ``fork-guide.txt``) give a time for the same step, the row carries it
as an :class:`Anchor` and ``ratio`` = our median / the anchor (below 1: faster than the guide's run).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from io import StringIO
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

SCHEMA = 1
RESULTS_DIR = Path(__file__).with_name("results")
UNITS = ("s", "ms", "MiB", "count", "load")
"""Units a row may have: times (``s``, ``ms``) and the density figure's host measures (``MiB``, ``count``, ``load``:
the 1-minute load average)."""


@dataclass(frozen=True)
class Anchor:
    """A reference time: ``value`` in the row's unit, ``text`` as shown in the table (``"2.2 s"``), ``source``
    (where it comes from, e.g. ``"resize guide: sbx stop --wait"``)."""

    value: float
    text: str
    source: str


@dataclass
class Row:
    """One figure of the run.

    - ``figure``: the group it belongs to (the name ``--only`` takes: ``resize``, ``fork``, ...);
    - ``name``: what was timed, as shown in the table;
    - ``unit``: ``"s"`` or ``"ms"`` (samples, median, min, max and the anchor are all in it);
    - ``samples``: every timed run; rows taken from elsewhere (``bench.storage``) give ``stats`` instead;
    - ``requested``: the ``--repeats`` asked for, when this row deliberately ran fewer (slow figures);
    - ``note``: extra facts (memory image size, a size ratio, ...).

    Raises ``ValueError`` for an unknown unit or a row with neither samples nor stats."""

    figure: str
    name: str
    unit: str
    samples: list[float] = field(default_factory=list)
    anchor: Anchor | None = None
    note: str = ""
    requested: int | None = None
    stats: tuple[float, float, float, int] | None = None  # (median, min, max, n) when there are no samples

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, not {self.unit!r}")
        if not self.samples and self.stats is None:
            raise ValueError(f"row {self.name!r} has no samples")

    @property
    def n(self) -> int:
        return len(self.samples) if self.samples else int(self.stats[3])  # type: ignore[index]

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float(self.stats[0])  # type: ignore[index]

    @property
    def min(self) -> float:
        return min(self.samples) if self.samples else float(self.stats[1])  # type: ignore[index]

    @property
    def max(self) -> float:
        return max(self.samples) if self.samples else float(self.stats[2])  # type: ignore[index]

    @property
    def ratio(self) -> float | None:
        """Our median / the anchor (None without an anchor, or for a zero anchor)."""
        if self.anchor is None or not self.anchor.value:
            return None
        return self.median / self.anchor.value

    @property
    def reduced(self) -> bool:
        """True when the row ran fewer times than ``--repeats`` asked."""
        return self.requested is not None and self.n < self.requested


def fmt_time(value: float, unit: str) -> str:
    """A duration for the table: seconds below 1 s are shown in ms (``0.0312, "s"`` -> ``"31.2 ms"``); seconds
    with 2 decimals (``"2.13 s"``); ms with 1 decimal (``"8.1 ms"``). Other units: ``count`` as an integer
    (``"120"``), ``load`` with 2 decimals (``"0.42"``), ``MiB`` with 1 decimal (``"9.3 MiB"``)."""
    if unit == "s":
        return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"
    if unit == "count":
        return f"{value:.0f}"
    if unit == "load":
        return f"{value:.2f}"
    return f"{value:.1f} {unit}"


def fmt_spread(row: Row) -> str:
    """``"min–max"`` in the unit of the row's median (``"2.01–2.40 s"``, ``"30.1–35.0 ms"``)."""
    if row.unit not in ("s", "ms"):
        return f"{fmt_time(row.min, row.unit)}–{fmt_time(row.max, row.unit)}"
    if row.unit == "s" and row.median >= 1:
        return f"{row.min:.2f}–{row.max:.2f} s"
    scale = 1000 if row.unit == "s" else 1
    return f"{row.min * scale:.1f}–{row.max * scale:.1f} ms"


def fmt_ratio(ratio: float | None) -> str:
    """``"0.84×"`` (ours / anchor), ``"—"`` without an anchor."""
    return "—" if ratio is None else f"{ratio:.2f}×"


def fmt_n(row: Row) -> str:
    """The sample count, with ``*`` when the row ran fewer times than ``--repeats`` asked."""
    return f"{row.n}*" if row.reduced else str(row.n)


def table(rows: Sequence[Row], title: str | None = None) -> Table:
    """A rich table: figure | ours (median) | spread (min–max) | n | seed anchor | ours/anchor | note."""
    t = Table(title=title, title_justify="left", show_lines=False)
    t.add_column("figure")
    t.add_column("ours (median)", justify="right")
    t.add_column("spread (min–max)", justify="right")
    t.add_column("n", justify="right")
    t.add_column("seed anchor", justify="right")
    t.add_column("ours/anchor", justify="right")
    t.add_column("note")
    for r in rows:
        ratio = r.ratio
        style = "" if ratio is None else ("green" if ratio <= 1 else "yellow")
        t.add_row(
            r.name, fmt_time(r.median, r.unit), fmt_spread(r), fmt_n(r), r.anchor.text if r.anchor else "—",
            f"[{style}]{fmt_ratio(ratio)}[/]" if style else fmt_ratio(ratio), r.note,
        )
    reduced = sorted({(r.requested or 0) for r in rows if r.reduced})
    captions = []
    if reduced:
        captions.append(f"* fewer runs than --repeats {reduced[-1]} (a slow figure)")
    sources = dict.fromkeys(r.anchor.source for r in rows if r.anchor)
    if sources:
        captions.append("anchors: " + "; ".join(sources))
    if captions:
        t.caption = "\n".join(captions)
        t.caption_justify = "left"
    return t


def render(rows: Sequence[Row], title: str | None = None, width: int = 160) -> str:
    """The table as plain text (no colour), ``width`` columns wide."""
    buf = StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False).print(table(rows, title))
    return buf.getvalue()


def row_dict(row: Row) -> dict[str, Any]:
    """One row for JSON: ``figure``, ``name``, ``unit``, ``n``, ``median``, ``min``, ``max`` (in ``unit``),
    ``samples``, ``anchor`` (``{value, text, source}`` or null), ``ratio`` (ours/anchor or null),
    ``requested`` (``--repeats`` when the row ran fewer), ``note``."""
    return {
        "figure": row.figure,
        "name": row.name,
        "unit": row.unit,
        "n": row.n,
        "median": round(row.median, 6),
        "min": round(row.min, 6),
        "max": round(row.max, 6),
        "samples": [round(s, 6) for s in row.samples],
        "anchor": None if row.anchor is None else
        {"value": row.anchor.value, "text": row.anchor.text, "source": row.anchor.source},
        "ratio": None if row.ratio is None else round(row.ratio, 3),
        "requested": row.requested if row.reduced else None,
        "note": row.note,
    }


def document(rows: Sequence[Row], *, started: datetime, finished: datetime, options: dict[str, Any],
             host: dict[str, Any], errors: Sequence[dict[str, str]] = (),
             figure_seconds: dict[str, float] | None = None) -> dict[str, Any]:
    """The JSON document of a run: ``schema``, ``started``/``finished`` (ISO 8601 UTC), ``duration_s``,
    ``host``, ``options``, ``figure_seconds`` (wall time each figure took, set-up included), ``rows`` (see
    :func:`row_dict`) and ``errors`` (``{figure, error}`` of figures that failed)."""
    return {
        "schema": SCHEMA,
        "started": started.astimezone(UTC).isoformat(timespec="seconds"),
        "finished": finished.astimezone(UTC).isoformat(timespec="seconds"),
        "duration_s": round((finished - started).total_seconds(), 1),
        "host": host,
        "options": options,
        "figure_seconds": {k: round(v, 1) for k, v in (figure_seconds or {}).items()},
        "rows": [row_dict(r) for r in rows],
        "errors": list(errors),
    }


def write_json(doc: dict[str, Any], directory: Path = RESULTS_DIR, when: datetime | None = None) -> Path:
    """Write ``doc`` to ``directory/<YYYYmmddTHHMMSSZ>.json`` (made if missing; a ``-N`` suffix if the name is
    taken) and return the path. Raises ``OSError``."""
    stamp = (when or datetime.now(UTC)).astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stamp}.json"
    n = 1
    while path.exists():
        path = directory / f"{stamp}-{n}.json"
        n += 1
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path
