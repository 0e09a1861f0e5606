"""DDTREE inside the real SGLang 0.5.23 server on CPU.

The DDTree bundle is deployed with ddtree-ops itself into a private prefix holding the
real SGLang package (prefix.py); the servers run that prefix's interpreter, so SGLang
finds the plugin through its entry point exactly as on a GPU host. What is checked:

* greedy (T=0) outputs equal the target's own outputs token for token, with the same
  top-3 log-probs (float32 noise aside), batch 1 and batch 3, budgets 4 and 16 -- once
  with a random-weight draft (almost nothing is accepted: the root row and padding must
  be right) and once with an oracle drafter (a test probe puts the target's own
  continuation into the tree, at rank 1 on every third depth, so accepted paths run
  through nodes that are not the first chain and their KV must be compacted);
* the draft block is the draft model's trained block whatever the budget, and the target
  verifies ``budget + 1`` tokens per request (widths the attention stand-in saw);
* a sampled request where no exact sampler can run is aborted alone, with the reason in
  the HTTP error, and the server goes on serving; with the reference sampler enabled it
  is served;
* configurations DDTREE cannot serve are refused at startup with one line naming the
  flag (arg resolution in one process for the many cases, one real launch for the CLI).

Mutants these tests catch (run by hand): dropping the tree mask (``custom_mask=None`` in
the verify input) fails the four oracle greedy tests on the log-probs (the random-draft
tests pass: with nothing accepted only the root row matters, which causal attention gets
right); drafting a block of ``budget + 1`` (tying the block to the budget) fails
``test_draft_block_is_the_trained_block`` for both budgets.
"""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from . import models
from .conftest import NEW_TOKENS
from .server import SglangServer
from .serverenv import coverage_env, server_env
from .test_real_server_smoke import LOGPROB_ATOL, PROMPTS, TOP_LOGPROBS

pytestmark = [pytest.mark.slow, pytest.mark.sglang_real, pytest.mark.timeout(900)]

TOPK = 4
CASES = {"batch1": PROMPTS[:1], "batch3": PROMPTS}
ABORT_HINT = "tree_speculative_sampling_target_only"


