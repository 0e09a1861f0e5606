"""The canary gate on real simulated servers (a process-managed local host, the simulator
run by an interpreter whose SGLang has the DDTree bundle deployed): the baseline's own
log-probabilities decide whether a changed greedy token is a near-tie or a defect, and the
speed of the same requests before and after the change is judged.

* one confident token changed at position >= 200 of one prompt
  (``SIM_DDTREE_FAULT=late_token``): rejected, though every other prompt agrees to the end;
* against one baseline (the target alone, in real time: ``SIM_TIME_SCALE=1``, so decode
  speed is judged), a divergence at an exact tie of the target (``SIM_TARGET_TIE_AT`` makes
  the model tie, ``SIM_DDTREE_FAULT=tie_flip`` breaks the tie the other way) is accepted,
  with the healthy canary's speed judged and passed; a canary 4x slower than before
  (``SIM_DDTREE_FAULT=slow``) is rejected.

The first goes through the CLI (``restart --canary``, in-process); the second asks the gate
directly (``capture_baseline`` / ``check_gate``), so that one baseline serves both canaries,
with shorter prompts than the default gate's, since a 4x slower server takes its time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_json import read_envelope
from minisglang import deployed_python
from testports import free_port

from ddtree_ops.inventory import load_inventory
from ddtree_ops.inventory_types import Host
from ddtree_ops.rollout.executor import capture_baseline, check_gate
from ddtree_ops.rollout.gate import DEFAULT_TIE_EPSILON, GateSpec, gate_prompts
from ddtree_ops.service import RunConfig, lifecycle
from ddtree_ops.service.manager import ProcessManager
from ddtree_ops.transport.local import LocalTransport

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TREE = ("--algorithm", "DDTREE", "--budget", "4", "--topk", "4")
# A short load and warmup; decode graphs of a small batch ceiling, whose simulated capture
# takes 2 s instead of 4.6 (real time costs it in full).
SERVER_ARGS = ["--cuda-graph-max-bs-decode", "8"]


@pytest.fixture
def inventory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """``make(env, gpu=..., scale=...)``: an inventory of one local host ``c1`` whose server is
    the simulator with ``env``; whatever serves there is stopped at the end."""
    monkeypatch.setenv("DDTREE_OPS_STATE", str(tmp_path / "state.json"))
    python = deployed_python()
    port = free_port()
    made: list[Path] = []

    def make(env: dict[str, str], *, gpu: str = "rtx-pro-6000", scale: str = "1") -> Path:
        server = {"command": "{python} -m ddtree_ops.sim", "model_path": "sim/qwen3-8b",
                  "draft_model_path": "sim/qwen3-8b-dflash", "port": port, "expected_load_s": 5,
                  "extra_args": SERVER_ARGS,
                  "env": {"SIM_GPU": gpu, "SIM_LOAD_S": "0.2", "SIM_WARMUP_S": "0.2", "SIM_TIME_SCALE": scale,
                          "SIM_SEED": "0", **env}}
        host = {"ansible_connection": "local", "ddtree": {"python": python, "run_dir": str(tmp_path / "run"),
                                                         "gpu": gpu, "server": server}}
        path = tmp_path / f"inv{len(made)}.yaml"
        path.write_text(yaml.safe_dump({"all": {"hosts": {"c1": host}}}))
        made.append(path)
        return path

    yield make
    if made:
        host = load_inventory([made[-1]]).hosts["c1"]
        ProcessManager(LocalTransport("c1"), host).stop(grace_s=5)


def _gate(done: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    env = read_envelope(done.stdout)
    return env, env["data"]["rollout"]["gates"]["c1"]


def test_one_confident_token_changed_late_in_one_prompt_is_rejected(
    inventory: Callable[..., Path], cli: Callable[..., Any]
) -> None:
    # Compressed time: only the tokens are judged here (the gate says it does not judge speed).
    inv = inventory({"SIM_DDTREE_FAULT": "late_token"}, scale="0.1")
    done = cli("-i", str(inv), "--json", "restart", "c1", *TREE, "--canary", "c1")
    assert done.exit_code == 5, done.stdout + done.stderr
    env, gate = _gate(done)
    assert not gate["passed"] and gate["agreement"] > 0.9
    (late,) = gate["divergences"]  # one prompt, one token: the long code prompt's
    long_code = next(p for p in gate_prompts() if p.category == "code" and p.long)
    assert late["prompt"] == long_code.id and late["at"] >= 200 and not late["tie"]
    # Confident: the baseline (the target alone) put its own token far above the canary's.
    assert late["gap"] is not None and late["gap"] > 1.0 > DEFAULT_TIE_EPSILON
    assert gate["speed"]["judged"] is False and "SIM_TIME_SCALE 0.1" in gate["speed"]["note"]
    error = next(e for e in env["errors"] if e["host"] == "c1")
    assert error["code"] == "canary_failed"
    assert f"{long_code.id}@{late['at']}" in error["message"] and "was not at a near-tie" in error["message"]


def _with_env(host: Host, **env: str) -> Host:
    server = host.ddtree.server
    return replace(host, ddtree=replace(host.ddtree, server=replace(server, env={**server.env, **env})))


def test_one_baseline_judges_a_tie_flip_canary_passed_and_a_four_times_slower_one_rejected(
    inventory: Callable[..., Path],
) -> None:
    """Real time (decode speed is judged). Both canaries keep the target's tie at output
    index 40 of the code prompts, as the baseline's model has it; shorter prompts than the
    default gate's, since the slow canary takes its time."""
    host = load_inventory([inventory({"SIM_TARGET_TIE_AT": "40"}, gpu="b300")]).hosts["c1"]
    spec = GateSpec(max_new_tokens=48, long_tokens=96)
    transport = LocalTransport("c1")
    baseline = capture_baseline(transport, host, spec, cancel=threading.Event())  # the target alone, launched
    assert "launched the target alone (AR)" in baseline.note
    ddtree = RunConfig("DDTREE", budget=4, topk=4)

    flipped = _with_env(host, SIM_DDTREE_FAULT="tie_flip")
    lifecycle.restart(transport, lifecycle.prepare_restart(transport, flipped, ddtree))
    verdict = check_gate(transport, flipped, spec, baseline, speculative=True)["c1"]
    assert verdict.passed, verdict.reasons
    # Both code prompts diverge at 40, where the baseline's two best tie exactly; the canary
    # took the other one, and each prompt is compared up to there.
    assert [(d.prompt, d.at, d.tie, d.gap) for d in verdict.divergences] == [
        (p.id, 40, True, 0.0) for p in spec.prompts if p.category == "code"]
    assert all(d.got != d.want for d in verdict.divergences)
    # DDTREE decodes faster than the target alone it replaced, on the same requests.
    assert verdict.speed is not None and verdict.speed.judged and verdict.speed.prompts == 6
    assert verdict.speed.ratio is not None and verdict.speed.ratio >= 0.9

    slow = _with_env(host, SIM_DDTREE_FAULT="slow")
    lifecycle.restart(transport, lifecycle.prepare_restart(transport, slow, ddtree))
    verdict = check_gate(transport, slow, spec, baseline, speculative=True)["c1"]
    assert not verdict.passed and verdict.agreement == 1.0  # the right tokens, slowly
    assert verdict.speed is not None and verdict.speed.judged and verdict.speed.ratio is not None
    assert verdict.speed.ratio < 0.9
    (reason,) = verdict.reasons
    assert reason.startswith("decode 0.") and reason.endswith("is below 0.9 x before")
