"""The batch layout helpers equal the per-request functions exactly.

The verify pass lays out a whole batch of trees; the batch helpers do it in whole-batch
tensor operations and must give bit-for-bit what calling the per-request contract
functions once per tree gives, for builder trees and for arbitrary (relabelled) parent
arrays, with ragged sizes and padding.
"""

from __future__ import annotations

import random
from types import ModuleType

import pytest
import torch


def _random_tree(rng: random.Random, n: int, *, shuffle: bool, ties: bool) -> tuple[list[int], list[float]]:
    """A random tree of n nodes rooted at 0; shuffled trees list children before parents."""
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    if ties:
        logws = [0.0] + [-float(rng.randrange(3)) for _ in range(1, n)]
    else:
        logws = [0.0] + [-rng.random() * 5 for _ in range(1, n)]
    if shuffle and n > 2:
        perm = [0] + rng.sample(range(1, n), n - 1)  # perm[new] = old
        new_of = {old: new for new, old in enumerate(perm)}
        parents = [-1] + [new_of[parents[perm[i]]] for i in range(1, n)]
        logws = [logws[perm[i]] for i in range(n)]
    return parents, logws


def _batch(rng: random.Random, bs: int, max_n: int) -> list[tuple[list[int], list[float]]]:
    return [
        _random_tree(rng, rng.randint(1, max_n), shuffle=rng.random() < 0.3, ties=rng.random() < 0.5)
        for _ in range(bs)
    ]


def _depths(parents: list[int]) -> list[int]:
    depths = [0] * len(parents)
    for _ in parents:  # relax until fixed: fine for test-sized trees
        for i in range(1, len(parents)):
            depths[i] = depths[parents[i]] + 1
    return depths


@pytest.mark.parametrize("seed", range(40))
def test_compile_retrieve_batch_equals_per_request(ref: ModuleType, layout: ModuleType, seed: int) -> None:
    rng = random.Random(seed)
    trees = _batch(rng, rng.randint(1, 9), rng.choice([2, 5, 17, 40]))
    n = max(len(p) for p, _ in trees) + rng.choice([0, 0, 3])
    index, nxt, sib = layout.compile_ddtree_retrieve_batch(
        [p for p, _ in trees], [w for _, w in trees], num_nodes_padded=n
    )
    assert index.shape == nxt.shape == sib.shape == (len(trees), n)
    assert index.dtype == nxt.dtype == sib.dtype == torch.int64
    for b, (parents, logws) in enumerate(trees):
        m = len(parents)
        ri, rn, rs = ref.compile_ddtree_retrieve(parents, logws, offset=b * n)
        assert index[b, :m].tolist() == ri.tolist()
        assert nxt[b, :m].tolist() == rn.tolist()
        assert sib[b, :m].tolist() == rs.tolist()
        assert index[b, m:].tolist() == list(range(b * n + m, (b + 1) * n))
        assert nxt[b, m:].tolist() == [-1] * (n - m)
        assert sib[b, m:].tolist() == [-1] * (n - m)


def test_compile_retrieve_batch_default_width_and_tensor_inputs(layout: ModuleType) -> None:
    rng = random.Random(7)
    trees = _batch(rng, 5, 12)
    want = layout.compile_ddtree_retrieve_batch([p for p, _ in trees], [w for _, w in trees])
    got = layout.compile_ddtree_retrieve_batch(
        [torch.tensor(p) for p, _ in trees], [torch.tensor(w, dtype=torch.float64) for _, w in trees]
    )
    assert want[0].shape[1] == max(len(p) for p, _ in trees)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed", range(40))
def test_mask_batch_equals_per_request_with_root_padding(ref: ModuleType, layout: ModuleType, seed: int) -> None:
    rng = random.Random(1000 + seed)
    trees = _batch(rng, rng.randint(1, 9), rng.choice([2, 5, 17, 40, 130]))
    n = max(len(p) for p, _ in trees) + rng.choice([0, 0, 2])
    masks = layout.tree_attention_mask_batch([p for p, _ in trees], n)
    assert masks.shape == (len(trees), n, n) and masks.dtype == torch.bool
    for b, (parents, _) in enumerate(trees):
        expected = ref.tree_attention_mask(parents + [0] * (n - len(parents)))
        assert torch.equal(masks[b], expected), b


