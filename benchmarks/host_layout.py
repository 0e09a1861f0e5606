"""The host-side verify layout the bundle's round used before it moved to the device.

``benchmarks/verify_round.py`` (the ``old`` round) and ``benchmarks/tree_build.py``
(the per-round table) measure the serving round against it, so it is kept here, as
the baseline, and out of the bundle: no server runs it. Every function equals the
per-request reference (``ddtree_reference``, loaded by path as deployed) called once
per request, bit for bit (``tests/ddtree/test_batch_layout.py``): the batch converts
once and works with whole-batch tensor ops, walking ancestors level by level.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddtree_ops.ddtree_core import load_ddtree_reference  # noqa: E402

_ref = load_ddtree_reference()
DDTree = _ref.DDTree
TensorOrSeq = _ref.TensorOrSeq
build_ddtree_tree_from_topk = _ref.build_ddtree_tree_from_topk
compile_ddtree_retrieve = _ref.compile_ddtree_retrieve
tree_attention_mask = _ref.tree_attention_mask
tree_positions = _ref.tree_positions
_build_from_rows = _ref._build_from_rows
_validated_depths = _ref._validated_depths
_to_tensor = _ref._to_tensor


def build_ddtree_trees_from_topk_batch(
    topk_token_ids: TensorOrSeq,
    topk_logprobs: TensorOrSeq,
    budget: int,
    root_tokens: TensorOrSeq,
) -> list[DDTree]:
    """One tree per request from the batch's ``[bs, depth, k]`` top-k.

    Equal, tree for tree, to :func:`build_ddtree_tree_from_topk` on each request; the
    whole batch crosses from tensors to python lists in one ``tolist()`` per input
    instead of one per request (the heap itself is sequential per request).
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if isinstance(topk_token_ids, torch.Tensor) != isinstance(topk_logprobs, torch.Tensor):
        topk_token_ids = torch.as_tensor(topk_token_ids)
        topk_logprobs = torch.as_tensor(topk_logprobs)
    if isinstance(topk_token_ids, torch.Tensor):
        assert isinstance(topk_logprobs, torch.Tensor)
        if topk_token_ids.dim() != 3 or topk_logprobs.shape != topk_token_ids.shape:
            raise ValueError(
                "topk_token_ids and topk_logprobs must have the same [bs, depth, k] shape, got "
                f"{tuple(topk_token_ids.shape)} and {tuple(topk_logprobs.shape)}"
            )
        # int64 / float64 conversions equal int(v) / float(v) per element, done in C.
        all_ids = topk_token_ids.detach().cpu().to(torch.int64).tolist()
        all_lps = topk_logprobs.detach().cpu().to(torch.float64).tolist()
        _, depth, k = topk_token_ids.shape
        checked = True
    else:
        all_ids = [[list(r) for r in req] for req in topk_token_ids]
        all_lps = [[list(r) for r in req] for req in topk_logprobs]
        checked = False
    roots = root_tokens.reshape(-1).tolist() if isinstance(root_tokens, torch.Tensor) else list(root_tokens)
    if len(roots) != len(all_ids) or len(all_lps) != len(all_ids):
        raise ValueError(
            f"batch sizes differ: {len(all_ids)} token-id rows, {len(all_lps)} log-prob rows, {len(roots)} root tokens"
        )
    trees = []
    for ids, lps, root in zip(all_ids, all_lps, roots, strict=True):
        if checked:
            trees.append(_build_from_rows(ids, lps, depth, k, budget, int(root)))
        else:
            trees.append(build_ddtree_tree_from_topk(ids, lps, budget, root_token=int(root)))
    return trees


# --------------------------------------------------------------------------- batches
#
# One verify round lays out a whole batch. Per-request calls cost a tensor conversion
# and a handful of small torch ops each (tens of microseconds), which at batch 32 adds
# up to the order of a GPU verify step. The batch helpers below equal the per-request
# functions exactly, but convert the batch once and work on it with whole-batch tensor
# ops, walking ancestors level by level (tree depth <= draft block size).


