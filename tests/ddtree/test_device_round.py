"""The device-resident round equals the per-request reference, tree for tree.

A serving round builds trees, masks, retrieve pointers and the greedy walk in
whole-batch tensor operations (``build_tree_batch`` and friends). Each is pinned here
to the per-request functions the rest of the suite checks against brute force and the
kernel contract: same trees (same pop order, ties included), same masks, same sibling
chains, same accepted paths, and a mask buffer whose per-round view is exactly the
prefix + tree-block layout SGLang's attention backends read.
"""

from __future__ import annotations

import random
from types import ModuleType

import pytest
import torch

BATCH_FIELDS = ("tokens", "parents", "depths", "logws", "valid")


def _draft(rng: random.Random, bs: int, depth: int, k: int, *, ties: bool):
    """Per-position top-k rows sorted by descending log-probability; quarter steps
    make exact ties between different paths common."""
    rows = [
        [
            sorted(
                (-rng.randint(0, 12) / 4 if ties else -rng.random() * 4 for _ in range(k)),
                reverse=True,
            )
            for _ in range(depth)
        ]
        for _ in range(bs)
    ]
    ids = torch.tensor([[[1000 * d + 7 * r + b for r in range(k)] for d in range(depth)] for b in range(bs)])
    return ids, torch.tensor(rows, dtype=torch.float32)


def _case(seed: int):
    rng = random.Random(seed)
    bs, depth, k = rng.randint(1, 5), rng.randint(1, 6), rng.randint(1, 5)
    budget = rng.randint(1, 48)
    ids, lps = _draft(rng, bs, depth, k, ties=rng.random() < 0.5)
    roots = torch.tensor([rng.randrange(900) for _ in range(bs)])
    return rng, ids, lps, budget, roots


@pytest.mark.parametrize("seed", range(60))
def test_build_tree_batch_equals_the_heap_per_request(ref: ModuleType, du: ModuleType, seed: int) -> None:
    _, ids, lps, budget, roots = _case(seed)
    got = du.build_tree_batch(ids, lps, budget, roots)
    trees = [ref.build_ddtree_tree_from_topk(ids[b], lps[b], budget, int(roots[b])) for b in range(len(roots))]
    want = du.tree_batch_from_trees(trees, budget + 1)
    for field in BATCH_FIELDS:
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert got.num_nodes == budget + 1
    assert got.max_depth >= max(t.max_depth for t in trees)


def _assert_builds_like_the_heap(ref: ModuleType, du: ModuleType, ids, lps, budget: int, roots) -> None:
    got = du.build_tree_batch(ids, lps, budget, roots)
    trees = [ref.build_ddtree_tree_from_topk(ids[b], lps[b], budget, int(roots[b])) for b in range(len(roots))]
    want = du.tree_batch_from_trees(trees, budget + 1)
    for field in BATCH_FIELDS:
        assert torch.equal(getattr(got, field), getattr(want, field)), field


@pytest.mark.parametrize(
    ("bs", "depth", "k", "budget"),
    [
        (1, 1, 1, 1),  # a single node
        (1, 1, 5, 1),  # k > budget at depth 1
        (2, 1, 5, 3),
        (1, 6, 5, 1),  # budget 1: depth 1 only
        (3, 4, 1, 10),  # a chain shorter than the budget: padding
        (2, 3, 6, 2),
        (2, 2, 2, 40),  # far fewer nodes (6) than the budget
        (1, 15, 4, 16),  # the serving shape, batch 1
    ],
)
@pytest.mark.parametrize("ties", [False, True])
def test_build_tree_batch_edge_shapes(
    ref: ModuleType, du: ModuleType, bs: int, depth: int, k: int, budget: int, ties: bool
) -> None:
    for seed in range(5):
        rng = random.Random(seed)
        ids, lps = _draft(rng, bs, depth, k, ties=ties)
        _assert_builds_like_the_heap(ref, du, ids, lps, budget, torch.tensor([rng.randrange(900) for _ in range(bs)]))


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(("depth", "k", "budget"), [(15, 4, 16), (15, 8, 24), (10, 3, 40), (15, 8, 64)])
def test_build_tree_batch_serving_shapes(
    ref: ModuleType, du: ModuleType, seed: int, depth: int, k: int, budget: int
) -> None:
    """Deep trees: wide final selections (the topk path of the key-order selection)."""
    rng = random.Random(seed)
    ids, lps = _draft(rng, 3, depth, k, ties=seed % 2 == 0)
    _assert_builds_like_the_heap(ref, du, ids, lps, budget, torch.tensor([5, 6, 7]))