def test_mask_batch_of_a_long_chain(ref: ModuleType, layout: ModuleType) -> None:
    # Depth n - 1: the doubling must run to the top of the deepest tree.
    chain = [-1] + list(range(99))
    masks = layout.tree_attention_mask_batch([chain, [-1, 0]], 100)
    assert torch.equal(masks[0], torch.ones(100, 100, dtype=torch.bool).tril())
    assert torch.equal(masks[1], ref.tree_attention_mask([-1, 0] + [0] * 98))


@pytest.mark.parametrize("seed", range(10))
def test_positions_batch_equals_per_request(ref: ModuleType, layout: ModuleType, seed: int) -> None:
    rng = random.Random(2000 + seed)
    trees = _batch(rng, rng.randint(1, 9), 20)
    n = max(len(p) for p, _ in trees) + 1
    depths = [_depths(p) for p, _ in trees]
    starts = [rng.randrange(5000) for _ in trees]
    pos = layout.tree_positions_batch(depths, torch.tensor(starts), n)
    assert pos.shape == (len(trees), n) and pos.dtype == torch.int64
    for b, d in enumerate(depths):
        assert torch.equal(pos[b], ref.tree_positions(d + [1] * (n - len(d)), starts[b]))
    assert torch.equal(pos, layout.tree_positions_batch(depths, starts, n))


def test_custom_mask_batch_equals_concatenation(layout: ModuleType) -> None:
    rng = random.Random(3)
    trees = _batch(rng, 6, 10)
    n = 10
    masks = layout.tree_attention_mask_batch([p for p, _ in trees], n)
    prefixes = [0, 1, 7, 30, 2, 5]
    expected = torch.cat([
        torch.cat([torch.ones((n, prefixes[b]), dtype=torch.bool), masks[b]], dim=1).reshape(-1)
        for b in range(len(trees))
    ])
    assert torch.equal(layout.tree_custom_mask_batch(masks, prefixes), expected)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_builder_batch_equals_per_request(ref: ModuleType, layout: ModuleType, k: int) -> None:
    g = torch.Generator().manual_seed(k)
    lp = torch.log_softmax(torch.randn(6, 5, 50, generator=g) * 2.0, dim=-1).topk(k, dim=-1)
    roots = [11, 12, 13, 14, 15, 16]
    for budget in (0, 1, 7, 40):
        expected = [
            ref.build_ddtree_tree_from_topk(lp.indices[b], lp.values[b], budget, root_token=roots[b])
            for b in range(6)
        ]
        assert layout.build_ddtree_trees_from_topk_batch(lp.indices, lp.values, budget, torch.tensor(roots)) == expected
        # Nested lists take the same path as the per-request function.
        assert layout.build_ddtree_trees_from_topk_batch(
            lp.indices.tolist(), lp.values.tolist(), budget, roots
        ) == expected


def test_builder_batch_rejects_mismatched_batches(layout: ModuleType) -> None:
    ids = torch.zeros((2, 3, 2), dtype=torch.int64)
    with pytest.raises(ValueError, match="same"):
        layout.build_ddtree_trees_from_topk_batch(ids, torch.zeros((2, 3, 3)), 4, [0, 0])
    with pytest.raises(ValueError, match="batch sizes differ"):
        layout.build_ddtree_trees_from_topk_batch(ids, torch.zeros((2, 3, 2)), 4, [0])


