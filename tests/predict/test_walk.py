"""The stream walk (T = 0) on a hand-made periodic stream: where a round starts decides its
acceptance, the naive mean (and the per-request correction) is biased, the walk is exact."""

from __future__ import annotations

from typing import Any

import pytest

from ddtree_ops.predict.estimate import greedy_stream, predict_acceptance
from ddtree_ops.predict.trace import parse_trace

A, B, C = 1, 2, 3  # the target's greedy stream is A B C A B C ...
# A context-determined draft: after A it proposes B C A (all right), after B X Y Z (wrong at
# once), after C A B C (all right).
DRAFT = {A: (B, C, A), B: (7, 8, 9), C: (A, B, C)}
RIGHT = {A: 3, B: 0, C: 3}  # argmax chain depth of the draft at each root


def _round(prefix: int, root: int) -> dict[str, Any]:
    chain = DRAFT[root]
    ok = [1 if d < RIGHT[root] else 0 for d in range(3)]
    return {"prefix": prefix, "root": root, "draft_ids": [[t] for t in chain], "draft_logp": [[-0.1]] * 3,
            "parent": [0, 1, 2], "token": list(chain), "p": [float(v) for v in ok], "argmax": ok,
            "accepted": RIGHT[root]}


def _trace(rounds: int) -> Any:
    out, q, root = [], 10, A
    for _ in range(rounds):
        out.append(_round(q, root))
        q += RIGHT[root] + 1
        root = (A, B, C)[(q - 10) % 3]
    return parse_trace({"version": 1, "grid": [[3, 1], [1, 1]], "block": 4,
                        "sampling": {"temperature": 0.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0},
                        "truncated": False, "rounds": out})


def test_the_walk_replays_a_smaller_tree_where_its_own_rounds_start() -> None:
    """The traced chain of 3 commits 4, 1, 4 tokens at roots A, B, C: its rounds start at A, B,
    C in turn (9 rounds cover 27 tokens). A chain of 1 commits 2 at A and C, 1 at B: naive 5/3.
    But its own rounds go A (pos 0) -> C (2) -> B (4) -> C (5) -> B (7) ...: never A again,
    (2 + 1) / 2 per two rounds; 27 tokens take 1 + 2 * 8 + 1 = 18 rounds: 1.5."""
    trace = _trace(9)
    stream = greedy_stream(trace)
    assert stream == (A, B, C) * 9
    got = predict_acceptance([trace], [(3, 1), (1, 1)])
    small = got[(1, 1)]
    assert small.naive == pytest.approx(5 / 3) and small.corrected == pytest.approx(5 / 3)
    assert small.walk == pytest.approx(27 / 18)
    # The traced tree's own rounds all start at traced starts: the walk is its realised mean.
    assert got[(3, 1)].walk == pytest.approx(3.0) == got[(3, 1)].traced
    # For requests of 19 output tokens (18 after the prefill's first): 12 rounds.
    assert predict_acceptance([trace], [(1, 1)], tokens=19)[(1, 1)].walk == pytest.approx(18 / 12)


def test_no_walk_where_the_stream_is_not_known() -> None:
    trace = _trace(3)
    warm = parse_trace({**_raw(trace), "sampling": {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0}})
    assert predict_acceptance([warm], [(1, 1)])[(1, 1)].walk is None
    gap = _raw(trace)
    gap["rounds"][1]["prefix"] += 1  # a round that does not start where the last one's commits ended
    assert greedy_stream(parse_trace(gap)) is None


def _raw(trace: Any) -> dict[str, Any]:
    rounds = [_round(r.prefix, r.root) for r in trace.rounds]
    return {"version": 1, "grid": [[3, 1], [1, 1]], "block": 4,
            "sampling": {"temperature": 0.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0}, "truncated": False,
            "rounds": rounds}
