"""Checks of the DDTree bundle inside one real SGLang 0.5.23 interpreter (no server).

Run by ``test_ddtree_inprocess.py`` with the interpreter of a prefix the bundle was
deployed into; prints one JSON object, a result per check. Each check names the SGLang
code it runs against; nothing of SGLang is replaced except where a check injects the
fault it is about.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace


def target_laws() -> dict:
    """The worker's two target-probability paths (kernel branch: SGLang's
    ``build_speculative_verify_target_probs`` then the bundle's min-p filter; reference
    branch: ``ddtree_reference.target_probs_from_logits``) against each other, and against
    SGLang's own torch sampler (``top_k_top_p_min_p_sampling_from_probs_torch``,
    srt/layers/sampler.py, with its filtered probabilities) where the two sampler
    backends agree (top-p 1: the torch backend applies top-p before the top-k renorm,
    FlashInfer's, which the verifier follows, after it)."""
    import torch
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch
    from sglang.srt.speculative import ddtree_reference
    from sglang.srt.speculative.dflash_utils import build_speculative_verify_target_probs

    gen = torch.Generator().manual_seed(0)
    bs, n, vocab = 6, 5, 97
    logits = torch.randn((bs * n, vocab), generator=gen) * 3
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.9, 1.0])
    top_ks = torch.tensor([5, 20, 97, 8, 3, 50])
    top_ps = torch.tensor([1.0, 0.9, 0.8, 1.0, 1.0, 0.95])
    min_ps = torch.tensor([0.3, 0.05, 0.2, 0.0, 0.6, 0.1])
    info = SimpleNamespace(
        temperatures=temps.view(bs, 1), top_ks=top_ks, top_ps=top_ps, min_ps=min_ps,
        need_top_k_sampling=True, need_top_p_sampling=True, need_min_p_sampling=True,
    )
    kernel = build_speculative_verify_target_probs(
        next_token_logits=logits, sampling_info=info, draft_token_num=n, bs=bs,
        max_top_k=int(top_ks.max()), uniform_top_k_value=None,
    )
    kernel = ddtree_reference.min_p_renorm_probs(kernel, min_ps.view(bs, 1)).view(bs * n, vocab)
    reference = ddtree_reference.target_probs_from_logits(
        logits, temps.repeat_interleave(n), top_ks.repeat_interleave(n),
        top_ps.repeat_interleave(n), min_ps.repeat_interleave(n),
    )
    rows_p1 = (top_ps == 1.0).repeat_interleave(n)
    scaled = torch.softmax(logits / temps.repeat_interleave(n).view(-1, 1), dim=-1)[rows_p1]
    _, filtered, idx, _ = top_k_top_p_min_p_sampling_from_probs_torch(
        scaled.clone(), top_ks.repeat_interleave(n)[rows_p1], top_ps.repeat_interleave(n)[rows_p1],
        min_ps.repeat_interleave(n)[rows_p1], True, None, None, return_filtered_probs=True,
    )
    sglang = torch.zeros_like(scaled).scatter_(1, idx.long(), filtered)
    sglang = sglang / sglang.sum(dim=-1, keepdim=True)
    return {
        "kernel_vs_reference_max_abs": float((kernel - reference).abs().max()),
        "kernel_vs_reference_support_equal": bool(((kernel > 0) == (reference > 0)).all()),
        "kernel_vs_sglang_sampler_max_abs": float((kernel[rows_p1] - sglang).abs().max()),
        "kernel_vs_sglang_sampler_support_equal": bool(((kernel[rows_p1] > 0) == (sglang > 0)).all()),
        "min_p_removed_tokens": int(
            ((ddtree_reference.target_probs_from_logits(
                logits, temps.repeat_interleave(n), top_ks.repeat_interleave(n), top_ps.repeat_interleave(n)
            ) > 0) & (reference == 0)).sum()
        ),
    }


def context_end() -> dict:
    """``ddtree_plugin.context_end_error`` for a block-16 draft at budget 16 (depth 15,
    window 17) in a 2048-token context whose req_to_token rows hold 2048 + 4 + 17 slots."""
    from sglang.srt.speculative import ddtree_plugin

    ddtree_plugin.set_round_shape(ddtree_plugin.RoundShape(context_len=2048, row_len=2069, window=17, max_depth=15))

    def req(prompt: int, max_new):
        return SimpleNamespace(origin_input_ids=[7] * prompt, sampling_params=SimpleNamespace(max_new_tokens=max_new))

    return {
        "fits": ddtree_plugin.context_end_error(req(2000, 38), True),
        "one_over": ddtree_plugin.context_end_error(req(2000, 39), True),
        "capped_by_sglang": ddtree_plugin.context_end_error(req(2040, None), True),
        "no_overlap": ddtree_plugin.context_end_error(req(2040, 8), False),
    }


