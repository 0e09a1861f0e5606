"""The walk on a hand-made periodic stream: where a round starts decides its acceptance, the
plain mean over positions is biased, the walk along the dense trace is exact."""

from __future__ import annotations

from typing import Any

import pytest

from ddtree_ops.predict.estimate import predict_acceptance
from ddtree_ops.predict.trace import TRACE_VERSION, parse_trace

A, B, C = 1, 2, 3  # the target's greedy stream is A B C A B C ...
# A context-determined draft: after A it proposes B C A (all right), after B X Y Z (wrong at
# once), after C A B C (all right).
DRAFT = {A: (B, C, A), B: (7, 8, 9), C: (A, B, C)}
RIGHT = {A: 3, B: 0, C: 3}  # argmax chain depth of the draft at each root
GRID = [[3, 1], [1, 1]]


def _round(prefix: int, root: int) -> dict[str, Any]:
    chain = DRAFT[root]
    ok = [1 if d < RIGHT[root] else 0 for d in range(3)]
    return {"prefix": prefix, "root": root, "draft_ids": [[t] for t in chain], "draft_logp": [[-0.1]] * 3,
            "parent": [0, 1, 2], "token": list(chain), "p": [float(v) for v in ok], "argmax": ok,
            "accepted": RIGHT[root]}


def _raw(positions: int, *, start: int = 10) -> dict[str, Any]:
    """A dense trace (a round at every position: each commits one token) of the stream."""
    rounds = [_round(start + i, (A, B, C)[i % 3]) for i in range(positions)]
    return {"version": TRACE_VERSION, "grid": GRID, "block": 4,
            "sampling": {"temperature": 0.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0}, "truncated": False,
            "rounds": rounds}


def test_the_walk_replays_a_smaller_tree_where_its_own_rounds_start() -> None:
    """30 positions (A B C ten times); a round's verdict needs the 3 tokens after its root, so
    the walks start no round past position 26. The chain of 3 commits 4, 1, 4 at A, B, C:
    rounds at 0 4 5 9 13 14 18 22 23, 27 tokens in 9 rounds, 3.0 (the plain mean over
    positions agrees). The chain of 1 commits 2 at A and C, 1 at B: plain mean 5/3. But its
    own rounds go A (0) -> C (2) -> B (4) -> C (5) -> B (7) ... and never meet A again:
    rounds at 0, 2 and then 4..26 alternating B, C (16 rounds), 2 + 2 + 8 * 1 + 8 * 2 = 28
    tokens in 18 rounds."""
    got = predict_acceptance([parse_trace(_raw(30))], [(3, 1), (1, 1)])
    small, big = got[(1, 1)], got[(3, 1)]
    assert small.naive == pytest.approx(5 / 3)
    assert (small.walk, small.walk_rounds) == (pytest.approx(28 / 18), 18)
    # At T = 0 p is 0 or 1: the path products at the walk's starts are its realised counts.
    assert small.expected == pytest.approx(small.walk)
    assert small.m2 == pytest.approx((2 * 4 + 8 * 1 + 8 * 4) / 18)
    assert (big.walk, big.walk_rounds, big.naive) == (pytest.approx(3.0), 9, pytest.approx(3.0))


def test_a_gap_starts_a_new_walk_and_a_trace_too_short_to_walk_is_refused() -> None:
    """A round that is not one position after the last (a retracted request resumes) starts a
    new segment; each segment is walked on its own."""
    raw = _raw(30)
    for rnd in raw["rounds"][15:]:
        rnd["prefix"] += 5
    got = predict_acceptance([parse_trace(raw)], [(1, 1)])[(1, 1)]
    # Segment 0..14: rounds 0 2 4 5 7 8 10 11 (ends at i <= 11): 2 + 2 + 3 * 1 + 3 * 2 = 13 in 8;
    # segment 15..29 starts at A again: rounds 15 17 19 20 22 23 25 26: 13 in 8.
    assert (got.walk, got.walk_rounds) == (pytest.approx(26 / 16), 16)
    with pytest.raises(ValueError, match="too short to walk"):
        predict_acceptance([parse_trace(_raw(3))], [(1, 1)])
