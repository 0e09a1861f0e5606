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
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddtree_ops.inventory_types import DdtreeSettings, Host
from ddtree_ops.patching import deploy, load_bundle
from ddtree_ops.transport.local import LocalTransport

from . import models
from .prefix import make_prefix
from .server import SglangServer
from .setup_env import server_env
from .test_real_server_smoke import LOGPROB_ATOL, PROMPTS, TOP_LOGPROBS

pytestmark = [pytest.mark.slow, pytest.mark.sglang_real, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
BUNDLE = REPO / "patches" / "ddtree_temperature"
NEW_TOKENS = 24
TOPK = 4
CASES = {"batch1": PROMPTS[:1], "batch3": PROMPTS}
ABORT_HINT = "tree_speculative_sampling_target_only"


@pytest.fixture(scope="session")
def ddtree_python(sglang_cpu_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prefix with the real SGLang 0.5.23 and the DDTree bundle deployed by ddtree-ops."""
    python = make_prefix(tmp_path_factory.mktemp("ddtree-prefix") / "prefix")
    host = Host(name="cpu-ddtree", connection="local", ddtree=DdtreeSettings(python=str(python)), source="<test>")
    with LocalTransport(host.name) as t:
        outcome = deploy(t, host, load_bundle(BUNDLE))
    assert outcome.outcome == "applied", outcome
    return python


@pytest.fixture(scope="session")
def random_draft(sglang_cpu_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.write_draft(tmp_path_factory.mktemp("random-draft") / "draft", block_size=8, random_weights=True)


@pytest.fixture(scope="session")
def reference_outputs(real_servers, tiny_models) -> list:
    """The target alone: the outputs every DDTREE server must reproduce."""
    baseline = real_servers.get("baseline", tiny_models["target"])
    baseline.flush_cache()
    return baseline.generate(PROMPTS, max_new_tokens=NEW_TOKENS + 16, top_logprobs=TOP_LOGPROBS)


@pytest.fixture(scope="session")
def oracle_file(reference_outputs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("oracle") / "oracle.json"
    path.write_text(
        json.dumps({",".join(map(str, p)): o.output_ids for p, o in zip(PROMPTS, reference_outputs, strict=True)})
    )
    return path


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
@pytest.fixture(scope="module", params=[4, 16], ids=["budget4", "budget16"])
def random_server(request, real_servers, ddtree_python, tiny_models, random_draft, tmp_path_factory) -> TreeServer:
    return _tree_server(real_servers, ddtree_python, tiny_models["target"], random_draft, request.param, "random",
                        tmp_path_factory.getbasetemp(), {})


@pytest.fixture(scope="module", params=[4, 16], ids=["budget4", "budget16"])
def oracle_server(request, real_servers, ddtree_python, tiny_models, oracle_file, tmp_path_factory) -> TreeServer:
    return _tree_server(
        real_servers, ddtree_python, tiny_models["target"], tiny_models["draft"], request.param, "oracle",
        tmp_path_factory.getbasetemp(),
        {"DDTREE_TEST_ORACLE": str(oracle_file), "SGLANG_DDTREE_REFERENCE_SAMPLER": "1"},
    )


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
    assert tree["tree_mask"] == "custom_mask"
    assert tree["decode_cuda_graph"] == "disabled" and tree["verify_cuda_graph_captured"] is False
    assert tree["sampler"] == "reference"
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


def test_sampled_requests_are_served_with_the_reference_sampler(oracle_server):
    srv = oracle_server.server()
    outs = srv.generate(PROMPTS, max_new_tokens=16, temperature=0.8, top_k=20, top_p=0.9)
    for o in outs:
        assert len(o.output_ids) == 16 and o.meta_info["spec_verify_ct"] > 0, o.meta_info
        assert all(0 <= t < models.VOCAB for t in o.output_ids)


REFUSALS = {
    "budget-0": (["--speculative-num-draft-tokens", "1"], {}, "--speculative-num-draft-tokens"),
    "budget-over-cap": (["--speculative-num-draft-tokens", "300"], {}, "--speculative-num-draft-tokens"),
    "topk-0": (["--speculative-eagle-topk", "0"], {}, "--speculative-eagle-topk"),
    "topk-over-vocab": (["--speculative-eagle-topk", "1000"], {}, "--speculative-eagle-topk"),
    "page-size": (["--page-size", "2"], {}, "--page-size"),
    "block-flag-disagrees": (["--speculative-dflash-block-size", "4"], {}, "--speculative-dflash-block-size"),
    "rejection-sampling": (["--speculative-use-rejection-sampling"], {}, "--speculative-use-rejection-sampling"),
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
from sglang.srt.server_args import prepare_server_args
results = []
for argv in json.loads(sys.argv[1]):
    try:
        prepare_server_args(argv).resolve_once()
        results.append({"ok": True})
    except Exception as exc:
        results.append({"ok": False, "type": type(exc).__name__, "message": str(exc)})
print(json.dumps(results))
"""


def _resolve_all(python: Path, argvs: list[list[str]], env: dict[str, str], cwd: Path) -> list[dict]:
    """Resolve each argv as `sglang.launch_server` would (plugins loaded first), all in
    one interpreter: one import of SGLang instead of one per case."""
    proc = subprocess.run(
        [str(python), "-c", _RESOLVE, json.dumps(argvs)], capture_output=True, text=True, timeout=600, cwd=cwd,
        env={**server_env(), "HOME": str(cwd), "PATH": "/usr/bin:/bin", **env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def refusals(ddtree_python, tiny_models, tmp_path_factory) -> dict[str, dict]:
    """Every case of REFUSALS resolved, grouped by environment (one interpreter each)."""
    cwd = tmp_path_factory.mktemp("resolve")
    base = ["--model-path", str(tiny_models["target"]), "--device", "cpu", "--attention-backend", "torch_native",
            "--skip-tokenizer-init", "--dtype", "float32", *ddtree_args(tiny_models["draft"], 4)]
    out: dict[str, dict] = {}
    groups: dict[str, list[str]] = {}
    for case, (_, env, _) in REFUSALS.items():
        groups.setdefault(json.dumps(env, sort_keys=True), []).append(case)
    for env_key, cases in groups.items():
        argvs = [base + REFUSALS[case][0] for case in cases]  # argparse: the last flag wins
        for case, result in zip(cases, _resolve_all(ddtree_python, argvs, json.loads(env_key), cwd), strict=True):
            out[case] = result
    return out


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_unservable_setups_are_refused_at_startup_naming_the_flag(case, refusals):
    _, _, flag = REFUSALS[case]
    result = refusals[case]
    assert not result["ok"], f"{case}: resolved although DDTREE cannot serve it"
    assert result["type"] == "DDTreeError", result
    assert "\n" not in result["message"] and flag in result["message"], result["message"]


def test_a_draft_without_a_block_size_is_refused_naming_the_flag(ddtree_python, tiny_models, tmp_path):
    draft = models.write_draft(tmp_path / "draft", block_size=None)
    argv = ["--model-path", str(tiny_models["target"]), "--device", "cpu", "--attention-backend", "torch_native",
            "--skip-tokenizer-init", "--dtype", "float32", *ddtree_args(draft, 4)]
    refused, served = _resolve_all(
        ddtree_python, [argv, [*argv, "--speculative-dflash-block-size", "8"]], {}, tmp_path
    )
    assert not refused["ok"] and "--speculative-dflash-block-size" in refused["message"], refused
    # ... and resolved once the flag states the block it was trained with.
    assert served["ok"], served


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