def per_node_refusals() -> dict:
    """``ddtree_plugin.ddtree_request_error`` on SGLang's own ``Req``: a request with a
    custom logit processor (served only with --enable-custom-logit-processor, so not sent
    to the test servers) is refused like the penalties are, a plain one is not."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative import ddtree_plugin

    def req(**kw):
        params = SamplingParams(max_new_tokens=4, temperature=0.0)
        params.normalize(None)
        return Req("r", "", array("l", [5, 6, 7]), params, **kw)

    def long(prompt: int, max_new: int):
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
        params.normalize(None)
        return Req("r", "", array("l", [7] * prompt), params)

    # The round shape context_end() sets: the overlap scheduler's last round must fit.
    ddtree_plugin.set_round_shape(ddtree_plugin.RoundShape(context_len=2048, row_len=2069, window=17, max_depth=15))
    return {
        "custom_logit_processor": ddtree_plugin.ddtree_request_error(
            req(custom_logit_processor=DisallowedTokensLogitsProcessor().to_str())
        ),
        "plain": ddtree_plugin.ddtree_request_error(req()),
        "context_end_overlap": ddtree_plugin.ddtree_request_error(long(2000, 39), True),
    }


# (budget, depth, k): the worker's tree shapes (depth = draft block - 1, budget up to the
# 256-node cap) and the builder's edge paths: fewer nodes than the budget (padding), a
# depth no node fits (the frontier plan stops early), rows long enough for the
# two-``topk`` selection, and no candidates at all.
TREE_SHAPES = [(4, 7, 4), (16, 7, 4), (64, 15, 4), (16, 15, 8), (255, 15, 16), (200, 3, 8), (16, 1, 2),
               (2, 7, 1), (40, 3, 3), (8, 0, 4), (8, 3, 0)]


def tree_builder() -> dict:
    """The worker's batched builder (``ddtree_utils.build_tree_batch``, on device in one
    pass) against the best-first heap (``build_ddtree_tree_from_topk``, per request)
    over the worker's shapes, with tied log-probs: the same nodes in the same order."""
    import torch
    from sglang.srt.speculative import ddtree_reference, ddtree_utils

    gen = torch.Generator().manual_seed(24)
    mismatches, trees = [], 0
    for budget, depth, k in TREE_SHAPES:
        bs = 3
        # Quantized log-probs: many exact ties, which the key order must break alike.
        raw = torch.log_softmax(torch.randn(bs, depth, max(k, 1), generator=gen) * 2, dim=-1)
        lps = (raw * 4).round() / 4
        lps = lps.sort(dim=-1, descending=True).values[..., :k].clamp(max=0.0)
        ids = torch.randint(4, 500, (bs, depth, k), generator=gen)
        roots = torch.randint(4, 500, (bs,), generator=gen)
        batch = ddtree_utils.build_tree_batch(ids, lps, budget, roots)
        assert batch.num_nodes == budget + 1
        for b in range(bs):
            want = ddtree_reference.build_ddtree_tree_from_topk(ids[b], lps[b], budget, int(roots[b]))
            m = len(want)
            got = (batch.tokens[b, :m].tolist(), batch.parents[b, :m].tolist(), batch.depths[b, :m].tolist(),
                   batch.logws[b, :m].tolist(), int(batch.valid[b].sum()))
            if got != (want.token_ids, want.parents, want.depths, want.node_logws, m):
                mismatches.append([budget, depth, k, b])
            trees += 1
    return {"trees": trees, "mismatches": mismatches}


