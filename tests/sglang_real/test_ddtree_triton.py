"""The GPU path's Triton kernels, run on CPU by Triton's interpreter (``TRITON_INTERPRET=1``).

* A real DDTREE server on ``--attention-backend triton`` (the target's TARGET_VERIFY reads
  the tree mask in SGLang's Triton extend kernel, the draft block runs on the same backend)
  with the oracle drafter, so that accepted paths go through non-first siblings: greedy
  outputs equal the target alone (the torch_native server) token for token, log-probs
  within float32 noise. The interpreter runs each kernel program in NumPy: slow (a few
  seconds per request here), so one batch.
* A full batch near the context end on the triton backend, through the verify graph's
  replay metadata (a test stand-in takes that GPU-only path on CPU): the tree mask the
  bundle hands over fits the graph's fixed mask buffer (``max_bs * N * (context_len +
  N)`` cells) and covers what the kernel reads; every request is served (or refused with
  a 400 naming the context), never a scheduler crash.
* The candidate head's Triton top-k + log-sum-exp (``lilicorr_topk_lse``,
  kernels/ops/speculative/lilicorr.py, which ``candidate_topk`` calls inside the draft
  CUDA graph) against its own torch path. The function sends non-CUDA tensors to torch,
  so the check hands it CPU tensors that answer ``is_cuda`` True and counts the launches
  of its two Triton kernels.
"""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from .serverenv import server_env
from .test_ddtree_real import ddtree_args
from .test_real_server_smoke import LOGPROB_ATOL, PROMPTS, TOP_LOGPROBS

pytestmark = [pytest.mark.slow, pytest.mark.sglang_real, pytest.mark.timeout(900)]

INTERPRET = {"TRITON_INTERPRET": "1"}


def test_triton_verify_backend_greedy_equals_target_alone(real_servers, ddtree_python, tiny_models, oracle_file,
                                                          reference_outputs):
    args = [*ddtree_args(tiny_models["draft"], 8), "--speculative-draft-attention-backend", "triton",
            "--attention-backend", "triton"]
    srv = real_servers.get("ddtree-triton", tiny_models["target"], args, python=ddtree_python,
                           env={**INTERPRET, "DDTREE_TEST_ORACLE": str(oracle_file)})
    tree = srv.server_info()["ddtree"]
    assert (tree["verify_attention_backend"], tree["draft_attention_backend"]) == ("TritonAttnBackend",) * 2, tree
    # Two prompts in one batch, 16 tokens: the interpreter runs every kernel program in NumPy.
    got = srv.generate(PROMPTS[:2], max_new_tokens=16, top_logprobs=TOP_LOGPROBS)
    for i, (g, w) in enumerate(zip(got, reference_outputs[:2], strict=True)):
        assert g.output_ids == w.output_ids[:16], f"prompt {i}: the triton verify diverged"
        for pos, (gt, wt) in enumerate(zip(g.meta_info["output_top_logprobs"],
                                           w.meta_info["output_top_logprobs"], strict=False)):
            assert [t[1] for t in gt] == [t[1] for t in wt], (i, pos)
            assert [t[0] for t in gt] == pytest.approx([t[0] for t in wt], abs=LOGPROB_ATOL), (i, pos, gt, wt)
        # The oracle's tree puts the true path through a rank-1 sibling at depth 2.
        assert g.meta_info["spec_accept_length"] > 2, g.meta_info


# A full batch (--max-running-requests = the stand-in's graph max batch size) of one prompt
# CONTEXT_END_PROMPT tokens short of a small context, each asking for every token left.
CONTEXT_LEN, GRAPH_MAX_BS, CONTEXT_END_PROMPT = 64, 2, 16


