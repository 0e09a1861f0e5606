"""Goodness-of-fit arithmetic for the sampling tests (stdlib only; no SciPy here).

:func:`chi_square_test` is Pearson's test of observed counts against exact cell
probabilities, with the cells whose expected count is under 5 pooled into one (the usual
rule that keeps the chi-square approximation honest). :func:`chi2_sf` is the survival
function of the chi-square distribution, the regularized upper incomplete gamma function
``Q(df / 2, x / 2)`` by its series (small ``x``) or continued fraction (large ``x``),
as in Numerical Recipes section 6.2.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

_EPS = 1e-15
_ITER = 10_000


def _gamma_p_series(a: float, x: float) -> float:
    term = total = 1.0 / a
    n = a
    for _ in range(_ITER):
        n += 1.0
        term *= x / n
        total += term
        if abs(term) < abs(total) * _EPS:
            break
    return total * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _gamma_q_fraction(a: float, x: float) -> float:
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, _ITER):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPS:
            break
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df must be positive, got {df}")
    if x <= 0:
        return 1.0
    a, half = df / 2.0, x / 2.0
    if half < a + 1.0:
        return max(0.0, 1.0 - _gamma_p_series(a, half))
    return _gamma_q_fraction(a, half)


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    df: int
    p_value: float
    cells: int  # after pooling
    n: int


def chi_square_test(
    counts: Mapping[object, int], probs: Mapping[object, float], *, min_expected: float = 5.0
) -> ChiSquare:
    """Pearson's chi-square of ``counts`` against ``probs`` (which must sum to 1 and cover
    every observed outcome: an outcome of probability 0 is an immediate failure)."""
    total = sum(probs.values())
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"probabilities sum to {total}, not 1")
    unexpected = [k for k, c in counts.items() if c and probs.get(k, 0.0) <= 0.0]
    n = sum(counts.values())
    if unexpected:
        return ChiSquare(math.inf, 1, 0.0, 0, n)
    kept, pooled_p, pooled_c = [], 0.0, 0
    for key, p in probs.items():
        if n * p >= min_expected:
            kept.append((counts.get(key, 0), n * p))
        else:
            pooled_p += p
            pooled_c += counts.get(key, 0)
    if pooled_p > 0:
        kept.append((pooled_c, n * pooled_p))
    stat = sum((c - e) ** 2 / e for c, e in kept)
    df = max(1, len(kept) - 1)
    return ChiSquare(stat, df, chi2_sf(stat, df), len(kept), n)