def test_batch_helpers_reject_what_the_per_request_functions_reject(ref: ModuleType, layout: ModuleType) -> None:
    good = [-1, 0, 0]
    for bad in ([-1, 2, 1], [0, 0], [-1, 5], [-1, 1]):
        with pytest.raises(ValueError):
            ref.compile_ddtree_retrieve(bad, [0.0] * len(bad))
        with pytest.raises(ValueError):
            layout.compile_ddtree_retrieve_batch([good, bad], [[0.0] * 3, [0.0] * len(bad)])
        with pytest.raises(ValueError):
            layout.tree_attention_mask_batch([good, bad], 3)
    with pytest.raises(ValueError, match="needs 1..3 nodes"):
        layout.tree_attention_mask_batch([[-1, 0, 0, 0]], 3)
    with pytest.raises(ValueError, match="node_logws"):
        layout.compile_ddtree_retrieve_batch([good], [[0.0]])


def _reference_layout(ref: ModuleType, trees: list, prefix_lens: list[int], num_nodes: int) -> dict:
    """The verify layout built one request at a time from the contract functions."""
    bs = len(trees)
    tokens = torch.empty((bs, num_nodes), dtype=torch.int64)
    positions = torch.empty((bs, num_nodes), dtype=torch.int64)
    masks = []
    r_index = torch.empty((bs, num_nodes), dtype=torch.int64)
    r_next = torch.full((bs, num_nodes), -1, dtype=torch.int64)
    r_sib = torch.full((bs, num_nodes), -1, dtype=torch.int64)
    for b, tree in enumerate(trees):
        n = len(tree.parents)
        pad = num_nodes - n
        tokens[b] = torch.tensor(tree.token_ids + [tree.token_ids[0]] * pad)
        positions[b] = ref.tree_positions(tree.depths + [1] * pad, prefix_lens[b])
        mask = ref.tree_attention_mask(tree.parents + [0] * pad)
        masks.append(torch.cat([torch.ones((num_nodes, prefix_lens[b]), dtype=torch.bool), mask], 1).reshape(-1))
        idx, nxt, sib = ref.compile_ddtree_retrieve(tree.parents, tree.node_logws, offset=b * num_nodes)
        r_index[b] = torch.arange(b * num_nodes, (b + 1) * num_nodes)
        r_index[b, :n] = idx
        r_next[b, :n] = nxt
        r_sib[b, :n] = sib
    return {"tokens": tokens, "positions": positions, "custom_mask": torch.cat(masks),
            "retrieve_index": r_index, "retrieve_next_token": r_next, "retrieve_next_sibling": r_sib}


@pytest.mark.parametrize("bs", [1, 2, 3, 4, 5, 9])
def test_layout_verify_batch_equals_per_request_layout(ref: ModuleType, layout: ModuleType, bs: int) -> None:
    # Batch sizes on both sides of the small-batch switch take different code paths.
    g = torch.Generator().manual_seed(bs)
    budget, depth = 12, 6
    lp = torch.log_softmax(torch.randn(bs, depth, 40, generator=g) * 2.0, dim=-1).topk(3, dim=-1)
    trees = layout.build_ddtree_trees_from_topk_batch(lp.indices, lp.values, budget, list(range(100, 100 + bs)))
    # A short tree (candidates ran out) exercises padding.
    trees[0] = ref.build_ddtree_tree_from_topk(lp.indices[0, :1, :2], lp.values[0, :1, :2], budget, root_token=100)
    prefixes = [5 + 3 * b for b in range(bs)]
    want = _reference_layout(ref, trees, prefixes, budget + 1)
    for need_retrieve in (True, False):
        got = layout.layout_verify_batch(trees, torch.tensor(prefixes), budget + 1, need_retrieve=need_retrieve)
        for name, expected in want.items():
            value = getattr(got, name)
            if name.startswith("retrieve") and not need_retrieve:
                assert value is None
            else:
                assert value.dtype == expected.dtype and torch.equal(value, expected), name


def test_layout_verify_batch_refuses_a_tree_larger_than_the_window(ref: ModuleType, layout: ModuleType) -> None:
    tree = ref.build_ddtree_tree_from_topk([[1, 2], [3, 4]], [[-0.1, -0.2], [-0.3, -0.4]], 4)
    with pytest.raises(ValueError, match="does not fit the verify window"):
        layout.layout_verify_batch([tree], [0], 3, need_retrieve=False)
