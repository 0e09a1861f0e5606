"""Retrieve encoding, attention mask and positions of DDTree trees.

The worked example is the one in design.md; the properties are checked on arbitrary
parent arrays (not only builder output), since the encoding is a contract of its own.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# Drafter top-k chosen so the budget-5 tree pops: (d0,r0), its child, grandchild, then
# the root's rank-1 child (-0.8) before node 1's rank-1 child (-1.1).
WORKED_IDS = [[10, 11], [20, 21], [30, 31]]
WORKED_LPS = [[-0.1, -0.8], [-0.5, -1.0], [-0.1, -2.0]]


def test_worked_example_from_design(ref: ModuleType) -> None:
    tree = ref.build_ddtree_tree_from_topk(WORKED_IDS, WORKED_LPS, 5, root_token=7)
    assert tree.parents == [-1, 0, 1, 2, 0, 1]
    assert tree.depths == [0, 1, 2, 3, 1, 2]
    assert tree.token_ids == [7, 10, 20, 30, 11, 21]
    assert tree.node_logws[0] == 0.0
    index, next_token, next_sibling = ref.compile_ddtree_retrieve(tree.parents, tree.node_logws)
    assert index.tolist() == [0, 1, 2, 3, 4, 5]
    assert next_token.tolist() == [1, 2, 3, -1, -1, -1]
    assert next_sibling.tolist() == [-1, 4, 5, -1, -1, -1]
    assert index.dtype == next_token.dtype == next_sibling.dtype == torch.int64


def test_offset_shifts_only_retrieve_index(ref: ModuleType) -> None:
    tree = ref.build_ddtree_tree_from_topk(WORKED_IDS, WORKED_LPS, 5)
    index, next_token, next_sibling = ref.compile_ddtree_retrieve(tree.parents, tree.node_logws, offset=12)
    assert index.tolist() == [12, 13, 14, 15, 16, 17]
    assert next_token.tolist() == [1, 2, 3, -1, -1, -1]
    assert next_sibling.tolist() == [-1, 4, 5, -1, -1, -1]


def test_worked_example_mask_and_positions(ref: ModuleType) -> None:
    parents = [-1, 0, 1, 2, 0, 1]
    mask = ref.tree_attention_mask(parents)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 0, 0, 0, 1, 0],
            [1, 1, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    assert ref.tree_positions([0, 1, 2, 3, 1, 2], 100).tolist() == [100, 101, 102, 103, 101, 102]
    per_request = ref.tree_positions(torch.tensor([0, 1, 1]), torch.tensor([[5], [9]]))
    assert per_request.tolist() == [[5, 6, 6], [9, 10, 10]]


@pytest.mark.parametrize(
    "parents",
    [[0], [-1, 5], [-1, 2, 1], [-1, 1], []],
    ids=["root-has-parent", "parent-out-of-range", "cycle", "self-loop", "empty"],
)
def test_invalid_parent_arrays_are_refused(ref: ModuleType, parents: list[int]) -> None:
    with pytest.raises(ValueError):
        ref.compile_ddtree_retrieve(parents, [0.0] * len(parents))
    with pytest.raises(ValueError):
        ref.tree_attention_mask(parents)


@st.composite
def random_trees(draw: st.DrawFn) -> tuple[list[int], list[float]]:
    """Any rooted tree: parents drawn freely, then nodes relabelled by a permutation so
    a parent may have a larger index than its child; logws with deliberate ties."""
    n = draw(st.integers(1, 40))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    perm = [0] + draw(st.permutations(list(range(1, n))))
    relabelled = [-1] * n
    for old in range(1, n):
        relabelled[perm[old]] = perm[parents[old]]
    logws = [0.0] + [float(draw(st.integers(-6, 0))) / 2 for _ in range(1, n)]
    return relabelled, logws


def _ancestor_mask(parents: list[int]) -> torch.Tensor:
    """Brute force: walk every node up to the root."""
    n = len(parents)
    expected = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            expected[i, j] = True
            j = parents[j]
    return expected


def _dfs(next_token: list[int], next_sibling: list[int]) -> list[int]:
    seen: list[int] = []
    stack = [next_token[0]] if next_token[0] != -1 else []
    while stack:
        node = stack.pop()
        seen.append(node)
        if next_sibling[node] != -1:
            stack.append(next_sibling[node])
        if next_token[node] != -1:
            stack.append(next_token[node])
    return seen


@settings(max_examples=200, deadline=None)
@given(random_trees())
def test_encoding_properties(ref: ModuleType, tree: tuple[list[int], list[float]]) -> None:
    parents, logws = tree
    n = len(parents)
    _, nt_t, ns_t = ref.compile_ddtree_retrieve(parents, logws)
    nt, ns = nt_t.tolist(), ns_t.tolist()
    visited = _dfs(nt, ns)
    assert sorted(visited) == list(range(1, n)), "DFS must visit every non-root node exactly once"
    for p in range(n):
        chain = []
        c = nt[p]
        while c != -1:
            chain.append(c)
            c = ns[c]
        # Pointers agree with parents: the chain of p is exactly p's children ...
        assert sorted(chain) == [i for i in range(1, n) if parents[i] == p]
        # ... in descending logw, ties by lower index first.
        assert chain == sorted(chain, key=lambda i: (-logws[i], i))
    assert ns[0] == -1


@settings(max_examples=100, deadline=None)
@given(random_trees())
def test_mask_is_ancestor_closure(ref: ModuleType, tree: tuple[list[int], list[float]]) -> None:
    parents, _ = tree
    assert torch.equal(ref.tree_attention_mask(parents), _ancestor_mask(parents))


@pytest.mark.parametrize("n", [127, 128, 129, 700])
def test_mask_on_large_trees_both_strategies(ref: ModuleType, n: int) -> None:
    """Sizes on both sides of the bitset / level-walk switch, numbered in any order."""
    g = torch.Generator().manual_seed(n)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    perm = [0] + (torch.randperm(n - 1, generator=g) + 1).tolist()
    relabelled = [-1] * n
    for old in range(1, n):
        relabelled[perm[old]] = perm[parents[old]]
    mask = ref.tree_attention_mask(relabelled)
    assert mask.is_contiguous() and mask.dtype == torch.bool
    assert torch.equal(mask, _ancestor_mask(relabelled))
