"""The TARGET_VERIFY stand-in of the CPU test plugin (standins/.../attention.py), against a
naive reference: per-request masks (causal, non-causal DFlash block, custom FULL_MASK trees),
the KV slot range, GQA, and the strictness of the custom-mask checks.

Needs only torch (the project's own CPU torch is enough), not SGLang: the module's
SGLang-facing hook is exercised end to end by test_real_server_smoke.py.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

_PATH = Path(__file__).parent / "standins" / "sglang_cpu_standins" / "attention.py"
_spec = importlib.util.spec_from_file_location("_standin_attention_under_test", _PATH)
att = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(att)

HQ, HK, D = 4, 2, 8


def reference(q, k_cache, v_cache, req_to_token, rows, prefix_lens, n, allowed):
    """Plain softmax attention; ``allowed(i, p) -> [n, p+n] bool``."""
    out = torch.empty_like(q)
    for i, (row, p) in enumerate(zip(rows, prefix_lens, strict=True)):
        slots = req_to_token[row, : p + n]
        mask = allowed(i, p)
        for h in range(HQ):
            kh = h // (HQ // HK)
            qi = q[i * n : (i + 1) * n, h]  # [n, D]
            scores = qi @ k_cache[slots, kh].T / math.sqrt(D)  # [n, p+n]
            scores = scores.masked_fill(~mask, float("-inf"))
            out[i * n : (i + 1) * n, h] = scores.softmax(-1) @ v_cache[slots, kh]
    return out


def batch(prefix_lens, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots_total = 64
    k_cache = torch.randn(slots_total, HK, D, generator=g, dtype=torch.float64)
    v_cache = torch.randn(slots_total, HK, D, generator=g, dtype=torch.float64)
    q = torch.randn(len(prefix_lens) * n, HQ, D, generator=g, dtype=torch.float64)
    # Scattered, non-contiguous slots per request; pool rows not in batch order.
    req_to_token = torch.zeros(8, 32, dtype=torch.int64)
    perm = torch.randperm(slots_total, generator=g)
    rows = [5, 2, 7][: len(prefix_lens)]
    used = 0
    for row, p in zip(rows, prefix_lens, strict=True):
        req_to_token[row, : p + n] = perm[used : used + p + n]
        used += p + n
    return q, k_cache, v_cache, req_to_token, rows


def causal(n):
    def allowed(i, p):
        m = torch.ones(n, p + n, dtype=torch.bool)
        m[:, p:] = torch.ones(n, n, dtype=torch.bool).tril()
        return m

    return allowed


def run(q, k_cache, v_cache, req_to_token, rows, prefix_lens, masks):
    out = torch.empty_like(q)
    return att.verify_attention(
        q, out, k_cache, v_cache, req_to_token, rows, prefix_lens, masks, scaling=None, enable_gqa=True
    )


PREFIXES = [3, 0, 9]  # different lengths, one request with no committed prefix yet
N = 4


def test_causal_default_matches_reference():
    q, kc, vc, r2t, rows = batch(PREFIXES, N)
    masks = att.verify_masks(PREFIXES, N, None, encoder_only=False, device="cpu")
    got = run(q, kc, vc, r2t, rows, PREFIXES, masks)
    torch.testing.assert_close(got, reference(q, kc, vc, r2t, rows, PREFIXES, N, causal(N)))


def test_encoder_only_block_sees_everything():
    q, kc, vc, r2t, rows = batch(PREFIXES, N, seed=1)
    masks = att.verify_masks(PREFIXES, N, None, encoder_only=True, device="cpu")
    assert masks == [None] * len(PREFIXES)
    got = run(q, kc, vc, r2t, rows, PREFIXES, masks)
    want = reference(q, kc, vc, r2t, rows, PREFIXES, N, lambda i, p: torch.ones(N, p + N, dtype=torch.bool))
    torch.testing.assert_close(got, want)


def flat(per_request):
    return torch.cat([m.reshape(-1) for m in per_request])


def test_custom_mask_equal_to_causal_gives_causal():
    q, kc, vc, r2t, rows = batch(PREFIXES, N, seed=2)
    mask = flat([causal(N)(i, p) for i, p in enumerate(PREFIXES)])
    got = run(q, kc, vc, r2t, rows, PREFIXES, att.verify_masks(PREFIXES, N, mask, False, "cpu"))
    want = run(q, kc, vc, r2t, rows, PREFIXES, att.verify_masks(PREFIXES, N, None, False, "cpu"))
    torch.testing.assert_close(got, want)


def test_custom_tree_mask_is_used_as_given_and_overrides_encoder_only():
    # A tree over the block: root 0; 1 and 2 children of 0; 3 child of 1. Each request gets a
    # different prefix visibility pattern, to catch any mix-up of request offsets.
    parents = {0: None, 1: 0, 2: 0, 3: 1}

    def tree(i, p):
        m = torch.zeros(N, p + N, dtype=torch.bool)
        m[:, : p] = True
        if p:
            m[:, i % p] = False  # hide one prefix key (never all of them)
        for node in range(N):
            a = node
            while a is not None:
                m[node, p + a] = True
                a = parents[a]
        return m

    q, kc, vc, r2t, rows = batch(PREFIXES, N, seed=3)
    mask = flat([tree(i, p) for i, p in enumerate(PREFIXES)])
    for encoder_only in (False, True):
        got = run(q, kc, vc, r2t, rows, PREFIXES, att.verify_masks(PREFIXES, N, mask, encoder_only, "cpu"))
        torch.testing.assert_close(got, reference(q, kc, vc, r2t, rows, PREFIXES, N, tree))


@pytest.mark.parametrize(
    "mask, message",
    [
        (torch.ones(sum(N * (p + N) for p in PREFIXES) - 1, dtype=torch.bool), "entries"),
        (torch.ones(N * N * len(PREFIXES), dtype=torch.bool), "entries"),  # QLEN_ONLY layout
        (torch.ones(sum(N * (p + N) for p in PREFIXES), dtype=torch.uint8), "flat bool"),
        (torch.ones(1, sum(N * (p + N) for p in PREFIXES), dtype=torch.bool), "flat bool"),
    ],
)
def test_custom_mask_of_the_wrong_size_or_type_raises(mask, message):
    with pytest.raises(att.VerifyMaskError, match=message):
        att.verify_masks(PREFIXES, N, mask, False, "cpu")


def test_a_longer_mask_is_read_up_to_what_the_batch_needs():
    """Callers size the mask from host upper bounds; the tail is never read."""
    q, kc, vc, r2t, rows = batch(PREFIXES, N, seed=5)
    exact = flat([causal(N)(i, p) for i, p in enumerate(PREFIXES)])
    longer = torch.cat([exact, torch.zeros(3 * N, dtype=torch.bool)])
    got = run(q, kc, vc, r2t, rows, PREFIXES, att.verify_masks(PREFIXES, N, longer, False, "cpu"))
    want = run(q, kc, vc, r2t, rows, PREFIXES, att.verify_masks(PREFIXES, N, exact, False, "cpu"))
    torch.testing.assert_close(got, want)


def test_custom_mask_row_that_sees_nothing_raises():
    per = [causal(N)(i, p) for i, p in enumerate(PREFIXES)]
    per[1][2] = False
    with pytest.raises(att.VerifyMaskError, match="attend to nothing"):
        att.verify_masks(PREFIXES, N, flat(per), False, "cpu")


def test_tokens_per_request_checks():
    class Spec:
        draft_token_num = 4

    assert att._tokens_per_request(12, 3, Spec()) == 4
    with pytest.raises(ValueError, match="do not split"):
        att._tokens_per_request(10, 3, Spec())
    with pytest.raises(ValueError, match="draft_token_num"):
        att._tokens_per_request(15, 3, Spec())
