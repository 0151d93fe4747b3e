"""Helpers shared by the CLI verbs: the SDK client, error reporting, JSON/human output, spinners.

Human output goes to stdout only where a script would want it (ids); progress and notes go to stderr. Machine
output is produced only with ``--json``. Errors print ``error: <code>: <message>`` to stderr and exit 1 (usage
errors exit 2, from click).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from sbx.sdk import Client, SbxError


def _width(stream: Any) -> int | None:
    """Rich lays out for 80 columns when output is not a terminal, which truncates ids, URLs and tokens in
    tables; piped output gets room for every cell instead (``COLUMNS`` still wins when set)."""
    try:
        interactive = stream.isatty()
    except (AttributeError, ValueError):  # no stream, or a closed one
        interactive = False
    return None if interactive or "COLUMNS" in os.environ else 1000


err = Console(stderr=True, highlight=False, soft_wrap=True, width=_width(sys.stderr))
out = Console(highlight=False, soft_wrap=True, width=_width(sys.stdout))

F = TypeVar("F", bound=Callable[..., Any])

JSON_OPT = typer.Option(False, "--json", help="Print machine-readable JSON on stdout.")


def client() -> Client:
    """An SDK client for the configured server (``SBX_URL``/``SBX_TOKEN`` or ``~/.config/sbx/config.toml``)."""
    return Client()


def fail(code: str, message: str) -> typer.Exit:
    """Print ``error: code: message`` to stderr and return the ``typer.Exit(1)`` to raise."""
    err.print(f"error: {code}: {message}", markup=False)
    return typer.Exit(1)


def handle_errors(fn: F) -> F:
    """Turn :class:`SbxError` from a verb into ``error: code: message`` on stderr and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SbxError as e:
            raise fail(e.code, e.message) from None

    return wrapper  # type: ignore[return-value]


def print_json(obj: Any) -> None:
    """One compact JSON document (or event line) on stdout."""
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def print_table(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
    """A borderless table on stdout: a header of ``columns``, then one line per row (the list views)."""
    table = Table(box=None, pad_edge=False)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    out.print(table)


@contextmanager
def spinner(message: str, enabled: bool = True) -> Iterator[None]:
    """A rich spinner on stderr while a long operation runs (only when stderr is a terminal)."""
    if enabled and err.is_terminal:
        with err.status(message):
            yield
    else:
        yield


def parse_env(pairs: list[str] | None, option: str = "--env") -> dict[str, str] | None:
    """``["K=V", ...]`` to a dict; a pair without ``=`` is a usage error (exit 2) naming ``option``."""
    if not pairs:
        return None
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint=option)
        env[key] = value
    return env
