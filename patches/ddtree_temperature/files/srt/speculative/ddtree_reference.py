"""DDTree (Diffusion Draft Tree) reference: per-request tree building, tree encodings
and verification, and the target distribution and sampler the serving round shares.

It depends only on torch and the standard library at import time (SGLang's sampling
kernel is imported lazily, inside :func:`sample_tree_paths`), so it can be loaded and
tested on its own, without the rest of SGLang.

The per-request functions are the reference -- plain lists and small tensors, each
pinned by tests to brute force or to the kernel's contract -- that the device-resident
round in ``ddtree_utils`` is pinned to, tree for tree:

1. :func:`build_ddtree_tree_from_topk` turns the drafter's per-position top-k into a
   tree of at most ``budget`` nodes, best first by cumulative draft log-probability.
2. :func:`tree_positions` and :func:`tree_attention_mask` give the verify pass its
   positions and its ancestor-only attention mask.
3. :func:`compile_ddtree_retrieve` encodes the tree the way SGLang's EAGLE tree kernels
   read it (first child / next sibling, siblings by descending cumulative log-prob).
4. Verification: :func:`follow_verified_tree` for greedy requests, and
   :func:`sample_tree_paths` (SGLang's ``tree_speculative_sampling_target_only`` kernel
   on CUDA, :func:`reference_tree_speculative_sampling` elsewhere) for temperature,
   top-k, top-p and min-p sampling. Both return ``(accepted, proposed)`` so the caller
   has one commit path.

Three of them are whole-batch tensor code that the serving round calls as they are
(``ddtree_worker_v2``): :func:`target_probs_from_logits` and
:func:`reference_tree_speculative_sampling` (the target distribution and the
pure-torch twin of the kernel, the sampler where the kernel is absent) and
:func:`min_p_renorm_probs` (the min-p filter applied to the kernel path's
distribution).
"""

from __future__ import annotations

import array
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch

__all__ = [
    "DDTree",
    "build_ddtree_tree_from_topk",
    "compile_ddtree_retrieve",
    "tree_attention_mask",
    "tree_positions",
    "follow_verified_tree",
    "target_probs_from_logits",
    "min_p_renorm_probs",
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


def _to_tensor(values: array.array, dtype: torch.dtype) -> torch.Tensor:
    """A filled ``array`` as a tensor without a per-element conversion: ``torch.tensor``
    on a python list costs ~0.1 us per element, a buffer view costs nothing per element
    (the tensor keeps the array alive)."""
    if len(values) == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(values, dtype=dtype)


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

    # Row b as compile_ddtree_retrieve(..., offset=b*N) gives it; past a tree both
    # pointers stay -1, so the kernel can never try (or accept) a padding node.
    r_index = torch.arange(bs * n, dtype=torch.int64).reshape(bs, n)
    r_next = torch.full((bs, n), -1, dtype=torch.int64)
    r_sib = torch.full((bs, n), -1, dtype=torch.int64)
    for b, tree in enumerate(trees):
        _, nxt, sib = compile_ddtree_retrieve(tree.parents, tree.node_logws)
        r_next[b, : len(tree)] = nxt
        r_sib[b, : len(tree)] = sib
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
