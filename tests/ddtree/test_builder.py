"""The best-first builder returns exactly the top-budget prefix paths (brute force)."""

from __future__ import annotations

import itertools
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st


@st.composite
def topk_inputs(draw: st.DrawFn) -> tuple[list[list[int]], list[list[float]], int]:
    depth = draw(st.integers(1, 4))
    k = draw(st.integers(1, 4))
    # Quarter steps make exact ties between different paths common.
    lps = [sorted((-draw(st.integers(0, 12)) / 4 for _ in range(k)), reverse=True) for _ in range(depth)]
    ids = [[100 * d + r for r in range(k)] for d in range(depth)]
    total = sum(k**d for d in range(1, depth + 1))
    budget = draw(st.integers(0, total + 2))
    return ids, lps, budget


def _all_paths(lps: list[list[float]]) -> list[tuple[tuple[int, ...], float]]:
    """Every prefix path as (ranks, cumulative logprob summed left to right)."""
    out = []
    k = len(lps[0])
    for d in range(1, len(lps) + 1):
        for ranks in itertools.product(range(k), repeat=d):
            w = 0.0
            for pos, r in enumerate(ranks):
                w = w + lps[pos][r]
            out.append((ranks, w))
    return out


@settings(max_examples=300, deadline=None)
@given(topk_inputs())
def test_builder_is_top_budget_by_brute_force(ref: ModuleType, case: tuple) -> None:
    ids, lps, budget = case
    tree = ref.build_ddtree_tree_from_topk(ids, lps, budget, root_token=-1)
    n = len(tree.parents)
    paths = _all_paths(lps)
    assert n - 1 == min(budget, len(paths))
    assert tree.parents[0] == -1 and tree.depths[0] == 0 and tree.token_ids[0] == -1 and tree.node_logws[0] == 0.0

    ranks_of: list[tuple[int, ...]] = [()]
    for i in range(1, n):
        p = tree.parents[i]
        assert 0 <= p < i, "ancestor-closed: a node is popped after its parent"
        assert tree.depths[i] == tree.depths[p] + 1
        rank = tree.token_ids[i] - 100 * (tree.depths[i] - 1)
        assert 0 <= rank < len(ids[0])
        ranks_of.append(ranks_of[p] + (rank,))
        assert tree.node_logws[i] == tree.node_logws[p] + lps[tree.depths[i] - 1][rank]
    assert len(set(ranks_of)) == n, "no path appears twice"
    # Non-increasing pop order, and the multiset of chosen weights is the top-budget one
    # (ties may be broken either way, so compare weights rather than paths).
    assert all(a >= b for a, b in itertools.pairwise(tree.node_logws[1:]))
    best = sorted((w for _, w in paths), reverse=True)[: n - 1]
    assert sorted(tree.node_logws[1:], reverse=True) == best


def test_builder_accepts_tensors_and_runs_out_of_candidates(ref: ModuleType) -> None:
    ids = torch.tensor([[3, 4], [5, 6]])
    lps = torch.log(torch.tensor([[0.6, 0.4], [0.7, 0.3]]))
    tree = ref.build_ddtree_tree_from_topk(ids, lps, 100, root_token=9)
    assert len(tree) == 1 + 2 + 4  # every path, budget not reached
    assert tree.token_ids[0] == 9
    assert ref.build_ddtree_tree_from_topk(ids, lps, 0).parents == [-1]


@pytest.mark.parametrize(
    ("ids", "lps", "budget"),
    [([[1, 2]], [[-0.1]], 3), ([[1, 2], [3]], [[-0.1, -0.2], [-0.3]], 3), ([[1]], [[-0.1]], -1)],
    ids=["shape-mismatch", "ragged", "negative-budget"],
)
def test_builder_rejects_bad_input(ref: ModuleType, ids: list, lps: list, budget: int) -> None:
    with pytest.raises(ValueError):
        ref.build_ddtree_tree_from_topk(ids, lps, budget)
