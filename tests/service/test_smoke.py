"""The speculative smoke: a restart is ready only after real decodes, and a crash of the
first decodes with decode CUDA graphs on falls back to eager like a capture failure.

The pure half (rounds, verdicts, the crash line) is tested on answers shaped like the
agent's; the rest against the real simulator over the local transport, with its
replay-crash mode (``SIM_REPLAY_CRASH_BUDGET_OVER``: a speculative server with decode
graphs on and a larger tree budget dies at its first decode, with the lines SGLang logs
for a CUDA error at graph replay) and its sampled-crash mode (``SIM_CRASH_SAMPLED``: a
decode with a request at temperature > 0 takes the scheduler down, graphs or not).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_json import json_data
from minisglang import deployed_python
from simhosts import free_port

from ddtree_ops.bench import ledger
from ddtree_ops.errors import ConfigError, ServerCrashed
from ddtree_ops.service import RunConfig, lifecycle
from ddtree_ops.service.lifecycle import LaunchFacts, RestartRequest
from ddtree_ops.service.logphases import Phase, PhaseEvent
from ddtree_ops.service.smoke import (
    GREEDY,
    SmokeFailure,
    SmokeSampling,
    SmokeSpec,
    crash_line,
    judge_smoke,
)
from ddtree_ops.state import StateStore

pytestmark = pytest.mark.timeout(180)

DDTREE16 = RunConfig("DDTREE", budget=16, topk=4)
FAST = {"poll_interval_s": 0.2, "stop_grace_s": 5.0}
REPLAY_CRASH = {"SIM_REPLAY_CRASH_BUDGET_OVER": "8"}
# The fallback scenario runs over both transports; these variants add nothing over SSH.
LOCAL_ONLY = pytest.mark.parametrize("transport_kind", ["local"])


def _req(host: Any, run: RunConfig, **options: Any) -> RestartRequest:
    return RestartRequest(host, run, LaunchFacts("0.5.23"), **(FAST | options))


# ---------------------------------------------------------------------- pure parts


def _answer(spec: SmokeSpec, *, alive: bool = True, tokens: int = 32, verify: int | None = 10,
            broken: dict[str, Any] | None = None, at: int | None = None) -> dict[str, Any]:
    results = []
    for n, rnd in enumerate(spec.rounds()):
        for _ in rnd:
            r: dict[str, Any] = {"round": n, "status": 200, "completion_tokens": tokens}
            if verify is not None:
                r["spec_verify_ct"] = verify
            results.append(r)
        if at == n:
            results[-1] = {"round": n, **(broken or {})}
            break
    return {"results": results, "seconds": 1.5, "alive": alive}


def test_rounds_greedy_first_then_each_setting_alone_and_batched() -> None:
    spec = SmokeSpec.for_samplings([SmokeSampling.of(0.7), SmokeSampling.of(0.0, 0.9, 20), SmokeSampling.of(0.7)])
    assert spec.samplings == (GREEDY, SmokeSampling(0.7))
    rounds = spec.rounds()
    assert [len(r) for r in rounds] == [1, 4, 1, 4]
    assert rounds[0][0]["sampling_params"] == {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    assert {r["sampling_params"]["temperature"] for r in rounds[3]} == {0.7}
    assert len({r["text"] for r in rounds[1]}) == 4  # no shared prompt within a batch
    # SGLang's "off" values are not sent; real ones are.
    assert SmokeSampling.of(0.5, 1.0, -1) == SmokeSampling(0.5)
    assert SmokeSampling.of(0.5, 0.9, 20).params(8) == {
        "max_new_tokens": 8, "temperature": 0.5, "ignore_eos": True, "top_p": 0.9, "top_k": 20,
    }
    with pytest.raises(ConfigError, match="batch"):
        SmokeSpec(batch=0)
    with pytest.raises(ConfigError, match="temperature"):
        SmokeSpec(samplings=(SmokeSampling(-1.0),))


def test_verdicts() -> None:
    spec = SmokeSpec.for_samplings([SmokeSampling(0.7)])
    ok = judge_smoke(_answer(spec), spec, speculative=True)
    assert ok.passed and ok.requests == 10 and ok.verify_ct == 100 and ok.accept_length == pytest.approx(3.2)
    assert ok.failure is None and "accept length 3.20" in ok.detail

    died = judge_smoke(_answer(spec, alive=False, at=3, broken={"error": "RemoteDisconnected: closed"}), spec,
                       speculative=True)
    assert died.failure is SmokeFailure.CRASHED and died.failure.decode_broke
    assert "batch of 4 at temperature 0.7: RemoteDisconnected" in died.detail

    hung = judge_smoke(_answer(spec, at=0, broken={"error": "timed out after 60 s", "timed_out": True}), spec,
                       speculative=True)
    assert hung.failure is SmokeFailure.HUNG and hung.failure.decode_broke

    refused = judge_smoke(_answer(spec, at=2, broken={"status": 400, "error": '{"error": "no sampler"}'}), spec,
                          speculative=True)
    assert refused.failure is SmokeFailure.FAILED and not refused.failure.decode_broke
    assert "one request at temperature 0.7" in refused.detail

    assert judge_smoke(_answer(spec, tokens=0), spec, speculative=False).detail.endswith("no tokens came back")
    no_spec = judge_smoke(_answer(spec, verify=None), spec, speculative=True)
    assert no_spec.failure is SmokeFailure.FAILED and "did not speculate" in no_spec.detail
    assert judge_smoke(_answer(spec, verify=None), spec, speculative=False).passed  # AR: no verify rounds
    assert judge_smoke(_answer(spec, tokens=5, verify=10), spec, speculative=True).detail == "accept length 0.50 < 1"
    short = dict(_answer(spec))
    short["results"] = short["results"][:3]
    assert judge_smoke(short, spec, speculative=True).detail == "3 of 10 requests answered"


def test_crash_line_is_the_error_the_traceback_ends_with() -> None:
    lines = [
        "[2026-11-30 10:00:00] Scheduler hit an exception: Traceback (most recent call last):",
        '  File "sglang/srt/managers/scheduler.py", in event_loop_overlap',
        "torch.AcceleratorError: CUDA error: an illegal memory access was encountered",
        "[2026-11-30 10:00:00] Received sigquit from a child process. It usually means the child failed.",
    ]
    assert crash_line(lines) == "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"
    assert crash_line(["[2026-11-30 10:00:00 TP1] RuntimeError: boom"]) == "RuntimeError: boom"
    assert crash_line(lines[:2] + lines[3:]) is None


# ------------------------------------------------------------- against the simulator


def test_replay_crash_falls_back_to_eager_with_the_reason_and_is_remembered(sim_target, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    host = sim_target.host(gpu="h200", extra_env=REPLAY_CRASH)
    state = StateStore(tmp_path / "state.json")
    events: list[PhaseEvent] = []
    t = sim_target.transport
    first = lifecycle.restart(t, _req(host, DDTREE16), state=state, on_phase=events.append)
    assert (first.cuda_graph, first.attempts) == (False, 2)
    assert first.fallback_reason == (
        "first decode crashed: torch.AcceleratorError: CUDA error: an illegal memory access was encountered"
    )
    seen = [e.phase for e in events]
    # Graphs captured fine; the first decodes crashed; eager relaunch; its smoke passed.
    assert seen.index(Phase.CAPTURING) < seen.index(Phase.SMOKE) < seen.index(Phase.FALLBACK_EAGER)
    assert seen[-2:] == [Phase.SMOKE, Phase.READY]
    assert first.smoke is not None and first.smoke.passed and first.smoke.verify_ct > 0
    assert sim_target.server_info(host)["cuda_graph_backend_decode"] == "disabled"
    [record] = state.fallbacks()
    assert record.reason == first.fallback_reason

    # Remembered: the next restart goes eager at once, saying why.
    second = lifecycle.restart(t, _req(host, DDTREE16), state=state)
    assert (second.cuda_graph, second.attempts) == (False, 1)
    assert second.fallback_reason == f"recorded fallback: {first.fallback_reason}"
    # Below the crash threshold graphs stay on: the condition is the configuration's.
    small = lifecycle.restart(t, _req(host, RunConfig("DDTREE", budget=8, topk=4)), state=state)
    assert (small.cuda_graph, small.attempts, small.fallback_reason) == (True, 1, None)


@LOCAL_ONLY
def test_without_the_smoke_the_crashing_server_is_called_ready(sim_target, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """What the smoke is for: /health_generate alone passes a server whose first decode
    crashes (one token at temperature 0 is a prefill)."""
    host = sim_target.host(gpu="h200", extra_env=REPLAY_CRASH)
    state = StateStore(tmp_path / "state.json")
    result = lifecycle.restart(sim_target.transport, _req(host, DDTREE16, smoke=None), state=state)
    assert result.cuda_graph is True and result.smoke is None and Phase.SMOKE not in result.phase_durations


@LOCAL_ONLY
def test_replay_crash_with_graphs_forced_on_is_an_error_and_the_server_is_stopped(sim_target, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    host = sim_target.host(gpu="h200", extra_env=REPLAY_CRASH)
    forced = RunConfig("DDTREE", budget=16, topk=4, cuda_graph="on")
    state = StateStore(tmp_path / "state.json")
    with pytest.raises(ServerCrashed) as info:
        lifecycle.restart(sim_target.transport, _req(host, forced), state=state)
    message = str(info.value)
    assert "smoke failed with decode CUDA graphs on: first decode crashed: torch.AcceleratorError" in message
    assert "log tail:" in message and "Received sigquit" in message
    assert state.fallbacks() == []  # forced graphs: nothing to remember, the operator asked for them
    assert not lifecycle.service_status(sim_target.transport, host).running


@LOCAL_ONLY
def test_a_sampled_request_that_kills_the_server_is_reported_not_ready(sim_target, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Greedy decodes work; the first request at the sweep's temperature takes the
    scheduler down, with graphs (-> eager relaunch) and then without (-> error). Eager
    did not help, so no fallback is remembered."""
    host = sim_target.host(gpu="h200", extra_env={"SIM_CRASH_SAMPLED": "1"})
    smoke = SmokeSpec.for_samplings([SmokeSampling(0.7)])
    state = StateStore(tmp_path / "state.json")
    events: list[PhaseEvent] = []
    with pytest.raises(ServerCrashed) as info:
        lifecycle.restart(sim_target.transport, _req(host, DDTREE16, smoke=smoke), state=state,
                          on_phase=events.append)
    message = str(info.value)
    assert "speculative smoke failed in eager mode: first decode crashed: RuntimeError: DDTree sampled" in message
    assert [e.phase for e in events].count(Phase.FALLBACK_EAGER) == 1
    assert Phase.READY not in [e.phase for e in events if e.note and e.note.startswith("serving")]
    assert not lifecycle.service_status(sim_target.transport, host).running
    assert state.fallbacks() == []
    # Greedy only: the same server is fine, on graphs.
    ok = lifecycle.restart(sim_target.transport, _req(host, DDTREE16), state=state)
    assert ok.smoke is not None and ok.smoke.passed and ok.cuda_graph is True


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DDTREE_OPS_STATE": str(cwd / "state.json"), "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "ddtree_ops", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=150, env=env)


