"""DDTree (Diffusion Draft Tree) core: tree building, tree encodings and verification.

It depends only on torch and the standard library at import time (SGLang's sampling
kernel is imported lazily, inside :func:`sample_tree_paths`), so it can be loaded and
tested on its own, without the rest of SGLang.

Two layers. The per-request functions are the reference -- plain lists and small
tensors, each pinned by tests to brute force or to the kernel's contract:

1. :func:`build_ddtree_tree_from_topk` turns the drafter's per-position top-k into a
   tree of at most ``budget`` nodes, best first by cumulative draft log-probability.
2. :func:`tree_positions` and :func:`tree_attention_mask` give the verify pass its
   positions and its ancestor-only attention mask.
3. :func:`compile_ddtree_retrieve` encodes the tree the way SGLang's EAGLE tree kernels
   read it (first child / next sibling, siblings by descending cumulative log-prob).
4. Verification: :func:`follow_verified_tree` for greedy requests, and
   :func:`sample_tree_paths` (SGLang's ``tree_speculative_sampling_target_only`` kernel
   on CUDA, :func:`reference_tree_speculative_sampling` elsewhere) for temperature,
   top-k and top-p sampling. Both return ``(accepted, proposed)`` so the caller has one
   commit path.

The device-resident functions at the end (:func:`build_tree_batch`,
:func:`tree_ancestor_masks`, :func:`tree_retrieve_batch`,
:func:`follow_verified_tree_batch`, :class:`TreeMaskBuffer`) are what a serving round
runs: whole-batch tensor operations on the device, equal to the reference tree for
tree, with no host synchronisation and no work that grows with the prefix.
"""

from __future__ import annotations

import array
import functools
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch

__all__ = [
    "DDTree",
    "build_ddtree_tree_from_topk",
    "build_ddtree_trees_from_topk_batch",
    "compile_ddtree_retrieve",
    "compile_ddtree_retrieve_batch",
    "tree_attention_mask",
    "tree_attention_mask_batch",
    "tree_positions",
    "tree_positions_batch",
    "tree_custom_mask_batch",
    "VerifyLayout",
    "layout_verify_batch",
    "follow_verified_tree",
    "target_probs_from_logits",
    "reference_tree_speculative_sampling",
    "sample_tree_paths",
    "kernel_available",
]

TensorOrSeq = Union[torch.Tensor, Sequence[Any]]
PathResult = tuple[list[int], list[int]]


@dataclass(frozen=True)
class DDTree:
    """A draft tree in pop order; node 0 is the root (the last committed token).

    Plain python lists keep tree building cheap: a tree has tens to a few thousand
    nodes, where per-element tensor operations would cost more than the work itself.
    """

    parents: list[int]
    depths: list[int]
    token_ids: list[int]
    node_logws: list[float]

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def num_nodes(self) -> int:
        """Number of nodes including the root."""
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths) if self.depths else 0


def _as_rows(x: TensorOrSeq, name: str) -> list[list[Any]]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 2:
            raise ValueError(
                f"{name} must be 2-D [depth, k], got shape {tuple(x.shape)}"
            )
        return x.detach().cpu().tolist()
    rows = [list(r) for r in x]
    return rows


def build_ddtree_tree_from_topk(
    topk_token_ids: TensorOrSeq,
    topk_logprobs: TensorOrSeq,
    budget: int,
    root_token: int = -1,
) -> DDTree:
    """Best-first DDTree from the drafter's per-position top-k.

    ``topk_token_ids`` / ``topk_logprobs`` are ``[depth, k]``, each row sorted by
    descending log-probability. A node at depth ``d+1`` with rank ``r`` under a parent
    of cumulative log-prob ``w`` has cumulative log-prob ``w + logprobs[d][r]``. The heap
    pops the best frontier node; each pop pushes its next-rank sibling and its rank-0
    child. Because log-probs are <= 0 and rows are sorted, every node's two successors
    are no better than itself, so the popped set is exactly the top-``budget`` prefix
    paths and pops come out in non-increasing order.

    Ties are broken by ``(depth, parent's pop index, rank)``: a total order that a
    successor never precedes, so the pop order is the sorted order of the chosen
    nodes under the key ``(-logw, depth, parent, rank)``. :func:`build_tree_batch`
    computes the same trees with whole-batch tensor operations and the same key.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if isinstance(topk_token_ids, torch.Tensor) and isinstance(
        topk_logprobs, torch.Tensor
    ):
        # int64 / float64 conversions equal int(v) / float(v) per element, done in C.
        ids = _as_rows(topk_token_ids.to(torch.int64), "topk_token_ids")
        lps = _as_rows(topk_logprobs.to(torch.float64), "topk_logprobs")
        converted = True
    else:
        ids = _as_rows(topk_token_ids, "topk_token_ids")
        lps = _as_rows(topk_logprobs, "topk_logprobs")
        converted = False
    if len(ids) != len(lps) or any(len(a) != len(b) for a, b in zip(ids, lps)):
        raise ValueError(
            "topk_token_ids and topk_logprobs must have the same [depth, k] shape"
        )
    depth = len(ids)
    k = len(ids[0]) if depth else 0
    if any(len(r) != k for r in ids):
        raise ValueError("topk rows must all have the same k")
    if not converted:
        lps = [[float(v) for v in row] for row in lps]
        ids = [[int(v) for v in row] for row in ids]
    return _build_from_rows(ids, lps, depth, k, budget, int(root_token))


def _build_from_rows(
    ids: list[list[int]],
    lps: list[list[float]],
    depth: int,
    k: int,
    budget: int,
    root_token: int,
) -> DDTree:
    """The heap walk on validated plain lists (shared by the single and batch builders)."""
    parents = [-1]
    depths = [0]
    tokens = [root_token]
    logws = [0.0]
    if depth == 0 or k == 0 or budget == 0:
        return DDTree(parents, depths, tokens, logws)

    # Heap items: (-logw, position d, parent node, rank r). (d, parent, r) names a node
    # uniquely, so the order is total without comparing floats for equality.
    heap: list[tuple[float, int, int, int]] = [(-lps[0][0], 0, 0, 0)]
    heappush, heappop = heapq.heappush, heapq.heappop
    last_rank = k - 1
    last_pos = depth - 1
    node = 0
    while heap and node < budget:
        neg_w, d, parent, r = heappop(heap)
        node += 1
        parents.append(parent)
        depths.append(d + 1)
        tokens.append(ids[d][r])
        logws.append(-neg_w)
        if r < last_rank:
            heappush(heap, (-logws[parent] - lps[d][r + 1], d, parent, r + 1))
        if d < last_pos:
            heappush(heap, (neg_w - lps[d + 1][0], d + 1, node, 0))
    return DDTree(parents, depths, tokens, logws)


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
    if isinstance(topk_token_ids, torch.Tensor) != isinstance(
        topk_logprobs, torch.Tensor
    ):
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
    roots = (
        root_tokens.reshape(-1).tolist()
        if isinstance(root_tokens, torch.Tensor)
        else list(root_tokens)
    )
    if len(roots) != len(all_ids) or len(all_lps) != len(all_ids):
        raise ValueError(
            f"batch sizes differ: {len(all_ids)} token-id rows, {len(all_lps)} log-prob rows, "
            f"{len(roots)} root tokens"
        )
    trees = []
    for ids, lps, root in zip(all_ids, all_lps, roots):
        if checked:
            trees.append(_build_from_rows(ids, lps, depth, k, budget, int(root)))
        else:
            trees.append(
                build_ddtree_tree_from_topk(ids, lps, budget, root_token=int(root))
            )
    return trees


def _validated_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node; raises if ``parents`` is not a tree rooted at node 0."""
    n = len(parents)
    if n == 0:
        raise ValueError("a tree needs at least the root node")
    if parents[0] != -1:
        raise ValueError(f"parents[0] must be -1 (root), got {parents[0]}")
    depths = [0] * n
    # Fast path: builder trees list every parent before its children.
    for i in range(1, n):
        p = parents[i]
        if not 0 <= p < i:
            break
        depths[i] = depths[p] + 1
    else:
        return depths
    depths = [-1] * n
    depths[0] = 0
    for i in range(1, n):
        if depths[i] >= 0:
            continue
        chain = []
        j = i
        while depths[j] < 0:
            p = parents[j]
            if not 0 <= p < n or p == j:
                raise ValueError(f"node {j} has invalid parent {p}")
            chain.append(j)
            if len(chain) > n:
                raise ValueError(f"parents contain a cycle through node {i}")
            j = p
        base = depths[j]
        for step, node in enumerate(reversed(chain), start=1):
            depths[node] = base + step
    return depths


