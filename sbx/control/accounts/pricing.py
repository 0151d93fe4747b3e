"""Prices and the arithmetic of usage (issue 12): pure functions over metered intervals, no database.

Two price models (``Settings.pricing``):

- ``size`` (the seed's price list, resize guide "What the bigger size costs"): a running sandbox costs its size's
  hourly price per second (small $0.018/h, default $0.036/h, large $0.072/h, xlarge twice large, $0.144/h); a
  stopped one costs nothing (its storage still counts toward the plan's included storage).
- ``memory`` (Sandbox0's memory-time, background-agents notes): running costs $0.015 per GiB-hour of the size's
  memory, per second; stored data costs $0.02 per GiB-month (a month is 730 hours).

An interval is ``(kind, size, gib, start, end)``: ``kind`` ``run`` (``gib`` = the size's memory in GiB) or
``store`` (``gib`` = GiB held on the volume). :func:`report` clips intervals to a window and groups them.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

HOURS_PER_MONTH = 730.0
DEFAULT_PRICING: dict[str, Any] = {
    "model": "size",
    "hourly": {"small": 0.018, "default": 0.036, "large": 0.072, "xlarge": 0.144},
    "memory_gib_hour": 0.015,
    "storage_gib_month": 0.02,
}


@dataclass(frozen=True)
class Pricing:
    """``model`` ``size`` or ``memory``; ``hourly``: USD per hour by size (size model); ``memory_gib_hour``: USD per
    GiB-hour of running memory and ``storage_gib_month``: USD per stored GiB-month (memory model)."""

    model: str = "size"
    hourly: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_PRICING["hourly"]))
    memory_gib_hour: float = 0.015
    storage_gib_month: float = 0.02

    @classmethod
    def from_settings(cls, table: dict[str, Any]) -> Pricing:
        """Build from ``Settings.pricing`` (missing keys take :data:`DEFAULT_PRICING`). Raises ``ValueError`` for
        an unknown model."""
        merged = {**DEFAULT_PRICING, **table}
        if merged["model"] not in ("size", "memory"):
            raise ValueError(f"pricing.model must be 'size' or 'memory', not {merged['model']!r}")
        hourly = {**DEFAULT_PRICING["hourly"], **dict(table.get("hourly") or {})}
        return cls(str(merged["model"]), {k: float(v) for k, v in hourly.items()},
                   float(merged["memory_gib_hour"]), float(merged["storage_gib_month"]))

    def cost(self, kind: str, size: str | None, gib: float, seconds: float) -> float:
        """USD for ``seconds`` of an interval of ``kind`` (``run`` at ``size`` holding ``gib`` of memory, or
        ``store`` of ``gib``)."""
        if kind == "run":
            if self.model == "memory":
                return seconds / 3600.0 * gib * self.memory_gib_hour
            return seconds / 3600.0 * self.hourly.get(size or "", 0.0)
        if self.model == "memory":
            return seconds / 3600.0 / HOURS_PER_MONTH * gib * self.storage_gib_month
        return 0.0


@dataclass(frozen=True)
class Interval:
    """One metered interval; ``end`` None while open (counted up to the report's ``to``)."""

    kind: str
    size: str | None
    gib: float
    start: dt.datetime
    end: dt.datetime | None
    sandbox_id: str | None = None
    snapshot: str | None = None


def _empty() -> dict[str, float]:
    return {"runningSeconds": 0.0, "runningGiBHours": 0.0, "storedGiBHours": 0.0, "cost": 0.0}


def _add(acc: dict[str, float], iv: Interval, seconds: float, pricing: Pricing) -> None:
    if iv.kind == "run":
        acc["runningSeconds"] += seconds
        acc["runningGiBHours"] += seconds / 3600.0 * iv.gib
    else:
        acc["storedGiBHours"] += seconds / 3600.0 * iv.gib
    acc["cost"] += pricing.cost(iv.kind, iv.size, iv.gib, seconds)


def _pieces(iv: Interval, start: dt.datetime, end: dt.datetime, by_day: bool
            ) -> list[tuple[dt.datetime, float]]:
    """``(piece start, seconds)`` of ``iv`` inside ``[start, end)``, split at UTC midnights when ``by_day``."""
    a = max(iv.start, start)
    b = min(iv.end or end, end)
    out: list[tuple[dt.datetime, float]] = []
    while a < b:
        cut = b
        if by_day:
            midnight = dt.datetime.combine(a.date() + dt.timedelta(days=1), dt.time(), dt.UTC)
            cut = min(b, midnight)
        out.append((a, (cut - a).total_seconds()))
        a = cut
    return out


def _round(acc: dict[str, float]) -> dict[str, float]:
    return {"runningSeconds": round(acc["runningSeconds"], 3), "runningGiBHours": round(acc["runningGiBHours"], 6),
            "storedGiBHours": round(acc["storedGiBHours"], 6), "cost": round(acc["cost"], 6)}


def report(intervals: list[Interval], start: dt.datetime, end: dt.datetime, by: str | None,
           pricing: Pricing) -> dict[str, Any]:
    """Sum ``intervals`` inside ``[start, end)``: ``{"total": {runningSeconds, runningGiBHours, storedGiBHours,
    cost}, "bySize": {size: {...}}, "groups": [{"key", ...figures, "bySize"}]}`` with ``groups`` by ``sandbox``
    (key = sandbox id, or ``snapshot:<name>``), ``size``, or ``day`` (key ``YYYY-MM-DD``, UTC) and empty when
    ``by`` is None. Cost in USD (6 decimals), seconds to the millisecond."""
    total = _empty()
    sizes: dict[str, dict[str, float]] = {}
    groups: dict[str, dict[str, Any]] = {}
    for iv in intervals:
        for piece_start, seconds in _pieces(iv, start, end, by == "day"):
            _add(total, iv, seconds, pricing)
            size_key = iv.size if iv.kind == "run" else "storage"
            _add(sizes.setdefault(size_key or "storage", _empty()), iv, seconds, pricing)
            if by is None:
                continue
            if by == "day":
                key = piece_start.date().isoformat()
            elif by == "size":
                key = size_key or "storage"
            else:
                key = iv.sandbox_id or f"snapshot:{iv.snapshot}"
            group = groups.setdefault(key, {"figures": _empty(), "sizes": {}})
            _add(group["figures"], iv, seconds, pricing)
            _add(group["sizes"].setdefault(size_key or "storage", _empty()), iv, seconds, pricing)
    return {
        "total": _round(total),
        "bySize": {k: _round(v) for k, v in sorted(sizes.items())},
        "groups": [{"key": k, **_round(g["figures"]), "bySize": {s: _round(v) for s, v in sorted(g["sizes"].items())}}
                   for k, g in sorted(groups.items())],
    }