def test_a_sweep_over_a_replay_crash_host_writes_only_successful_rows(tmp_path: Path) -> None:
    """The issue's end-to-end case through the CLI: `restart` ends ready in eager mode with
    the reason named, the next restart goes eager directly, and a sweep over the host
    writes only ok rows, each saying its smoke passed."""
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"sim-x": {
        "ansible_connection": "local",
        # A prefix holding the real SGLang 0.5.23 files (the eager flags follow its version)
        # and the DDTree bundle deployed.
        "ddtree": {"python": deployed_python(),
                   "run_dir": str(tmp_path / "run"), "server": {
            "command": "{python} -m ddtree_ops.sim", "model_path": "sim/m", "draft_model_path": "sim/d",
            "port": free_port(), "expected_load_s": 2,
            "env": {"SIM_GPU": "h200", "SIM_LOAD_S": "0.5", "SIM_TIME_SCALE": "0.2", **REPLAY_CRASH}}}}}}}))
    restart = ("-i", str(inv), "--json", "restart", "sim-x", "--algorithm", "DDTREE", "--budget", "16", "--topk", "4")
    try:
        _restart_then_sweep(inv, restart, tmp_path)
    finally:  # the sweep puts the server back (issue 53): it must not outlive the test
        _cli("-i", str(inv), "stop", "sim-x", cwd=tmp_path)