@pytest.mark.parametrize("seed", range(30))
def test_build_tree_batch_with_masked_logprobs(ref: ModuleType, du: ModuleType, seed: int) -> None:
    """-inf log-probs (masked tokens) tie among themselves and still pop in key order."""
    rng = random.Random(seed)
    bs, depth, k = rng.randint(1, 4), rng.choice([1, 3, 6, 15]), rng.randint(1, 5)
    ids, lps = _draft(rng, bs, depth, k, ties=seed % 2 == 0)
    for b in range(bs):
        for d in range(depth):
            masked = rng.choice([0, 0, 1, k])  # a row's tail is masked
            if masked:
                lps[b, d, k - masked :] = float("-inf")
    budget = rng.choice([1, 4, 16, 40])
    _assert_builds_like_the_heap(ref, du, ids, lps, budget, torch.arange(bs))


@pytest.mark.parametrize("seed", range(60))
def test_build_tree_batch_at_the_pruning_bounds(ref: ModuleType, du: ModuleType, seed: int) -> None:
    """Rows of zeros then a cliff: every node of the zero block ties at logw 0, so the
    heap takes whole blocks (a depth's positions, a parent's ranks) up to the budget,
    the shapes at which the static frontier widths and candidate lists are tight."""
    rng = random.Random(seed)
    bs, depth, k = rng.randint(1, 3), rng.randint(1, 8), rng.randint(1, 5)
    rows = [
        [[0.0] * (m := rng.randint(1, k)) + [-50.0 - rng.randint(0, 2) for _ in range(k - m)] for _ in range(depth)]
        for _ in range(bs)
    ]
    lps = torch.tensor([[sorted(row, reverse=True) for row in req] for req in rows])
    ids = torch.arange(bs * depth * k).reshape(bs, depth, k)
    _assert_builds_like_the_heap(ref, du, ids, lps, rng.randint(1, 40), torch.arange(bs))


@pytest.mark.parametrize("seed", range(20))
def test_best_in_key_order_is_a_stable_descending_sort(du: ModuleType, seed: int) -> None:
    rng = random.Random(seed)
    width = rng.choice([8, 65, 106, 300])
    count = rng.randint(1, width)
    values = torch.tensor(
        [[-rng.randint(0, 6) / 4 if rng.random() < 0.9 else float("-inf") for _ in range(width)] for _ in range(4)],
        dtype=torch.float64,
    )
    top, order = du._best_in_key_order(values, count)
    want_top, want_order = torch.sort(values, dim=1, descending=True, stable=True)
    assert torch.equal(top, want_top[:, :count]) and torch.equal(order, want_order[:, :count])


@pytest.mark.parametrize("budget", [62, 63, 64, 100, 130])
def test_ancestor_masks_past_one_word_per_row(ref: ModuleType, layout: ModuleType, du: ModuleType, budget: int) -> None:
    """Rows of more than 64 nodes span several packed words (bit 63 is the sign bit)."""
    rng = random.Random(budget)
    ids, lps = _draft(rng, 2, 15, 8, ties=True)
    batch = du.build_tree_batch(ids, lps, budget, torch.tensor([1, 2]))
    trees = [ref.build_ddtree_tree_from_topk(ids[b], lps[b], budget, b + 1) for b in range(2)]
    n = budget + 1
    want = layout.tree_attention_mask_batch([t.parents + [0] * (n - len(t)) for t in trees], n)
    assert torch.equal(du.tree_ancestor_masks(batch), want)
    # A chain: every node's row is its whole path.
    chain = du.tree_batch_from_trees(
        [ref.build_ddtree_tree_from_topk(torch.zeros(n - 1, 1, dtype=torch.int64), torch.zeros(n - 1, 1), n - 1)], n
    )
    assert torch.equal(du.tree_ancestor_masks(chain)[0], torch.ones(n, n, dtype=torch.bool).tril())


