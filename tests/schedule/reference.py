"""Independent references for the solver: brute force over all plans, and a MILP."""

from __future__ import annotations

import itertools
import math

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from revckpt.schedule.costs import APPROX_PREFIX, REVERSIBLE, BlockCost
from revckpt.schedule.programme import Instance


def _table(inst: Instance):
    return {
        (j, k, s): (kept, work, err, time) for j, k, s, kept, work, err, time in inst.candidates
    }


def _forbidden(a, b, saved_outputs, selective_kept=frozenset()) -> bool:
    """After reversible: neither approx nor reversible. After a store segment whose last block
    saves its own output, or a selective one whose policy keeps it: neither either. Offload
    follows the rules of approx."""
    if not (b[2] == REVERSIBLE or b[2].startswith(APPROX_PREFIX) or b[2] == "offload"):
        return False
    if a[2] == REVERSIBLE:
        return True
    if a[2] == "store" and (a[1] - 1) in saved_outputs:
        return True
    return a[2].startswith("selective:") and (a[1] - 1, a[2]) in selective_kept


def brute_force(
    inst: Instance, saved_outputs=frozenset(), selective_kept=frozenset()
) -> float | None:
    """Minimum time over every plan (every composition of the chain, every strategy per
    segment), checked with the quantised peak and error; None when nothing fits.
    ``saved_outputs``: the blocks that save their own output."""
    table = _table(inst)
    n = inst.length
    best = math.inf
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        segs = list(itertools.pairwise(bounds))
        for strategies in itertools.product(inst.strategies, repeat=len(segs)):
            # a store segment of several blocks equals that many store segments of one
            parts = []
            for (j, k), s in zip(segs, strategies, strict=True):
                parts += [(i, i + 1, s) for i in range(j, k)] if s == "store" else [(j, k, s)]
            if any(p not in table for p in parts):
                continue
            if any(
                _forbidden(a, b, saved_outputs, selective_kept)
                for a, b in itertools.pairwise(parts)
            ):
                continue
            prefix = peak = err = 0
            time = 0.0
            for p in parts:
                kept, work, e, t = table[p]
                peak = max(peak, prefix + work)
                prefix += kept
                err += e
                time += t
            if peak <= inst.budget and err <= inst.error_budget and time < best:
                best = time
    return None if math.isinf(best) else best


def milp_optimum(
    inst: Instance, saved_outputs=frozenset(), selective_kept=frozenset()
) -> float | None:
    """The same problem as a MILP: one binary per candidate segment, a path from 0 to L, a
    big-M peak constraint per candidate, the error budget, and the adjacency rules (x_a + x_b
    <= 1 for every forbidden pair meeting at a node)."""
    cands = inst.candidates
    m = len(cands)
    n = inst.length
    cost = np.array([c[6] for c in cands])
    rows, lo, hi = [], [], []

    def add(row, low, high):
        rows.append(row)
        lo.append(low)
        hi.append(high)

    for node in range(n + 1):  # flow conservation
        row = np.zeros(m)
        for i, (j, k, *_rest) in enumerate(cands):
            if j == node:
                row[i] += 1
            if k == node:
                row[i] -= 1
        target = 1 if node == 0 else (-1 if node == n else 0)
        add(row, target, target)
    big = sum(c[3] for c in cands) + max(c[4] for c in cands)
    starts = np.array([c[0] for c in cands])
    stops = np.array([c[1] for c in cands])
    kept = np.array([c[3] for c in cands], dtype=float)
    work = np.array([c[4] for c in cands], dtype=float)
    # candidate i's peak: kept by every chosen segment ending at or before its start, plus its
    # work; inactive (big-M) when i is not chosen
    peak_rows = (stops[None, :] <= starts[:, None]) * kept[None, :]
    peak_rows[np.arange(m), np.arange(m)] += work + big
    for row in peak_rows:
        add(row, -np.inf, inst.budget + big)
    row = np.array([c[5] for c in cands], dtype=float)
    add(row, -np.inf, inst.error_budget)
    # at node t one segment ends and one starts (flow), so "a forbids b" for every pair is:
    # (ending segments forbidding kind K) + (starting segments of kind K) <= 1, per kind
    for node in range(1, n):
        for kind in ("approx", REVERSIBLE):
            row = np.zeros(m)
            for i, c in enumerate(cands):
                j, k, s = c[0], c[1], c[2]
                probe = (0, 0, APPROX_PREFIX if kind == "approx" else REVERSIBLE)
                if k == node and _forbidden(c, probe, saved_outputs, selective_kept):
                    row[i] = 1
                if j == node and (
                    (s.startswith(APPROX_PREFIX) or s == "offload")
                    if kind == "approx"
                    else s == REVERSIBLE
                ):
                    row[i] = 1
            add(row, -np.inf, 1)
    res = milp(
        cost,
        constraints=LinearConstraint(np.array(rows), lo, hi),
        integrality=np.ones(m),
        bounds=Bounds(0, 1),
    )
    return float(res.fun) if res.status == 0 else None


def timed_block(forward_s: float, backward_s: float, **fields) -> BlockCost:
    """A block of only times (every byte figure 0, or as ``fields`` say): what a time
    check needs."""
    sizes = dict.fromkeys(
        (
            "input_bytes",
            "output_bytes",
            "saved_bytes",
            "forward_peak_bytes",
            "forward_peak_nograd_bytes",
            "backward_peak_bytes",
        ),
        0,
    )
    return BlockCost(forward_s=forward_s, backward_s=backward_s, **{**sizes, **fields})
