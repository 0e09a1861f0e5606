"""Spec inputs of DDTREE: the tree verify input and the draft state between rounds.

A DDTREE round drafts one DFlash block of ``block_size`` positions and then verifies
a tree of ``N = budget + 1`` tokens (the root, i.e. the last committed token, and
``budget`` nodes) in one ``TARGET_VERIFY`` forward. Each node sits at the position
of its depth and attends to the committed prefix and to its own ancestors only,
which the attention backends read from ``custom_mask`` in the layout EAGLE's tree
verify uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.mem_cache.allocation import alloc_for_spec_decode
from sglang.srt.mem_cache.allocation_sizing import get_alloc_reserve_per_decode
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.dflash_info_v2 import (
    DFlashDraftInputV2,
    _get_overlap_plan_stream,
)


@dataclass
class DDTreeVerifyInput(DFlashVerifyInput):
    """A DFlash verify input whose tokens form a tree.

    It shares DFlash's verify plumbing (``prepare_for_verify``, the CSR arguments
    and mask padding of ``generate_attn_arg_prefill``) and differs in what it
    carries: ``custom_mask`` is always set (the ancestor-only tree mask), ``topk``
    is the tree's branching factor (backends that gate tree metadata on
    ``topk > 1``, like FA3, then take their tree path), and the three retrieve
    tensors are the first-child / next-sibling encoding that
    ``tree_speculative_sampling_target_only`` walks (``None`` when every request
    is greedy: the greedy walk needs the parent array alone).
    """

    retrieve_index: Optional[torch.Tensor] = None
    retrieve_next_token: Optional[torch.Tensor] = None
    retrieve_next_sibling: Optional[torch.Tensor] = None


def decode_alloc_lens(reqs, *, reserve: int, row_len: int):
    """``page_aligned_decode_alloc_lens`` (``mem_cache/allocation_sizing.py``) at page
    size 1 (DDTREE's only one), with each request's reservation capped at its
    ``req_to_token`` row.

    The reserve is twice the round's window (the overlap scheduler's double buffer),
    but a row holds only ``context_len + 4 + window`` slots
    (``get_req_to_token_extra_context_len``): near the context end an uncapped
    reservation writes past the row (an index error on CPU, another request's row on
    a GPU). A round reads and writes ``window`` slots from its committed length,
    which admission keeps at most ``context_len - 2`` while the request runs, so the
    cap never takes a slot a round uses; the round an overlap scheduler still runs
    after a request finished is bounded at admission
    (``ddtree_plugin.context_end_error``).
    """
    cur_kv_lens = [0] * len(reqs)
    nxt_kv_lens = [0] * len(reqs)
    num_needed_tokens = 0
    for i, r in enumerate(reqs):
        cur = r.kv.kv_allocated_len
        nxt = max(cur, min(r.kv.kv_committed_len + reserve, row_len))
        cur_kv_lens[i] = cur
        nxt_kv_lens[i] = nxt
        num_needed_tokens += nxt - cur
    return cur_kv_lens, nxt_kv_lens, num_needed_tokens


@dataclass
class DDTreeDraftInputV2(DFlashDraftInputV2):
    """DFlash's draft state, reserving KV for the wider of the draft block and the
    verify window.

    A DDTREE round writes ``block_size`` draft slots and ``budget + 1`` verify slots
    from the committed prefix on, so each decode step needs
    ``max(block_size, budget + 1)`` slots (``max_speculative_num_draft_tokens``),
    where DFlash, whose two windows coincide, reserves for
    ``speculative_num_draft_tokens``. ``prepare_for_decode`` is DFlash's with that
    number changed and the reservation capped at the request's row
    (:func:`decode_alloc_lens`); the rest is identical.
    """

    def prepare_for_decode(self, batch: ScheduleBatch):
        plan_stream, plan_stream_ctx = _get_overlap_plan_stream(batch.device)

        bs = batch.batch_size()
        if bs == 0:
            return

        batch.maybe_evict_swa()

        self._ensure_prepare_length_buffers(bs, batch.device)
        assert self._prepare_batch_seq_lens_cpu_buf is not None
        assert self._prepare_cur_kv_lens_cpu_buf is not None
        assert self._prepare_nxt_kv_lens_cpu_buf is not None
        assert self._prepare_cur_kv_lens_gpu_buf is not None
        assert self._prepare_nxt_kv_lens_gpu_buf is not None
        batch_seq_lens_cpu_t = self._prepare_batch_seq_lens_cpu_buf[:bs]
        cur_kv_lens_cpu_t = self._prepare_cur_kv_lens_cpu_buf[:bs]
        nxt_kv_lens_cpu_t = self._prepare_nxt_kv_lens_cpu_buf[:bs]

        cur_kv_lens, nxt_kv_lens, num_needed_tokens = decode_alloc_lens(
            batch.reqs,
            reserve=get_alloc_reserve_per_decode(),
            row_len=int(batch.req_to_token_pool.req_to_token.shape[1]),
        )

        max_top_k = 1
        uniform_top_k_value = None
        uniform_top_k = True
        nxt_kv_lens_sum = 0
        committed_seq_lens_sum = 0
        for i, (req, cur, nxt) in enumerate(zip(batch.reqs, cur_kv_lens, nxt_kv_lens)):
            committed_len = int(req.kv.kv_committed_len)
            committed_seq_lens_sum += committed_len
            top_k = int(req.sampling_params.top_k)

            batch_seq_lens_cpu_t[i] = committed_len
            cur_kv_lens_cpu_t[i] = cur
            nxt_kv_lens_cpu_t[i] = nxt

            nxt_kv_lens_sum += nxt
            if top_k > max_top_k:
                max_top_k = top_k
            if i == 0:
                uniform_top_k_value = top_k
            elif uniform_top_k and top_k != uniform_top_k_value:
                uniform_top_k = False

        self.max_top_k = max(max_top_k, 1)
        self.uniform_top_k_value = uniform_top_k_value if uniform_top_k else None

        caller_stream = None
        if plan_stream is not None:
            caller_stream = torch.get_device_module(batch.device).current_stream()

        with plan_stream_ctx:
            if plan_stream is not None and caller_stream is not None:
                plan_stream.wait_stream(caller_stream)

            cur_kv_lens = self._prepare_cur_kv_lens_gpu_buf[:bs]
            nxt_kv_lens = self._prepare_nxt_kv_lens_gpu_buf[:bs]
            cur_kv_lens.copy_(cur_kv_lens_cpu_t, non_blocking=True)
            nxt_kv_lens.copy_(nxt_kv_lens_cpu_t, non_blocking=True)

            alloc_for_spec_decode(
                batch.tree_cache,
                batch.req_to_token_pool,
                reqs=batch.reqs,
                req_pool_indices=batch.req_pool_indices,
                cur_kv_lens=cur_kv_lens,
                cur_kv_lens_cpu=cur_kv_lens_cpu_t,
                nxt_kv_lens=nxt_kv_lens,
                nxt_kv_lens_cpu=nxt_kv_lens_cpu_t,
                num_needed_tokens=num_needed_tokens,
                batch=batch,
            )
        if caller_stream is not None:
            caller_stream.wait_stream(plan_stream)
        for req in batch.reqs:
            req.decode_batch_idx += 1
        batch.seq_lens_cpu = batch_seq_lens_cpu_t
        batch.seq_lens_sum = committed_seq_lens_sum
        self.nxt_kv_lens_cpu = nxt_kv_lens_cpu_t
        self.nxt_kv_lens_sum = nxt_kv_lens_sum


def make_ddtree_draft_input(
    *, bonus_tokens: torch.Tensor, new_seq_lens: torch.Tensor
) -> DDTreeDraftInputV2:
    """The draft state after a round: DFlash's fields, DDTREE's reservation."""
    bs = int(new_seq_lens.numel())
    device = bonus_tokens.device
    return DDTreeDraftInputV2(
        topk_p=torch.empty((bs, 0), device=device, dtype=torch.float32),
        topk_index=torch.empty((bs, 0), device=device, dtype=torch.int64),
        bonus_tokens=bonus_tokens.to(dtype=torch.int64),
        new_seq_lens=new_seq_lens.to(dtype=torch.int64),
        hidden_states=torch.empty((bs, 0), device=device, dtype=torch.float16),
    )