def _restart_then_sweep(inv: Path, restart: tuple[str, ...], tmp_path: Path) -> None:
    first = _cli(*restart, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    [row] = json_data(first.stdout)["hosts"]
    result = row["result"]
    assert (result["cuda_graph"], result["attempts"]) == (False, 2)
    assert result["fallback_reason"].startswith("first decode crashed: torch.AcceleratorError: CUDA error")
    assert result["smoke"]["passed"] is True and result["smoke"]["verify_ct"] > 0
    assert "smoke" in result["phase_durations"]

    second = _cli(*restart, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    again = json_data(second.stdout)["hosts"][0]["result"]
    assert (again["cuda_graph"], again["attempts"]) == (False, 1)
    assert again["fallback_reason"] == f"recorded fallback: {result['fallback_reason']}"

    (tmp_path / "p.jsonl").write_text('{"prompt": "hello there"}\n{"prompt": "general kenobi"}\n')
    sweep = tmp_path / "s.yaml"
    sweep.write_text(yaml.safe_dump({
        "name": "smoke", "targets": ["all"], "warmup": 0,
        "grid": {"algorithm": ["ddtree"], "budget": [16], "topk": [4], "temperature": [0.0, 0.7], "concurrency": [2]},
        "workload": {"prompt_files": ["p.jsonl"], "num_prompts": 4, "max_new_tokens": 24},
    }))
    out = tmp_path / "ledger.jsonl"
    bench = _cli("-i", str(inv), "bench", "--sweep", str(sweep), "--out", str(out), cwd=tmp_path)
    assert bench.returncode == 0, bench.stderr[-3000:]
    rows = ledger.read_ledger(out).rows
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows), rows
    for r in rows:
        assert (r["smoke"], r["cuda_graph"]) == ("passed", False)
        assert r["fallback_reason"] == f"recorded fallback: {result['fallback_reason']}"
        assert r["smoke_s"] > 0 and r["readiness_s"]["smoke"] == pytest.approx(r["smoke_s"])