def compile_ddtree_retrieve(
    parents: Sequence[int],
    node_logws: Sequence[float],
    *,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First-child / next-sibling encoding read by SGLang's EAGLE tree kernels.

    Returns ``(retrieve_index, retrieve_next_token, retrieve_next_sibling)``, int64 of
    length n. ``retrieve_index[i] = offset + i`` (the node's row in the flattened
    ``[bs * N]`` batch). Siblings are chained by descending ``node_logws`` (ties: lower
    index first) because the sampling kernel tries children in chain order: putting the
    likeliest draft first makes an early accept likelier, which is what the kernel
    rewards (losslessness holds for any order).
    """
    parents = [int(p) for p in parents]
    n = len(parents)
    if len(node_logws) != n:
        raise ValueError(f"node_logws has {len(node_logws)} entries, parents has {n}")
    _validated_depths(parents)
    logws = [float(w) for w in node_logws]

    next_token = [-1] * n
    next_sibling = [-1] * n
    last_child = [-1] * n
    # One stable global sort (ties keep lower index first) then append each node to
    # its parent's chain. Builder trees are already in non-increasing logw order, so
    # the sort is a linear pass there.
    for i in sorted(range(1, n), key=lambda c: -logws[c]):
        p = parents[i]
        if last_child[p] == -1:
            next_token[p] = i
        else:
            next_sibling[last_child[p]] = i
        last_child[p] = i
    retrieve_index = torch.arange(offset, offset + n, dtype=torch.int64)
    return (
        retrieve_index,
        torch.tensor(next_token, dtype=torch.int64),
        torch.tensor(next_sibling, dtype=torch.int64),
    )


# Up to this many nodes, python bitsets + one unpack beat per-level tensor indexing
# (measured on CPU: ~25 vs ~60 us at 17 nodes); beyond it, unpacking n*n bits costs
# more than walking a shallow tree level by level (~0.4 vs ~0.12 ms at 257 nodes).
_MASK_BITSET_MAX_NODES = 128
_BIT_VALUES = (1, 2, 4, 8, 16, 32, 64, 128)


def tree_attention_mask(parents: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """``[n, n]`` bool mask: row i is True at i and at every ancestor of i."""
    plist = (
        parents.tolist()
        if isinstance(parents, torch.Tensor)
        else [int(p) for p in parents]
    )
    depths = _validated_depths(plist)
    n = len(plist)
    if n > _MASK_BITSET_MAX_NODES:
        return _mask_by_levels(plist)
    rows = [0] * n
    # Parents before children (by depth, so arbitrarily numbered trees work too):
    # a child's row is its parent's row plus its own bit.
    for i in sorted(range(n), key=depths.__getitem__):
        p = plist[i]
        rows[i] = (rows[p] if p >= 0 else 0) | (1 << i)
    nbytes = (n + 7) // 8
    packed = bytearray(b"".join(r.to_bytes(nbytes, "little") for r in rows))
    bits = torch.frombuffer(packed, dtype=torch.uint8).reshape(n, nbytes, 1)
    unpacked = (bits & torch.tensor(_BIT_VALUES, dtype=torch.uint8)).ne(0)
    return unpacked.reshape(n, nbytes * 8)[:, :n].contiguous()


def _mask_by_levels(plist: list[int]) -> torch.Tensor:
    """Same mask, every node climbing one ancestor per step (tree-depth steps)."""
    n = len(plist)
    p = torch.tensor(plist, dtype=torch.int64)
    mask = torch.eye(n, dtype=torch.bool)
    rows = torch.arange(n)
    cur = p.clone()
    while True:
        # Drop walks that went above the root; the rest climb one level.
        live = cur >= 0
        rows = rows[live]
        cur = cur[live]
        if rows.numel() == 0:
            return mask
        mask[rows, cur] = True
        cur = p[cur]


def tree_positions(
    depths: Sequence[int] | torch.Tensor, start: int | torch.Tensor
) -> torch.Tensor:
    """Absolute positions of the tree nodes: ``start + depth`` (int64).

    ``start`` is the root's position (the last committed token). A tensor ``start`` of
    shape ``[bs, 1]`` broadcasts to per-request positions ``[bs, n]``.
    """
    d = (
        depths.to(torch.int64)
        if isinstance(depths, torch.Tensor)
        else torch.tensor(list(depths), dtype=torch.int64)
    )
    if isinstance(start, torch.Tensor):
        return d.to(start.device) + start.to(torch.int64)
    return d + int(start)


# --------------------------------------------------------------------------- batches
#
# One verify round lays out a whole batch. Per-request calls cost a tensor conversion
# and a handful of small torch ops each (tens of microseconds), which at batch 32 adds
# up to the order of a GPU verify step. The batch helpers below equal the per-request
# functions exactly, but convert the batch once and work on it with whole-batch tensor
# ops, walking ancestors level by level (tree depth <= draft block size).


def _as_int_list(x: Sequence[int] | torch.Tensor) -> Sequence[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else x


def _to_tensor(values: array.array, dtype: torch.dtype) -> torch.Tensor:
    """A filled ``array`` as a tensor without a per-element conversion: ``torch.tensor``
    on a python list costs ~0.1 us per element, a buffer view costs nothing per element
    (the tensor keeps the array alive)."""
    if len(values) == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(values, dtype=dtype)


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
            raise ValueError(
                f"tree {b} has {len(p)} nodes; each tree needs 1..{n} nodes"
            )
        flat.extend(p)
        flat.extend(pad[: n - len(p)])
    table = _to_tensor(flat, torch.int64).reshape(len(plists), n)
    _validate_parent_table(table, plists, sizes)
    return plists, sizes, n, table


def _validate_parent_table(
    table: torch.Tensor, plists: list[list[int]], sizes: list[int]
) -> None:
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
            raise ValueError(
                f"tree {b}: node_logws has {len(wl)} entries, parents has {sizes[b]}"
            )
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
    n = (
        max((len(d) for d in dlists), default=1)
        if num_nodes is None
        else int(num_nodes)
    )
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


def tree_custom_mask_batch(
    tree_masks: torch.Tensor, prefix_lens: Sequence[int] | torch.Tensor
) -> torch.Tensor:
    """Flat bool custom mask of a verify pass: per request, ``N`` rows of ``prefix + N``
    columns (the committed prefix, all visible, then the tree block), requests one
    after the other — the layout SGLang's ``custom_mask`` takes for target verify.

    Equal to ``torch.cat([torch.cat([ones(N, prefix_b), tree_masks[b]], 1).reshape(-1)
    for b])`` but written in one scatter instead of two concatenations per request.
    """
    if tree_masks.dim() != 3 or tree_masks.shape[1] != tree_masks.shape[2]:
        raise ValueError(
            f"tree_masks must be [bs, N, N], got {tuple(tree_masks.shape)}"
        )
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
    idx = (
        (starts + pre).view(bs, 1, 1)
        + rows.view(1, n, 1) * widths.view(bs, 1, 1)
        + rows.view(1, 1, n)
    )
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
                f"DDTree {b} with {len(tree.parents)} nodes does not fit the verify window "
                f"of {num_nodes}."
            )
    if len(trees) < _LAYOUT_BATCH_MIN:
        return _layout_per_request(
            trees, prefix_lens, num_nodes, need_retrieve=need_retrieve
        )
    flat_tokens = array.array("q")
    for tree in trees:
        toks = tree.token_ids
        flat_tokens.extend(toks)
        flat_tokens.extend(array.array("q", toks[:1]) * (num_nodes - len(toks)))
    tokens = _to_tensor(flat_tokens, torch.int64).reshape(len(trees), num_nodes)
    parents = [t.parents for t in trees]
    positions = tree_positions_batch([t.depths for t in trees], prefix_lens, num_nodes)
    custom_mask = tree_custom_mask_batch(
        tree_attention_mask_batch(parents, num_nodes), prefix_lens
    )
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
    pre = (
        prefix_lens.reshape(-1).tolist()
        if isinstance(prefix_lens, torch.Tensor)
        else list(prefix_lens)
    )
    tokens = torch.empty((bs, num_nodes), dtype=torch.int64)
    positions = torch.empty((bs, num_nodes), dtype=torch.int64)
    r_index = torch.arange(bs * num_nodes, dtype=torch.int64).reshape(bs, num_nodes)
    r_next = torch.full((bs, num_nodes), -1, dtype=torch.int64)
    r_sib = torch.full((bs, num_nodes), -1, dtype=torch.int64)
    masks: list[torch.Tensor] = []
    for b, tree in enumerate(trees):
        n = len(tree.parents)
        pad = num_nodes - n
        tokens[b] = torch.tensor(
            list(tree.token_ids) + [tree.token_ids[0]] * pad, dtype=torch.int64
        )
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


def follow_verified_tree(
    parents: Sequence[int],
    token_ids: Sequence[int],
    target_argmax: TensorOrSeq,
) -> PathResult:
    """Greedy verification: follow the target's argmax down the tree.

    Returns ``(accepted, proposed)``: ``accepted`` lists local node indices starting
    with the root 0; ``proposed[i]`` is the target's choice after ``accepted[i]``, i.e.
    the tokens of the accepted children followed by the bonus token. If two siblings
    carry the same token (never the case for builder trees) the lower index wins.
    """
    n = len(parents)
    if len(token_ids) != n:
        raise ValueError(f"token_ids has {len(token_ids)} entries, parents has {n}")
    argmax = (
        target_argmax.detach().reshape(-1).cpu().tolist()
        if isinstance(target_argmax, torch.Tensor)
        else [int(t) for t in target_argmax]
    )
    if len(argmax) < n:
        raise ValueError(f"target_argmax has {len(argmax)} entries for {n} nodes")
    child_by_token: list[dict[int, int]] = [{} for _ in range(n)]
    for i in range(n - 1, 0, -1):  # reverse so the lowest index ends up stored
        child_by_token[int(parents[i])][int(token_ids[i])] = i
    accepted = [0]
    proposed: list[int] = []
    cur = 0
    while True:
        want = int(argmax[cur])
        proposed.append(want)
        nxt = child_by_token[cur].get(want)
        if nxt is None:
            return accepted, proposed
        accepted.append(nxt)
        cur = nxt


def _per_row(
    values: Any, rows: int, dtype: torch.dtype, device: torch.device, name: str
) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=dtype, device=device).reshape(-1)
    if t.numel() == 1:
        return t.expand(rows)
    if t.numel() != rows:
        raise ValueError(
            f"{name} must be a scalar or have one value per row ({rows}), got {t.numel()}"
        )
    return t


def target_probs_from_logits(
    logits: torch.Tensor,
    temperature: Any,
    top_k: Any = -1,
    top_p: Any = 1.0,
    min_p: Any = 0.0,
) -> torch.Tensor:
    """Target distribution per row, as SGLang 0.5.23 samples a token.

    softmax(logits / T), then top-k renorm, then top-p renorm, then min-p (float32):
    the order of SGLang's FlashInfer sampler (``srt/layers/sampler.py``:
    ``top_k_renorm_prob``, ``top_p_renorm_prob``, ``min_p_sampling_from_probs``). The
    renorms use FlashInfer's pivot semantics that SGLang mirrors: every probability >=
    the pivot is kept, so ties at the pivot survive. ``top_k <= 0`` or ``>= V``,
    ``top_p >= 1`` and ``min_p <= 0`` disable a filter. Rows with ``T == 0`` are one-hot
    at the argmax (greedy).
    """
    if logits.dim() != 2:
        raise ValueError(
            f"logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}"
        )
    rows, vocab = logits.shape
    dev = logits.device
    temps = _per_row(temperature, rows, torch.float32, dev, "temperature")
    ks = _per_row(top_k, rows, torch.int64, dev, "top_k")
    ps = _per_row(top_p, rows, torch.float32, dev, "top_p")
    x = logits.float()
    greedy = temps <= 0
    safe_t = torch.where(greedy, torch.ones_like(temps), temps)
    probs = torch.softmax(x / safe_t.unsqueeze(1), dim=-1)

    k_eff = torch.where((ks <= 0) | (ks >= vocab), torch.full_like(ks, vocab), ks)
    if bool((k_eff < vocab).any()):
        desc = torch.sort(probs, dim=-1, descending=True).values
        pivot = desc.gather(1, (k_eff - 1).clamp(0, vocab - 1).unsqueeze(1))
        probs = torch.where(probs >= pivot, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if bool((ps < 1.0).any()):
        asc = torch.sort(probs, dim=-1).values
        cdf = torch.cumsum(asc, dim=-1)
        cut = torch.searchsorted(cdf, (1.0 - ps).unsqueeze(1).contiguous(), right=False)
        pivot = asc.gather(1, cut.clamp(max=vocab - 1))
        keep = (probs >= pivot) | (ps >= 1.0).unsqueeze(1)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    mins = _per_row(min_p, rows, torch.float32, dev, "min_p")
    if bool((mins > 0).any()):
        probs = min_p_renorm_probs(probs, mins)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs)
        onehot.scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), onehot, probs)
    return probs


def min_p_renorm_probs(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Min-p filter of rows of probabilities, renormalised: keep every ``p >= min_p *
    max(p)`` of its row (FlashInfer's ``min_p_sampling_from_probs`` pivot, which
    SGLang's sampler applies after the top-k and top-p renorms); ``min_p <= 0`` keeps
    the row. Whole-batch and sync-free, so the serving round uses it as is."""
    pivot = probs.amax(dim=-1, keepdim=True) * min_ps.to(probs.dtype).unsqueeze(-1)
    kept = torch.where(probs >= pivot, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def reference_tree_speculative_sampling(
    predicts: torch.Tensor,  # mutable
    accept_index: torch.Tensor,  # mutable
    accept_token_num: torch.Tensor,  # mutable
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """Pure-torch twin of SGLang 0.5.23 ``tree_speculative_sampling_target_only``.

    Same argument list, shapes, dtypes and in-place writes as the CUDA kernel
    (``sglang/kernels/jit/include/sgl_kernel/speculative/sampling.cuh``):

    - ``predicts[bs*N]`` int32: at the flat position of each accepted node, the token
      emitted after it (the next accepted child, or the bonus token at the last one);
    - ``accept_index[bs, S]`` int32: flat positions of root + accepted nodes (entries
      past ``accept_token_num[b]`` are left untouched, like the kernel);
    - ``accept_token_num[bs]`` int32: number of accepted draft tokens;
    - ``draft_probs[bs, N, V]`` f32: the target mass of every rejected child is written
      at its parent's row, so the bonus is drawn from ``relu(q - draft_probs)``.

    The walk is vectorised over the batch but follows the kernel's float32 arithmetic
    step by step (a running sum of the tried siblings' target probability compared
    with one coin per parent), so accept decisions are bitwise those of the kernel for
    the same coins. The bonus draw inverts the same CDF with ``coin * sum``; the kernel
    sums in a block-reduction order, so only a coin within float32 rounding of a CDF
    boundary can pick a neighbouring token. ``deterministic`` only selects the
    kernel's scan flavour and does not change results here.
    """
    del deterministic
    _check(candidates.dim() == 2, "candidates must be [bs, N]")
    bs, n = candidates.shape
    _check(
        accept_index.dim() == 2 and accept_index.shape[0] == bs,
        "accept_index must be [bs, S]",
    )
    s = accept_index.shape[1]
    _check(
        target_probs.dim() == 3 and target_probs.shape[:2] == (bs, n),
        "target_probs must be [bs, N, V]",
    )
    vocab = target_probs.shape[2]
    for name, t in (
        ("candidates", candidates),
        ("retrive_index", retrive_index),
        ("retrive_next_token", retrive_next_token),
        ("retrive_next_sibling", retrive_next_sibling),
    ):
        _check(
            tuple(t.shape) == (bs, n) and t.dtype == torch.int64,
            f"{name} must be int64 [bs, N]",
        )
    _check(accept_index.dtype == torch.int32, "accept_index must be int32")
    _check(
        tuple(accept_token_num.shape) == (bs,)
        and accept_token_num.dtype == torch.int32,
        "accept_token_num must be int32 [bs]",
    )
    _check(
        tuple(predicts.shape) == (bs * n,) and predicts.dtype == torch.int32,
        "predicts must be int32 [bs*N]",
    )
    _check(
        tuple(uniform_samples.shape) == (bs, n)
        and uniform_samples.dtype == torch.float32,
        "uniform_samples must be float32 [bs, N]",
    )
    _check(
        tuple(uniform_samples_for_final_sampling.shape) == (bs,)
        and uniform_samples_for_final_sampling.dtype == torch.float32,
        "uniform_samples_for_final_sampling must be float32 [bs]",
    )
    _check(
        target_probs.dtype == torch.float32
        and draft_probs.dtype == torch.float32
        and tuple(draft_probs.shape) == (bs, n, vocab),
        "target_probs/draft_probs must be float32 [bs, N, V]",
    )
    _check(
        n > 0 and s > 0 and vocab > 0,
        "draft tokens, spec tokens and vocab must be positive",
    )
    _check(
        0.0 <= threshold_single <= 1.0 and 0.0 <= threshold_acc <= 1.0,
        "thresholds must be in [0, 1]",
    )
    if bs == 0:
        return

    # Scalars rounded to float32 exactly as the kernel's launcher casts them.
    thr_single = torch.tensor(threshold_single, dtype=torch.float32)
    thr_acc = torch.maximum(
        torch.tensor(threshold_acc, dtype=torch.float32),
        torch.tensor(1e-9, dtype=torch.float32),
    )

    dev = target_probs.device
    b_idx = torch.arange(bs, device=dev)
    ri = retrive_index.to(dev)
    nt = retrive_next_token.to(dev)
    ns = retrive_next_sibling.to(dev)
    cand = candidates.to(dev)
    coins_all = uniform_samples.to(dev)
    thr_single = thr_single.to(dev)
    thr_acc = thr_acc.to(dev)

    prob_acc = torch.zeros(bs, dtype=torch.float32, device=dev)
    cur_row = torch.zeros(
        bs, dtype=torch.int64, device=dev
    )  # local node whose probs are in use
    coin = coins_all[:, 0].clone()
    last_flat = ri[:, 0].clone()
    acc_idx = accept_index.to(dev)
    acc_idx[:, 0] = last_flat.to(torch.int32)
    num_acc = torch.zeros(bs, dtype=torch.int64, device=dev)
    pred = predicts.to(dev)
    running = torch.ones(bs, dtype=torch.bool, device=dev)
    cur_index = torch.zeros(bs, dtype=torch.int64, device=dev)

    for _j in range(1, s):
        if not bool(running.any()):
            break
        cur_index = torch.where(running, nt[b_idx, cur_index.clamp(min=0)], cur_index)
        trying = running & (cur_index != -1)
        accepted_now = torch.zeros(bs, dtype=torch.bool, device=dev)
        while bool(trying.any()):
            ci = cur_index.clamp(min=0)
            tok = cand[b_idx, ci]
            bad = trying & ((tok < 0) | (tok >= vocab))
            if bool(bad.any()):
                raise ValueError(
                    f"candidate token out of vocabulary range [0, {vocab})"
                )
            tok_c = tok.clamp(0, vocab - 1)
            q = target_probs[b_idx, cur_row, tok_c]
            prob_acc = torch.where(trying, prob_acc + q, prob_acc)
            accept = (
                trying & (q > 0) & ((coin < prob_acc / thr_acc) | (q >= thr_single))
            )
            reject = trying & ~accept
            if bool(accept.any()):
                ab = b_idx[accept]
                draft_flat = ri[ab, ci[accept]]
                pred[last_flat[accept]] = tok[accept].to(torch.int32)
                num_acc[accept] += 1
                acc_idx[ab, num_acc[accept]] = draft_flat.to(torch.int32)
                last_flat[accept] = draft_flat
                prob_acc[accept] = 0.0
                cur_row[accept] = ci[accept]
                coin[accept] = coins_all[ab, ci[accept]]
                accepted_now |= accept
            if bool(reject.any()):
                rb = b_idx[reject]
                rr = cur_row[reject]
                rt = tok_c[reject]
                draft_probs[rb, rr, rt] = target_probs[rb, rr, rt]
                cur_index = torch.where(reject, ns[b_idx, ci], cur_index)
            trying = reject & (cur_index != -1)
        # A request stops at the first depth where no child was accepted.
        running = running & accepted_now
    accept_token_num.copy_(num_acc.to(torch.int32))

    # Bonus token from relu(q - p) at the last accepted node; the kernel ignores
    # draft_probs when the walk used every spec slot (no children were tried there).
    q_rows = target_probs[b_idx, cur_row]
    p_rows = draft_probs[b_idx, cur_row]
    full = num_acc == (s - 1)
    p_rows = torch.where(full.unsqueeze(1), torch.zeros_like(p_rows), p_rows)
    relu = torch.clamp(q_rows - p_rows, min=0.0)
    total = relu.sum(dim=-1)
    u = uniform_samples_for_final_sampling.to(dev) * total
    cdf = torch.cumsum(relu, dim=-1)
    valid = relu > 0
    hit = (cdf > u.unsqueeze(1)) & valid
    vocab_ar = torch.arange(vocab, device=dev)
    big = torch.full_like(vocab_ar, vocab)
    first_hit = torch.where(hit, vocab_ar, big).min(dim=-1).values
    last_valid = (
        torch.where(valid, vocab_ar, torch.full_like(vocab_ar, -1)).max(dim=-1).values
    )
    fallback = torch.where(
        last_valid >= 0, last_valid, torch.full_like(last_valid, vocab - 1)
    )
    sampled = torch.where(first_hit < vocab, first_hit, fallback)
    pred[last_flat] = sampled.to(torch.int32)

    if pred is not predicts:
        predicts.copy_(pred)
    if acc_idx is not accept_index:
        accept_index.copy_(acc_idx)


_KERNEL_CACHE: dict[str, Any] = {}


def _load_kernel() -> Any | None:
    """SGLang's CUDA tree sampling op, or None where it cannot run (no CUDA, no SGLang)."""
    if "fn" in _KERNEL_CACHE:
        return _KERNEL_CACHE["fn"]
    fn = None
    if torch.cuda.is_available():
        try:
            from sglang.kernels.ops.speculative.sampling import (  # noqa: PLC0415
                tree_speculative_sampling_target_only,
            )

            fn = tree_speculative_sampling_target_only
        except Exception:  # any import-time failure means: use the reference
            fn = None
    _KERNEL_CACHE["fn"] = fn
    return fn


def kernel_available() -> bool:
    """Whether :func:`sample_tree_paths` can use SGLang's CUDA kernel on this host."""
    return _load_kernel() is not None


def sample_tree_paths(
    trees: Sequence[DDTree],
    target_logits: torch.Tensor,
    temperatures: Any,
    top_ks: Any,
    top_ps: Any,
    *,
    generator: torch.Generator | None = None,
    use_kernel: Literal["auto"] | bool = "auto",
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> list[PathResult]:
    """Verify a batch of trees by tree rejection sampling against the target.

    ``target_logits`` is ``[bs, N, V]`` (or ``[bs*N, V]``) with row ``i`` of request
    ``b`` holding the target logits after node ``i`` of ``trees[b]``; ``N`` must cover
    the largest tree (smaller trees are padded with unreachable nodes). Inputs are
    laid out exactly as SGLang's EAGLE path lays them out for
    ``tree_speculative_sampling_target_only`` (flat retrieve offset ``b*N``, zeroed
    draft probs, one uniform coin per node, one for the bonus) so the kernel and the
    reference see the same thing. Returns one ``(accepted, proposed)`` per request,
    the same contract as :func:`follow_verified_tree`; all-greedy batches (every row
    temperature 0 or top-k 1) take the greedy walk directly.

    ``use_kernel``: "auto" uses the kernel for CUDA logits when it imports; True
    requires it (CPU logits are moved to CUDA); False always runs the reference, on
    the logits' device, which is how to compare both on identical target probs.

    Coins are drawn on the CPU from ``generator`` (then moved), so a seeded run gives
    the same coins whichever implementation consumes them.
    """
    bs = len(trees)
    if bs == 0:
        return []
    if target_logits.dim() == 2:
        if target_logits.shape[0] % bs:
            raise ValueError(
                f"target_logits rows ({target_logits.shape[0]}) not divisible by batch {bs}"
            )
        target_logits = target_logits.reshape(bs, target_logits.shape[0] // bs, -1)
    if target_logits.dim() != 3 or target_logits.shape[0] != bs:
        raise ValueError(
            f"target_logits must be [bs, N, V], got {tuple(target_logits.shape)}"
        )
    n = target_logits.shape[1]
    vocab = target_logits.shape[2]
    if max(len(t) for t in trees) > n:
        raise ValueError(
            f"target_logits has {n} rows per request, the largest tree has "
            f"{max(len(t) for t in trees)} nodes"
        )
    temps = _per_row(
        temperatures, bs, torch.float32, torch.device("cpu"), "temperatures"
    )
    ks = _per_row(top_ks, bs, torch.int64, torch.device("cpu"), "top_ks")

    # SGLang marks greedy requests as top_k == 1 (temperature 1); T == 0 means the same.
    if bool(((temps <= 0) | (ks == 1)).all()):
        argmax = target_logits.argmax(dim=-1).cpu()
        return [
            follow_verified_tree(t.parents, t.token_ids, argmax[b])
            for b, t in enumerate(trees)
        ]

    if use_kernel == "auto":
        kernel = _load_kernel() if target_logits.device.type == "cuda" else None
    elif use_kernel:
        kernel = _load_kernel()
        if kernel is None:
            raise RuntimeError(
                "SGLang's tree_speculative_sampling_target_only kernel is not available here"
            )
        target_logits = target_logits.cuda()
    else:
        kernel = None
    dev = target_logits.device

    r_index, r_next, r_sib = compile_ddtree_retrieve_batch(
        [t.parents for t in trees], [t.node_logws for t in trees], num_nodes_padded=n
    )
    # Root token is the last committed one; the kernel never reads candidates[.,0]
    # for acceptance, and a -1 sentinel must not reach an index (padding is 0 too).
    flat_cand = array.array("q")
    for tree in trees:
        m = len(tree)
        flat_cand.append(0)
        flat_cand.extend(tree.token_ids[1:m])
        flat_cand.extend(array.array("q", [0]) * (n - m))
    cand = _to_tensor(flat_cand, torch.int64).reshape(bs, n)
    spec = max(tree.max_depth for tree in trees) + 1

    probs = target_probs_from_logits(
        target_logits.reshape(bs * n, vocab),
        _per_row(
            temperatures, bs, torch.float32, dev, "temperatures"
        ).repeat_interleave(n),
        _per_row(top_ks, bs, torch.int64, dev, "top_ks").repeat_interleave(n),
        _per_row(top_ps, bs, torch.float32, dev, "top_ps").repeat_interleave(n),
    ).reshape(bs, n, vocab)
    coins = torch.rand((bs, n), generator=generator, dtype=torch.float32)
    final_coins = torch.rand((bs,), generator=generator, dtype=torch.float32)

    predicts = torch.zeros(bs * n, dtype=torch.int32, device=dev)
    accept_index = torch.full((bs, spec), -1, dtype=torch.int32, device=dev)
    accept_num = torch.empty(bs, dtype=torch.int32, device=dev)
    fn = kernel if kernel is not None else reference_tree_speculative_sampling
    fn(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_num,
        candidates=cand.to(dev),
        retrive_index=r_index.to(dev),
        retrive_next_token=r_next.to(dev),
        retrive_next_sibling=r_sib.to(dev),
        uniform_samples=coins.to(dev),
        uniform_samples_for_final_sampling=final_coins.to(dev),
        target_probs=probs,
        draft_probs=torch.zeros_like(probs),
        threshold_single=threshold_single,
        threshold_acc=threshold_acc,
        deterministic=True,
    )
    acc = accept_index.cpu().tolist()
    nums = accept_num.cpu().tolist()
    pred = predicts.cpu().tolist()
    out: list[PathResult] = []
    for b in range(bs):
        flats = acc[b][: nums[b] + 1]
        out.append(([f % n for f in flats], [pred[f] for f in flats]))
    return out


# ------------------------------------------------------------ device-resident rounds
#
# What a serving round runs. Everything below takes and returns tensors on the
# device the drafter and the target run on, in whole-batch operations whose count
# depends on the tree shape (budget, depth, top-k) and never on the data: no
# ``.item()``, ``.tolist()`` or boolean indexing, so a round issues no host sync and
# nothing it does grows with the prefix length or the vocabulary. Each function has
# a per-request twin above (the reference the tests pin it to).


@dataclass(frozen=True)
class TreeBatch:
    """A batch of draft trees laid out ``[bs, N]``, ``N = budget + 1``.

    Node 0 is the root (the last committed token). Nodes are in the builder's pop
    order. A tree with fewer than ``budget`` candidate paths is padded with nodes
    that hang off the root, repeat the root token and have ``valid == False``: they
    keep every tensor rectangular, and no walk or retrieve pointer ever reaches them.
    """

    tokens: torch.Tensor  # [bs, N] int64
    parents: torch.Tensor  # [bs, N] int64, -1 at the root
    depths: torch.Tensor  # [bs, N] int64
    logws: torch.Tensor  # [bs, N] float64, cumulative draft log-probability
    valid: torch.Tensor  # [bs, N] bool
    max_depth: int  # bound on ``depths`` known without looking at the data

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])


def build_tree_batch(
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    budget: int,
    root_tokens: torch.Tensor,
) -> TreeBatch:
    """:func:`build_ddtree_tree_from_topk` for a batch, without leaving the device.

    ``topk_ids`` / ``topk_logprobs`` are ``[bs, depth, k]`` with each row sorted by
    descending log-probability (log-probabilities, so ``<= 0``), ``root_tokens``
    ``[bs]``. The best-first heap pops the ``count`` smallest keys
    ``(-logw, depth, parent, rank)`` of the product tree (see the builder's
    docstring), ``count = min(budget, nodes)``. Every node that beats a chosen node
    (a smaller key) is chosen too, so the chosen nodes of a depth are a prefix of
    that depth's nodes in key order, and a chosen node at position ``q`` of depth
    ``d`` brings along the ``q`` nodes before it, at least ``ceil((q + 1) / k**j)``
    distinct ancestors of them ``j`` levels up, and itself: at most ``budget`` in all
    (:func:`_tree_plan` turns that into static frontier widths and candidate lists).
    Expanding one depth at a time, the children of the frontier listed in (parent
    position, rank) order and stably sorted on ``-logw`` are in key order, so each
    depth's frontier holds all of its chosen nodes, first, in key order. Behind the
    root (``logw = 0``, the best key), the frontiers laid out depth after depth and
    stably sorted once more give exactly the heap's trees in its pop order.
    Cumulative log-probabilities are summed in float64, as the heap does.
    """
    if topk_ids.dim() != 3 or topk_logprobs.shape != topk_ids.shape:
        raise ValueError(
            "topk_ids and topk_logprobs must have the same [bs, depth, k] shape, got "
            f"{tuple(topk_ids.shape)} and {tuple(topk_logprobs.shape)}"
        )
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    bs, depth, k = topk_ids.shape
    device = topk_ids.device
    n = budget + 1
    roots = root_tokens.reshape(bs).to(device=device, dtype=torch.int64)
    if depth == 0 or k == 0:
        return _padded_tree_batch(roots, n, 0)
    plan = _tree_plan(budget, depth, k, str(device))
    # Column 0 is the root's log-prob (0), then the [depth * k] draft log-probs; the
    # first k of those are depth 1's frontier as it is (sorted rows: key order).
    lps = torch.nn.functional.pad(
        topk_logprobs.to(torch.float64).reshape(bs, depth * k), (1, 0)
    )
    # `torch.cat` takes a slow path for any non-contiguous input, so every piece
    # below is a fresh tensor.
    values = [lps]
    orders = [torch.zeros((bs, lps.shape[1]), dtype=torch.int64, device=device)]
    if plan.padding:
        values.append(
            torch.full((bs, 1), float("-inf"), dtype=torch.float64, device=device)
        )
        orders.append(torch.zeros((bs, 1), dtype=torch.int64, device=device))
    logw = lps
    child_lps = torch.index_select(lps, 1, plan.child_cols).split(plan.child_sizes, 1)
    for parent_col, child_lp in zip(plan.parent_cols, child_lps):
        children = torch.index_select(logw, 1, parent_col) + child_lp
        logw, order = torch.sort(children, dim=1, descending=True, stable=True)
        values.append(logw)
        orders.append(order)

    # Root, frontier prefixes depth after depth, padding: column order is the key's
    # (depth, position) order, so the stable selection is the pop order, root first.
    kept = torch.index_select(torch.cat(values, dim=1), 1, plan.keep)
    logws, chosen = _best_in_key_order(kept, n)
    # Each kept column's candidate (a static id) is its depth's offset plus the
    # position its sort came from; the static tables tell the rest.
    cand = torch.index_select(torch.cat(orders, dim=1), 1, plan.keep) + plan.cand_base
    cand = torch.gather(cand, 1, chosen)
    tokens = torch.gather(
        torch.cat([roots.unsqueeze(1), topk_ids.to(torch.int64).reshape(bs, -1)], 1),
        1,
        torch.take(plan.token_col, cand),
    )
    # Kept column -> node index. A chosen node's parent is chosen (and so written
    # here); the root's parent is the extra last column, left at -1.
    node_of = torch.full(
        (bs, plan.keep.numel() + 1), -1, dtype=torch.int64, device=device
    )
    node_of.scatter_(1, chosen, plan.node_index.expand(bs, n))
    return TreeBatch(
        tokens=tokens,
        parents=torch.gather(node_of, 1, torch.take(plan.parent_col, cand)),
        depths=torch.take(plan.depth_of, cand),
        logws=logws,
        valid=plan.valid.expand(bs, n).clone(),
        max_depth=depth,
    )


@dataclass(frozen=True)
class _TreePlan:
    """The static part of :func:`build_tree_batch` for one (budget, depth, k, device).

    The frontiers' columns, side by side ("wide"): the root, the ``[depth * k]``
    draft log-probs (depth 1 is the first ``k``), a padding column if the product
    tree has fewer than ``budget`` nodes, then every deeper depth's sorted
    candidates. Candidates have static ids: 0 the root, ``1 + r`` rank ``r`` at
    depth 1, then every deeper depth's candidate list in order, then the padding.
    """

    child_cols: torch.Tensor  # per deeper candidate: its draft log-prob's column
    child_sizes: tuple[int, ...]  # candidates per depth, from depth 2
    parent_cols: tuple[torch.Tensor, ...]  # per depth: the parents' columns
    padding: bool
    keep: torch.Tensor  # the wide columns that can hold a chosen node, in key order
    cand_base: torch.Tensor  # per kept column: candidate id of sorted position 0
    token_col: torch.Tensor  # per candidate id: column of [root | topk_ids]
    parent_col: torch.Tensor  # per candidate id: kept column of the parent
    depth_of: torch.Tensor  # per candidate id: depth (padding: 1)
    node_index: torch.Tensor  # arange(budget + 1)
    valid: torch.Tensor  # [budget + 1] bool


@functools.lru_cache(maxsize=64)
def _tree_plan(budget: int, depth: int, k: int, device: str) -> _TreePlan:
    def closure(d: int, q: int) -> int:
        # Fewest nodes chosen along with the one at position q of depth d: it, the q
        # before it, and at least ceil((q + 1) / k**j) distinct ancestors of those
        # j levels up.
        total, span = 0, q + 1
        for _ in range(d):
            total += span
            span = -(-span // k)
        return total

    def fits(d: int) -> int:
        # Positions of depth d that can hold a chosen node.
        q = 0
        while closure(d, q) <= budget:
            q += 1
        return q

    # Child (p, r) of frontier position p is beaten by the (p + 1) * (r + 1) - 1
    # other children (p' <= p, r' <= r) and by the closure of position p, so it is
    # a candidate only if those and itself fit the budget. A chosen node's parent is
    # chosen and sits at its true position, so no chosen node is pruned.
    widths = [min(k, fits(1))]
    lists: list[list[tuple[int, int]]] = []
    for d in range(1, depth):
        pairs = [
            (p, r)
            for p in range(widths[-1])
            for r in range(k)
            if (p + 1) * (r + 1) + closure(d, p) <= budget
        ]
        if not pairs:
            break
        lists.append(pairs)
        widths.append(min(len(pairs), fits(d + 1)))
    # With fewer nodes than the budget every node fits, so sum(widths) counts them.
    pad = max(0, budget - sum(widths))

    lp_cols = 1 + depth * k
    starts = [lp_cols + (pad > 0)]
    for pairs in lists:
        starts.append(starts[-1] + len(pairs))
    keep, cand_base = [0], [0]
    keep += range(1, 1 + widths[0])
    cand_base += range(1, 1 + widths[0])
    kept_start = [1]  # kept column of each depth's position 0
    cand_start = 1 + k
    for pairs, start, w in zip(lists, starts, widths[1:]):
        kept_start.append(len(keep))
        keep += range(start, start + w)
        cand_base += [cand_start] * w
        cand_start += len(pairs)
    keep += [lp_cols] * pad
    cand_base += [cand_start] * pad

    # Token columns of [root | flat topk_ids] equal the log-prob columns above.
    token_col = [0, *range(1, 1 + k)]
    parent_col = [len(keep), *[0] * k]  # the root's: one past the kept columns
    depth_of = [0, *[1] * k]
    for d, pairs in enumerate(lists, start=2):
        token_col += [1 + (d - 1) * k + r for _, r in pairs]
        parent_col += [kept_start[d - 2] + p for p, _ in pairs]
        depth_of += [d] * len(pairs)
    token_col.append(0)
    parent_col.append(0)
    depth_of.append(1)

    def i64(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return _TreePlan(
        child_cols=i64(
            [1 + d * k + r for d, pairs in enumerate(lists, 1) for _, r in pairs]
        ),
        child_sizes=tuple(len(pairs) for pairs in lists),
        # Depth 1's frontier is read from the log-prob columns, deeper ones from
        # the previous sort's output.
        parent_cols=tuple(
            i64([p + (d == 0) for p, _ in pairs]) for d, pairs in enumerate(lists)
        ),
        padding=pad > 0,
        keep=i64(keep),
        cand_base=i64(cand_base),
        token_col=i64(token_col),
        parent_col=i64(parent_col),
        depth_of=i64(depth_of),
        node_index=torch.arange(budget + 1, device=device),
        valid=torch.arange(budget + 1, device=device) <= budget - pad,
    )


def _best_in_key_order(
    values: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``count`` largest values of each row and their column indices, largest
    first, ties by lower index: the first ``count`` of a stable descending sort, which
    is what it is for short rows. For long rows a full sort costs far more than
    ``topk``, whose choice among ties is unspecified: ``topk`` gives the ``count``-th
    value (the cut), a second ``topk`` on an integer key that ranks the values above
    the cut over those at it, and those at it by lower index, picks exactly the stable
    sort's columns, and only those are sorted.
    """
    bs, width = values.shape
    if width <= 64 or 4 * count >= width:
        top, order = torch.sort(values, dim=1, descending=True, stable=True)
        return top[:, :count], order[:, :count]
    cut = torch.topk(values, count, dim=1, sorted=False).values.amin(1, keepdim=True)
    # Fewer than `count` values are above the cut and at least `count` are at or
    # above it, so the set is exact: all above, then the lowest columns at the cut.
    lower_first = torch.arange(width, 0, -1, device=values.device)
    key = (values > cut) * (width + 1) + (values == cut) * lower_first
    kept = torch.topk(key, count, dim=1, sorted=False).indices
    kept = torch.sort(kept, dim=1).values
    top, order = torch.sort(
        torch.gather(values, 1, kept), dim=1, descending=True, stable=True
    )
    return top, torch.gather(kept, 1, order)


def _padded_tree_batch(roots: torch.Tensor, n: int, max_depth: int) -> TreeBatch:
    """A batch of ``n``-node trees in which every node but the root is padding."""
    bs = roots.shape[0]
    device = roots.device
    parents = torch.zeros((bs, n), dtype=torch.int64, device=device)
    parents[:, 0] = -1
    depths = torch.ones((bs, n), dtype=torch.int64, device=device)
    depths[:, 0] = 0
    logws = torch.full((bs, n), float("-inf"), dtype=torch.float64, device=device)
    logws[:, 0] = 0.0
    valid = torch.zeros((bs, n), dtype=torch.bool, device=device)
    valid[:, 0] = True
    return TreeBatch(
        tokens=roots.unsqueeze(1).expand(bs, n).clone(),
        parents=parents,
        depths=depths,
        logws=logws,
        valid=valid,
        max_depth=max(int(max_depth), 1),
    )


def tree_batch_from_trees(trees: Sequence[DDTree], num_nodes: int) -> TreeBatch:
    """A :class:`TreeBatch` holding host-built trees (padded to ``num_nodes``)."""
    roots = torch.tensor([t.token_ids[0] for t in trees], dtype=torch.int64)
    out = _padded_tree_batch(
        roots, num_nodes, max((t.max_depth for t in trees), default=1)
    )
    for b, t in enumerate(trees):
        m = len(t)
        if m > num_nodes:
            raise ValueError(f"tree {b} has {m} nodes, more than {num_nodes}")
        out.tokens[b, :m] = torch.tensor(t.token_ids, dtype=torch.int64)
        out.parents[b, :m] = torch.tensor(t.parents, dtype=torch.int64)
        out.depths[b, :m] = torch.tensor(t.depths, dtype=torch.int64)
        out.logws[b, :m] = torch.tensor(t.node_logws, dtype=torch.float64)
        out.valid[b, :m] = True
    return out


def tree_ancestor_masks(trees: TreeBatch) -> torch.Tensor:
    """``[bs, N, N]`` bool: row i is True at i and at every ancestor of i.

    Pointer doubling for a number of steps fixed by ``max_depth`` (no data-dependent
    stop), so the mask costs ``log2(depth)`` whole-batch steps, on rows packed 64
    nodes to an int64 word. Equal to :func:`tree_attention_mask_batch` of the same
    trees.
    """
    bs, n = trees.parents.shape
    word_of, bit_of, own = _node_bits(n, str(trees.parents.device))
    # The root points to itself: OR-ing its own row in again changes nothing.
    up = trees.parents.clamp(min=0)
    rows = own | torch.index_select(own, 0, up.reshape(-1)).view(bs, n, -1)
    reach = 1
    while reach < trees.max_depth:
        rows |= torch.gather(rows, 1, up.unsqueeze(2).expand_as(rows))
        up = torch.gather(up, 1, up)
        reach *= 2
    if rows.shape[2] > 1:
        rows = torch.index_select(rows, 2, word_of)
    return (rows & bit_of) != 0


@functools.lru_cache(maxsize=64)
def _node_bits(n: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Node j's word and bit in a packed row, and ``[N, words]``: node i's own bit."""
    words = (n + 63) // 64
    word_of = torch.arange(n, device=device) // 64
    # 1 << 63 is int64's sign bit; wrapped, it is still just that bit.
    bit_of = torch.tensor(
        [(1 << (j % 64)) - (1 << 64 if j % 64 == 63 else 0) for j in range(n)],
        dtype=torch.int64,
        device=device,
    )
    own = torch.zeros((n, words), dtype=torch.int64, device=device)
    own[torch.arange(n, device=device), word_of] = bit_of
    return word_of, bit_of, own


def tree_retrieve_batch(
    trees: TreeBatch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`compile_ddtree_retrieve_batch` on the device.

    Nodes are in pop order, i.e. by descending cumulative log-probability with the
    builder's tie order, so a parent's children in index order are exactly the
    sibling chain the kernel must walk: first child = smallest child index, next
    sibling = the next larger index under the same parent. Padding nodes are in no
    chain.
    """
    bs, n = trees.parents.shape
    device = trees.parents.device
    idx = torch.arange(n, device=device).expand(bs, n)
    is_child = trees.valid.clone()
    is_child[:, 0] = False
    # Sort children by (parent, index); non-children sort last.
    key = torch.where(is_child, trees.parents * n + idx, torch.full_like(idx, n * n))
    sorted_key, order = torch.sort(key, dim=1)
    same_parent = (sorted_key[:, 1:] // n == sorted_key[:, :-1] // n) & (
        sorted_key[:, 1:] < n * n
    )
    next_sibling = torch.full((bs, n), -1, dtype=torch.int64, device=device)
    next_sibling.scatter_(
        1, order[:, :-1], torch.where(same_parent, order[:, 1:], next_sibling[:, 1:])
    )
    first = torch.full((bs, n + 1), n, dtype=torch.int64, device=device)
    first.scatter_reduce_(
        1,
        torch.where(is_child, trees.parents, torch.full_like(idx, n)),
        torch.where(is_child, idx, torch.full_like(idx, n)),
        reduce="amin",
    )
    first = first[:, :n]
    next_token = torch.where(first < n, first, torch.full_like(first, -1))
    retrieve_index = torch.arange(bs * n, device=device).reshape(bs, n)
    return retrieve_index, next_token, next_sibling


@dataclass(frozen=True)
class AcceptedPaths:
    """One round's accepted paths, chain-shaped: entry ``j`` of request ``b`` is the
    ``j``-th node of the accepted path (``j = 0`` the root) and the token the target
    emitted after it, valid for ``j < commit_lens[b]``; later entries repeat the
    last valid one so gathers stay in range. ``commit_lens`` counts emitted tokens
    (accepted drafts plus the bonus token)."""

    nodes: torch.Tensor  # [bs, S] int64, local node index
    tokens: torch.Tensor  # [bs, S] int64
    commit_lens: torch.Tensor  # [bs] int64


def follow_verified_tree_batch(
    trees: TreeBatch, target_argmax: torch.Tensor
) -> AcceptedPaths:
    """:func:`follow_verified_tree` for a batch: ``max_depth`` whole-batch steps.

    ``target_argmax`` is ``[bs, N]``: the target's choice after each node. Among
    siblings carrying the wanted token (never more than one in builder trees) the
    lowest index wins, as in the per-request walk.
    """
    bs, n = trees.parents.shape
    device = trees.parents.device
    steps = trees.max_depth + 1
    argmax = target_argmax.reshape(bs, n).to(torch.int64)
    idx = torch.arange(n, device=device).expand(bs, n)
    child_tok = torch.where(
        trees.valid & (idx > 0), trees.tokens, torch.full_like(trees.tokens, -1)
    )
    nodes = torch.zeros((bs, steps), dtype=torch.int64, device=device)
    tokens = torch.zeros((bs, steps), dtype=torch.int64, device=device)
    lens = torch.ones(bs, dtype=torch.int64, device=device)
    cur = torch.zeros(bs, dtype=torch.int64, device=device)
    alive = torch.ones(bs, dtype=torch.bool, device=device)
    want = argmax[:, 0]
    tokens[:, 0] = want
    for j in range(1, steps):
        hit = (trees.parents == cur.unsqueeze(1)) & (child_tok == want.unsqueeze(1))
        nxt = torch.where(hit, idx, torch.full_like(idx, n)).min(dim=1).values
        alive = alive & (nxt < n)
        cur = torch.where(alive, nxt, cur)
        want = torch.gather(argmax, 1, cur.unsqueeze(1)).squeeze(1)
        nodes[:, j] = cur
        tokens[:, j] = want
        lens = lens + alive.to(torch.int64)
    return AcceptedPaths(nodes=nodes, tokens=tokens, commit_lens=lens)


def accepted_paths_from_kernel(
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    predicts: torch.Tensor,
    num_nodes: int,
) -> AcceptedPaths:
    """:class:`AcceptedPaths` from the outputs of ``tree_speculative_sampling_target_only``
    (or its reference): flat node positions ``b * N + i`` and the token emitted at
    each accepted position."""
    bs, s = accept_index.shape
    device = accept_index.device
    lens = accept_token_num.to(torch.int64) + 1
    cols = torch.arange(s, device=device).expand(bs, s)
    last = torch.gather(accept_index.to(torch.int64), 1, (lens - 1).unsqueeze(1))
    flat = torch.where(cols < lens.unsqueeze(1), accept_index.to(torch.int64), last)
    return AcceptedPaths(
        nodes=flat % num_nodes,
        tokens=predicts.to(torch.int64)[flat],
        commit_lens=lens,
    )


class TreeMaskBuffer:
    """The target-verify custom mask, kept in one buffer that never shrinks.

    Attention backends read the mask SGLang's way: per request ``N`` rows of
    ``prefix + N`` columns, requests one after the other. Every prefix cell is True.
    Instead of building that per round (``N * prefix`` cells per request), every
    cell of this buffer is True between rounds: :meth:`write` sets only the ``N * N``
    tree-block cells of the round at their offsets, and :meth:`restore` sets the same
    cells back to True once the verify pass has read them. A round therefore touches
    ``bs * N * N`` cells whatever the prefix length; growing the buffer (amortised,
    by doubling) is the only work that scales with it.
    """

    def __init__(self, device: torch.device | str, dtype: torch.dtype = torch.bool):
        self.device = torch.device(device)
        self.dtype = dtype
        self._buf = torch.ones(0, dtype=dtype, device=self.device)
        self._written: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return int(self._buf.numel())

    def write(
        self, tree_masks: torch.Tensor, prefix_lens: torch.Tensor, cells: int
    ) -> torch.Tensor:
        """Lay ``tree_masks`` ``[bs, N, N]`` out behind prefixes ``prefix_lens``
        ``[bs]`` (device) and return the mask, a view of ``cells`` cells.

        ``cells`` must be at least ``N * (sum(prefix_lens) + bs * N)``; it comes from
        host-side lengths the scheduler already has (an upper bound is fine), so
        sizing the view costs no device-to-host copy.
        """
        if self._written is not None:
            self.restore()
        bs, n, _ = tree_masks.shape
        if cells > self.capacity:
            self._buf = torch.ones(
                max(int(cells), 2 * self.capacity), dtype=self.dtype, device=self.device
            )
        pre = prefix_lens.reshape(bs, 1, 1).to(device=self.device, dtype=torch.int64)
        # Request b's block starts after all earlier blocks (N rows of prefix + N
        # cells each) and its own prefix; row i adds i rows of pre_b + N cells. So
        # cell (b, i, j) is N * cumsum(pre)_b + pre_b * (i + 1 - N) + (b N + i) N + j.
        idx = torch.addcmul(
            torch.cumsum(pre, 0) * n
            + torch.arange(bs * n * n, device=self.device).view(bs, n, n),
            pre,
            torch.arange(1 - n, 1, device=self.device).view(1, n, 1),
        ).reshape(-1)
        self._buf.index_copy_(0, idx, tree_masks.reshape(-1).to(self.dtype))
        self._written = idx
        return self._buf[: int(cells)]

    def restore(self) -> None:
        """Set the cells of the last :meth:`write` back to True."""
        if self._written is not None:
            self._buf.index_fill_(0, self._written, True)
            self._written = None
