"""The measured phase's verdict on a group's candidates (issue 56 item 2): median and MAD over
repeats, a candidate out once the best leads it by more than their noise, a tie within 1 %
to the smaller tree, undecided at the cap with the lead and the noise said."""

from __future__ import annotations

import pytest

from ddtree_ops.predict.decide import Candidate, judge, repeats_cap, repeats_floor


def c(tree: tuple[int, int], *values: float, taken: int | None = None) -> Candidate:
    return Candidate(tree, tuple(values), len(values) if taken is None else taken)


def test_one_measurement_each_is_never_a_decision() -> None:
    # What a predicted run did before: one repeat each, the fastest of them chosen.
    v = judge([c((16, 4), 100.0), c((8, 4), 80.0)], floor=2, cap=6)
    assert not v.decided and v.more and v.contenders == ((16, 4), (8, 4))
    assert repeats_floor(1) == 2 and repeats_floor(3) == 3 and repeats_cap(1) == 6 and repeats_cap(8) == 8
    assert repeats_cap(1, 3) == 3 and repeats_cap(4, 3) == 4  # a sweep's max_repeats, never below its repeats


def test_the_best_ahead_by_more_than_the_noise_is_decided_and_the_others_are_out() -> None:
    v = judge([c((16, 4), 100.0, 102.0, 99.0), c((8, 4), 90.0, 91.0, 89.0), c((32, 4), 60.0, 58.0, 61.0)],
              floor=2, cap=6)
    assert v.decided and not v.more and v.why == "ahead"
    assert v.winner == (16, 4) and v.contenders == ((16, 4),) and v.runner_up == (8, 4)
    assert v.gap == pytest.approx(0.10) and 0 < (v.noise or 0) < v.gap


def test_one_slow_measurement_of_the_best_does_not_lose_it() -> None:
    # The case: one measurement of the best came out 42 % below its others; the
    # median over three repeats keeps it first, where its first value alone lost to the second.
    best, second = (24, 3), (12, 3)
    first = judge([c(best, 58.0), c(second, 92.0)], floor=2, cap=6)
    assert first.more  # one value each: measure again
    v = judge([c(best, 58.0, 101.0, 100.0), c(second, 92.0, 91.0, 93.0)], floor=2, cap=6)
    assert v.winner == best and v.decided


def test_within_the_noise_the_group_is_measured_again_then_left_undecided_at_the_cap() -> None:
    noisy = [c((16, 4), 100.0, 108.0, 94.0), c((8, 4), 97.0, 103.0, 92.0), c((4, 4), 70.0, 71.0, 69.0)]
    v = judge(noisy, floor=2, cap=6)
    assert not v.decided and v.more and v.contenders == ((8, 4), (16, 4))  # (4, 4) is out
    at_cap = judge([c(t.tree, *t.values, taken=6) for t in noisy], floor=2, cap=6)
    assert not at_cap.decided and not at_cap.more and at_cap.why == "undecided"
    # The best median wins; what it led by and the noise are said.
    assert at_cap.winner == (16, 4) and at_cap.runner_up == (8, 4)
    assert at_cap.gap == pytest.approx(0.03) and (at_cap.noise or 0) > at_cap.gap


def test_within_one_percent_the_smaller_tree_wins() -> None:
    v = judge([c((32, 4), 100.0, 100.2, 99.9), c((16, 4), 99.5, 99.4, 99.6), c((8, 2), 90.0, 90.1, 89.9)],
              floor=2, cap=6)
    assert v.decided and v.why == "tie" and v.winner == (16, 4) and v.tie == ((16, 4), (32, 4))
    assert v.runner_up == (8, 2)


def test_a_candidate_whose_every_measurement_failed_cannot_win() -> None:
    v = judge([c((16, 4), taken=2), c((8, 4), 90.0, 91.0)], floor=2, cap=6)
    assert v.winner == (8, 4) and v.decided
    nothing = judge([c((16, 4), taken=6)], floor=2, cap=6)
    assert nothing.winner is None and not nothing.more and nothing.why == "no candidate measured ok"
