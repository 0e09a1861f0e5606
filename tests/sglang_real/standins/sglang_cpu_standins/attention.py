"""TARGET_VERIFY for SGLang's torch_native attention backend (TEST-ONLY stand-in).

Why: ``TorchNativeAttnBackend`` (srt/layers/attention/torch_native_backend.py) has no
target-verify path. ``AttentionBackend.forward`` sends every non-decode mode to
``forward_extend`` (srt/layers/attention/base_attn_backend.py:332-363), whose extend
bookkeeping (``extend_prefix_lens`` / ``extend_seq_lens``, torch_native_backend.py:101-102,
312-327) is None in TARGET_VERIFY. Speculative decoding runs TARGET_VERIFY twice per step:
the target verifies the N draft tokens, and a DFlash draft runs its block of N tokens
(dflash_worker_v2.py:2638-2688).

What it computes, per request ``i`` with committed prefix length ``P_i``
(``forward_batch.seq_lens`` in TARGET_VERIFY) and N = tokens per request:

* the queries are the N verify tokens at positions ``P_i .. P_i+N-1``, appended after the
  prefix; their K/V are first written at ``forward_batch.out_cache_loc`` exactly as
  ``forward_extend`` writes them (``set_kv_buffer`` with ``KVWriteLoc``);
* keys/values are ``req_to_token[req_pool_indices[i], :P_i+N]`` (prefix, then the block);
* the mask is ``spec_info.custom_mask`` when it is not None: a flat bool tensor holding per
  request a row-major ``[N, P_i+N]`` block (True = may attend), requests concatenated (the
  FULL_MASK layout, srt/speculative/eagle_utils.py / kernels/ops/speculative/spec_tree.py);
  it must hold at least ``sum_i N*(P_i+N)`` entries (the rest is not read) or this raises. Without a mask, a layer of
  type ENCODER_ONLY (the DFlash draft: non-causal inside its block) sees the whole prefix and
  the whole block; any other layer is causal (whole prefix, lower triangle in the block).

It uses the same ``scaled_dot_product_attention`` call as the backend's extend/decode paths.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention


class VerifyMaskError(ValueError):
    """A custom verify mask that does not fit the batch."""


def _tokens_per_request(q_tokens: int, batch_size: int, spec_info) -> int:
    if batch_size <= 0 or q_tokens % batch_size != 0:
        raise ValueError(f"TARGET_VERIFY: {q_tokens} query tokens do not split over {batch_size} requests")
    n = q_tokens // batch_size
    declared = getattr(spec_info, "draft_token_num", None)
    if declared is not None and int(declared) > 0 and int(declared) != n:
        raise ValueError(f"TARGET_VERIFY: {n} tokens per request, but spec_info.draft_token_num={declared}")
    return n


def verify_masks(prefix_lens: list[int], n: int, custom_mask, encoder_only: bool, device) -> list:
    """One ``[N, P+N]`` bool mask per request (None = everything visible)."""
    if custom_mask is not None:
        if custom_mask.dtype != torch.bool or custom_mask.dim() != 1:
            raise VerifyMaskError(
                "custom_mask must be a flat bool tensor, got"
                f" dtype={custom_mask.dtype} shape={tuple(custom_mask.shape)}"
            )
        expected = sum(n * (p + n) for p in prefix_lens)
        # Like the GPU backends (which index the mask through offsets of their own), a
        # mask may be longer than the batch needs: callers size it from host-side upper
        # bounds of the prefix lengths. Shorter is a bug.
        if custom_mask.numel() < expected:
            raise VerifyMaskError(
                f"custom_mask has {custom_mask.numel()} entries; prefix lens {prefix_lens} with "
                f"{n} verify tokens each need sum(N*(P+N)) = {expected}"
            )
        masks, off = [], 0
        for p in prefix_lens:
            m = custom_mask[off : off + n * (p + n)].view(n, p + n)
            off += n * (p + n)
            if not bool(m.any(dim=1).all()):
                raise VerifyMaskError("custom_mask has a query row that may attend to nothing")
            masks.append(m)
        return masks
    if encoder_only:
        return [None] * len(prefix_lens)
    masks = []
    tri = torch.ones((n, n), dtype=torch.bool, device=device).tril()
    for p in prefix_lens:
        m = torch.ones((n, p + n), dtype=torch.bool, device=device)
        m[:, p:] = tri
        masks.append(m)
    return masks


def verify_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    pool_rows: list[int],
    prefix_lens: list[int],
    masks: list,
    *,
    scaling: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """``out[i*N:(i+1)*N] = SDPA(q of request i, K/V of its P_i+N slots, mask i)``.

    q/out: [bs*N, heads, dim]; k_cache/v_cache: [slots, kv_heads, dim];
    ``masks`` from :func:`verify_masks`.
    """
    bs = len(prefix_lens)
    n = q.shape[0] // bs if bs else 0
    for i, (p, row, mask) in enumerate(zip(prefix_lens, pool_rows, masks, strict=True)):
        slots = req_to_token[row, : p + n]
        # [tokens, heads, dim] -> [heads, tokens, dim]
        query = q[i * n : (i + 1) * n].movedim(0, 1)
        key = k_cache[slots].movedim(0, 1)
        value = v_cache[slots].movedim(0, 1)
        if not (query.dtype == key.dtype == value.dtype):
            key, value = key.to(query.dtype), value.to(query.dtype)
        res = scaled_dot_product_attention(
            query.unsqueeze(0),
            key.unsqueeze(0),
            value.unsqueeze(0),
            attn_mask=mask,
            enable_gqa=enable_gqa,
            scale=scaling,
            is_causal=False,
        )
        out[i * n : (i + 1) * n] = res.squeeze(0).movedim(0, 1)
    return out


def forward_extend_with_target_verify(original, self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    """AROUND ``TorchNativeAttnBackend.forward_extend``: add TARGET_VERIFY (see module doc)."""
    if not forward_batch.forward_mode.is_target_verify():
        return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if kwargs:
        raise NotImplementedError(f"torch_native TARGET_VERIFY stand-in: unsupported arguments {sorted(kwargs)}")
    if layer.is_cross_attention:
        raise NotImplementedError("torch_native TARGET_VERIFY stand-in: cross attention")
    if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
        raise NotImplementedError("torch_native TARGET_VERIFY stand-in: sliding-window layers")
    if forward_batch.encoder_lens is not None:
        raise NotImplementedError("torch_native TARGET_VERIFY stand-in: encoder-decoder models")

    if layer.qk_head_dim != layer.v_head_dim:
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
    else:
        o = torch.empty_like(q)

    # Same KV write as forward_extend (torch_native_backend.py:298-301).
    if save_kv_cache and k is not None and v is not None:
        self.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
        )

    q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
    o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
    bs = int(forward_batch.batch_size)
    spec_info = forward_batch.spec_info
    n = _tokens_per_request(q_.shape[0], bs, spec_info)
    from . import ddtree

    ddtree.record_width("draft" if layer.attn_type == AttentionType.ENCODER_ONLY else "target", n)
    if layer.layer_id == 0:
        ddtree.record_mask(spec_info, forward_batch, n, bs)
    prefix_lens = [int(x) for x in forward_batch.seq_lens[:bs].tolist()]
    pool_rows = [int(x) for x in forward_batch.req_pool_indices[:bs].tolist()]
    masks = verify_masks(
        prefix_lens,
        n,
        getattr(spec_info, "custom_mask", None) if spec_info is not None else None,
        layer.attn_type == AttentionType.ENCODER_ONLY,
        q.device,
    )

    verify_attention(
        q_,
        o_,
        self.token_to_kv_pool.get_key_buffer(layer.layer_id),
        self.token_to_kv_pool.get_value_buffer(layer.layer_id),
        self.req_to_token_pool.req_to_token,
        pool_rows,
        prefix_lens,
        masks,
        scaling=layer.scaling,
        enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
    )
    return o