@pytest.mark.parametrize("seed", range(40))
def test_masks_and_retrieve_pointers_equal_the_batch_reference(
    ref: ModuleType, layout: ModuleType, du: ModuleType, seed: int
) -> None:
    _, ids, lps, budget, roots = _case(seed)
    batch = du.build_tree_batch(ids, lps, budget, roots)
    trees = [ref.build_ddtree_tree_from_topk(ids[b], lps[b], budget, int(roots[b])) for b in range(len(roots))]
    n = budget + 1
    # Padding nodes hang off the root in both layouts.
    want_masks = layout.tree_attention_mask_batch([t.parents + [0] * (n - len(t)) for t in trees], n)
    assert torch.equal(du.tree_ancestor_masks(batch), want_masks)
    index, nxt, sib = du.tree_retrieve_batch(batch)
    w_index, w_nxt, w_sib = layout.compile_ddtree_retrieve_batch(
        [t.parents for t in trees], [t.node_logws for t in trees], num_nodes_padded=n
    )
    assert torch.equal(index, w_index) and torch.equal(nxt, w_nxt) and torch.equal(sib, w_sib)


def test_retrieve_chains_visit_every_real_node_once_and_no_padding(du: ModuleType) -> None:
    # Budget far beyond the product tree (2 + 4 paths): four padding nodes.
    ids = torch.tensor([[[3, 4], [5, 6]]])
    lps = torch.log(torch.tensor([[[0.6, 0.4], [0.7, 0.3]]]))
    batch = du.build_tree_batch(ids, lps, 10, torch.tensor([9]))
    assert batch.valid[0].tolist() == [True] * 7 + [False] * 4
    _, nxt, sib = du.tree_retrieve_batch(batch)
    seen, stack = [], [0]
    while stack:
        node = stack.pop()
        seen.append(node)
        child = int(nxt[0, node])
        while child != -1:
            stack.append(child)
            child = int(sib[0, child])
    assert sorted(seen) == list(range(7))


@pytest.mark.parametrize("seed", range(40))
def test_greedy_walk_batch_equals_follow_verified_tree(ref: ModuleType, du: ModuleType, seed: int) -> None:
    rng, ids, lps, budget, roots = _case(seed)
    batch = du.build_tree_batch(ids, lps, budget, roots)
    trees = [ref.build_ddtree_tree_from_topk(ids[b], lps[b], budget, int(roots[b])) for b in range(len(roots))]
    n = budget + 1
    argmax = torch.randint(0, 5000, (len(trees), n))
    for b, tree in enumerate(trees):  # the target often agrees with some child
        for i in range(len(tree)):
            kids = [j for j in range(1, len(tree)) if tree.parents[j] == i]
            if kids and rng.random() < 0.75:
                argmax[b, i] = tree.token_ids[rng.choice(kids)]
    paths = du.follow_verified_tree_batch(batch, argmax)
    for b, tree in enumerate(trees):
        accepted, proposed = ref.follow_verified_tree(tree.parents, tree.token_ids, argmax[b])
        length = int(paths.commit_lens[b])
        assert length == len(accepted)
        assert paths.nodes[b, :length].tolist() == accepted
        assert paths.tokens[b, :length].tolist() == proposed
        # Past the commit length the last entry repeats (gathers stay in range).
        assert set(paths.nodes[b, length - 1 :].tolist()) == {accepted[-1]}


def test_accepted_paths_from_kernel_outputs(du: ModuleType) -> None:
    # Request 0 accepted nodes 2 then 5 (flat 2, 5), request 1 nothing (flat 8 = root).
    n = 8
    accept_index = torch.tensor([[0, 2, 5], [8, -1, -1]], dtype=torch.int32)
    accept_num = torch.tensor([2, 0], dtype=torch.int32)
    predicts = torch.arange(100, 100 + 2 * n, dtype=torch.int32)
    paths = du.accepted_paths_from_kernel(accept_index, accept_num, predicts, n)
    assert paths.commit_lens.tolist() == [3, 1]
    assert paths.nodes.tolist() == [[0, 2, 5], [0, 0, 0]]
    assert paths.tokens.tolist() == [[100, 102, 105], [108, 108, 108]]


@pytest.mark.parametrize("seed", range(30))
def test_mask_buffer_view_is_the_full_custom_mask_and_restores(layout: ModuleType, du: ModuleType, seed: int) -> None:
    rng = random.Random(seed)
    buf = du.TreeMaskBuffer("cpu")
    for _round in range(4):
        bs, n = rng.randint(1, 6), rng.randint(2, 12)
        masks = torch.rand(bs, n, n) < 0.5
        prefix = torch.tensor([rng.randint(0, 200) for _ in range(bs)])
        cells = n * (int(prefix.sum()) + bs * n)
        slack = rng.randint(0, 50)  # host bounds may exceed the exact size
        view = buf.write(masks, prefix, cells + slack)
        assert view.numel() == cells + slack
        assert torch.equal(view[:cells], layout.tree_custom_mask_batch(masks, prefix))
        assert bool(view[cells:].all())
        buf.restore()
        assert bool(buf._buf.all()), "between rounds every cell is True"


