"""The readiness check of a tuned DDTREE policy, and reading a launch record back: pure."""

from __future__ import annotations

from pathlib import Path

from simhosts import sim_host

from ddtree_ops.service.lifecycle import PreviousServer, _previous_spec, _run_of
from ddtree_ops.service.readiness import policy_mismatch

POLICY = {"1": {"budget": 8, "topk": 4}, "8": {"budget": 4, "topk": 2}}


def info(ddtree: object) -> dict[str, object]:
    return {"internal_states": [{"avg_spec_accept_length": 2.0, "ddtree": ddtree}]}


def test_a_server_following_the_files_policy_passes() -> None:
    live = {"mode": "policy", "active": {"budget": 8, "topk": 4}, "policy": dict(POLICY), "budgets": [4, 8]}
    assert policy_mismatch(info(live), POLICY) is None


def test_every_other_answer_names_what_is_wrong() -> None:
    pinned = {"mode": "pinned", "policy": dict(POLICY)}
    assert policy_mismatch(info(pinned), POLICY) == "internal_states[0].ddtree.mode is 'pinned', not 'policy'"
    other = {"mode": "policy", "policy": {"1": {"budget": 8, "topk": 4}}}
    assert "internal_states[0].ddtree.policy is {'1'" in (policy_mismatch(info(other), POLICY) or "")
    # a bundle without runtime states reports no live ddtree state at all
    assert "no internal_states[0].ddtree" in (policy_mismatch({"internal_states": [{}]}, POLICY) or "")
    assert "no internal_states[0].ddtree" in (policy_mismatch({}, POLICY) or "")


def test_a_launch_record_reads_back_as_the_launch_it_was(tmp_path: Path) -> None:
    host = sim_host(tmp_path / "run")
    args = ("--model-path", "m", "--port", "1", "--speculative-algorithm", "DDTREE",
            "--speculative-draft-model-path", "d", "--speculative-num-draft-tokens", "9",
            "--speculative-eagle-topk", "4", "--speculative-adaptive-config", "/p/policy json")
    run = _run_of(args)
    assert (run.algorithm, run.budget, run.topk, run.adaptive_config) == ("DDTREE", 8, 4, "/p/policy json")
    assert _run_of(("--speculative-algorithm", "DFLASH", "--speculative-num-draft-tokens", "16")).budget == 16
    assert _run_of(("--model-path", "m")).algorithm == "AR"
    # the argv's tail the record names as its launch command is what readiness compares
    previous = PreviousServer(host.name, running=True, pid=1, argv=("python", "-m", "ddtree_ops.sim", *args),
                              launch_command=" ".join(args), cuda_graph=False)
    spec = _previous_spec(host, previous)
    assert spec.server_args == args and spec.argv == previous.argv and not spec.cuda_graph
