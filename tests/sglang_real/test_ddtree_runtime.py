"""DDTREE's runtime tree states inside the real SGLang 0.5.23 server on CPU.

One server launched with ``--speculative-adaptive-config`` holding budgets 4, 8 and 16
(top-k up to 4) and a per-batch-size policy, the oracle drafter of test_ddtree_real.py
(accepted paths run through non-first siblings, so a wrong tree or stale KV shows), and
the fresh launch at budget 16 / top-k 4 of that module to compare with. What is checked:

* ``/server_info`` reports the set, the mode, the active tree and each state's graph;
* the policy picks the tree per round by batch size (the verify widths the attention
  stand-in saw);
* after each switch through ``/set_internal_state``, T = 0 outputs equal the fresh launch
  at that budget and top-k (tokens and per-request verify counts: the same trees) and
  the target alone; a round trip back to the launch tree repeats its outputs exactly;
* switches requested while requests are in flight land between rounds (several target
  widths within one request) and never corrupt them (outputs equal the target alone);
* refused switches answer HTTP 400 with the reason and change nothing; the acceptance
  statistics restart at a switch.

The sampled-losslessness test after a switch is test_ddtree_sampling.py (its DDTREE
server is launched on one tree and switched to the one it tests).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import NEW_TOKENS
from .test_ddtree_real import SAMPLER_ENV, assert_same_as_target, ddtree_args, oracle_tree_server
from .test_real_server_smoke import PROMPTS, TOP_LOGPROBS

pytestmark = [pytest.mark.slow, pytest.mark.sglang_real, pytest.mark.timeout(900)]

BUDGETS = [4, 8, 16]
TOPK_MAX = 4
LAUNCH = (4, 2)
# Batch 1 -> the launch tree; batch 3 (all of PROMPTS) -> budget 16.
POLICY = {"1": {"budget": 4, "topk": 2}, "3": {"budget": 16, "topk": 4}}


def runtime_config(path: Path, **extra: Any) -> Path:
    path.write_text(json.dumps({"ddtree": {"budgets": BUDGETS, "topk_max": TOPK_MAX, "policy": POLICY, **extra}}))
    return path


@pytest.fixture(scope="module")
def widths(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "widths-runtime.jsonl"


@pytest.fixture
def runtime_server(real_servers, ddtree_python, tiny_models, oracle_file, widths, tmp_path_factory):
    config = runtime_config(tmp_path_factory.getbasetemp() / "ddtree-runtime.json")
    return real_servers.get(
        "ddtree-runtime", tiny_models["target"],
        [*ddtree_args(tiny_models["draft"], LAUNCH[0], LAUNCH[1]), "--speculative-adaptive-config", str(config)],
        env={"DDTREE_TEST_WIDTHS": str(widths), "DDTREE_TEST_WIDTHS_EVERY": "1", "DDTREE_TEST_ORACLE": str(oracle_file),
             **SAMPLER_ENV["kernel"]},
        python=ddtree_python,
    )


@pytest.fixture
def fresh_b16(real_servers, ddtree_python, tiny_models, oracle_file, tmp_path_factory):
    """A fresh launch at budget 16 / top-k 4, no runtime set: test_ddtree_real.py's
    oracle server of budget 16 (started once for both modules: they are one lane unit)."""
    return oracle_tree_server(real_servers, ddtree_python, tiny_models, oracle_file, tmp_path_factory.getbasetemp(),
                              16).server()


def switch(srv, **server_args: float) -> httpx.Response:
    return httpx.post(srv.url + "/set_internal_state", json={"server_args": server_args}, timeout=60)


def pin(srv, budget: int, topk: int) -> None:
    resp = switch(srv, ddtree_budget=budget, ddtree_topk=topk)
    assert resp.status_code == 200 and resp.json() == [True], resp.text
    state = runtime_state(srv)
    assert (state["mode"], state["active"]) == ("pinned", {"budget": budget, "topk": topk}), state


def runtime_state(srv) -> dict[str, Any]:
    return srv.server_info()["internal_states"][0]["ddtree"]


def target_widths(path: Path, start: int) -> list[int]:
    lines = path.read_text().splitlines()[start:]
    return [w["tokens_per_req"] for w in map(json.loads, lines) if w["runner"] == "target"]


def seen_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_server_info_reports_the_runtime_states(runtime_server):
    switch(runtime_server, ddtree_policy=1)
    state = runtime_state(runtime_server)
    assert state["mode"] == "policy"
    assert state["budgets"] == BUDGETS and state["topk_max"] == TOPK_MAX and state["policy"] == POLICY
    # No CUDA graphs on CPU: every state is served by its own eager verify backend.
    memory = {s["budget"]: s.pop("memory_mb") for s in state["states"]}
    assert state["states"] == [
        # No graph, so no graph ceiling (cuda_graph_max_bs: the largest batch a state's graph replays).
        {"budget": b, "verify_width": b + 1, "cuda_graph": "disabled", "reason": None, "cuda_graph_max_bs": None}
        for b in BUDGETS
    ]
    # Each extra state's memory, measured around its build (SGLang's get_available_gpu_memory,
    # on CPU the host's free memory); the launch state is SGLang's own, not measured.
    assert memory[LAUNCH[0]] is None
    assert all(isinstance(memory[b], float) and memory[b] >= 0 for b in BUDGETS if b != LAUNCH[0]), memory
    cap = state["state_memory"]
    assert cap["state_memory_fraction"] == 0.5 and abs(cap["cap_mb"] - 0.5 * cap["free_at_start_mb"]) <= 0.1, cap
    info = runtime_server.server_info()
    # The launch tree is what the static entry and the flat server args say.
    assert (info["ddtree"]["budget"], info["ddtree"]["topk"]) == LAUNCH
    assert info["speculative_num_draft_tokens"] == LAUNCH[0] + 1


def test_the_policy_picks_the_tree_per_round_by_batch_size(runtime_server, reference_outputs, widths):
    srv = runtime_server
    assert switch(srv, ddtree_policy=1).json() == [True]
    srv.flush_cache()
    start = seen_lines(widths)
    one = srv.generate(PROMPTS[:1], max_new_tokens=NEW_TOKENS, top_logprobs=TOP_LOGPROBS)
    assert set(target_widths(widths, start)) == {LAUNCH[0] + 1}
    assert runtime_state(srv)["active"] == POLICY["1"]
    start = seen_lines(widths)
    three = srv.generate(PROMPTS, max_new_tokens=NEW_TOKENS, top_logprobs=TOP_LOGPROBS)
    # Rounds of all three requests verify budget 16; a round of fewer (a request
    # admitted late or done early) the launch tree.
    assert 17 in target_widths(widths, start) and set(target_widths(widths, start)) <= {5, 17}
    assert_same_as_target(one, reference_outputs, "policy, batch 1")
    assert_same_as_target(three, reference_outputs, "policy, batch 3")


def _outputs(srv) -> list:
    srv.flush_cache()
    return srv.generate(PROMPTS, max_new_tokens=NEW_TOKENS, top_logprobs=TOP_LOGPROBS)


def test_after_each_switch_greedy_equals_a_fresh_launch_and_the_target_alone(
    runtime_server, fresh_b16, reference_outputs, widths
):
    fresh = _outputs(fresh_b16)
    srv = runtime_server
    pin(srv, *LAUNCH)
    before = _outputs(srv)
    assert_same_as_target(before, reference_outputs, "pinned at the launch tree")
    for budget, topk in [(16, 4), (8, 3), (16, 1), LAUNCH]:
        pin(srv, budget, topk)
        start = seen_lines(widths)
        got = _outputs(srv)
        assert set(target_widths(widths, start)) == {budget + 1}, f"the switch to budget {budget} did not take"
        assert_same_as_target(got, reference_outputs, f"after a switch to budget {budget}, top-k {topk}")
        if (budget, topk) == (16, 4):
            # The same trees as the fresh launch: the same accepted paths, round for round.
            assert [o.output_ids for o in got] == [o.output_ids for o in fresh]
            assert [o.meta_info["spec_verify_ct"] for o in got] == [o.meta_info["spec_verify_ct"] for o in fresh]
    # Back on the launch tree after three switches: exactly what it did before them.
    assert [o.meta_info["spec_verify_ct"] for o in got] == [o.meta_info["spec_verify_ct"] for o in before]
    # A bigger tree accepts more per round than the launch tree (the oracle's path is in it).
    assert sum(o.meta_info["spec_verify_ct"] for o in fresh) < sum(o.meta_info["spec_verify_ct"] for o in before)


def test_switches_while_requests_are_in_flight_never_corrupt_them(
    runtime_server, fresh_b16, reference_outputs, widths
):
    # Twelve requests of 640 tokens: enough rounds for switches to land while they run on
    # a busy two-core machine. A switch is taken between two rounds, but from its POST to
    # its first round took 9 to 21 rounds here, and longer on a busy machine: with 160
    # tokens (about 115 rounds) 5 to 9 switches landed here, and a fresh-clone CI run once
    # saw one; 640 tokens give nearly four times the rounds (about 420). The fresh launch
    # gives the 640-token outputs; their first 40 are the target alone's own
    # (reference_outputs).
    prompts, tokens = PROMPTS * 4, 640
    fresh_b16.flush_cache()
    fresh = fresh_b16.generate(prompts, max_new_tokens=tokens)
    for i, (f, w) in enumerate(zip(fresh, reference_outputs * 4, strict=True)):
        assert f.output_ids[: len(w.output_ids)] == w.output_ids, f"request {i}: the fresh launch left the target"
    srv = runtime_server
    pin(srv, 16, 4)
    srv.flush_cache()
    start = seen_lines(widths)
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["out"] = srv.generate(prompts, max_new_tokens=tokens)
        except Exception as e:  # reported by the assertion below
            result["error"] = e

    worker = threading.Thread(target=run)
    worker.start()
    # Each switch waits for a round at its width before the next is sent, so on a slow
    # machine the requests are slower too and the count below does not depend on speed.
    shapes = [(4, 1), (8, 3), (16, 2), (4, 4), (16, 4)]
    taken_in_flight = 0
    for budget, topk in shapes * 2:
        if not worker.is_alive():
            break
        resp = switch(srv, ddtree_budget=budget, ddtree_topk=topk)
        assert resp.status_code == 200, resp.text
        deadline = time.monotonic() + 300
        while worker.is_alive() and time.monotonic() < deadline:
            seen = target_widths(widths, start)
            if seen and seen[-1] == budget + 1:
                taken_in_flight += int(worker.is_alive())
                break
            time.sleep(0.02)
    worker.join()
    assert "error" not in result, result.get("error")
    seen = target_widths(widths, start)
    changes = sum(1 for a, b in itertools.pairwise(seen) if a != b)
    # Within the same requests the verify width changed again and again: the switches
    # landed between rounds of requests in flight.
    assert taken_in_flight >= 3 and changes >= 3, (taken_in_flight, seen)
    for i, (g, f) in enumerate(zip(result["out"], fresh, strict=True)):
        assert len(g.output_ids) == tokens and g.output_ids == f.output_ids, (
            f"request {i}: a switch in flight changed the output"
        )


def test_sglang_keys_beside_a_switch_go_to_sglangs_handlers_and_a_refusal_of_theirs_stops_the_switch(
    runtime_server,
):
    srv = runtime_server
    pin(srv, 16, 4)
    # An SGLang key SGLang accepts (the acceptance threshold, 1.0 = exact) and a switch: both made.
    resp = switch(srv, ddtree_budget=8, ddtree_topk=2, speculative_accept_threshold_acc=1.0)
    assert resp.status_code == 200 and resp.json() == [True], resp.text
    assert runtime_state(srv)["active"] == {"budget": 8, "topk": 2}
    # One SGLang refuses (out of its range): the switch is not made either.
    resp = switch(srv, ddtree_budget=4, pp_max_micro_batch_size=0)
    assert resp.status_code == 400 and "SGLang refused pp_max_micro_batch_size" in resp.json()["message"], resp.text
    assert runtime_state(srv)["active"] == {"budget": 8, "topk": 2}


REFUSED = {
    "budget not in the set": ({"ddtree_budget": 12},
                              "DDTREE: budget 12 is not in this server's runtime states [4, 8, 16]"),
    "top-k above topk_max": ({"ddtree_topk": 5}, "DDTREE: top-k 5 is outside 1..4"),
    "fractional budget": ({"ddtree_budget": 8.5}, "DDTREE: ddtree_budget must be an integer"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_switch_answers_400_with_the_reason_and_changes_nothing(case, runtime_server, reference_outputs):
    srv = runtime_server
    pin(srv, 8, 2)
    before = runtime_state(srv)
    request, message = REFUSED[case]
    resp = switch(srv, **request)
    assert resp.status_code == 400 and message in resp.json()["message"], resp.text
    after = runtime_state(srv)
    assert message in after.pop("last_refusal")
    before.pop("last_refusal")
    assert after == before
    assert_same_as_target(srv.generate(PROMPTS[:1], max_new_tokens=NEW_TOKENS, top_logprobs=TOP_LOGPROBS),
                          reference_outputs, f"after refusing {case}")


def test_a_server_without_runtime_states_refuses_a_switch(fresh_b16):
    resp = switch(fresh_b16, ddtree_budget=8)
    assert resp.status_code == 400 and "this server has one tree (budget 16, top-k 4)" in resp.json()["message"]
    assert runtime_state(fresh_b16)["mode"] == "fixed"


def test_acceptance_statistics_restart_at_a_switch(runtime_server):
    srv = runtime_server
    # SGLang adds a round's counts to the totals every decode_log_interval (40) rounds: a
    # chain of 4 commits at most 5 tokens a round, so 220 tokens span 44 rounds or more.
    pin(srv, 4, 1)
    srv.generate(PROMPTS[:1], max_new_tokens=220)
    assert srv.server_info()["internal_states"][0]["avg_spec_accept_length"] > 1
    pin(srv, 4, 2)
    # Nothing measured since the switch: SGLang reports no average at all.
    assert "avg_spec_accept_length" not in srv.server_info()["internal_states"][0]


def test_a_sampled_request_after_a_switch_takes_the_kernel_branch(runtime_server, reference_outputs):
    srv = runtime_server
    pin(srv, 8, 3)
    (out,) = srv.generate(PROMPTS[:1], max_new_tokens=16, temperature=0.7)
    assert len(out.output_ids) == 16 and out.meta_info["spec_verify_ct"] > 0, out.meta_info
    assert srv.server_info()["ddtree"]["sampler"] == "kernel"
    assert_same_as_target(srv.generate(PROMPTS, max_new_tokens=NEW_TOKENS, top_logprobs=TOP_LOGPROBS),
                          reference_outputs, "greedy after a sampled request on a switched tree")
