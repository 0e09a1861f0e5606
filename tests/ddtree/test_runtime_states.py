"""The runtime tree states' pure part (``ddtree_runtime.py``, loaded as deployed): the
``ddtree`` section of ``--speculative-adaptive-config``, the per-batch-size routing, a
failed capture's outcome and the switch validation. The server side (a real SGLang
0.5.23 on CPU switching between rounds) is ``tests/sglang_real/test_ddtree_runtime.py``."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType, SimpleNamespace
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
    "memory fraction 0": ({"budgets": [16], "state_memory_fraction": 0},
                          "ddtree.state_memory_fraction must be a number in (0, 1], got 0"),
    "memory fraction > 1": ({"budgets": [16], "state_memory_fraction": 1.5},
                            "ddtree.state_memory_fraction must be a number in (0, 1], got 1.5"),
    "memory fraction text": ({"budgets": [16], "state_memory_fraction": "half"},
                             "ddtree.state_memory_fraction must be a number in (0, 1], got 'half'"),
    "memory fraction bool": ({"budgets": [16], "state_memory_fraction": True},
                             "ddtree.state_memory_fraction must be a number in (0, 1], got True"),
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


def _context_usable() -> None:
    """Stand-in for ``cuda_context_probe`` on a context that still runs kernels."""


def _context_poisoned() -> None:
    """Stand-in for ``cuda_context_probe`` after a sticky CUDA error: every later call fails."""
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.mark.parametrize("on_failure", ["eager", "drop"])
def test_a_failed_capture_costs_only_its_own_budget(rt: ModuleType, on_failure: str) -> None:
    cfg = _cfg(rt, {"budgets": [4, 8, 16, 32], "on_capture_failure": on_failure}, launch=(4, 4))
    got = {b: rt.capture_outcome(b, _capture_fails_above_8, graphs_enabled=True, config=cfg, probe=_context_usable)
           for b in (8, 16, 32)}
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


def test_a_capture_that_poisons_the_context_refuses_the_start_in_one_line(rt: ModuleType) -> None:
    # B300 above budget 8: the capture hits an illegal memory access, which is sticky -- the probe
    # after it fails too, so no budget can run: refuse to start instead of reporting ready and
    # dying at the first forward.
    cfg = _cfg(rt, {"budgets": [4, 8, 16, 32]}, launch=(4, 4))
    # Probed after every capture (issue 55): a sticky error from the last warm-up surfaces only at
    # the next CUDA call, so a capture that returned on a poisoned context is refused too.
    with pytest.raises(rt.CaptureContextPoisoned, match=r"^Capture cuda graph failed: DDTREE budget 8: the capture "
                                                        r"returned -- the CUDA context is unusable"):
        rt.capture_outcome(8, _capture_fails_above_8, graphs_enabled=True, config=cfg, probe=_context_poisoned)
    with pytest.raises(rt.CaptureContextPoisoned) as err:
        rt.capture_outcome(16, _capture_fails_above_8, graphs_enabled=True, config=cfg, probe=_context_poisoned)
    line = str(err.value)
    assert "\n" not in line
    # SGLang's own capture-failure marker first: the toolkit's log reader (LogEvent.CAPTURE_FAILED)
    # relaunches the whole server eager on it; then the budget and the original error.
    assert line.startswith("Capture cuda graph failed: DDTREE budget 16: RuntimeError: CUDA error: an illegal "
                           "memory access was encountered (budget 16) -- the CUDA context is unusable"), line
    assert "eager_budgets" in line
    assert isinstance(err.value.__cause__, RuntimeError)


def test_the_refusal_is_what_the_toolkit_reads_as_a_capture_failure(rt: ModuleType) -> None:
    from ddtree_ops.service.logphases import LogEvent, classify

    cfg = _cfg(rt, {"budgets": [4, 16]}, launch=(4, 4))

    def sglang_capture(budget: int) -> str:
        # DecodeCudaGraphRunner.__init__'s own wrapping of a failed capture (multi-line advice).
        raise Exception("Capture cuda graph failed: CUDA error: an illegal memory access was encountered\n"
                        "Possible solutions:\n1. set --mem-fraction-static to a smaller value\n")

    with pytest.raises(rt.CaptureContextPoisoned) as err:
        rt.capture_outcome(16, sglang_capture, graphs_enabled=True, config=cfg, probe=_context_poisoned)
    line = str(err.value)
    assert classify(f"[2026-12-01 10:00:00 TP0] {line}")[1] is LogEvent.CAPTURE_FAILED
    assert "Possible solutions" not in line and "DDTREE budget 16" in line, line


def test_a_plain_capture_error_with_a_usable_context_costs_only_its_budget(rt: ModuleType) -> None:
    # A Python error (not sticky): the probe passes, that budget is served eager, the others captured.
    cfg = _cfg(rt, {"budgets": [4, 8, 16, 32]}, launch=(4, 4))
    probes: list[int] = []

    def capture(budget: int) -> str:
        if budget == 16:
            raise ValueError("shape mismatch in the verify buffers")
        return f"graph-{budget}"

    def probe() -> None:
        probes.append(1)

    got = {b: rt.capture_outcome(b, capture, graphs_enabled=True, config=cfg, probe=probe) for b in (8, 16, 32)}
    assert [(g, o.cuda_graph) for g, o in got.values()] == [("graph-8", "captured"), (None, "eager"),
                                                            ("graph-32", "captured")]
    assert got[16][1].reason == "ValueError: shape mismatch in the verify buffers"
    assert probes == [1, 1, 1]  # probed after every capture, returned or not (issue 55)


def test_the_default_probe_is_cudas_and_passes_without_a_cuda_context(rt: ModuleType) -> None:
    import inspect

    assert inspect.signature(rt.capture_outcome).parameters["probe"].default is rt.cuda_context_probe
    assert inspect.signature(rt.build_state).parameters["probe"].default is rt.cuda_context_probe
    rt.cuda_context_probe()  # CPU torch here: nothing to poison, returns


class _FakeDevice:
    """Stand-in for the free-memory query (SGLang's get_available_gpu_memory, in MB): building a
    backend or capturing a graph takes the MB the test says."""

    def __init__(self, free_mb: float) -> None:
        self.free = free_mb
        self.reads = 0

    def free_mb(self) -> float:
        self.reads += 1
        return self.free

    def take(self, mb: float) -> None:
        self.free -= mb


def _build_all(rt: ModuleType, cfg: Any, device: _FakeDevice, cost: dict[int, tuple[float, float]],
               launch: int, fail: tuple[int, ...] = ()) -> tuple[Any, list[Any]]:
    memory = rt.StateMemory(device.free_mb, cfg.state_memory_fraction)

    def make_backend(budget: int) -> str:
        device.take(cost[budget][0])
        return f"backend-{budget}"

    def capture(backend: str, budget: int) -> SimpleNamespace:
        device.take(cost[budget][1])
        if budget in fail:
            raise RuntimeError(f"capture of {budget} failed")
        # A DecodeCudaGraphRunner's capture sizes: the widest state's alignment leaves fewer.
        return SimpleNamespace(name=f"graph-{budget}", capture_bs=[1, 2, 4, 40 if budget >= 32 else 48])

    outcomes = []
    for budget in cfg.budgets:
        if budget != launch:
            backend, graph, outcome = rt.build_state(budget, make_backend, capture, graphs_enabled=True,
                                                     config=cfg, memory=memory, probe=_context_usable)
            assert backend == f"backend-{budget}"
            outcomes.append(outcome)
    return memory, outcomes


def test_each_state_reports_the_memory_it_took(rt: ModuleType) -> None:
    cfg = _cfg(rt, {"budgets": [4, 8, 16, 32]}, launch=(4, 4))
    assert cfg.state_memory_fraction == 0.5  # the default share
    device = _FakeDevice(20_000.0)
    memory, outcomes = _build_all(rt, cfg, device, {8: (100, 400), 16: (150, 650), 32: (300, 1500)}, launch=4,
                                  fail=(16,))
    assert [(o.budget, o.cuda_graph, o.memory_mb) for o in outcomes] == [
        (8, "captured", 500.0), (16, "eager", 800.0), (32, "captured", 1800.0)]
    # Each state's graph ceiling: its runner's largest capture size; none for the eager one.
    assert [(o.budget, o.cuda_graph_max_bs) for o in outcomes] == [(8, 48), (16, None), (32, 40)]
    assert (memory.free_at_start_mb, memory.cap_mb, memory.used_mb) == (20_000.0, 10_000.0, 3100.0)
    runtime = rt.TreeRuntime(launch=rt.TreeShape(4, 4), config=cfg,
                             outcomes=[rt.StateOutcome(4, "captured")] + outcomes, memory=memory)
    described = runtime.describe()
    assert {s["budget"]: s["memory_mb"] for s in described["states"]} == {4: None, 8: 500.0, 16: 800.0,
                                                                          32: 1800.0}
    assert {s["budget"]: s["cuda_graph_max_bs"] for s in described["states"]} == {4: None, 8: 48, 16: None, 32: 40}
    assert described["state_memory"] == {"state_memory_fraction": 0.5, "free_at_start_mb": 20_000.0,
                                         "cap_mb": 10_000.0, "used_mb": 3100.0}
    # A server without a set reports no state memory.
    assert rt.TreeRuntime(launch=rt.TreeShape(4, 4)).describe()["state_memory"] is None


def test_a_state_past_the_cap_refuses_the_start_naming_budget_mb_and_cap(rt: ModuleType) -> None:
    cfg = _cfg(rt, {"budgets": [4, 8, 16, 32], "state_memory_fraction": 0.25}, launch=(4, 4))
    device = _FakeDevice(16_000.0)  # cap: 4000 MB for all extra states
    with pytest.raises(rt.StateMemoryExceeded) as err:
        _build_all(rt, cfg, device, {8: (100, 900), 16: (200, 1800), 32: (400, 2100)}, launch=4)
    line = str(err.value)
    assert "\n" not in line
    # The cap bounds the extra states together: 1000 + 2000 MB fit, the 2500 MB of budget 32 do not.
    assert line.startswith("DDTREE refuses to start: runtime state budget 32 took 2500 MB, past the cap of "
                           "4000 MB for all runtime states (ddtree.state_memory_fraction 0.25 of 16000 MB free"), line
    assert "the states built so far took 5500 MB" in line
    assert "Capture cuda graph failed" not in line  # not a capture failure: no eager relaunch


def test_a_dropped_state_is_measured_but_not_charged(rt: ModuleType) -> None:
    cfg = _cfg(rt, {"budgets": [4, 16], "on_capture_failure": "drop", "state_memory_fraction": 0.1},
               launch=(4, 4))
    device = _FakeDevice(10_000.0)  # cap 1000 MB
    memory, outcomes = _build_all(rt, cfg, device, {16: (500, 1500)}, launch=4, fail=(16,))
    assert (outcomes[0].cuda_graph, outcomes[0].memory_mb, memory.used_mb) == ("dropped", 2000.0, 0.0)


def test_memory_freed_during_a_build_counts_as_zero(rt: ModuleType) -> None:
    cfg = _cfg(rt, {"budgets": [4, 8]}, launch=(4, 4))
    device = _FakeDevice(1000.0)
    memory, outcomes = _build_all(rt, cfg, device, {8: (-50, 0)}, launch=4)  # another tenant freed memory
    assert outcomes[0].memory_mb == 0.0 and memory.used_mb == 0.0


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
