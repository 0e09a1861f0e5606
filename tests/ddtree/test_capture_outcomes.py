"""How a runtime state's verify-graph capture ends, and what the toolkit reads of it (issue 55):
every capture is logged in SGLang's own words (so a death during one is a death during capture,
blamed on its budget), probed whether it returned or raised, and under TP > 1 decided alike on
every rank -- here with two real ranks of a gloo process group standing in for TP 2.

The bundle's ``ddtree_runtime.py`` is loaded by path exactly as deployed (tests/ddtree/conftest.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ddtree_ops.ddtree_core import REPO_ROOT
from ddtree_ops.service.fallback import LISTED_EAGER, capture_failure, failed_capture_budget, runtime_capture_failures
from ddtree_ops.service.logphases import LogEvent, Phase, PhaseTracker, classify


def _cfg(rt: ModuleType, section: dict[str, Any], launch: tuple[int, int] = (4, 4), eager_from: str | None = None):
    return rt.parse_runtime_config({"ddtree": section}, source="states.json", launch=rt.TreeShape(*launch),
                                   max_budget=256, eager_from=eager_from)


def _usable() -> None:
    pass


def test_each_capture_is_logged_in_sglangs_words_and_read_as_the_capture_phase(rt: ModuleType) -> None:
    cfg = _cfg(rt, {"budgets": [4, 8, 16]})
    lines: list[str] = []

    def capture(budget: int) -> str:
        if budget == 16:
            raise RuntimeError("CUDA out of memory")
        return f"graph-{budget}"

    for budget in (8, 16):
        rt.capture_outcome(budget, capture, graphs_enabled=True, config=cfg, probe=_usable, log=lines.append)
    assert [line.split(" CUDA graph ")[0] for line in lines] == [
        "Capture DDTREE budget 8 target verify", "Capture DDTREE budget 8 target verify",
        "Capture DDTREE budget 16 target verify", "Capture DDTREE budget 16 target verify"]
    # Never SGLang's whole-launch failure marker for a state served eager.
    assert not any(classify(line)[1] is LogEvent.CAPTURE_FAILED for line in lines)
    tracker = PhaseTracker("h")
    phases = []
    for line in lines:
        tracker.feed([f"[2026-12-06 10:00:00 TP0] {line}"], 1.0)
        phases.append(tracker.phase)
    assert phases == [Phase.CAPTURING, Phase.WARMUP, Phase.CAPTURING, Phase.WARMUP]
    assert "not captured (RuntimeError: CUDA out of memory): served eager" in lines[-1]


def test_a_death_while_a_runtime_state_captures_is_blamed_on_its_budget() -> None:
    """Before: a crash that killed the process during a runtime budget's capture was recorded
    at the launch budget (the log said nothing of the state, and the toolkit named none)."""
    tracker = PhaseTracker("h")
    tracker.feed(["[t TP0] Capture target verify CUDA graph begin. num_tokens_per_req=5",
                  "[t TP0] Capture target verify CUDA graph end. elapsed=2.00 s",
                  "[t TP0] Capture DDTREE budget 16 target verify CUDA graph begin. verify_width=17"], 5.0)
    why = capture_failure(tracker, alive=False)
    assert why == "server died during CUDA-graph capture of DDTREE budget 16 target verify"
    assert failed_capture_budget(why) == 16
    # A death in SGLang's own capture (the launch width) names no runtime budget.
    own = PhaseTracker("h")
    own.feed(["[t TP0] Capture target verify CUDA graph begin. num_tokens_per_req=5"], 5.0)
    assert failed_capture_budget(capture_failure(own, alive=False) or "") is None
    assert capture_failure(own, alive=True) is None


def test_a_capture_that_returned_on_a_poisoned_context_refuses_the_start(rt: ModuleType) -> None:
    cfg = _cfg(rt, {"budgets": [4, 16]})

    def poisoned() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(rt.CaptureContextPoisoned) as err:
        rt.capture_outcome(16, lambda b: "graph", graphs_enabled=True, config=cfg, probe=poisoned)
    line = str(err.value)
    assert classify(line)[1] is LogEvent.CAPTURE_FAILED and failed_capture_budget(line) == 16, line
    assert "the capture returned" in line and "\n" not in line


def test_the_relaunch_switch_serves_budgets_from_it_eager_and_is_not_a_failure(rt: ModuleType) -> None:
    cfg = _cfg(rt, {"budgets": [4, 8, 16, 32]}, eager_from="16")

    def never(budget: int) -> str:
        raise AssertionError(f"budget {budget} must not be captured")

    got = {b: rt.capture_outcome(b, never if b >= 16 else (lambda b: f"graph-{b}"), graphs_enabled=True,
                                 config=cfg, probe=_usable)[1] for b in (8, 16, 32)}
    assert [got[b].cuda_graph for b in (8, 16, 32)] == ["captured", "eager", "eager"]
    assert got[16].reason is not None and got[16].reason.startswith(LISTED_EAGER)
    assert rt.EAGER_FROM_ENV in got[16].reason
    # What /server_info reports of them is no capture failure for the toolkit to record.
    info = {"internal_states": [{"ddtree": {"states": [o.as_dict() for o in got.values()]}}]}
    assert runtime_capture_failures(info) == []
    with pytest.raises(rt.RuntimeConfigError, match=rt.EAGER_FROM_ENV):
        _cfg(rt, {"budgets": [4, 16]}, eager_from="sixteen")


_RANK = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[4])
    from ddtree_ops.ddtree_core import load_ddtree_runtime

    rt = load_ddtree_runtime()
    rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    agree = rt.tp_capture_agreement(dist.group.WORLD, world)
    cfg = rt.parse_runtime_config({"ddtree": {"budgets": [4, 16]}}, source="s.json", launch=rt.TreeShape(4, 4),
                                  max_budget=256)

    def usable():
        pass

    def poisoned():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def oom(budget):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    # (scenario, which rank fails, how): the other rank captures on a usable context.
    out = {}
    for name, failing, capture, probe in (("all-captured", None, None, None), ("oom-on-1", 1, oom, usable),
                                          ("poisoned-on-0", 0, None, poisoned)):
        mine = rank == failing
        try:
            graph, outcome = rt.capture_outcome(16, capture if mine else (lambda b: f"graph-{b}"),
                                                graphs_enabled=True, config=cfg,
                                                probe=probe if mine else usable, agree=agree)
            out[name] = {"outcome": outcome.cuda_graph}
        except Exception as exc:
            out[name] = {"raised": type(exc).__name__, "line": str(exc)}
    print(json.dumps(out), flush=True)
    # Not torch's teardown: gloo's process-group destructor sometimes aborts at exit
    # ("terminate called without an active exception") once the work is done.
    os._exit(0)
""")