def kernel_row_chunks() -> dict:
    """The worker's call of ``tree_speculative_sampling_target_only``
    (``ddtree_utils.sample_tree_in_row_chunks``) with the kernel's offset limit lowered, so
    that a small batch is split: through the test-only stand-in bound where
    ``verify_sampling.py`` binds the op on CUDA (its entry checks: shapes bound across the
    chunk's tensors, contiguity, one device), against one unchunked call on identical
    coins -- every request's accepted path, count and emitted tokens equal."""
    import torch
    from sglang.kernels.ops.speculative import verify_sampling
    from sglang.srt.speculative import ddtree_reference, ddtree_utils
    from sglang_cpu_standins.sampling import provide_tree_sampling_kernel

    provide_tree_sampling_kernel()
    kernel = verify_sampling.tree_speculative_sampling_target_only
    calls = []

    def counted(**kw):
        calls.append(int(kw["candidates"].shape[0]))
        kernel(**kw)

    gen = torch.Generator().manual_seed(55)
    bs, budget, k, vocab = 7, 16, 4, 257
    n = budget + 1
    base = torch.randn(bs, 16, vocab, generator=gen) * 3
    top = torch.log_softmax(base[:, :15] + torch.randn(bs, 15, vocab, generator=gen) * 0.5, dim=-1).topk(k, dim=-1)
    roots = torch.randint(0, vocab, (bs,), generator=gen)
    trees = ddtree_utils.build_tree_batch(top.indices, top.values, budget, roots)
    logits = torch.gather(base, 1, trees.depths.clamp(max=15).unsqueeze(2).expand(bs, n, vocab))
    probs = ddtree_reference.target_probs_from_logits(logits.reshape(bs * n, vocab), 0.8, 50, 0.95, 0.0)
    probs = probs.view(bs, n, vocab).contiguous()
    retrieve = ddtree_utils.tree_retrieve_batch(trees)
    coins, final = torch.rand((bs, n), generator=gen), torch.rand((bs,), generator=gen)

    def run(limit: int) -> dict:
        out = {
            "predicts": torch.zeros((bs * n,), dtype=torch.int32),
            "accept_index": torch.full((bs, trees.max_depth + 1), -1, dtype=torch.int32),
            "accept_token_num": torch.zeros((bs,), dtype=torch.int32),
        }
        calls.clear()
        ddtree_utils.sample_tree_in_row_chunks(
            counted, **out, candidates=trees.tokens, retrive_index=retrieve[0], retrive_next_token=retrieve[1],
            retrive_next_sibling=retrieve[2], uniform_samples=coins, uniform_samples_for_final_sampling=final,
            target_probs=probs, draft_probs=torch.zeros_like(probs), threshold_single=1.0, threshold_acc=1.0,
            deterministic=True, limit=limit)
        paths = ddtree_utils.accepted_paths_from_kernel(out["accept_index"], out["accept_token_num"],
                                                        out["predicts"], n)
        return {"calls": list(calls), "accept_index": out["accept_index"].tolist(),
                "accept_token_num": out["accept_token_num"].tolist(),
                "tokens": [paths.tokens[b, : int(paths.commit_lens[b])].tolist() for b in range(bs)]}

    whole = run(ddtree_utils.KERNEL_PROB_OFFSET_LIMIT)
    # 3 rows per call (3 * 17 * 257 < limit <= 4 * 17 * 257): chunks of 3, 3, 1.
    chunked = run(3 * n * vocab + 1)
    try:
        run(n * vocab)  # not even one row fits
        too_wide = None
    except ValueError as exc:
        too_wide = str(exc)
    return {"whole": whole, "chunked": chunked, "too_wide": too_wide}


def broken_hook() -> dict:
    """A hook that HookRegistry fails to apply (it logs the exception and carries on,
    srt/plugins/hook_registry.py ``apply_hooks``): the worker's start-up check refuses."""
    from sglang.srt.plugins import hook_registry

    target = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info"
    real_apply = hook_registry.HookRegistry._apply_target.__func__

    def failing(cls, name, hooks):
        if name == target:
            raise RuntimeError("injected: this hook cannot be applied")
        return real_apply(cls, name, hooks)

    hook_registry.HookRegistry._apply_target = classmethod(failing)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.speculative import ddtree_plugin

    try:
        ddtree_plugin.verify_hooks()
    except Exception as exc:  # the check's own error type and message
        return {"refused": True, "type": type(exc).__name__, "message": str(exc)}
    return {"refused": False}


CHECKS = {
    "target_laws": target_laws,
    "context_end": context_end,
    "per_node_refusals": per_node_refusals,
    "tree_builder": tree_builder,
    "broken_hook": broken_hook,
    "kernel_row_chunks": kernel_row_chunks,
}

if __name__ == "__main__":
    # Every module of the bundle, imported before the checks: under the real-server
    # lane's coverage this is where their module-level lines are measured (a server's
    # scheduler loads the plugin's modules before it starts measuring).
    from sglang.srt.speculative import (  # noqa: F401
        ddtree_info,
        ddtree_plugin,
        ddtree_reference,
        ddtree_registration,
        ddtree_utils,
        ddtree_worker_v2,
    )

    print(json.dumps({name: CHECKS[name]() for name in sys.argv[1:]}))