def _as_int_list(x: Sequence[int] | torch.Tensor) -> Sequence[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else x


def _padded_parent_table(
    parents_list: Sequence[Sequence[int] | torch.Tensor],
    num_nodes: int | None,
    pad_parent: int,
) -> tuple[list[list[int]], list[int], int, torch.Tensor]:
    """Validated parent arrays, their sizes, ``N`` and a ``[bs, N]`` int64 table in which
    nodes past a tree's size get ``pad_parent``."""
    plists = [_as_int_list(p) for p in parents_list]
    sizes = [len(p) for p in plists]
    n = max(sizes, default=1) if num_nodes is None else int(num_nodes)
    flat = array.array("q")
    pad = array.array("q", [pad_parent]) * n
    for b, p in enumerate(plists):
        if not 1 <= len(p) <= n:
            raise ValueError(f"tree {b} has {len(p)} nodes; each tree needs 1..{n} nodes")
        flat.extend(p)
        flat.extend(pad[: n - len(p)])
    table = _to_tensor(flat, torch.int64).reshape(len(plists), n)
    _validate_parent_table(table, plists, sizes)
    return plists, sizes, n, table


def _validate_parent_table(table: torch.Tensor, plists: list[list[int]], sizes: list[int]) -> None:
    """Same acceptance as the per-request functions: a row passes at once when it lists
    every parent before its child (all builder trees); any other row goes through
    :func:`_validated_depths`, which accepts any tree rooted at 0 and names the fault."""
    if table.numel() == 0:
        return
    n = table.shape[1]
    # Root: parent -1 = column 0 - 1; any other node: 0 <= parent < its own column.
    # Padding columns hold a parent that passes or fails alike for every row, so only
    # the rows' own nodes decide (checked per failing row below).
    ahead = table - torch.arange(n)
    ok_root = ahead[:, 0] == -1
    ok_rest = (table[:, 1:] >= 0) & (ahead[:, 1:] < 0)
    if bool(ok_root.all()) and bool(ok_rest.all()):
        return
    for b in range(len(plists)):
        m = sizes[b]
        if not (bool(ok_root[b]) and bool(ok_rest[b, : m - 1].all())):
            _validated_depths(list(plists[b]))


def compile_ddtree_retrieve_batch(
    parents_list: Sequence[Sequence[int] | torch.Tensor],
    logws_list: Sequence[Sequence[float] | torch.Tensor],
    *,
    num_nodes_padded: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`compile_ddtree_retrieve` for a batch, laid out ``[bs, N]`` as the kernel reads it.

    ``N`` is ``num_nodes_padded`` (default: the largest tree). Row ``b`` equals
    ``compile_ddtree_retrieve(parents_list[b], logws_list[b], offset=b * N)`` on the
    tree's nodes; past the tree, ``retrieve_index`` keeps counting (``b*N + i``) and
    both pointers are -1, so no pointer ever reaches a padding node and the kernel can
    never try (or accept) one.
    """
    plists, sizes, n, table = _padded_parent_table(parents_list, num_nodes_padded, -1)
    bs = len(plists)
    if len(logws_list) != bs:
        raise ValueError(f"{len(logws_list)} logw arrays for {bs} parent arrays")
    wflat = array.array("d")
    wpad = array.array("d", [0.0]) * n
    for b, w in enumerate(logws_list):
        wl = w.tolist() if isinstance(w, torch.Tensor) else w
        if len(wl) != sizes[b]:
            raise ValueError(f"tree {b}: node_logws has {len(wl)} entries, parents has {sizes[b]}")
        wflat.extend(wl)
        wflat.extend(wpad[: n - sizes[b]])
    retrieve_index = torch.arange(bs * n, dtype=torch.int64).reshape(bs, n)
    next_token = torch.full((bs * n,), -1, dtype=torch.int64)
    next_sibling = torch.full((bs * n,), -1, dtype=torch.int64)
    if bs == 0:
        return retrieve_index, next_token.reshape(0, n), next_sibling.reshape(0, n)

    # Group the real non-root nodes by (flat) parent, each group in descending logw with
    # ties by lower index: a stable sort on -logw, then a stable sort on the parent,
    # gives exactly the chains the per-request python sort builds.
    # The root and padding columns get a parent key past every real one, so they sort
    # last and are cut off.
    sentinel = bs * n
    flat_parent = table + retrieve_index - torch.arange(n)
    flat_parent[:, 0] = sentinel
    count = sum(sizes) - bs
    if count < bs * (n - 1):
        flat_parent[torch.arange(n) >= torch.tensor(sizes).unsqueeze(1)] = sentinel
    flat_parent = flat_parent.reshape(-1)
    neg_w = _to_tensor(wflat, torch.float64).neg()
    by_w = torch.sort(neg_w, stable=True).indices
    nodes = by_w[torch.sort(flat_parent[by_w], stable=True).indices[:count]]
    group = flat_parent[nodes]
    local = nodes % n
    same = group[1:] == group[:-1]
    next_sibling[nodes[:-1][same]] = local[1:][same]
    first = torch.ones(count, dtype=torch.bool)
    first[1:] = ~same
    next_token[group[first]] = local[first]
    return retrieve_index, next_token.reshape(bs, n), next_sibling.reshape(bs, n)


def tree_attention_mask_batch(
    parents_list: Sequence[Sequence[int] | torch.Tensor],
    num_nodes: int | None = None,
) -> torch.Tensor:
    """``[bs, N, N]`` ancestor masks; ``N`` is ``num_nodes`` (default: the largest tree).

    Row ``b`` equals ``tree_attention_mask(parents_list[b] + [0] * pad)``: the nodes
    that pad a short tree hang off the root (they see the root and themselves), which
    is how the verify pass lays a short tree out. All rows climb one ancestor per step
    together, so the cost is tree-depth whole-batch steps.
    """
    plists, _sizes, n, table = _padded_parent_table(parents_list, num_nodes, 0)
    bs = len(plists)
    # Node n is a sink: the root's parent and its own, with an empty mask row, so walks
    # that passed the root need no compaction. Pointer doubling: after step s, row i
    # holds i's ancestors up to 2**s levels up and ``up`` jumps 2**s levels, so
    # log2(depth) whole-batch steps suffice.
    up = torch.cat([table, torch.full((bs, 1), n, dtype=torch.int64)], dim=1)
    up[:, 0] = n
    cols = torch.arange(n + 1)
    mask = (cols.unsqueeze(1) == cols) | (up.unsqueeze(2) == cols)
    mask[:, n, :] = False
    if bs == 0:
        return mask[:, :n, :n].contiguous()
    while True:
        up = torch.gather(up, 1, up)
        if bool((up == n).all()):
            break
        mask |= torch.gather(mask, 1, up.unsqueeze(2).expand(bs, n + 1, n + 1))
    return mask[:, :n, :n].contiguous()


def tree_positions_batch(
    depths_list: Sequence[Sequence[int] | torch.Tensor],
    starts: Sequence[int] | torch.Tensor,
    num_nodes: int | None = None,
) -> torch.Tensor:
    """``[bs, N]`` int64 positions ``starts[b] + depth``; nodes padding a short tree get
    depth 1 (children of the root, like :func:`tree_attention_mask_batch`)."""
    dlists = [_as_int_list(d) for d in depths_list]
    n = max((len(d) for d in dlists), default=1) if num_nodes is None else int(num_nodes)
    flat = array.array("q")
    pad = array.array("q", [1]) * n
    for b, d in enumerate(dlists):
        if len(d) > n:
            raise ValueError(f"tree {b} has {len(d)} nodes, more than {n}")
        flat.extend(d)
        flat.extend(pad[: n - len(d)])
    s = (
        starts.reshape(-1).to(torch.int64).cpu()
        if isinstance(starts, torch.Tensor)
        else torch.tensor([int(v) for v in starts], dtype=torch.int64)
    )
    if s.numel() != len(dlists):
        raise ValueError(f"{s.numel()} start positions for {len(dlists)} trees")
    return _to_tensor(flat, torch.int64).reshape(len(dlists), n) + s.unsqueeze(1)


def tree_custom_mask_batch(tree_masks: torch.Tensor, prefix_lens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Flat bool custom mask of a verify pass: per request, ``N`` rows of ``prefix + N``
    columns (the committed prefix, all visible, then the tree block), requests one
    after the other — the layout SGLang's ``custom_mask`` takes for target verify.

    Equal to ``torch.cat([torch.cat([ones(N, prefix_b), tree_masks[b]], 1).reshape(-1)
    for b])`` but written in one scatter instead of two concatenations per request.
    """
    if tree_masks.dim() != 3 or tree_masks.shape[1] != tree_masks.shape[2]:
        raise ValueError(f"tree_masks must be [bs, N, N], got {tuple(tree_masks.shape)}")
    bs, n, _ = tree_masks.shape
    pre = (
        prefix_lens.reshape(-1).to(torch.int64).cpu()
        if isinstance(prefix_lens, torch.Tensor)
        else torch.tensor([int(v) for v in prefix_lens], dtype=torch.int64)
    )
    if pre.numel() != bs:
        raise ValueError(f"{pre.numel()} prefix lengths for {bs} trees")
    if bool((pre < 0).any()):
        raise ValueError("prefix lengths must be >= 0")
    widths = pre + n
    sizes = widths * n
    starts = torch.cumsum(sizes, 0) - sizes
    total = int(sizes.sum()) if bs else 0
    out = torch.ones(total, dtype=torch.bool)
    if bs == 0:
        return out
    rows = torch.arange(n, dtype=torch.int64)
    idx = (starts + pre).view(bs, 1, 1) + rows.view(1, n, 1) * widths.view(bs, 1, 1) + rows.view(1, 1, n)
    out[idx.reshape(-1)] = tree_masks.reshape(-1).to(torch.bool).cpu()
    return out


# Below this many requests the per-request functions are cheaper: each whole-batch
# tensor op costs a few microseconds however small the batch (measured on CPU: ~0.1 ms
# per-request vs ~0.3 ms batched at batch 1, budget 16).
_LAYOUT_BATCH_MIN = 4


@dataclass(frozen=True)
class VerifyLayout:
    """Host-side tensors of one verify pass over a batch of trees (``N`` nodes each).

    ``tokens`` ``[bs, N]`` (padding repeats the root token), ``positions`` ``[bs, N]``,
    ``custom_mask`` flat bool (:func:`tree_custom_mask_batch`), and the three retrieve
    tensors ``[bs, N]`` (:func:`compile_ddtree_retrieve_batch`) or None when nobody
    samples (the greedy walk needs the parent arrays alone).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    custom_mask: torch.Tensor
    retrieve_index: torch.Tensor | None
    retrieve_next_token: torch.Tensor | None
    retrieve_next_sibling: torch.Tensor | None


def layout_verify_batch(
    trees: Sequence[DDTree],
    prefix_lens: Sequence[int] | torch.Tensor,
    num_nodes: int,
    *,
    need_retrieve: bool,
) -> VerifyLayout:
    """Everything a target verify pass needs for ``trees``, built on the host in
    whole-batch tensor operations. A tree shorter than ``num_nodes`` (draft candidates
    ran out) is padded with nodes hanging off the root that carry the root token; the
    retrieve pointers never reach them, so they are never accepted. The root (the last
    committed token) sits at position ``prefix_lens[b]``.
    """
    for b, tree in enumerate(trees):
        if len(tree.parents) > num_nodes:
            raise ValueError(
                f"DDTree {b} with {len(tree.parents)} nodes does not fit the verify window of {num_nodes}."
            )
    if len(trees) < _LAYOUT_BATCH_MIN:
        return _layout_per_request(trees, prefix_lens, num_nodes, need_retrieve=need_retrieve)
    flat_tokens = array.array("q")
    for tree in trees:
        toks = tree.token_ids
        flat_tokens.extend(toks)
        flat_tokens.extend(array.array("q", toks[:1]) * (num_nodes - len(toks)))
    tokens = _to_tensor(flat_tokens, torch.int64).reshape(len(trees), num_nodes)
    parents = [t.parents for t in trees]
    positions = tree_positions_batch([t.depths for t in trees], prefix_lens, num_nodes)
    custom_mask = tree_custom_mask_batch(tree_attention_mask_batch(parents, num_nodes), prefix_lens)
    if not need_retrieve:
        return VerifyLayout(tokens, positions, custom_mask, None, None, None)
    r_index, r_next, r_sib = compile_ddtree_retrieve_batch(
        parents, [t.node_logws for t in trees], num_nodes_padded=num_nodes
    )
    return VerifyLayout(tokens, positions, custom_mask, r_index, r_next, r_sib)


def _layout_per_request(
    trees: Sequence[DDTree],
    prefix_lens: Sequence[int] | torch.Tensor,
    num_nodes: int,
    *,
    need_retrieve: bool,
) -> VerifyLayout:
    """:func:`layout_verify_batch` one request at a time (same tensors)."""
    bs = len(trees)
    pre = prefix_lens.reshape(-1).tolist() if isinstance(prefix_lens, torch.Tensor) else list(prefix_lens)
    tokens = torch.empty((bs, num_nodes), dtype=torch.int64)
    positions = torch.empty((bs, num_nodes), dtype=torch.int64)
    r_index = torch.arange(bs * num_nodes, dtype=torch.int64).reshape(bs, num_nodes)
    r_next = torch.full((bs, num_nodes), -1, dtype=torch.int64)
    r_sib = torch.full((bs, num_nodes), -1, dtype=torch.int64)
    masks: list[torch.Tensor] = []
    for b, tree in enumerate(trees):
        n = len(tree.parents)
        pad = num_nodes - n
        tokens[b] = torch.tensor(list(tree.token_ids) + [tree.token_ids[0]] * pad, dtype=torch.int64)
        positions[b] = tree_positions(list(tree.depths) + [1] * pad, int(pre[b]))
        tree_mask = tree_attention_mask(list(tree.parents) + [0] * pad)
        masks.append(
            torch.cat(
                [torch.ones((num_nodes, int(pre[b])), dtype=torch.bool), tree_mask],
                dim=1,
            ).reshape(-1)
        )
        if need_retrieve:
            _, nxt, sib = compile_ddtree_retrieve(tree.parents, tree.node_logws)
            r_next[b, :n] = nxt
            r_sib[b, :n] = sib
    custom_mask = torch.cat(masks) if masks else torch.ones(0, dtype=torch.bool)
    if not need_retrieve:
        return VerifyLayout(tokens, positions, custom_mask, None, None, None)
    return VerifyLayout(tokens, positions, custom_mask, r_index, r_next, r_sib)
