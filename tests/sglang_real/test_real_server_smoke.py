"""The real SGLang 0.5.23 server on CPU: DFLASH speculative decoding is lossless.

Greedy (T=0) outputs with ``--speculative-algorithm DFLASH`` must equal the target's own
outputs token for token -- batch 1 and batch 3, prompts of different lengths, 24 new
tokens, ``ignore_eos`` -- with the same top-3 log-probs at every position (up to float32
noise; the log-probs, unlike the tokens, also expose a verify attention that sees wrong
keys), and the DFLASH server must really have speculated
(``spec_verify_ct > 0``) and accepted several drafts per step (the tiny models are built so
that the draft is right up to 4 times per block, see models.py), so the accept/commit path
runs, not only the bonus token. Runs the stand-in plugin's CPU paths end to end: the
TARGET_VERIFY attention of the target and of the draft block, the KV bookkeeping ops, the
DFLASH checks.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.sglang_real, pytest.mark.timeout(600)]

NEW_TOKENS = 24
TOP_LOGPROBS = 3
# fp32 verify (N rows at once) vs decode (one row) differs by ~6e-6 in these log-probs; a wrong
# verify mask or KV range moves them by >= 1e-3 (models.py, CONTENT_GAIN) without changing
# a single token.
LOGPROB_ATOL = 1e-4
# Token ids >= 4: 0-3 are pad/bos/eos/mask in the tiny models.
PROMPTS = [
    [17, 301, 42, 99, 250, 7, 460, 31],
    [5, 6, 7],
    [200, 201, 88, 13, 77, 480, 350, 12, 11, 10, 300, 299, 298, 45, 46, 47, 48, 222, 111],
]
CASES = {"batch1": PROMPTS[:1], "batch3": PROMPTS}


@pytest.mark.parametrize("case", sorted(CASES))
def test_dflash_greedy_equals_target_alone(case, baseline_server, dflash_server):
    prompts = CASES[case]
    baseline_server.flush_cache()
    dflash_server.flush_cache()
    want = baseline_server.generate(prompts, max_new_tokens=NEW_TOKENS, top_logprobs=TOP_LOGPROBS)
    got = dflash_server.generate(prompts, max_new_tokens=NEW_TOKENS, top_logprobs=TOP_LOGPROBS)

    assert [len(o.output_ids) for o in want] == [NEW_TOKENS] * len(prompts)
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert g.output_ids == w.output_ids, f"prompt {i}: DFLASH diverged from the target alone"
        assert g.meta_info["completion_tokens"] == NEW_TOKENS
        w_top, g_top = w.meta_info["output_top_logprobs"], g.meta_info["output_top_logprobs"]
        assert len(g_top) == len(w_top) == NEW_TOKENS
        for pos, (wt, gt) in enumerate(zip(w_top, g_top, strict=True)):
            assert [t[1] for t in gt] == [t[1] for t in wt], f"prompt {i} token {pos}: top-{TOP_LOGPROBS} ids differ"
            assert [t[0] for t in gt] == pytest.approx([t[0] for t in wt], abs=LOGPROB_ATOL), (
                f"prompt {i} token {pos}: top-{TOP_LOGPROBS} log-probs differ: {gt} vs {wt}"
            )
        assert g.meta_info.get("spec_verify_ct", 0) > 0, f"prompt {i}: no verify step: {g.meta_info}"
        assert g.meta_info["spec_accept_length"] >= 2, f"prompt {i}: drafts (almost) never accepted: {g.meta_info}"
        assert "spec_verify_ct" not in w.meta_info or not w.meta_info["spec_verify_ct"]


def test_server_info_says_dflash_on_cpu(dflash_server):
    info = dflash_server.server_info()
    assert info["speculative_algorithm"] == "DFLASH"
    assert info["device"] == "cpu"
    assert info["speculative_num_draft_tokens"] == 8  # the draft's block_size
    assert info["speculative_draft_attention_backend"] == "torch_native"


def test_the_flush_bench_sends_waits_for_a_running_request_on_the_real_server(baseline_server):
    """bench flushes the prefix cache before every measured load with ``/flush_cache?timeout=S``
    (``ddtree_ops.bench.client.flush_cache``; the host client sends the same): the real
    0.5.23 server refuses it once S runs out while a request runs, with the answer the
    simulator mimics, and flushes as soon as the request has ended when S is long enough."""
    import threading
    import time

    from ddtree_ops.bench._hostclient import FLUSH_ANSWER_S
    from ddtree_ops.bench.client import flush_cache

    done: list[float] = []

    def long_request() -> None:
        baseline_server.generate([PROMPTS[0]], max_new_tokens=1500)
        done.append(time.monotonic())

    worker = threading.Thread(target=long_request)
    worker.start()
    try:
        refused = None
        while refused is None and not done:  # until the server has the request (a flush of nothing is harmless)
            ok, detail = flush_cache(baseline_server.url, timeout_s=FLUSH_ANSWER_S + 0.2)
            refused = None if ok else detail
        assert refused == "HTTP 400: Timed out waiting for idle state.", (refused, done)
        assert flush_cache(baseline_server.url, timeout_s=300.0) == (True, "HTTP 200")
        answered = time.monotonic()
    finally:
        worker.join(300)
    assert done and done[0] - answered < 1.0  # the flush was answered when the request ended, not before it
