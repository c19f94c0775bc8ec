"""Profile a chain of blocks, solve for the cheapest mix of strategies under a memory budget and
an error budget, and apply the plan.

* :mod:`~revckpt.schedule.costs`: the cost model (memory peak, recompute time, error), on
  per-block measurements (:class:`BlockCost`, with one record per strategy: :class:`ApproxCost`,
  :class:`SelectiveCost`, :class:`CompressCost`, :class:`OffloadCost`, :class:`ReplayCost`,
  :class:`GradNorms`).
* :mod:`~revckpt.schedule.solver`: :func:`solve` (exact dynamic programme, every plan checked
  against the exact figures), baselines and :func:`make_plan` (a plan you choose, with its
  predictions); :mod:`~revckpt.schedule.programme`: the quantised problem and its programmes;
  :mod:`~revckpt.schedule.budget`: :func:`parse_budget`.
* :mod:`~revckpt.schedule.profile`: :func:`profile` (per-block measurements).
* :mod:`~revckpt.schedule.plan`: :class:`Plan` (table, JSON round trip) and :func:`apply`.
"""

from .budget import parse_budget
from .cost_records import (
    ApproxCost,
    CompressCost,
    GradNorms,
    OffloadCost,
    ReplayCost,
    SelectiveCost,
)
from .costs import BlockCost, Segment, evaluate
from .plan import Plan, Scheduled, apply
from .profile import Profile, profile
from .solver import baseline, make_plan, solve
from .verify import Verified, verify

__all__ = [
    "ApproxCost",
    "BlockCost",
    "CompressCost",
    "GradNorms",
    "OffloadCost",
    "Plan",
    "Profile",
    "ReplayCost",
    "Scheduled",
    "Segment",
    "SelectiveCost",
    "Verified",
    "apply",
    "baseline",
    "evaluate",
    "make_plan",
    "parse_budget",
    "profile",
    "solve",
    "verify",
]
