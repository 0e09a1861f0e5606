"""The runtime tree states' pure part (``ddtree_runtime.py``, loaded as deployed): the
``ddtree`` section of ``--speculative-adaptive-config``, the per-batch-size routing, a
failed capture's outcome and the switch validation. The server side (a real SGLang
0.5.23 on CPU switching between rounds) is ``tests/sglang_real/test_ddtree_runtime.py``."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def _cfg(rt: ModuleType, section: dict[str, Any], launch: tuple[int, int] = (16, 4)) -> Any:
    return rt.parse_runtime_config({"ddtree": section}, source="f.json", launch=rt.TreeShape(*launch),
                                   max_budget=256)


def test_a_config_without_a_ddtree_section_is_no_runtime_set(rt: ModuleType) -> None:
    # An EAGLE adaptive file (integer batch-size keys only) says nothing to DDTREE.
    got = rt.parse_runtime_config({"1": {"candidate_steps": [1, 3]}}, source="f", launch=rt.TreeShape(4, 2),
                                  max_budget=256)
    assert got is None


def test_budgets_sorted_topk_max_from_launch_and_policy(rt: ModuleType) -> None:
    cfg = _cfg(rt, {"budgets": [16, 4, 8], "policy": {"8": {"budget": 4, "topk": 6}}})
    assert cfg.budgets == (4, 8, 16) and cfg.max_budget == 16
    assert cfg.topk_max == 6  # the policy's top-k is above the launch's 4
    assert cfg.on_capture_failure == "eager" and cfg.eager_budgets == ()


def test_policy_routes_like_sglangs_closest_batch_size(rt: ModuleType) -> None:
    # AdaptiveSpeculativeParams._find_closest_bs: the largest key <= bs, the smallest below all.
    cfg = _cfg(rt, {"budgets": [4, 8, 16], "policy": {
        "4": {"budget": 16, "topk": 4}, "16": {"budget": 8, "topk": 4}, "64": {"budget": 4, "topk": 2}}})
    route = {bs: cfg.route(bs) for bs in (1, 4, 15, 16, 63, 64, 500)}
    assert route == {
        1: rt.TreeShape(16, 4), 4: rt.TreeShape(16, 4), 15: rt.TreeShape(16, 4), 16: rt.TreeShape(8, 4),
        63: rt.TreeShape(8, 4), 64: rt.TreeShape(4, 2), 500: rt.TreeShape(4, 2)}
    assert cfg.policy_dict() == {"4": {"budget": 16, "topk": 4}, "16": {"budget": 8, "topk": 4},
                                 "64": {"budget": 4, "topk": 2}}


BAD = {
    "launch not in set": ({"budgets": [4, 8]}, "the launch budget 16 (--speculative-num-draft-tokens 17) is not in "
                                               "ddtree.budgets [4, 8]"),
    "duplicate": ({"budgets": [4, 16, 4]}, "ddtree.budgets has duplicates"),
    "too big": ({"budgets": [16, 300]}, "ddtree.budgets[1] must be in 1..256, got 300"),
    "not int": ({"budgets": [16, "8"]}, "ddtree.budgets[1] must be an integer, got '8'"),
    "policy budget": ({"budgets": [4, 16], "policy": {"8": {"budget": 12, "topk": 4}}},
                      'ddtree.policy["8"].budget 12 is not in ddtree.budgets [4, 16]'),
    "policy key": ({"budgets": [16], "policy": {"x": {"budget": 16, "topk": 4}}},
                   'ddtree.policy["x"]: keys are batch sizes'),
    "policy entry": ({"budgets": [16], "policy": {"1": {"budget": 16}}}, 'ddtree.policy["1"] must be {"budget"'),
    "topk_max low": ({"budgets": [16], "topk_max": 2}, "ddtree.topk_max 2 is below a top-k the server must serve (4"),
    "failure choice": ({"budgets": [16], "on_capture_failure": "retry"}, "ddtree.on_capture_failure must be one of"),
    "eager launch": ({"budgets": [4, 16], "eager_budgets": [16]}, "ddtree.eager_budgets holds the launch budget 16"),
    "unknown key": ({"budgets": [16], "budget": 8}, "ddtree.budget is not a key DDTREE reads"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_section_names_its_key(rt: ModuleType, case: str) -> None:
    section, message = BAD[case]
    with pytest.raises(rt.RuntimeConfigError) as err:
        _cfg(rt, section)
    assert message in str(err.value), err.value


def test_load_names_the_file(rt: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "ddtree.json"
    path.write_text(json.dumps({"ddtree": {"budgets": [4, 8]}}))
    with pytest.raises(rt.RuntimeConfigError) as err:
        rt.load_runtime_config(str(path), launch=rt.TreeShape(16, 4), max_budget=256)
    assert str(err.value).startswith(f"--speculative-adaptive-config {path}: the launch budget 16"), err.value
    path.write_text("{not json")
    with pytest.raises(rt.RuntimeConfigError, match="not JSON"):
        rt.load_runtime_config(str(path), launch=rt.TreeShape(16, 4), max_budget=256)
    with pytest.raises(rt.RuntimeConfigError, match="cannot read it"):
        rt.load_runtime_config(str(tmp_path / "absent.json"), launch=rt.TreeShape(16, 4), max_budget=256)
    assert rt.load_runtime_config(None, launch=rt.TreeShape(16, 4), max_budget=256) is None


def _capture_fails_above_8(budget: int) -> str:
    # What B300 did for budgets > 8: the capture raised.
    if budget > 8:
        raise RuntimeError(f"CUDA error: an illegal memory access\nwas encountered (budget {budget})")
    return f"graph-{budget}"


@pytest.mark.parametrize("on_failure", ["eager", "drop"])
def test_a_failed_capture_costs_only_its_own_budget(rt: ModuleType, on_failure: str) -> None:
    cfg = _cfg(rt, {"budgets": [4, 8, 16, 32], "on_capture_failure": on_failure}, launch=(4, 4))
    got = {b: rt.capture_outcome(b, _capture_fails_above_8, graphs_enabled=True, config=cfg) for b in (8, 16, 32)}
    assert got[8][0] == "graph-8" and got[8][1].cuda_graph == "captured"
    for budget in (16, 32):
        graph, outcome = got[budget]
        assert graph is None and outcome.cuda_graph == ("dropped" if on_failure == "drop" else "eager")
        # one line, the exception's own words
        assert outcome.reason == f"RuntimeError: CUDA error: an illegal memory access was encountered (budget {budget})"
    runtime = rt.TreeRuntime(launch=rt.TreeShape(4, 4), config=cfg,
                             outcomes=[rt.StateOutcome(4, "captured")] + [o for _, o in got.values()])
    assert runtime.budgets == ([4, 8] if on_failure == "drop" else [4, 8, 16, 32])
    states = {s["budget"]: s["cuda_graph"] for s in runtime.describe()["states"]}
    assert states[4] == states[8] == "captured"


def test_eager_budgets_and_disabled_graphs_capture_nothing(rt: ModuleType) -> None:
    cfg = _cfg(rt, {"budgets": [4, 16], "eager_budgets": [4]})

    def never(budget: int) -> str:
        raise AssertionError("must not capture")

    graph, outcome = rt.capture_outcome(4, never, graphs_enabled=True, config=cfg)
    assert graph is None and (outcome.cuda_graph, outcome.reason) == ("eager", "listed in ddtree.eager_budgets")
    graph, outcome = rt.capture_outcome(4, never, graphs_enabled=False, config=cfg)
    assert graph is None and outcome.cuda_graph == "disabled"


def _runtime(rt: ModuleType, policy: bool = True, dropped: tuple[int, ...] = ()) -> Any:
    section: dict[str, Any] = {"budgets": [4, 8, 16], "topk_max": 6}
    if policy:
        section["policy"] = {"1": {"budget": 16, "topk": 4}, "8": {"budget": 8, "topk": 2}}
    cfg = _cfg(rt, section, launch=(16, 4))
    outcomes = [rt.StateOutcome(b, "dropped" if b in dropped else "disabled", "boom" if b in dropped else None)
                for b in cfg.budgets]
    return rt.TreeRuntime(launch=rt.TreeShape(16, 4), config=cfg, outcomes=outcomes)


def test_policy_mode_routes_each_round_and_a_pin_stops_it(rt: ModuleType) -> None:
    runtime = _runtime(rt)
    assert runtime.mode == "policy"
    assert runtime.for_round(1) == rt.TreeShape(16, 4) and runtime.for_round(9) == rt.TreeShape(8, 2)
    assert runtime.describe()["active"] == {"budget": 8, "topk": 2}
    runtime.commit(runtime.plan({"ddtree_budget": 4}))  # top-k kept from the active tree
    assert (runtime.mode, runtime.active) == ("pinned", rt.TreeShape(4, 2))
    assert runtime.for_round(1) == rt.TreeShape(4, 2)
    runtime.commit(runtime.plan({"ddtree_policy": 1}))
    assert runtime.mode == "policy" and runtime.for_round(1) == rt.TreeShape(16, 4)
    assert runtime.describe()["switches"] == 2


REFUSED = {
    "budget not in set": ({"ddtree_budget": 12}, "DDTREE: budget 12 is not in this server's runtime states [4, 8, 16]"),
    "topk above max": ({"ddtree_topk": 7}, "DDTREE: top-k 7 is outside 1..6"),
    "topk zero": ({"ddtree_topk": 0}, "DDTREE: top-k 0 is outside 1..6"),
    "fractional": ({"ddtree_budget": 8.5}, "DDTREE: ddtree_budget must be an integer, got 8.5."),
    "policy with pin": ({"ddtree_policy": 1, "ddtree_budget": 8}, "ddtree_policy goes alone"),
    "policy value": ({"ddtree_policy": 2}, "ddtree_policy must be 0 or 1"),
    "foreign key": ({"ddtree_depth": 3}, "ddtree_depth is not a DDTREE switch key"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_switch_changes_nothing_and_says_why(rt: ModuleType, case: str) -> None:
    runtime = _runtime(rt)
    before = runtime.describe()
    request, message = REFUSED[case]
    with pytest.raises(rt.TreeSwitchRefused) as err:
        runtime.plan(request)
    assert message in str(err.value), err.value
    after = runtime.describe()
    assert after.pop("last_refusal") == str(err.value)
    before.pop("last_refusal")
    assert after == before


def test_refusals_of_dropped_budgets_missing_policy_and_fixed_servers(rt: ModuleType) -> None:
    with pytest.raises(rt.TreeSwitchRefused, match=r"budget 8 is not in .* \[4, 16\] \(dropped at start: boom\)"):
        _runtime(rt, dropped=(8,)).plan({"ddtree_budget": 8})
    with pytest.raises(rt.TreeSwitchRefused, match="no per-batch-size policy in f.json"):
        _runtime(rt, policy=False).plan({"ddtree_policy": 1})
    fixed = rt.TreeRuntime(launch=rt.TreeShape(16, 4))
    assert fixed.mode == "fixed" and fixed.budgets == [16] and fixed.describe()["policy"] is None
    with pytest.raises(rt.TreeSwitchRefused, match="this server has one tree"):
        fixed.plan({"ddtree_budget": 16})


def test_a_policy_entry_whose_budget_was_dropped_falls_back_to_the_launch_tree(rt: ModuleType) -> None:
    runtime = _runtime(rt, dropped=(8,))
    assert runtime.for_round(9) == rt.TreeShape(16, 4)
