"""Profile a chain of blocks, solve for the cheapest mix of strategies under a memory budget and
an error budget, and apply the plan.

* :mod:`~revckpt.schedule.costs`: the cost model (memory peak, recompute time, error).
* :mod:`~revckpt.schedule.solver`: :func:`solve` (exact dynamic programme) and baselines.
* :mod:`~revckpt.schedule.profile`: :func:`profile` (per-block measurements).
* :mod:`~revckpt.schedule.plan`: :class:`Plan` (table, JSON round trip) and :func:`apply`.
"""

from .costs import BlockCost, Segment, evaluate
from .plan import Plan, Scheduled, apply
from .profile import Profile, profile
from .solver import baseline, parse_budget, solve

__all__ = [
    "BlockCost",
    "Plan",
    "Profile",
    "Scheduled",
    "Segment",
    "apply",
    "baseline",
    "evaluate",
    "parse_budget",
    "profile",
    "solve",
]
