"""Plans (issue 12): which sizes an account may run, how many starts per hour, how many sandboxes at once, and
how much storage is included.

The table is ``Settings.plans`` (TOML ``[plans.<name>]``) merged over :data:`DEFAULT_PLANS`, whose figures follow
the seeds: the free trial runs ``small`` and ``default`` only, and ``xlarge`` needs the $100 plan or higher
(resize guide); a create, a resume and a fork each count as a start (fork guide); stopped sandboxes and snapshots
count toward included storage (resize guide's fork table). ``unlimited`` is the self-hosted installation's own
plan (its first account). A limit of 0 means none.

A plan may also name the runtime classes its accounts run (``runtimes``, default both): ``["gvisor"]`` requires
the hardened class (issue 33), and such an account's sandboxes are gVisor's unless a request names another.

A refusal is ``403 plan_limit`` with ``limit`` (``size``, ``runtime``, ``starts_per_hour``, ``running``,
``storage_gib``), the
account's ``plan`` and ``upgrade``, the cheapest plan that would allow it (null when none would).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sbx.config import RUNTIME_CLASSES, SIZE_ORDER
from sbx.control.errors import ControlError

DEFAULT_PLANS: dict[str, dict[str, Any]] = {
    "trial": {"price_usd_month": 0, "sizes": ["small", "default"], "starts_per_hour": 20, "running": 2,
              "storage_gib": 20},
    "pro": {"price_usd_month": 20, "sizes": ["small", "default", "large"], "starts_per_hour": 200, "running": 10,
            "storage_gib": 200},
    "team": {"price_usd_month": 100, "sizes": list(SIZE_ORDER), "starts_per_hour": 1000, "running": 50,
             "storage_gib": 1000},
    "unlimited": {"price_usd_month": 0, "sizes": list(SIZE_ORDER), "starts_per_hour": 0, "running": 0,
                  "storage_gib": 0},
}


@dataclass(frozen=True)
class Plan:
    """One plan: ``price_usd_month``, ``sizes`` allowed, ``starts_per_hour``, ``running`` (at once) and
    ``storage_gib`` included (0 = no limit), the ``runtimes`` allowed (runtime classes, never empty)."""

    name: str
    price_usd_month: float
    sizes: tuple[str, ...]
    starts_per_hour: int
    running: int
    storage_gib: float
    runtimes: tuple[str, ...] = RUNTIME_CLASSES

    def view(self) -> dict[str, Any]:
        """API shape: ``{name, priceUsdMonth, sizes, startsPerHour, running, storageGiB, runtimes}``."""
        return {"name": self.name, "priceUsdMonth": self.price_usd_month, "sizes": list(self.sizes),
                "startsPerHour": self.starts_per_hour, "running": self.running, "storageGiB": self.storage_gib,
                "runtimes": list(self.runtimes)}

    def default_runtime(self, preferred: str) -> str:
        """The class of a sandbox created without one: ``preferred`` (the server's ``default_runtime``) when
        this plan allows it, else the plan's first class."""
        return preferred if preferred in self.runtimes else self.runtimes[0]


def load_plans(table: dict[str, Any]) -> dict[str, Plan]:
    """The plan table from ``Settings.plans`` over :data:`DEFAULT_PLANS`, cheapest first (``unlimited`` last).
    Raises ``ValueError`` for a plan entry that is not a table, names an unknown size or runtime class, or
    allows no runtime class."""
    merged: dict[str, dict[str, Any]] = {k: dict(v) for k, v in DEFAULT_PLANS.items()}
    for name, entry in table.items():
        if not isinstance(entry, dict):
            raise ValueError(f"plans.{name} must be a table")
        merged[name] = {**merged.get(name, DEFAULT_PLANS["trial"]), **entry}
    plans: dict[str, Plan] = {}
    for name, e in merged.items():
        sizes = tuple(str(s) for s in e["sizes"])
        unknown = [s for s in sizes if s not in SIZE_ORDER]
        if unknown:
            raise ValueError(f"plans.{name}.sizes names unknown sizes: {', '.join(unknown)}")
        runtimes = tuple(str(r) for r in e.get("runtimes", RUNTIME_CLASSES))
        wrong = [r for r in runtimes if r not in RUNTIME_CLASSES]
        if wrong or not runtimes:
            raise ValueError(f"plans.{name}.runtimes must list runtime classes of {', '.join(RUNTIME_CLASSES)}"
                             f"{' (not ' + ', '.join(wrong) + ')' if wrong else ''}")
        plans[name] = Plan(name, float(e["price_usd_month"]), sizes, int(e["starts_per_hour"]), int(e["running"]),
                           float(e["storage_gib"]), runtimes)
    return dict(sorted(plans.items(), key=lambda kv: (kv[0] == "unlimited", kv[1].price_usd_month, kv[0])))


def _allows(plan: Plan, limit: str, need: float | str) -> bool:
    if limit == "size":
        return need in plan.sizes
    if limit == "runtime":
        return need in plan.runtimes
    value = {"starts_per_hour": plan.starts_per_hour, "running": plan.running, "storage_gib": plan.storage_gib}[limit]
    return value == 0 or float(need) <= value


def refusal(plans: dict[str, Plan], plan: Plan, limit: str, need: float | str, message: str) -> ControlError:
    """403 ``plan_limit`` for ``limit`` on ``plan``: the message names the cheapest plan of ``plans`` whose limit
    allows ``need`` (a size name, or the count/GiB the request would reach)."""
    upgrade = next((p.name for p in plans.values() if p.name != plan.name and _allows(p, limit, need)), None)
    hint = f"; the {upgrade} plan allows it" if upgrade else ""
    return ControlError("plan_limit", f"{message} on the {plan.name} plan{hint}", 403,
                        extra={"limit": limit, "plan": plan.name, "upgrade": upgrade})


def check(plans: dict[str, Plan], plan: Plan, size: str, starts_last_hour: int, running: int, what: str,
          runtime: str = RUNTIME_CLASSES[0]) -> None:
    """Refuse ``what`` (a create, resume or fork at ``size``, of runtime class ``runtime``) with 403 ``plan_limit``
    when ``plan`` does not allow the size or the class, when ``starts_last_hour`` (starts in the past 3600 s) has
    reached the start limit, or ``running`` (the account's sandboxes that are running or starting, not counting this
    one) the concurrency limit."""
    if size not in plan.sizes:
        raise refusal(plans, plan, "size", size, f"{what}: size {size} is not included (sizes: "
                      f"{', '.join(plan.sizes)})")
    if runtime not in plan.runtimes:
        raise refusal(plans, plan, "runtime", runtime, f"{what}: the {runtime} runtime class is not included "
                      f"(runtimes: {', '.join(plan.runtimes)})")
    if plan.starts_per_hour and starts_last_hour >= plan.starts_per_hour:
        raise refusal(plans, plan, "starts_per_hour", starts_last_hour + 1,
                      f"{what}: {starts_last_hour} starts in the past hour reach the limit of "
                      f"{plan.starts_per_hour} starts per hour (a create, a resume and a fork each count)")
    if plan.running and running >= plan.running:
        raise refusal(plans, plan, "running", running + 1,
                      f"{what}: {running} sandboxes already run, the limit is {plan.running} at once")
