"""The chi-square arithmetic the sampling tests rest on, against closed forms and tables."""

from __future__ import annotations

import math

import pytest

from .stats import chi2_sf, chi_square_test


@pytest.mark.parametrize("x", [0.1, 1.0, 5.0, 20.0, 80.0])
def test_two_degrees_of_freedom_is_an_exponential(x):
    assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)


@pytest.mark.parametrize(
    ("x", "df", "p"),
    # Critical values of the chi-square table (NIST/SEMATECH e-Handbook, 1.3.6.7.4).
    [(3.841, 1, 0.05), (10.828, 1, 0.001), (18.307, 10, 0.05), (29.588, 10, 0.001), (54.052, 26, 0.001)],
)
def test_table_critical_values(x, df, p):
    assert chi2_sf(x, df) == pytest.approx(p, rel=2e-3)


def test_a_perfect_fit_passes_and_a_wrong_one_fails():
    probs = {"a": 0.5, "b": 0.3, "c": 0.2}
    fit = chi_square_test({"a": 500, "b": 300, "c": 200}, probs)
    assert fit.statistic == 0 and fit.p_value == 1.0 and fit.df == 2
    off = chi_square_test({"a": 600, "b": 250, "c": 150}, probs)
    assert off.p_value < 1e-6


def test_rare_cells_are_pooled_and_an_impossible_outcome_fails_at_once():
    probs = {"a": 0.6, "b": 0.396, "c": 0.002, "d": 0.002}
    pooled = chi_square_test({"a": 60, "b": 40}, probs)
    assert pooled.cells == 3 and pooled.df == 2  # c and d pooled (expected 0.2 each)
    assert chi_square_test({"a": 59, "e": 1}, {"a": 1.0}).p_value == 0.0
