"""Issue 42: eager fallbacks per runtime budget (``service.fallback``, ``state``).

Pure parts without fixtures: which budgets a launch holding several lists in the bundle's
``ddtree.eager_budgets`` and where it launches, a record at another top-k taken as likely,
what ``/server_info`` says failed at runtime, and old state files. One real simulator
launch (b300: verify capture crashes above budget 8) proves a runtime state's failure is
recorded at its own budget, not at the launch budget.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from ddtree_ops.bench.livetree import states_file
from ddtree_ops.bench.plan import LaunchConfig
from ddtree_ops.inventory_types import DdtreeSettings, Host
from ddtree_ops.limits import policy_problem
from ddtree_ops.service import RunConfig, lifecycle
from ddtree_ops.service.fallback import (
    failed_capture_budget,
    fallback_key,
    initial_cuda_graph,
    plan_runtime_budgets,
    remember_bisection,
    runtime_capture_failures,
)
from ddtree_ops.service.lifecycle import LaunchFacts, RestartRequest
from ddtree_ops.sim.states import parse_adaptive_config
from ddtree_ops.state import FallbackKey, StateStore
from ddtree_ops.transport.local import LocalTransport

KEY = FallbackKey("b1", "sm_103", "0.5.23", "DDTREE", 16, 4)


def _store(tmp_path: Path, *records: tuple[int, int]) -> StateStore:
    state = StateStore(tmp_path / "state.json")
    for budget, topk in records:
        state.record_fallback(replace(KEY, budget=budget, topk=topk), f"capture crashed at {budget}")
    return state


def test_a_record_at_9_lists_16_eager_and_launches_at_8(tmp_path: Path) -> None:
    planned = plan_runtime_budgets(_store(tmp_path, (9, 4)), KEY, [8, 16])
    assert (planned.launch_budget, planned.eager_budgets) == (8, (16,))
    assert planned.note is not None and "eager_budgets [16]" in planned.note and "capture crashed at 9" in planned.note


def test_a_launch_budget_with_graphs_is_kept_and_every_budget_above_the_record_is_eager(tmp_path: Path) -> None:
    planned = plan_runtime_budgets(_store(tmp_path, (12, 4)), replace(KEY, budget=4), [4, 8, 16, 32])
    assert (planned.launch_budget, planned.eager_budgets) == (4, (16, 32))


def test_no_record_or_every_budget_failing_keeps_the_launch_as_it_was(tmp_path: Path) -> None:
    assert plan_runtime_budgets(_store(tmp_path), KEY, [8, 16]) == plan_runtime_budgets(
        _store(tmp_path / "x", (4, 4)), KEY, [8, 16]
    )
    everything = plan_runtime_budgets(_store(tmp_path / "y", (4, 4)), KEY, [8, 16])
    # every budget fails: no eager_budgets, the restart's own check sends the server eager
    assert (everything.launch_budget, everything.eager_budgets, everything.note) == (16, (), None)
    state = _store(tmp_path / "y")
    assert initial_cuda_graph(RunConfig("DDTREE", 16, 4), state, KEY, retry_cuda_graph=False)[0] is False


def test_retry_cuda_graph_tries_every_budget(tmp_path: Path) -> None:
    planned = plan_runtime_budgets(_store(tmp_path, (9, 4)), KEY, [8, 16], retry_cuda_graph=True)
    assert (planned.launch_budget, planned.eager_budgets) == (16, ())


def test_a_record_at_another_topk_is_applied_as_likely_and_says_so(tmp_path: Path) -> None:
    state = _store(tmp_path, (9, 8))
    assert state.fallback_for(KEY) is None  # the record keeps its own top-k
    likely = state.likely_fallback_for(KEY)
    assert likely is not None and likely.key.topk == 8
    graphs, why = initial_cuda_graph(RunConfig("DDTREE", 16, 4), state, KEY, retry_cuda_graph=False)
    assert graphs is False and why is not None and "recorded fallback at top-k 8, taken as likely at top-k 4" in why
    planned = plan_runtime_budgets(state, KEY, [8, 16])
    assert planned.eager_budgets == (16,) and "taken as likely at top-k 4" in (planned.note or "")
    # an own-top-k record wins over a likely one
    state.record_fallback(replace(KEY, budget=16), "own")
    assert initial_cuda_graph(RunConfig("DDTREE", 16, 4), state, KEY, retry_cuda_graph=False)[1] == \
        "recorded fallback: own"
    # another scope (machine, arch, SGLang, algorithm) is never likely
    assert StateStore(tmp_path / "state.json").likely_fallback_for(replace(KEY, gpu_arch="sm_100")) is None


def test_runtime_capture_failures_reads_the_states_the_server_reports() -> None:
    info = {"internal_states": [{"ddtree": {"states": [
        {"budget": 8, "verify_width": 9, "cuda_graph": "captured", "reason": None},
        {"budget": 12, "verify_width": 13, "cuda_graph": "eager", "reason": "listed in ddtree.eager_budgets"},
        {"budget": 16, "verify_width": 17, "cuda_graph": "eager", "reason": "CUDA error: illegal memory access"},
        {"budget": 32, "verify_width": 33, "cuda_graph": "dropped", "reason": None},
        {"budget": "x", "cuda_graph": "eager"},
    ]}}]}
    assert runtime_capture_failures(info) == [(16, "CUDA error: illegal memory access"), (32, "no reason given")]
    assert runtime_capture_failures({}) == [] and runtime_capture_failures({"internal_states": "x"}) == []


def test_live_states_and_policy_files_carry_eager_budgets_the_server_accepts() -> None:
    launch = LaunchConfig("ddtree", 8, 4, budgets=(8, 16), topk_max=4)
    name, content = states_file(launch, eager_budgets=(16,))
    document = json.loads(content)
    assert document["ddtree"]["eager_budgets"] == [16]
    parsed = parse_adaptive_config(document, path=name, launch_budget=8, launch_topk=4)
    assert parsed.eager_budgets == (16,)
    # without eager budgets the file is the one it always was (same name, same argv hash)
    assert "eager_budgets" not in json.loads(states_file(launch)[1])["ddtree"]
    assert states_file(launch)[0] != name
    assert policy_problem({"ddtree": {"budgets": [8, 16], "topk_max": 4, "eager_budgets": [32],
                                      "policy": {"1": {"budget": 8, "topk": 4}}}}) is not None


def test_an_old_state_file_keyed_on_the_launch_budget_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    old = {"version": 1, "load_times": {}, "policies": {}, "fallbacks": {
        "b1|sm_103|0.5.23|DDTREE|16|4": {"key": {"host": "b1", "gpu_arch": "sm_103", "sglang_version": "0.5.23",
                                                 "algorithm": "DDTREE", "budget": 16, "topk": 4},
                                         "reason": "CUDA-graph capture failed", "recorded_at": 1.0}}}
    path.write_text(json.dumps(old))
    planned = plan_runtime_budgets(StateStore(path), replace(KEY, budget=8), [8, 16])
    assert (planned.launch_budget, planned.eager_budgets) == (8, (16,))


class _Found:
    first_failing = 9
    passed_up_to = 8
    blocking_error = "illegal memory access"


def test_bisection_writes_the_records_a_restart_and_a_policy_launch_read(tmp_path: Path) -> None:
    state = StateStore(tmp_path / "state.json")
    host = Host(name="b1", connection="local", ddtree=DdtreeSettings(), source="<test>")
    remember_bisection(state, host, _Found(), gpu_arch="sm_103", sglang_version="0.5.23", topk=4)
    run = RunConfig("DDTREE", budget=16, topk=4)
    key = fallback_key(host, run, arch="sm_103", sglang_version="0.5.23")
    (record,) = state.fallbacks()
    assert record.key == replace(key, budget=9)
    assert plan_runtime_budgets(state, key, [8, 16]).eager_budgets == (16,)


def test_a_whole_start_capture_failure_naming_a_runtime_budget_is_recorded_at_that_budget() -> None:
    line = ("CUDA-graph capture failed: DDTREE budget 16: RuntimeError: CUDA error: an illegal memory access "
            "was encountered -- the CUDA context is unusable after it")
    assert failed_capture_budget(line) == 16
    assert failed_capture_budget("CUDA-graph capture failed: CUDA error: an illegal memory access") is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sticky", [False, True], ids=["served-eager", "context-poisoned"])
def test_a_runtime_state_that_failed_capture_is_recorded_at_its_own_budget(
    make_sim_host, tmp_path: Path, sticky: bool
) -> None:
    """B300, budgets [8, 16] launched at 8: 16's verify capture crashes. Served eager by the
    bundle (the restart reads it from /server_info), or, when the crash is sticky (a real
    illegal memory access poisons the CUDA context), the bundle refuses the whole start
    naming budget 16 and the restart relaunches with budgets from 16 up eager, keeping 8's
    graph (issue 55; before, the whole server went eager). Either way the record is at 16,
    not at the launch's 8, and the next launch with 16 listed eager keeps 8's graph."""
    host = make_sim_host(gpu="b300", name="b300", extra_env={"SIM_CAPTURE_STICKY": "1" if sticky else "0"})
    config = tmp_path / "states.json"
    config.write_text(json.dumps({"ddtree": {"budgets": [8, 16], "topk_max": 4, "on_capture_failure": "eager"}}))
    state = StateStore()
    run = RunConfig("DDTREE", budget=8, topk=4, adaptive_config=str(config))

    def restart(run: RunConfig) -> lifecycle.RestartResult:
        return lifecycle.restart(t, RestartRequest(host, run, LaunchFacts("0.5.23"), poll_interval_s=0.2,
                                                   stop_grace_s=5.0), state=state)

    with LocalTransport(host.name) as t:
        try:
            result = restart(run)
            assert (result.cuda_graph, result.attempts) == ((True, 2) if sticky else (True, 1))
            (record,) = state.fallbacks()
            assert (record.key.budget, record.key.topk) == (16, 4)  # not the launch budget 8
            if sticky:
                assert result.fallback_reason is not None and "DDTREE budget 16" in result.fallback_reason
                assert result.fallback_reason.startswith("runtime budgets >= 16 served eager")
                assert result.spec.env["SGLANG_DDTREE_EAGER_FROM_BUDGET"] == "16"
            else:
                assert record.reason.startswith("runtime state budget 16: verify graph did not capture")
            planned = plan_runtime_budgets(state, replace(record.key, budget=8), [8, 16])
            assert (planned.launch_budget, planned.eager_budgets) == (8, (16,))
            # with 16 listed eager the bundle does not attempt its capture: graphs on, one attempt
            listed = tmp_path / "listed.json"
            listed.write_text(json.dumps({"ddtree": {"budgets": [8, 16], "topk_max": 4,
                                                     "eager_budgets": list(planned.eager_budgets)}}))
            again = restart(replace(run, adaptive_config=str(listed)))
            assert (again.cuda_graph, again.attempts) == (True, 1)
        finally:
            lifecycle.stop(t, host, grace_s=5)


