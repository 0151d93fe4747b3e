"""The benchmark's figures register themselves here: each figure function carries ``@figure(name, order=...)``,
and ``python -m bench`` (:mod:`bench.__main__`) imports the figure modules, then reads :func:`figures`.

A figure is a function ``(Ctx) -> list[Row]`` (:class:`bench.context.Ctx`, :class:`bench.report.Row`). Its
``name`` is what ``--only`` takes; ``order`` places it in the run (and in ``--only``'s list): figures run by
ascending order, whatever order their modules were imported in. ``opt_in`` figures run only when ``--only`` names
them; ``needs_server`` is false for those that start what they need themselves (no benchmark server is started
for a run of only those). This module imports no figure module, so none of them imports another through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.context import Ctx
    from bench.report import Row

FigureFn = Callable[["Ctx"], "list[Row]"]


@dataclass(frozen=True)
class Figure:
    """One registered figure: its ``name`` (``--only``), the function that ``run`` s it, its place ``order`` in
    a run, whether it is ``opt_in`` and whether it ``needs_server`` (the benchmark's ``sbx server``)."""

    name: str
    run: FigureFn
    order: int
    opt_in: bool = False
    needs_server: bool = True


_registered: dict[str, Figure] = {}


def figure(name: str, *, order: int, opt_in: bool = False, needs_server: bool = True) -> Callable[[FigureFn],
                                                                                                   FigureFn]:
    """Decorator: register the decorated function as figure ``name`` at place ``order`` (see the module
    docstring); the function is returned unchanged. Raises ``ValueError`` when another function already has that
    name or that order (registering the same function again, as a module reloaded, is fine)."""

    def register(fn: FigureFn) -> FigureFn:
        where = f"{fn.__module__}.{fn.__qualname__}"
        for other in _registered.values():
            theirs = f"{other.run.__module__}.{other.run.__qualname__}"
            if (other.name == name or other.order == order) and theirs != where:
                raise ValueError(f"figure {name!r} (order {order}, {where}) clashes with {other.name!r} "
                                 f"(order {other.order}, {theirs})")
        _registered[name] = Figure(name, fn, order, opt_in, needs_server)
        return fn

    return register


def figures() -> dict[str, Figure]:
    """The registered figures by name, in the order they run (ascending ``order``)."""
    return {f.name: f for f in sorted(_registered.values(), key=lambda f: f.order)}