def test_mask_buffer_round_touches_only_tree_cells(du: ModuleType) -> None:
    """The per-round write is bs * N * N cells, whatever the prefix length."""
    buf = du.TreeMaskBuffer("cpu")
    masks = torch.zeros(2, 5, 5, dtype=torch.bool)
    for prefix_len in (10, 10_000):
        prefix = torch.tensor([prefix_len, prefix_len])
        buf.write(masks, prefix, 5 * (2 * prefix_len + 10))
        assert buf._written.numel() == 2 * 5 * 5
        buf.restore()


def test_build_tree_batch_rejects_bad_shapes(du: ModuleType) -> None:
    with pytest.raises(ValueError):
        du.build_tree_batch(torch.zeros(2, 3, 4, dtype=torch.int64), torch.zeros(2, 3, 5), 4, torch.zeros(2))
    with pytest.raises(ValueError):
        du.build_tree_batch(torch.zeros(2, 3, 4, dtype=torch.int64), torch.zeros(2, 3, 4), 0, torch.zeros(2))


def _triton_verify_mask_numel(max_bs: int, n: int, context_len: int) -> int:
    """SGLang 0.5.23's Triton verify-mask buffer: ``tree_mask_numel(FULL_MASK, max_bs, N,
    context_len)`` (srt/layers/attention/verify_mask.py), ``N * (context_len + N)`` per request."""
    return max_bs * n * (context_len + n)


@pytest.mark.parametrize("budget", [4, 8, 16, 64])
@pytest.mark.parametrize("context_len", [64, 2048, 32768])
def test_mask_view_fits_the_triton_graph_buffer_at_the_context_end(du: ModuleType, budget: int,
                                                                   context_len: int) -> None:
    """A full batch (bs = the graph's max bs) with every prefix at context_len - 2, the
    most admission lets a running request commit: the view is capped at the buffer a
    graph replay copies it into and still covers every cell the kernel reads; uncapped,
    it overran the buffer (RuntimeError in the copy: the scheduler died)."""
    n, max_bs = budget + 1, 4
    fixed = _triton_verify_mask_numel(max_bs, n, context_len)
    prefix = torch.full((max_bs,), context_len - 2)
    verify_kv_sum = int((prefix + n).sum())  # the host bound a round has: prefix + N per request
    reads = n * verify_kv_sum  # mask_indptr = cumsum(N * (seq_lens + N))
    uncapped = du.verify_mask_cells(n, verify_kv_sum, max_bs)
    capped = du.verify_mask_cells(n, verify_kv_sum, max_bs, fixed_cells=fixed)
    assert uncapped > fixed
    assert reads <= capped <= fixed
    # The buffer the worker hands over holds the tree blocks where the kernel reads them.
    masks = torch.rand(max_bs, n, n) < 0.5
    buf = du.TreeMaskBuffer("cpu")
    view = buf.write(masks, prefix, capped)
    graph_mask = torch.zeros(fixed, dtype=torch.uint8)
    graph_mask[: view.numel()] = view  # TritonAttnBackend._update_target_verify_buffers
    starts = torch.cumsum(n * (prefix + n), 0) - n * (prefix + n)
    for b in range(max_bs):
        rows = graph_mask[int(starts[b]) : int(starts[b]) + n * int(prefix[b] + n)].view(n, -1)
        assert bool(rows[:, : int(prefix[b])].all())
        assert torch.equal(rows[:, int(prefix[b]) :].bool(), masks[b])


def test_mask_view_is_uncapped_without_a_fixed_buffer_and_never_below_the_reads(du: ModuleType) -> None:
    """FlashInfer's size (no fixed buffer) is unchanged; a host bound whose reads exceed the
    buffer keeps them (the worker then runs that round eager)."""
    assert du.verify_mask_cells(9, 100, 2) == 9 * 100 + 81 * 2
    assert du.verify_mask_cells(9, 100, 2, fixed_cells=10_000) == 9 * 100 + 81 * 2
    assert du.verify_mask_cells(9, 100, 2, fixed_cells=950) == 950
    assert du.verify_mask_cells(9, 100, 2, fixed_cells=500) == 900
