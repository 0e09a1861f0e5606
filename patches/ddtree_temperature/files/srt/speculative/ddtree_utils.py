"""DDTree's device-resident round: what a serving round runs, and nothing else.

Everything here takes and returns tensors on the device the drafter and the target
run on, in whole-batch operations whose count depends on the tree shape (budget,
depth, top-k) and never on the data: no ``.item()``, ``.tolist()`` or boolean
indexing, so a round issues no host sync and nothing it does grows with the prefix
length or the vocabulary.

``__all__`` is exactly what ``ddtree_worker_v2`` calls here: build the batch's trees
(:func:`build_tree_batch`), their ancestor-only masks (:func:`tree_ancestor_masks`)
written into the persistent :class:`TreeMaskBuffer`, the first-child / next-sibling
retrieve tensors for sampled requests (:func:`tree_retrieve_batch`), the greedy walk
(:func:`follow_verified_tree_batch`) and the sampled one read back from the kernel's
outputs (:func:`accepted_paths_from_kernel`). Each has a per-request twin in
``ddtree_reference`` that the tests pin it to, tree for tree; the target distribution
and the sampler the round shares with that reference live there too.

Like the reference, it depends only on torch and the standard library, so it can be
loaded by path and tested without the rest of SGLang.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "build_tree_batch",
    "tree_ancestor_masks",
    "tree_retrieve_batch",
    "tree_batch_from_trees",
    "follow_verified_tree_batch",
    "accepted_paths_from_kernel",
    "sample_tree_in_row_chunks",
    "TreeMaskBuffer",
    "verify_mask_cells",
]


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


def tree_batch_from_trees(trees: Sequence[Any], num_nodes: int) -> TreeBatch:
    """A :class:`TreeBatch` holding host-built trees (``ddtree_reference.DDTree``,
    padded to ``num_nodes``): how the tests and benchmarks/verify_round.py hand the
    reference's trees to the device functions. The worker never calls it."""
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


# ``tree_speculative_sampling_target_only`` computes each request's probability offset in
# uint32 (0.5.23's ``kernels/jit/include/sgl_kernel/speculative/sampling.cuh``:
# ``cur_prob_offset = bx * num_draft_tokens * d`` and ``(bx * num_draft_tokens +
# cur_index) * d``): from ``bs * N * V >= 2**32`` on, a row reads another request's
# probabilities, silently (vocab 151,936: width 65 from batch 435, width 17 from 1,663).
KERNEL_PROB_OFFSET_LIMIT = 2**32


def sample_tree_in_row_chunks(
    kernel: Any,
    *,
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    threshold_single: float,
    threshold_acc: float,
    deterministic: bool = True,
    limit: int = KERNEL_PROB_OFFSET_LIMIT,
) -> int:
    """Call the tree sampling kernel (its exact arguments) on row chunks small enough that
    ``rows * N * V < limit``; returns the number of calls. Rows are independent requests:
    a chunk's tensors are row slices (contiguous views: no copy of the probabilities), its
    ``retrive_index`` (flat positions ``b * N + i`` into ``predicts``) shifted to the
    chunk's slice of ``predicts``, and the flat positions it writes into ``accept_index``
    shifted back. One call, unchanged, where the batch fits."""
    bs, width = candidates.shape
    per_row = width * int(target_probs.shape[-1])
    rows = (int(limit) - 1) // per_row
    if rows < 1:
        raise ValueError(
            f"DDTREE: one request's verify probabilities ({width} x "
            f"{target_probs.shape[-1]}) exceed the sampling kernel's {limit}-element "
            "offset range."
        )
    args = {
        "threshold_single": threshold_single,
        "threshold_acc": threshold_acc,
        "deterministic": deterministic,
    }
    if bs <= rows:
        kernel(
            predicts=predicts,
            accept_index=accept_index,
            accept_token_num=accept_token_num,
            candidates=candidates,
            retrive_index=retrive_index,
            retrive_next_token=retrive_next_token,
            retrive_next_sibling=retrive_next_sibling,
            uniform_samples=uniform_samples,
            uniform_samples_for_final_sampling=uniform_samples_for_final_sampling,
            target_probs=target_probs,
            draft_probs=draft_probs,
            **args,
        )
        return 1
    calls = 0
    for start in range(0, bs, rows):
        end = min(bs, start + rows)
        shift = start * width
        chunk_accept = accept_index[start:end]
        kernel(
            predicts=predicts[shift : end * width],
            accept_index=chunk_accept,
            accept_token_num=accept_token_num[start:end],
            candidates=candidates[start:end],
            retrive_index=retrive_index[start:end] - shift,
            retrive_next_token=retrive_next_token[start:end],
            retrive_next_sibling=retrive_next_sibling[start:end],
            uniform_samples=uniform_samples[start:end],
            uniform_samples_for_final_sampling=uniform_samples_for_final_sampling[
                start:end
            ],
            target_probs=target_probs[start:end],
            draft_probs=draft_probs[start:end],
            **args,
        )
        # Written positions are chunk-local flat positions; -1 (never written) stays.
        chunk_accept.add_((chunk_accept >= 0).to(chunk_accept.dtype) * shift)
        calls += 1
    return calls


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


def verify_mask_cells(
    width: int, verify_kv_sum: int, bs: int, *, fixed_cells: int | None = None
) -> int:
    """Cells of the tree mask view handed to attention.

    FlashInfer's verify planning (``DFlashVerifyInput.generate_attn_arg_prefill``,
    ``srt/speculative/dflash_info.py``) re-allocates and copies any mask shorter than
    ``paged_kernel_lens_sum * N + N * N * bs`` cells, where ``paged_kernel_lens_sum``
    is the forward batch's ``seq_lens_sum``: the host bound ``verify_kv_sum`` this
    round gives it (prefix + N per request). A view of exactly that size keeps the
    mask the :class:`TreeMaskBuffer` (all True past the tree blocks).

    ``fixed_cells``: the size of a backend's fixed verify-mask buffer that a graph
    replay copies the view into (Triton's ``VerifyMask``, ``max_bs * N *
    (context_len + N)`` cells, ``srt/layers/attention/verify_mask.py``
    ``tree_mask_numel``; the copy is in ``TritonAttnBackend._update_target_verify_buffers``).
    The view is then capped at that size, but never below ``N * verify_kv_sum``, the
    host bound of the cells the kernel reads (``N * (prefix + N)`` per request): a
    result above ``fixed_cells`` means the round cannot replay against that buffer.
    """
    reads = int(width) * int(verify_kv_sum)
    cells = reads + int(width) * int(width) * int(bs)
    if fixed_cells is None:
        return cells
    return max(min(cells, int(fixed_cells)), reads)
