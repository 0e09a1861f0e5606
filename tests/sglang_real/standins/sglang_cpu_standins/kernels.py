"""Pure-PyTorch stand-ins for sgl_kernel CPU ops the CUDA-only wheel lacks (TEST-ONLY).

sglang-kernel 0.4.10 from PyPI is a CUDA build: its Python wrappers for the ``*_cpu`` ops
exist (sgl_kernel/speculative.py, sgl_kernel/kvcacheio.py) but the ops themselves
(``torch.ops.sgl_kernel.*_cpu``) are not compiled in. SGLang calls them on device cpu
(``_is_cpu`` branches). Each function below replaces one wrapper (HookRegistry REPLACE on
``sgl_kernel.speculative.<name>``; the registry also rebinds every ``from sgl_kernel import
<name>`` copy) with a plain-PyTorch loop that does exactly what the Triton kernel SGLang
uses on GPUs does. They only move KV-cache slot indices around (bookkeeping); no model
arithmetic happens here.
"""

from __future__ import annotations

import torch


def _req_spans(start_offset: torch.Tensor, end_offset: torch.Tensor):
    """(request i, start, end, offset of its span in the packed out_cache_loc)."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    packed = 0
    for i, (s, e) in enumerate(zip(starts, ends, strict=True)):
        n = max(int(e) - int(s), 0)
        yield i, int(s), int(e), packed
        packed += n


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[packed span i]``.

    Replaces ``sgl_kernel.speculative.assign_req_to_token_pool_cpu`` (missing op), called from
    ``assign_req_to_token_pool_func`` (srt/mem_cache/allocation.py:737-755) when a speculative
    decode step allocates its draft slots. GPU twin: the Triton kernel
    ``assign_req_to_token_pool`` (allocation.py:691-723).
    """
    rows = req_pool_indices.tolist()
    for i, s, e, packed in _req_spans(start_offset, end_offset):
        if e > s:
            req_to_token[int(rows[i]), s:e] = out_cache_loc[packed : packed + (e - s)].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``out_cache_loc[packed span i] = req_to_token[req_pool_indices[i], start[i]:end[i]]``.

    Replaces ``sgl_kernel.speculative.assign_extend_cache_locs_cpu`` (missing op), called from
    ``assign_extend_cache_locs_func`` / ``fill_front_out_cache_loc_func``
    (kernels/ops/speculative/cache_locs.py:679-776). GPU twin: the Triton kernel
    ``assign_extend_cache_locs`` (cache_locs.py:500-531).
    """
    rows = req_pool_indices.tolist()
    for i, s, e, packed in _req_spans(start_offset, end_offset):
        if e > s:
            out_cache_loc[packed : packed + (e - s)] = req_to_token[int(rows[i]), s:e].to(out_cache_loc.dtype)


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
) -> None:
    """``accept_out_cache_loc[:k] = out_cache_loc[accepted entries of accept_index]`` (-1 skipped).

    Replaces ``sgl_kernel.speculative.fill_accept_out_cache_loc_cpu`` (missing op), called
    from ``fill_accept_out_cache_loc_func`` (kernels/ops/speculative/eagle.py:73-91) when a
    tree commit moves the accepted nodes' KV to the front of the verify window
    (``move_accept_tokens_to_target_kvcache``, srt/speculative/spec_utils.py). GPU twin: the
    Triton kernel ``fill_accept_out_cache_loc`` (eagle.py:57-70): entry ``pid`` goes to the
    count of non-(-1) entries before it.
    """
    flat = accept_index.reshape(-1).to(torch.int64)
    picked = out_cache_loc[flat[flat != -1]]
    accept_out_cache_loc[: picked.numel()] = picked.to(accept_out_cache_loc.dtype)


# name in sgl_kernel.speculative -> stand-in
REPLACEMENTS = {
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    "assign_extend_cache_locs_cpu": assign_extend_cache_locs_cpu,
    "fill_accept_out_cache_loc_cpu": fill_accept_out_cache_loc_cpu,
}