def test_triton_full_batch_at_the_context_end_is_served_through_the_graph_mask(
        real_servers, ddtree_python, tiny_models, tmp_path):
    prompt = [(37 * i + 11) % 500 + 4 for i in range(CONTEXT_LEN - CONTEXT_END_PROMPT)]
    max_new = CONTEXT_END_PROMPT
    baseline = real_servers.get("baseline", tiny_models["target"])
    (want,) = baseline.generate([prompt], max_new_tokens=max_new)
    # The oracle drafter proposes the target's own continuation: deep trees, long rounds.
    oracle = tmp_path / "oracle.json"
    oracle.write_text(json.dumps({",".join(map(str, prompt)): want.output_ids}))
    records = tmp_path / "replay.jsonl"
    args = [*ddtree_args(tiny_models["draft"], 8), "--speculative-draft-attention-backend", "triton",
            "--attention-backend", "triton", "--context-length", str(CONTEXT_LEN),
            "--max-running-requests", str(GRAPH_MAX_BS)]
    srv = real_servers.get("ddtree-triton-context-end", tiny_models["target"], args, python=ddtree_python,
                           env={**INTERPRET, "DDTREE_TEST_ORACLE": str(oracle),
                                "DDTREE_TEST_TRITON_REPLAY": str(records),
                                "DDTREE_TEST_TRITON_REPLAY_MAX_BS": str(GRAPH_MAX_BS)})
    body = {"input_ids": [prompt] * GRAPH_MAX_BS,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}}
    resp = httpx.post(srv.url + "/generate", json=body, timeout=600)
    if resp.status_code == 200:
        for out in resp.json():
            # SGLang caps max_new_tokens at context_len - 2 - prompt (init_req_max_new_tokens).
            got = out["output_ids"]
            assert len(got) == CONTEXT_LEN - 2 - len(prompt), out["meta_info"]
            assert got == want.output_ids[:len(got)], "the triton verify near the context end diverged"
    else:
        assert resp.status_code == 400 and "context" in resp.text, resp.text[-2000:]
    (alive,) = srv.generate([prompt[:8]], max_new_tokens=4)
    assert len(alive.output_ids) == 4, srv.log_tail()
    rounds = [json.loads(line) for line in records.read_text().splitlines()]
    n = 8 + 1
    full = [r for r in rounds if r["bs"] == GRAPH_MAX_BS]
    assert full, rounds
    assert all(r["buffer_cells"] == GRAPH_MAX_BS * n * (CONTEXT_LEN + n) for r in rounds), rounds
    assert all(r["kernel_reads"] <= r["mask_cells"] <= r["buffer_cells"] for r in rounds), rounds
    # Near the end the uncapped view (N * (prefix + N) + N * N per request) overran the buffer.
    assert any(r["kernel_reads"] + n * n * r["bs"] > r["buffer_cells"] for r in full), full


_HEAD = r"""
import json, torch
from sglang.kernels.ops.speculative import lilicorr

class AsCuda(torch.Tensor):
    @property
    def is_cuda(self):
        return True

launches = {"_tiled_scan": 0, "_tiled_select": 0}
for name in launches:
    kernel = getattr(lilicorr, name)
    class Counted:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name
        def __getitem__(self, grid):
            launches[self.name] += 1
            return self.kernel[grid]
    setattr(lilicorr, name, Counted(kernel, name))
gen = torch.Generator().manual_seed(0)
cases = []
for n, vocab, k in ((3, 5000, 4), (8, 2048, 8), (2, 151936, 4), (5, 1000, 1), (4, 512, 4)):
    logits = torch.randn((n, vocab), generator=gen) * 4
    vals, ids, lse = (t.as_subclass(torch.Tensor) for t in lilicorr.lilicorr_topk_lse(logits.as_subclass(AsCuda), k))
    rv, ri, rl = lilicorr._topk_lse_torch(logits, k)
    cases.append({"shape": [n, vocab, k], "ids_equal": bool(torch.equal(ids, ri)),
                  "vals": float((vals - rv).abs().max()), "lse": float((lse - rl).abs().max())})
print(json.dumps({"launches": launches, "cases": cases}))
"""


def test_candidate_head_triton_kernels_match_their_torch_path(sglang_cpu_env, tmp_path):
    proc = subprocess.run(
        [str(sglang_cpu_env), "-c", _HEAD], capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**server_env(), **INTERPRET, "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["launches"] == {"_tiled_scan": 5, "_tiled_select": 5}, got
    for case in got["cases"]:
        assert case["ids_equal"] and case["vals"] == 0.0 and case["lse"] < 1e-5, case
