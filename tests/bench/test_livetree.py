"""Judging a live tree switch from what the server answered (pure), and the runtime-state
file a live launch writes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ddtree_ops.bench.livetree import (
    LiveTree,
    SwitchAnswer,
    judge_switch,
    refusal_detail,
    states_file,
    switch_request,
)
from ddtree_ops.bench.plan import LaunchConfig
from ddtree_ops.sim.states import parse_adaptive_config


def info(mode: str = "pinned", budget: int = 8, topk: int = 2, graph: str = "captured",
         reason: str | None = None) -> dict[str, Any]:
    states = [{"budget": 4, "verify_width": 5, "cuda_graph": "captured", "reason": None},
              {"budget": 8, "verify_width": 9, "cuda_graph": graph, "reason": reason}]
    return {"internal_states": [{"ddtree": {"mode": mode, "active": {"budget": budget, "topk": topk},
                                            "budgets": [4, 8], "topk_max": 4, "policy": None, "states": states,
                                            "switches": 1}}]}


def test_a_switch_that_took_gives_the_state_with_its_graph() -> None:
    assert judge_switch(SwitchAnswer(200, "", info()), 8, 2) == LiveTree(8, 2, "captured")
    eager = judge_switch(SwitchAnswer(200, "", info(graph="eager", reason="CUDA error: boom")), 8, 2)
    assert isinstance(eager, LiveTree) and not eager.graph
    assert eager.fallback_reason() == (
        "runtime state budget 8: verify graph not captured (CUDA error: boom); served eager")
    assert LiveTree(8, 2, "disabled").fallback_reason() is None  # graphs off for the whole server


@pytest.mark.parametrize(
    ("answer", "needle"),
    [
        (SwitchAnswer(None, "connection failed: refused", None), "no answer from the server (connection failed"),
        (SwitchAnswer(400, "DDTREE: budget 12 is not in this server's runtime states [4, 8]", None),
         "refused (HTTP 400): DDTREE: budget 12 is not in"),
        (SwitchAnswer(200, "", None), "/server_info could not be read back"),
        (SwitchAnswer(200, "", {"internal_states": [{}]}), "reports no runtime states"),
        (SwitchAnswer(200, "", info(mode="policy")), "did not take: the server reports mode 'policy'"),
        (SwitchAnswer(200, "", info(budget=4)), "did not take: the server reports mode 'pinned', active budget 4"),
        (SwitchAnswer(200, "", info(topk=4)), "active budget 8 top-k 4"),
        (SwitchAnswer(200, "", info(graph="dropped", reason="boom")), "budget 8's state is 'dropped' (boom)"),
    ],
)
def test_anything_short_of_a_proven_switch_is_the_cells_error(answer: SwitchAnswer, needle: str) -> None:
    verdict = judge_switch(answer, 8, 2)
    assert isinstance(verdict, str)
    assert verdict.startswith("live switch to budget 8 top-k 2") and needle in verdict, verdict


def test_refusal_detail_reads_the_contracts_shape_and_falls_back_to_text() -> None:
    assert refusal_detail(400, json.dumps({"detail": "DDTREE: no"}).encode()) == "DDTREE: no"
    assert refusal_detail(400, json.dumps({"error": {"message": "bad"}}).encode()) == "bad"
    assert refusal_detail(404, b"Not Found") == "Not Found"
    assert refusal_detail(500, b"") == "HTTP 500"


def test_states_file_is_what_the_server_accepts_and_named_by_its_content() -> None:
    launch = LaunchConfig("ddtree", 4, 2, budgets=(4, 8, 16), topk_max=8)
    name, content = states_file(launch)
    assert name.startswith("runtime-states-") and name.endswith(".json")
    # The simulator's validation (the contract) accepts it at the launch state.
    config = parse_adaptive_config(json.loads(content), path=name, launch_budget=4, launch_topk=2)
    assert (config.budgets, config.topk_max, config.on_capture_failure) == ((4, 8, 16), 8, "eager")
    other, _ = states_file(LaunchConfig("ddtree", 4, 2, budgets=(4, 8), topk_max=8))
    assert other != name
    assert switch_request(8, 2) == {"server_args": {"ddtree_budget": 8, "ddtree_topk": 2}}
    with pytest.raises(ValueError, match="no runtime states"):
        states_file(LaunchConfig("ddtree", 4, 2))