@pytest.mark.timeout(120)
def test_tp_ranks_decide_a_capture_alike(tmp_path: Path) -> None:
    """N3: two gloo ranks (TP 2's CPU group) each capture budget 16. When one fails -- out of
    memory with a usable context, or a poisoned context -- both refuse the start, each with one
    line carrying SGLang's capture-failure marker and the budget (so the toolkit relaunches with
    16 eager on every rank); never graph on one rank and eager on the other."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", str(tmp_path / "store"), str(REPO_ROOT)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=110)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["all-captured"] for r in results] == [{"outcome": "captured"}] * 2
    oom = [r["oom-on-1"] for r in results]
    assert [o["raised"] for o in oom] == ["CaptureDisagreement", "CaptureDisagreement"], oom
    assert "here: RuntimeError: CUDA out of memory" in oom[1]["line"] and "here:" not in oom[0]["line"]
    poisoned = [r["poisoned-on-0"] for r in results]
    assert [p["raised"] for p in poisoned] == ["CaptureContextPoisoned", "CaptureDisagreement"], poisoned
    assert "TP rank(s) 0 of 2 (its CUDA context is unusable)" in poisoned[1]["line"]
    for got in (*oom, *poisoned):
        line = got["line"]
        assert "\n" not in line and line.startswith("Capture cuda graph failed: DDTREE budget 16: "), line
        assert classify(f"[t TP0] {line}")[1] is LogEvent.CAPTURE_FAILED and failed_capture_budget(line) == 16
    assert "TP rank(s) 1 of 2 (not captured)" in oom[0]["line"]


def test_a_live_launch_past_the_state_memory_cap_names_the_states_that_fit(rt: ModuleType) -> None:
    """N4: the refusal says which of the extra states fit under the cap (the largest set this
    launch holds), so the sweep's operator or the toolkit can launch the rest in another server."""
    cfg = _cfg(rt, {"budgets": [4, 8, 16, 32], "state_memory_fraction": 0.25})
    free = [16_000.0]
    memory = rt.StateMemory(lambda: free[0], cfg.state_memory_fraction)  # cap 4000 MB
    with pytest.raises(rt.StateMemoryExceeded) as err:
        for budget, took in ((8, 1000.0), (16, 2000.0), (32, 2500.0)):
            before = free[0]
            free[0] -= took
            memory.charge(budget, before, kept=True)
    line = str(err.value)
    assert "runtime state budget 32 took 2500 MB" in line and "the extra states that fit: [8, 16]" in line, line
    assert "\n" not in line and classify(line)[1] is None  # no capture marker: never relaunched eager
