"""How many steps a simulation needs: the warm-up to drop and the error of the steady-state
step time (:func:`steady_state`)."""

from __future__ import annotations

import itertools
import math


def steady_state(ends: list[float], truncate: bool = True) -> tuple[int, float, float]:
    """The warm-up to drop from a run's step intervals (``ends``' differences, step 2 on) by
    MSER on batch means (White 1997, "An effective truncation heuristic for bias reduction in
    simulation output", Simulation 69(6); with batch means, the rule Hoad, Robinson and Davies
    2010 recommend): the intervals, the oldest one left out where their count is odd, are
    averaged in consecutive pairs y_1..y_m, and the d in [0, m / 2] minimising
    sum_{j > d} (y_j - mean)^2 / (m - d)^2, the squared standard error of the mean of the rest,
    is dropped (``truncate=False``: d = 0). Returns (intervals dropped, the mean of the rest in
    seconds, its relative error): the largest of its standard error and the gaps between the
    first and last halves of the rest, beyond their noise (:func:`_drift`), in the pairs'
    means and in their swings |long - short|
    (a swing still dying out keeps each pair's mean above the steady state, 23.7 against 23.3
    s, while the pairs agree among themselves: a 0.4% standard error where the mean was 2%
    off); ``inf`` with fewer than two pairs left.

    Pairs, because a pipelined run alternates: the trainer trains one batch while the engines
    generate the next, and an asynchronous run's steps swing long and short (a 1,024-GPU,
    eta = 1 run: 206, 96, 182, 121, ... settling at 144 s; a 32-GPU one keeps swinging 37, 51,
    37, 51 s); a pair averages the swing, and a mean over the first few steps alone is off by
    10-15%.
    """
    x = [b - a for a, b in itertools.pairwise(ends)]
    if len(x) < 2:
        return 0, x[0] if x else 0.0, math.inf
    odd = len(x) % 2
    y = [(x[i] + x[i + 1]) / 2 for i in range(odd, len(x) - 1, 2)]
    best = None
    for d in range(len(y) // 2 + 1 if truncate else 1):
        rest = y[d:]
        mean = sum(rest) / len(rest)
        mser = sum((v - mean) ** 2 for v in rest) / len(rest) ** 2
        if best is None or mser < best[0] - 1e-12 * mean**2:
            best = (mser, d, mean)
    mser, d, mean = best
    rest = y[d:]
    if len(rest) < 2 or mean <= 0:  # one pair: its error is unknown
        return odd + 2 * d, mean, math.inf if mean > 0 else 0.0
    half = len(rest) // 2
    first = odd + 2 * d  # the pairs' swings |long - short|, in the same order
    swing = [abs(x[i] - x[i + 1]) for i in range(first, len(x) - 1, 2)]
    drift = max(_drift(v[:half], v[len(v) - half :]) for v in (rest, swing)) / mean
    return first, mean, max(math.sqrt(mser) / mean, drift)


def _drift(early: list[float], late: list[float]) -> float:
    """How far the means of ``early`` and ``late`` differ beyond twice the standard error of
    their difference (0 where noise explains it)."""
    n = len(early)

    def var(v: list[float]) -> float:
        m = sum(v) / n
        return sum((a - m) ** 2 for a in v) / max(1, n - 1)

    gap = abs(sum(late) - sum(early)) / n
    return max(0.0, gap - 2 * math.sqrt((var(early) + var(late)) / n))