@pytest.fixture(scope="session")
def random_draft(sglang_cpu_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.write_draft(tmp_path_factory.mktemp("random-draft") / "draft", block_size=8, random_weights=True)


def ddtree_args(draft: Path, budget: int, topk: int = TOPK) -> list[str]:
    return [
        "--speculative-algorithm", "DDTREE",
        "--speculative-draft-model-path", str(draft),
        "--speculative-num-draft-tokens", str(budget + 1),
        "--speculative-eagle-topk", str(topk),
        "--speculative-draft-attention-backend", "torch_native",
    ]


@dataclass(frozen=True)
class TreeServer:
    """One DDTREE server configuration; ``server()`` is free while it runs and restarts
    it if the pool stopped it to make room (module-scoped fixtures outlive a server)."""

    budget: int
    widths: Path
    get: Callable[[], SglangServer]

    def server(self) -> SglangServer:
        return self.get()


def _tree_server(pool, python, target, draft, budget, kind, tmp_dir: Path, env: dict[str, str]) -> TreeServer:
    widths = tmp_dir / f"widths-{kind}-{budget}.jsonl"
    return TreeServer(
        budget,
        widths,
        lambda: pool.get(
            f"ddtree-{kind}-b{budget}",
            target,
            ddtree_args(draft, budget),
            env={"DDTREE_TEST_WIDTHS": str(widths), **env},
            python=python,
        ),
    )


# Module-scoped and parametrized: pytest runs every test of one budget before the next,
# so each server configuration starts once.
@pytest.fixture(scope="module", params=[4, 16, 64], ids=["budget4", "budget16", "budget64"])
def random_server(request, real_servers, ddtree_python, tiny_models, random_draft, tmp_path_factory) -> TreeServer:
    return _tree_server(real_servers, ddtree_python, tiny_models["target"], random_draft, request.param, "random",
                        tmp_path_factory.getbasetemp(), {})


# How a sampled request is verified on each oracle server: budget 4 by the worker's
# reference branch (the CPU fallback), budget 16 by its kernel branch, the one a GPU host
# runs (build_speculative_verify_target_probs feeding tree_speculative_sampling_target_only),
# with only the CUDA op replaced by its pure-torch twin (stand-in tree_sampling_kernel).
ORACLE_SAMPLERS = {4: "reference", 16: "kernel"}
SAMPLER_ENV = {
    "reference": {"SGLANG_DDTREE_REFERENCE_SAMPLER": "1"},
    "kernel": {"SGLANG_CPU_STANDINS_ENABLE": "tree_sampling_kernel"},
}


def oracle_tree_server(pool, python, tiny_models, oracle_file, base: Path, budget: int) -> TreeServer:
    """The oracle-draft server of ``budget`` (top-k 4), the same configuration wherever a
    test asks for it, so that the pool starts it once (test_ddtree_runtime.py compares
    with it)."""
    return _tree_server(
        pool, python, tiny_models["target"], tiny_models["draft"], budget, "oracle", base,
        {"DDTREE_TEST_ORACLE": str(oracle_file), "DDTREE_TEST_MASK": str(base / f"mask-{budget}.jsonl"),
         **SAMPLER_ENV[ORACLE_SAMPLERS[budget]]},
    )


@pytest.fixture(scope="module", params=[4, 16], ids=["budget4", "budget16"])
def oracle_server(request, real_servers, ddtree_python, tiny_models, oracle_file, tmp_path_factory) -> TreeServer:
    return oracle_tree_server(real_servers, ddtree_python, tiny_models, oracle_file, tmp_path_factory.getbasetemp(),
                              request.param)


def assert_same_as_target(got, want, label: str) -> None:
    assert [len(o.output_ids) for o in got] == [NEW_TOKENS] * len(got), label
    # A batch-1 case sends the first prompt only: compare with the references it was sent.
    for i, (g, w) in enumerate(zip(got, want[: len(got)], strict=True)):
        assert g.output_ids == w.output_ids[:NEW_TOKENS], f"{label} prompt {i}: DDTREE diverged from the target alone"
        w_top = w.meta_info["output_top_logprobs"][:NEW_TOKENS]
        g_top = g.meta_info["output_top_logprobs"]
        for pos, (wt, gt) in enumerate(zip(w_top, g_top, strict=True)):
            assert [t[1] for t in gt] == [t[1] for t in wt], f"{label} prompt {i} token {pos}: top ids differ"
            assert [t[0] for t in gt] == pytest.approx([t[0] for t in wt], abs=LOGPROB_ATOL), (
                f"{label} prompt {i} token {pos}: log-probs differ: {gt} vs {wt}"
            )
        assert g.meta_info.get("spec_verify_ct", 0) > 0, f"{label} prompt {i}: no verify step: {g.meta_info}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_random_draft_greedy_equals_target_alone(case, random_server, reference_outputs):
    budget, srv = random_server.budget, random_server.server()
    prompts = CASES[case]
    srv.flush_cache()
    got = srv.generate(prompts, max_new_tokens=NEW_TOKENS, top_logprobs=TOP_LOGPROBS)
    assert_same_as_target(got, reference_outputs, f"random draft, budget {budget}, {case}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_oracle_draft_greedy_equals_target_alone_and_accepts_through_the_tree(case, oracle_server, reference_outputs):
    budget, srv = oracle_server.budget, oracle_server.server()
    prompts = CASES[case]
    srv.flush_cache()
    got = srv.generate(prompts, max_new_tokens=NEW_TOKENS, top_logprobs=TOP_LOGPROBS)
    assert_same_as_target(got, reference_outputs, f"oracle draft, budget {budget}, {case}")
    for i, g in enumerate(got):
        # The oracle's tree holds the true path through a rank-1 sibling at depth 2:
        # every round accepts at least two drafts, one of them a non-first node.
        assert g.meta_info["spec_accept_length"] > 2, f"prompt {i}: {g.meta_info}"


def test_draft_block_is_the_trained_block(oracle_server):
    """Budget 4 and 16 both draft the trained block of 8; the target verifies budget + 1."""
    budget, srv, widths = oracle_server.budget, oracle_server.server(), oracle_server.widths
    srv.generate(PROMPTS[:1], max_new_tokens=8)
    seen = [json.loads(line) for line in widths.read_text().splitlines()]
    assert {w["tokens_per_req"] for w in seen if w["runner"] == "draft"} == {8}, seen
    assert {w["tokens_per_req"] for w in seen if w["runner"] == "target"} == {budget + 1}, seen
    info = srv.server_info()["ddtree"]
    got = (info["budget"], info["topk"], info["draft_block_size"], info["verify_width"])
    assert got == (budget, TOPK, 8, budget + 1)
    assert info["max_depth"] == min(7, budget)


def test_server_info_reports_how_the_tree_is_verified(oracle_server):
    srv = oracle_server.server()
    info = srv.server_info()
    tree = info["ddtree"]
    assert tree["verify_attention_backend"] == "TorchNativeAttnBackend"
    # What the worker checked at start, not a constant: every plugin hook found in its
    # site's wrapper chain, the capture hook's input, and (no graphs on CPU) no captures.
    checks = tree["tree_mask"]
    assert checks["hooks_in_place"] == [
        "overrides.get_default_attn_backend", "DecodeCudaGraphRunner.get_spec_info",
        "spec_info.create_dummy_verify_input",
        "dflash_utils.validate_dflash_request", "spec_sampling_mask.validate_spec_sampling_mask_request",
        "spec_utils.spec_need_hidden_states", "Scheduler.get_init_info",
        "SchedulerInternalStateController.set_internal_state", "SchedulerInternalStateController.get_internal_state",
        "TokenizerControlMixin.set_internal_state", "Scheduler.get_output_streamer_class",
        "TokenizerManager.update_request_meta_info",
    ], checks
    assert checks["capture_input"] == "DDTreeVerifyInput with the runner's mask buffer"
    assert checks["verify_graphs"] == "none captured"
    assert tree["decode_cuda_graph"] == "disabled" and tree["verify_cuda_graph_captured"] is False
    assert tree["verify_cuda_graph_max_bs"] is None  # no verify graph runner: no graph ceiling
    assert tree["candidate_head"] == "eager"
    assert tree["sampler"] == ORACLE_SAMPLERS[oracle_server.budget]
    assert tree["accept_thresholds"] == [1.0, 1.0]
    assert info["speculative_algorithm"] == "DDTREE"
    assert info["speculative_eagle_topk"] == TOPK
    assert info["speculative_num_draft_tokens"] == tree["budget"] + 1


def test_sampled_request_is_aborted_alone_and_the_server_keeps_serving(random_server, reference_outputs):
    budget, srv = random_server.budget, random_server.server()
    assert srv.server_info()["ddtree"]["sampler"] == "none"
    with pytest.raises(Exception) as err:
        srv.generate(PROMPTS[:1], max_new_tokens=8, temperature=0.8)
    assert "400" in str(err.value) and ABORT_HINT in str(err.value), err.value
    # The scheduler is alive and greedy requests are still exact.
    got = srv.generate(PROMPTS, max_new_tokens=NEW_TOKENS, top_logprobs=TOP_LOGPROBS)
    assert_same_as_target(got, reference_outputs, f"after an aborted request, budget {budget}")


def test_a_sampled_request_is_served_then_greedy_stays_exact(oracle_server, reference_outputs):
    """One temperature 0.7 request through the server's sampler (budget 16: the kernel
    branch, which crashed on its first sampled request when it read the draft state from
    ``batch.spec_info``), then greedy requests are still served, equal to the target."""
    srv = oracle_server.server()
    (out,) = srv.generate(PROMPTS[:1], max_new_tokens=16, temperature=0.7)
    assert len(out.output_ids) == 16 and out.meta_info["spec_verify_ct"] > 0, out.meta_info
    assert all(0 <= t < models.VOCAB for t in out.output_ids)
    got = srv.generate(PROMPTS, max_new_tokens=NEW_TOKENS, top_logprobs=TOP_LOGPROBS)
    assert_same_as_target(got, reference_outputs, f"after a sampled request, budget {oracle_server.budget}")


def test_sampled_requests_with_top_k_top_p_and_min_p_are_served(oracle_server, reference_outputs):
    srv = oracle_server.server()
    outs = srv.generate(PROMPTS, max_new_tokens=16, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05)
    # One batch whose requests differ in top-k (the verifier's top-k is then per row),
    # with a greedy row among them: that row must still be the target's own output.
    mixed = srv.generate_each([*PROMPTS, PROMPTS[0]], [
        *({"temperature": 0.9, "top_k": k, "max_new_tokens": 16, "ignore_eos": True} for k in (5, 40, -1)),
        {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True},
    ])
    for o in [*outs, *mixed]:
        assert len(o.output_ids) == 16 and o.meta_info["spec_verify_ct"] > 0, o.meta_info
        assert all(0 <= t < models.VOCAB for t in o.output_ids)
    assert mixed[-1].output_ids == reference_outputs[0].output_ids[:16], "the greedy row of a sampled batch diverged"


def test_the_mask_attention_reads_is_the_tree_mask_buffer(oracle_server):
    """No per-round copy: every target verify hands attention a view of the worker's
    TreeMaskBuffer, long enough that FlashInfer's planning would not re-allocate it."""
    srv = oracle_server.server()
    srv.generate(PROMPTS, max_new_tokens=12)
    path = srv_mask_file(oracle_server)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records, "the mask probe saw no target verify"
    assert all(r["view_of_buffer"] for r in records), records
    assert all(r["mask_cells"] >= r["flashinfer_needs"] for r in records), records
    assert {r["n"] for r in records} == {oracle_server.budget + 1}, records


def srv_mask_file(tree_server: TreeServer) -> Path:
    return tree_server.widths.parent / f"mask-{tree_server.budget}.jsonl"


PER_NODE_INEXACT = {
    "frequency_penalty": {"frequency_penalty": 0.5},
    "presence_penalty": {"presence_penalty": 0.3},
    "repetition_penalty": {"repetition_penalty": 1.2},
    "logit_bias": {"logit_bias": {"7": 2.0}},
}


@pytest.mark.parametrize("field", sorted(PER_NODE_INEXACT))
def test_penalties_and_logit_bias_are_refused_alone_with_one_line(field, oracle_server, reference_outputs):
    srv = oracle_server.server()
    with pytest.raises(Exception) as err:
        srv.generate(PROMPTS[:1], max_new_tokens=8, **PER_NODE_INEXACT[field])
    message = str(err.value)
    assert "400" in message and f"DDTREE does not apply {field} per tree node" in message, message
    got = srv.generate(PROMPTS[:1], max_new_tokens=NEW_TOKENS, top_logprobs=TOP_LOGPROBS)
    assert_same_as_target(got, reference_outputs, f"after refusing {field}")


# Requests DDTREE's rounds cannot serve, each refused at admission alone: (extra fields of
# the /generate body, extra sampling params, the 400's text).
REFUSED_ALONE = {
    # the support each sampled token was drawn from: DDTREE's rounds do not build it
    "return_sampling_mask": ({"return_sampling_mask": True}, {}, "return_sampling_mask is not supported with DDTREE"),
    # refused before SGLang's grammar manager sees it
    "regex": ({}, {"regex": "[a-z]+"}, "DDTREE does not support constrained decoding"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_ALONE))
def test_requests_the_rounds_cannot_serve_are_refused_alone(case, oracle_server, reference_outputs):
    srv = oracle_server.server()
    fields, params, text = REFUSED_ALONE[case]
    body = {"input_ids": PROMPTS[0], **fields,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, **params}}
    resp = httpx.post(srv.url + "/generate", json=body, timeout=120)
    assert resp.status_code == 400 and text in resp.text, resp.text
    got = srv.generate(PROMPTS[:1], max_new_tokens=NEW_TOKENS, top_logprobs=TOP_LOGPROBS)
    assert_same_as_target(got, reference_outputs, f"after refusing {case}")


def _near_context_requests(limit: int, context_len: int) -> tuple[list[list[int]], list[dict]]:
    """Prompts of ``limit - 64`` to ``limit - 1`` tokens (prefixes of one fixed random
    sequence, so the radix cache shares them), each asking for every token the
    context admits (``context_len - prompt``; SGLang caps it a little lower)."""
    rng = random.Random(2030)
    seq = [rng.randrange(4, models.VOCAB) for _ in range(limit)]
    lens = range(limit - 64, limit)
    return ([seq[:n] for n in lens],
            [{"temperature": 0.0, "max_new_tokens": context_len - n, "ignore_eos": True} for n in lens])


@pytest.fixture(scope="session")
def near_context(real_servers, tiny_models) -> dict:
    """The target alone near its context end: the outputs, and its answer at the limit."""
    baseline = real_servers.get("baseline", tiny_models["target"])
    info = baseline.server_info()
    # Scheduler._handle_generate_request refuses a prompt of max_req_input_len tokens or more.
    limit, context_len = int(info["max_req_input_len"]), models.CONTEXT_LEN
    prompts, params = _near_context_requests(limit, context_len)
    outputs = baseline.generate_each(prompts, params)
    with pytest.raises(Exception) as refused:
        baseline.generate_each([prompts[-1] + [5]], [params[-1]])
    return {"limit": limit, "context_len": context_len, "outputs": [o.output_ids for o in outputs],
            "refusal": str(refused.value)}


def test_near_the_context_end_every_request_is_served_exactly(random_server, near_context):
    """Prompts from limit - 64 to the limit, each with the most new tokens it may ask
    for: every round's KV reservation stays inside the request's req_to_token row (it
    ran past it and killed the scheduler), the outputs equal the target alone, and the
    prompt at the limit is refused as the target alone refuses it."""
    srv = random_server.server()
    prompts, params = _near_context_requests(near_context["limit"], near_context["context_len"])
    got = srv.generate_each(prompts, params)
    want = near_context["outputs"]
    assert [len(o.output_ids) for o in got] == [len(w) for w in want]
    diverged = [len(p) for p, o, w in zip(prompts, got, want, strict=True) if o.output_ids != w]
    assert not diverged, f"budget {random_server.budget}: prompt lengths {diverged} diverged from the target alone"
    with pytest.raises(Exception) as refused:
        srv.generate_each([prompts[-1] + [5]], [params[-1]])
    assert "400" in str(refused.value) and "400" in near_context["refusal"], (refused.value, near_context["refusal"])
    (alive,) = srv.generate(PROMPTS[:1], max_new_tokens=8)
    assert len(alive.output_ids) == 8


REFUSALS = {
    "budget-0": (["--speculative-num-draft-tokens", "1"], {}, "--speculative-num-draft-tokens"),
    "budget-over-cap": (["--speculative-num-draft-tokens", "300"], {}, "--speculative-num-draft-tokens"),
    "topk-0": (["--speculative-eagle-topk", "0"], {}, "--speculative-eagle-topk"),
    "topk-over-vocab": (["--speculative-eagle-topk", "1000"], {}, "--speculative-eagle-topk"),
    "page-size": (["--page-size", "2"], {}, "--page-size"),
    "block-flag-disagrees": (["--speculative-dflash-block-size", "4"], {}, "--speculative-dflash-block-size"),
    "rejection-sampling": (["--speculative-use-rejection-sampling"], {}, "--speculative-use-rejection-sampling"),
    "num-steps": (["--speculative-num-steps", "2"], {}, "--speculative-num-steps"),
    "pp-size": (["--pp-size", "2"], {}, "--pp-size"),
    "dp-attention": (["--enable-dp-attention", "--dp-size", "2", "--tp-size", "2"], {}, "dp attention"),
    "draft-window": (["--speculative-draft-window-size", "64"], {}, "--speculative-draft-window-size"),
    "disaggregation": (["--disaggregation-mode", "prefill"], {}, "--disaggregation-mode"),
    "watermark": (["--enable-watermark"], {}, "--enable-watermark"),
    "thresholds": (["--speculative-accept-threshold-single", "0"], {}, "--speculative-accept-threshold-single"),
    "torch_native-without-tree-verify": (
        [], {"SGLANG_CPU_STANDINS_DISABLE": "ddtree_backend"}, "--attention-backend torch_native",
    ),
    "cpu-device": ([], {"SGLANG_CPU_STANDINS_DISABLE": "ddtree_device"}, "--device cpu"),
}

_RESOLVE = r"""
import json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.arg_groups.overrides import max_speculative_num_draft_tokens, resolved_view
from sglang.srt.server_args import prepare_server_args
results = []
for argv in json.loads(sys.argv[1]):
    try:
        args = prepare_server_args(argv)
        args.resolve_once()
        results.append({"ok": True, "draft_backend": resolved_view(args).speculative_draft_attention_backend,
                        "max_draft_tokens": max_speculative_num_draft_tokens(args)})
    except Exception as exc:
        results.append({"ok": False, "type": type(exc).__name__, "message": str(exc)})
print(json.dumps(results))
"""


def _resolve_all(python: Path, argvs: list[list[str]], env: dict[str, str], cwd: Path) -> list[dict]:
    """Resolve each argv as `sglang.launch_server` would (plugins loaded first), all in
    one interpreter: one import of SGLang instead of one per case."""
    proc = subprocess.run(
        [str(python), "-c", _RESOLVE, json.dumps(argvs)], capture_output=True, text=True, timeout=600, cwd=cwd,
        env={**server_env(), **coverage_env(now=True), "HOME": str(cwd), "PATH": "/usr/bin:/bin", **env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Resolved beside REFUSALS (same interpreter): a draft whose config has no block_size.
BLOCKLESS = {
    "blockless": [],
    "blockless-flag-1": ["--speculative-dflash-block-size", "1"],
    "blockless-flag-8": ["--speculative-dflash-block-size", "8"],
    # A draft backend that takes a tree or windowed path (fa3 does whenever top-k > 1):
    # moved to the verify backend, which runs a plain block (the GPU default's path).
    "blockless-flag-8-fa3-draft": ["--speculative-dflash-block-size", "8", "--speculative-draft-attention-backend",
                                   "fa3"],
}


# Resolved beside REFUSALS: --speculative-adaptive-config files (the runtime tree states)
# on a budget-4 launch: (the file's JSON, None if it resolves else the refusal's text).
RUNTIME_CONFIGS: dict[str, tuple[object, str | None]] = {
    "runtime-ok": ({"ddtree": {"budgets": [4, 64], "policy": {"8": {"budget": 64, "topk": 2}}}}, None),
    "runtime-launch-not-in-set": ({"ddtree": {"budgets": [8, 16]}},
                                  "the launch budget 4 (--speculative-num-draft-tokens 5) is not in ddtree.budgets"),
    "runtime-policy-budget": ({"ddtree": {"budgets": [4, 16], "policy": {"8": {"budget": 12, "topk": 4}}}},
                              'ddtree.policy["8"].budget 12 is not in ddtree.budgets [4, 16]'),
    "runtime-not-json": ("{budgets", "not JSON"),
}


@pytest.fixture(scope="module")
def refusals(ddtree_python, tiny_models, tmp_path_factory) -> dict[str, dict]:
    """Every case of REFUSALS and BLOCKLESS resolved, grouped by environment (one
    interpreter each)."""
    cwd = tmp_path_factory.mktemp("resolve")
    blockless = models.write_draft(cwd / "blockless-draft", block_size=None)

    def base(draft: Path) -> list[str]:
        return ["--model-path", str(tiny_models["target"]), "--device", "cpu", "--attention-backend", "torch_native",
                "--skip-tokenizer-init", "--dtype", "float32", *ddtree_args(draft, 4)]

    out: dict[str, dict] = {}
    groups: dict[str, list[tuple[str, list[str]]]] = {json.dumps({}): []}
    for case, (extra, env, _) in REFUSALS.items():
        # argparse: the last flag wins
        groups.setdefault(json.dumps(env, sort_keys=True), []).append((case, base(tiny_models["draft"]) + extra))
    for case, extra in BLOCKLESS.items():
        groups[json.dumps({})].append((case, base(blockless) + extra))
    for case, (content, _) in RUNTIME_CONFIGS.items():
        path = cwd / f"{case}.json"
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        groups[json.dumps({})].append((case, base(tiny_models["draft"]) + ["--speculative-adaptive-config", str(path)]))
    without_draft = base(tiny_models["draft"])
    at = without_draft.index("--speculative-draft-model-path")
    groups[json.dumps({})].append(("no-draft", without_draft[:at] + without_draft[at + 2:]))
    for env_key, cases in groups.items():
        results = _resolve_all(ddtree_python, [argv for _, argv in cases], json.loads(env_key), cwd)
        for (case, _), result in zip(cases, results, strict=True):
            out[case] = result
    return out


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_unservable_setups_are_refused_at_startup_naming_the_flag(case, refusals):
    _, _, flag = REFUSALS[case]
    result = refusals[case]
    assert not result["ok"], f"{case}: resolved although DDTREE cannot serve it"
    assert result["type"] == "DDTreeError", result
    assert "\n" not in result["message"] and flag in result["message"], result["message"]


@pytest.mark.parametrize("case", sorted(c for c, (_, text) in RUNTIME_CONFIGS.items() if text is not None))
def test_a_bad_runtime_config_is_refused_at_startup_naming_the_file_and_key(case, refusals, tmp_path_factory):
    result, text = refusals[case], RUNTIME_CONFIGS[case][1]
    assert not result["ok"] and result["type"] == "DDTreeError", result
    message = result["message"]
    assert "\n" not in message and text in message, message
    assert message.startswith("DDTREE: --speculative-adaptive-config ") and f"{case}.json: " in message, message


def test_a_runtime_set_reserves_kv_for_its_widest_tree(refusals):
    # A switch to budget 64 may come after the scheduler reserved the next round's KV:
    # SGLang reserves for the widest tree of the set (65 tokens), not the launch's 5.
    got = refusals["runtime-ok"]
    assert got["ok"] and got["max_draft_tokens"] == 65, got


def test_ddtree_without_a_draft_model_is_refused_naming_the_flag(refusals):
    got = refusals["no-draft"]
    assert not got["ok"] and got["type"] == "DDTreeError", got
    assert "--speculative-draft-model-path" in got["message"] and "\n" not in got["message"], got


def test_a_draft_without_a_block_size_is_refused_naming_the_flag(refusals):
    refused, too_small = refusals["blockless"], refusals["blockless-flag-1"]
    assert not refused["ok"] and "--speculative-dflash-block-size" in refused["message"], refused
    assert not too_small["ok"] and "must be >= 2" in too_small["message"], too_small
    # ... and resolved once the flag states the block it was trained with.
    assert refusals["blockless-flag-8"]["ok"], refusals["blockless-flag-8"]
    # Each round writes the block (8) and the verify window (budget 4 + 1) from the same
    # position: SGLang reserves KV for the wider one.
    assert refusals["blockless-flag-8"]["max_draft_tokens"] == 8, refusals["blockless-flag-8"]
    moved = refusals["blockless-flag-8-fa3-draft"]
    assert moved["ok"] and moved["draft_backend"] == "torch_native", moved


def test_the_launcher_prints_the_refusal_as_its_last_line(ddtree_python, tiny_models, tmp_path):
    from .server import BASE_ARGS, free_port

    argv = [str(ddtree_python), "-m", "sglang.launch_server", "--model-path", str(tiny_models["target"]),
            "--host", "127.0.0.1", "--port", str(free_port()), *BASE_ARGS, *ddtree_args(tiny_models["draft"], 4),
            "--page-size", "2"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**server_env(), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("sglang.srt.speculative.ddtree_registration.DDTreeError: ") or "DDTreeError" in last, last
    assert "--page-size" in last, last
