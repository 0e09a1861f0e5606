"""DDTREE runtime states in the simulator: the adaptive-config file, the live switch, the
per-batch-size policy and per-state capture outcomes (the contract of issue 25).

The pure part (file validation, the controller) runs without processes; the rest against
real simulator processes, as the other sim tests do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from ddtree_ops.sim.args import parse_server_args
from ddtree_ops.sim.states import (
    RuntimeStates,
    StateGraph,
    SwitchRefused,
    TreeState,
    parse_adaptive_config,
)

DDTREE_8_4 = ("--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", "9", "--speculative-eagle-topk",
              "4")
PROMPT = "def add(a, b): return a + b"


def _write(tmp_path: Path, body: object, name: str = "ddtree.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(body))
    return path


# ------------------------------------------------------------------ the file (pure)
@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"ddtree": {"budgets": [4, 8, 16], "policy": {"8": {"budget": 12, "topk": 4}}}},
         'ddtree.policy["8"].budget 12 is not in ddtree.budgets [4, 8, 16]'),
        ({"ddtree": {"budgets": [4, 16]}},
         "ddtree.budgets [4, 16] does not hold the launch budget 8 (--speculative-num-draft-tokens 9)"),
        ({"ddtree": {"budgets": [4, 8, 8]}}, "ddtree.budgets[2] 8 is listed twice"),
        ({"ddtree": {"budgets": [8, 300]}}, "ddtree.budgets[1] 300 is not an integer in 1..256"),
        ({"ddtree": {"budgets": [8, True]}}, "ddtree.budgets[1] True is not an integer in 1..256"),
        ({"ddtree": {"budgets": []}}, "ddtree.budgets must be a non-empty list of budgets"),
        ({"ddtree": {"budgets": [8], "topk_max": 2}},
         "ddtree.topk_max 2 is below the launch top-k 4 (--speculative-eagle-topk)"),
        ({"ddtree": {"budgets": [8], "policy": {"0": {"budget": 8, "topk": 4}}}},
         'ddtree.policy["0"] is not a batch size (a decimal string >= 1)'),
        ({"ddtree": {"budgets": [8], "topk_max": 4, "policy": {"1": {"budget": 8, "topk": 5}}}},
         'ddtree.policy["1"].topk 5 is not in 1..4 (ddtree.topk_max)'),
        ({"ddtree": {"budgets": [8], "on_capture_failure": "retry"}},
         "ddtree.on_capture_failure 'retry' is not one of eager, drop"),
        ({"ddtree": {"budgets": [8], "budget": 8}},
         "ddtree.budget is not a key (expected budgets, topk_max, policy, on_capture_failure, eager_budgets, "
         "state_memory_fraction)"),
        ({"ddtree": {"budgets": [8], "state_memory_fraction": 0}},
         "ddtree.state_memory_fraction 0 is not a number in (0, 1]"),
        ({"ddtree": {"budgets": [8], "state_memory_fraction": "half"}},
         "ddtree.state_memory_fraction 'half' is not a number in (0, 1]"),
        ({"ddtree": {"budgets": [8, 16], "eager_budgets": [8]}},
         "ddtree.eager_budgets holds the launch budget 8; launch on a budget whose graph captures "
         "(or with graphs disabled)"),
        ({"ddtree": {"budgets": [8, 16], "eager_budgets": [32]}},
         "ddtree.eager_budgets[0] 32 is not in ddtree.budgets [8, 16]"),
        ({"eagle": {}}, 'the file must be a JSON object with a "ddtree" key'),
    ],
)
def test_a_bad_file_exits_2_with_one_error_line_naming_file_and_key(
    tmp_path: Path, body: object, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, body)
    with pytest.raises(SystemExit) as exc:
        parse_server_args(["--model-path", "m", *DDTREE_8_4, "--speculative-adaptive-config", str(path)])
    assert exc.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert errors == [f"python -m ddtree_ops.sim: error: DDTREE: --speculative-adaptive-config {path}: {message}"]


def test_unreadable_or_non_json_file_and_non_ddtree_launch_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{budgets: [4")
    for path, needle in ((tmp_path / "missing.json", "cannot read the file"), (garbage, "not valid JSON")):
        with pytest.raises(SystemExit):
            parse_server_args(["--model-path", "m", *DDTREE_8_4, "--speculative-adaptive-config", str(path)])
        err = capsys.readouterr().err
        assert f"--speculative-adaptive-config {path}: {needle}" in err
    ok = _write(tmp_path, {"ddtree": {"budgets": [8]}})
    with pytest.raises(SystemExit):
        parse_server_args(["--model-path", "m", "--speculative-algorithm", "DFLASH",
                           "--speculative-adaptive-config", str(ok)])
    assert "only with --speculative-algorithm DDTREE" in capsys.readouterr().err


def test_a_good_file_is_sorted_and_topk_max_defaults_to_the_largest_asked(tmp_path: Path) -> None:
    path = _write(tmp_path, {"ddtree": {"budgets": [16, 4, 8], "policy": {"8": {"budget": 4, "topk": 6},
                                                                        "1": {"budget": 16, "topk": 2}}}})
    args, _ = parse_server_args(["--model-path", "m", *DDTREE_8_4, "--speculative-adaptive-config", str(path)])
    config = args.ddtree_adaptive
    assert config is not None
    assert config.budgets == (4, 8, 16)
    assert config.topk_max == 6  # the policy's top-k 6 beats the launch top-k 4
    assert config.policy == ((1, TreeState(16, 2)), (8, TreeState(4, 6)))
    assert config.on_capture_failure == "eager"
    assert args.as_dict()["speculative_adaptive_config"] == str(path)
    assert "ddtree_adaptive" not in args.as_dict()


# ------------------------------------------------------------------ the controller (pure)
def _states(policy: dict[str, Any] | None = None) -> RuntimeStates:
    body: dict[str, Any] = {"budgets": [4, 8, 16, 32], "topk_max": 8}
    if policy is not None:
        body["policy"] = policy
    config = parse_adaptive_config({"ddtree": body}, path="/p.json", launch_budget=8, launch_topk=4)
    graphs = (StateGraph(4, "captured"), StateGraph(8, "captured"), StateGraph(16, "eager", "boom"),
              StateGraph(32, "dropped", "boom"))
    return RuntimeStates(launch=TreeState(8, 4), graphs=graphs, config=config)


def test_switch_pins_either_key_alone_keeps_the_other_and_refusals_change_nothing() -> None:
    states = _states()
    assert (states.mode, states.active, states.budgets) == ("pinned", TreeState(8, 4), (4, 8, 16))
    assert states.apply({"ddtree_topk": 2})
    assert states.active == TreeState(8, 2)
    assert states.apply({"ddtree_topk": 2.0})  # 0.5.23 passes numbers as int | float
    assert states.switches == 2
    assert states.apply({"ddtree_budget": 16})
    assert states.active == TreeState(16, 2)
    refusals = [
        ({"ddtree_budget": 12}, "budget 12 is not in this server's runtime states [4, 8, 16]"),
        ({"ddtree_budget": 32}, "budget 32 was dropped from this server's runtime states"),
        ({"ddtree_topk": 9}, "top-k 9 is not in 1..8"),
        ({"ddtree_budget": 8.5}, "ddtree_budget must be an integer"),
        ({"ddtree_budget": True}, "ddtree_budget must be an integer"),
        ({"ddtree_policy": 1}, "launched without a policy"),
        ({"speculative_num_steps": 3}, "speculative_num_steps is not a runtime setting"),
        ({}, "nothing to set"),
    ]
    for request, message in refusals:
        with pytest.raises(SwitchRefused, match=message.replace("[", r"\[").replace("]", r"\]")):
            states.apply(request)
    assert (states.active, states.switches) == (TreeState(16, 2), 3)
    assert states.as_json()["last_refusal"] == "DDTREE: nothing to set (give ddtree_budget and/or ddtree_topk, " \
        "or ddtree_policy)"
    fixed = RuntimeStates(launch=TreeState(8, 4), graphs=(StateGraph(8, "captured"),), config=None)
    with pytest.raises(SwitchRefused, match='no runtime states \\(mode "fixed"\\)'):
        fixed.apply({"ddtree_budget": 8})
    assert fixed.as_json()["mode"] == "fixed" and fixed.as_json()["policy"] is None


def test_policy_picks_the_largest_key_at_or_below_the_batch_and_the_smallest_below_all() -> None:
    states = _states({"2": {"budget": 16, "topk": 4}, "8": {"budget": 8, "topk": 4}, "32": {"budget": 4, "topk": 2}})
    assert states.mode == "policy"
    picks = {bs: states.for_round(bs) for bs in (1, 2, 7, 8, 31, 32, 500)}
    assert picks == {1: TreeState(16, 4), 2: TreeState(16, 4), 7: TreeState(16, 4), 8: TreeState(8, 4),
                     31: TreeState(8, 4), 32: TreeState(4, 2), 500: TreeState(4, 2)}
    assert states.active == TreeState(4, 2)  # the one the last round used
    states.apply({"ddtree_budget": 4})
    assert states.mode == "pinned" and states.for_round(1) == TreeState(4, 2)
    states.apply({"ddtree_policy": 1})
    assert states.mode == "policy" and states.for_round(1) == TreeState(16, 4)
    states.apply({"ddtree_policy": 0})  # pin the state the last round used
    assert states.mode == "pinned" and states.for_round(32) == TreeState(16, 4)
    with pytest.raises(SwitchRefused, match="cannot be combined"):
        states.apply({"ddtree_policy": 1, "ddtree_budget": 4})


# ------------------------------------------------------------------ real servers
def _info(sim: Any) -> dict[str, Any]:
    return httpx.get(sim.url + "/server_info", timeout=10).json()


def _switch(sim: Any, **server_args: object) -> httpx.Response:
    return httpx.post(sim.url + "/set_internal_state", json={"server_args": server_args}, timeout=10)


def _generate(sim: Any, max_new_tokens: int = 24) -> dict[str, Any]:
    r = httpx.post(sim.url + "/generate", json={"text": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_b300_states_over_8_go_eager_the_others_keep_their_graphs_and_switches_take(
    sim_factory: Any, tmp_path: Path
) -> None:
    path = _write(tmp_path, {"ddtree": {"budgets": [4, 8, 16], "topk_max": 8}})
    sim = sim_factory(*DDTREE_8_4, "--speculative-adaptive-config", str(path), env={"SIM_GPU": "b300"})
    sim.wait_ready()
    info = _info(sim)
    tree = info["internal_states"][0]["ddtree"]
    reason = "CUDA error: an illegal memory access was encountered"
    memory = tree.pop("state_memory")
    # Modelled memory of the extra states (the plugin measures it): a 128 MB workspace each, plus
    # the 0.30 GB verify graph where one was captured; the launch state is SGLang's, not reported.
    assert memory["simulated"] is True and memory["state_memory_fraction"] == 0.5
    assert memory["used_mb"] == 128 + 307.2 + 128 and abs(memory["cap_mb"] - memory["free_at_start_mb"] / 2) <= 0.1
    assert tree == {
        "mode": "pinned",
        "active": {"budget": 8, "topk": 4},
        "budgets": [4, 8, 16],
        "topk_max": 8,
        "policy": None,
        "states": [
            # cuda_graph_max_bs: the graph ceiling, min(--cuda-graph-max-bs-decode 256, the 128-request pool)
            {"budget": 4, "verify_width": 5, "cuda_graph": "captured", "reason": None, "memory_mb": 435.2,
             "cuda_graph_max_bs": 128},
            {"budget": 8, "verify_width": 9, "cuda_graph": "captured", "reason": None, "memory_mb": None,
             "cuda_graph_max_bs": 128},
            {"budget": 16, "verify_width": 17, "cuda_graph": "eager", "reason": reason, "memory_mb": 128.0,
             "cuda_graph_max_bs": None},
        ],
        "switches": 0,
        "last_refusal": None,
        "trace": {"on": False},
    }
    # The static top-level object keeps its fields and describes the launch state.
    assert info["ddtree"]["budget"] == 8 and info["ddtree"]["verify_cuda_graph_captured"] is True
    assert "--speculative-adaptive-config" in info["launch_command"]
    log = sim.log()
    assert log.count("Capture target verify CUDA graph begin.") == 3
    assert log.count("Capture target verify CUDA graph end.") == 2
    # The launch-ending wording is not used for a state that falls back (readiness reads it).
    assert "Capture cuda graph failed" not in log and "Scheduler hit an exception" not in log
    assert "verify graph of budget 16 (num_tokens_per_req=17) did not capture" in log

    first = _generate(sim)["meta_info"]
    assert _info(sim)["internal_states"][0]["avg_spec_accept_length"] > 0
    refused = _switch(sim, ddtree_budget=12)
    assert refused.status_code == 400
    assert refused.json() == {"detail": "DDTREE: budget 12 is not in this server's runtime states [4, 8, 16]; "
                                        "relaunch with it in ddtree.budgets of --speculative-adaptive-config"}
    assert _info(sim)["internal_states"][0]["avg_spec_accept_length"] > 0  # a refusal restarts nothing
    ok = _switch(sim, ddtree_budget=4, ddtree_topk=2)
    assert (ok.status_code, ok.json()) == (200, [True])
    after = _info(sim)["internal_states"][0]
    assert after["ddtree"]["active"] == {"budget": 4, "topk": 2}
    assert after["ddtree"]["switches"] == 1
    assert after["avg_spec_accept_length"] == 0.0  # restarted at the switch
    meta = _generate(sim)["meta_info"]
    # The new state runs: 4 tree nodes proposed per round, and a smaller tree accepts less.
    assert meta["spec_num_proposed_drafts"] == 4 * meta["spec_verify_ct"]
    assert first["spec_num_proposed_drafts"] == 8 * first["spec_verify_ct"]
    assert meta["spec_accept_length"] < first["spec_accept_length"]
    assert _info(sim)["internal_states"][0]["avg_spec_accept_length"] > 0


def test_drop_removes_a_failed_state_and_refuses_switching_to_it(sim_factory: Any, tmp_path: Path) -> None:
    path = _write(tmp_path, {"ddtree": {"budgets": [4, 8, 16], "on_capture_failure": "drop", "eager_budgets": [4]}})
    sim = sim_factory(*DDTREE_8_4, "--speculative-adaptive-config", str(path), env={"SIM_GPU": "b300"})
    sim.wait_ready()
    tree = _info(sim)["internal_states"][0]["ddtree"]
    assert tree["budgets"] == [4, 8]
    assert [(s["budget"], s["cuda_graph"]) for s in tree["states"]] == [(4, "eager"), (8, "captured"),
                                                                        (16, "dropped")]
    assert tree["states"][0]["reason"] == "listed in ddtree.eager_budgets"
    # Only 8 and 16 were captured: an eager_budgets entry is not even tried.
    assert sim.log().count("Capture target verify CUDA graph begin.") == 2
    refused = _switch(sim, ddtree_budget=16)
    assert refused.status_code == 400 and "budget 16 was dropped" in refused.json()["detail"]
    assert "dropped from the runtime states" in sim.log()


def test_the_graph_ceiling_is_named_per_budget_and_a_batch_above_it_runs_eager(
    sim_factory: Any, tmp_path: Path
) -> None:
    # The ceiling is min(--cuda-graph-max-bs-decode, --max-running-requests), as 0.5.23's
    # get_batch_sizes_to_capture leaves it; an eager budget (B300, above 8) has none.
    path = _write(tmp_path, {"ddtree": {"budgets": [4, 8, 16]}})
    sim = sim_factory(*DDTREE_8_4, "--speculative-adaptive-config", str(path), "--cuda-graph-max-bs-decode", "2",
                      env={"SIM_GPU": "b300"})
    sim.wait_ready()
    info = _info(sim)
    states = info["internal_states"][0]["ddtree"]["states"]
    assert [(s["budget"], s["cuda_graph"], s["cuda_graph_max_bs"]) for s in states] == [
        (4, "captured", 2), (8, "captured", 2), (16, "eager", None)]
    assert info["ddtree"]["verify_cuda_graph_max_bs"] == 2 and info["cuda_graph_config"]["decode"]["max_bs"] == 2
    # The pool bounds it too; without decode graphs nothing replays a graph.
    pooled = parse_server_args(["--model-path", "m", *DDTREE_8_4, "--max-running-requests", "3"])[0]
    assert pooled.decode_graph_max_bs == 3 and pooled.graph_replays(3) and not pooled.graph_replays(4)
    eager = parse_server_args(["--model-path", "m", *DDTREE_8_4, "--cuda-graph-backend-decode", "disabled"])[0]
    assert eager.decode_graph_max_bs is None and not eager.graph_replays(1)
    # What the engine asks per round: a state replays its graph up to its ceiling only.
    captured = StateGraph(4, "captured", cuda_graph_max_bs=2)
    assert [captured.replays_graph(bs) for bs in (1, 2, 3)] == [True, True, False]
    assert not StateGraph(16, "eager", "failed").replays_graph(1)


def test_states_past_the_memory_cap_refuse_the_start_in_one_line(sim_factory: Any, tmp_path: Path) -> None:
    # A cap so small that the first extra state passes it (the plugin's ddtree.state_memory_fraction):
    # refused at startup, naming the budget, the MB it took and the cap -- not served eager.
    path = _write(tmp_path, {"ddtree": {"budgets": [4, 8], "state_memory_fraction": 1e-6}})
    sim = sim_factory(*DDTREE_8_4, "--speculative-adaptive-config", str(path), env={"SIM_GPU": "h200"})
    assert sim.wait_exit() != 0
    log = sim.log()
    assert "DDTREE refuses to start: runtime state budget 4 took 435 MB, past the cap of 0 MB" in log, log
    assert "Capture cuda graph failed" not in log  # not a capture failure: the toolkit does not relaunch eager


def test_policy_chooses_the_state_per_round_by_batch_size(sim_factory: Any, tmp_path: Path) -> None:
    policy = {"1": {"budget": 16, "topk": 4}, "3": {"budget": 4, "topk": 2}}
    path = _write(tmp_path, {"ddtree": {"budgets": [4, 8, 16], "policy": policy}})
    sim = sim_factory(*DDTREE_8_4, "--speculative-adaptive-config", str(path), env={"SIM_GPU": "h200"})
    sim.wait_ready()
    assert _info(sim)["internal_states"][0]["ddtree"]["mode"] == "policy"
    alone = _generate(sim)["meta_info"]
    assert alone["spec_num_proposed_drafts"] == 16 * alone["spec_verify_ct"]
    assert _info(sim)["internal_states"][0]["ddtree"]["active"] == {"budget": 16, "topk": 4}

    # One batched request: the three are admitted in one prefill and decode together, so
    # every round has batch size 3 and uses the "3" entry.
    r = httpx.post(sim.url + "/generate", json={"input_ids": [[5, 6, 7]] * 3, "sampling_params": {
        "temperature": 0, "max_new_tokens": 24, "ignore_eos": True}}, timeout=60)
    metas = [item["meta_info"] for item in r.json()]
    assert all(m["spec_num_proposed_drafts"] == 4 * m["spec_verify_ct"] for m in metas), metas
    assert _info(sim)["internal_states"][0]["ddtree"]["active"] == {"budget": 4, "topk": 2}
    assert _switch(sim, ddtree_budget=8).status_code == 200
    assert _info(sim)["internal_states"][0]["ddtree"]["mode"] == "pinned"
    assert (_switch(sim, ddtree_policy=1).status_code, _info(sim)["internal_states"][0]["ddtree"]["mode"]) == (
        200, "policy")


def test_a_switched_state_serves_like_a_fresh_launch_of_it(sim_factory: Any, tmp_path: Path) -> None:
    """Same tokens, same rounds, same modelled time: a switched cell measures what a fresh
    launch at that (budget, top-k) measures, captured and eager alike (b300, budget 16 is
    eager there, as a fresh launch of it must be)."""
    # Compressed time: the latencies compared are the cost model's (sim_modelled_s), which
    # the machine's speed does not reach.
    env = {"SIM_GPU": "b300", "SIM_TIME_SCALE": "0.1", "SIM_WARMUP_S": "0.5", "SIM_LOAD_S": "1"}
    path = _write(tmp_path, {"ddtree": {"budgets": [4, 8, 16]}})
    live = sim_factory(*DDTREE_8_4, "--speculative-adaptive-config", str(path), env=env)
    fresh_4 = sim_factory("--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", "5",
                          "--speculative-eagle-topk", "2", env=env)
    fresh_16 = sim_factory("--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", "17",
                           "--speculative-eagle-topk", "4", "--cuda-graph-backend-decode", "disabled", env=env)
    for sim in (live, fresh_4, fresh_16):
        sim.wait_ready()
    latencies: dict[str, float] = {}
    for name, fresh, state in (("4", fresh_4, {"ddtree_budget": 4, "ddtree_topk": 2}),
                               ("16", fresh_16, {"ddtree_budget": 16, "ddtree_topk": 4})):
        assert _switch(live, **state).status_code == 200
        switched, launched = _generate(live, 32), _generate(fresh, 32)
        assert switched["output_ids"] == launched["output_ids"]
        for key in ("spec_verify_ct", "spec_num_proposed_drafts", "spec_accept_length"):
            assert switched["meta_info"][key] == launched["meta_info"][key], key
        # Time on the cost model's own clock (the steps' modelled milliseconds), which a busy
        # machine cannot stretch: wall-clock latencies compared here failed under load (a
        # fresh launch at 0.45 s against the switched state's 0.29 s, best of two).
        a, b = switched["meta_info"]["sim_modelled_s"], launched["meta_info"]["sim_modelled_s"]
        assert a == pytest.approx(b, rel=1e-9), (name, a, b)
        latencies[name] = a
    # The eager state really is eager (3.8x per step), not the captured speed.
    assert latencies["16"] > 2 * latencies["4"], latencies
