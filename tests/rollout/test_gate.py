"""The canary gate's verdict (pure): greedy agreement, acceptance floors, failed requests."""

from __future__ import annotations

import pytest

from ddtree_ops.rollout.gate import (
    DEFAULT_ACCEPT_FLOOR,
    GateAnswer,
    GateSpec,
    agreement,
    answers,
    gate_prompts,
    judge_gate,
    ledger_floors,
)
from ddtree_ops.service.launch import RunConfig

SPEC = GateSpec()


def _answers(tokens: list[list[int]], *, verify: int = 16, error: str | None = None) -> tuple[GateAnswer, ...]:
    return tuple(GateAnswer(p.id, tuple(t), None, len(t), verify, error)
                 for p, t in zip(SPEC.prompts, tokens, strict=True))


BASE = [[i * 100 + j for j in range(64)] for i in range(len(SPEC.prompts))]


def test_the_gate_prompts_are_the_first_two_of_each_shipped_set() -> None:
    prompts = gate_prompts()
    assert [p.category for p in prompts] == ["chat", "chat", "code", "code", "math", "math"]
    assert len({p.text for p in prompts}) == 6
    round_ = SPEC.round(0.7)
    assert all(r["sampling_params"]["temperature"] == 0.7 and "sampling_seed" in r["sampling_params"]
               for r in round_)
    assert all("sampling_seed" not in r["sampling_params"] for r in SPEC.round(0.0))


def test_identical_greedy_tokens_and_good_acceptance_pass() -> None:
    after = {0.0: _answers(BASE), 0.7: _answers(BASE, verify=24)}
    verdict = judge_gate(SPEC, _answers(BASE), after, speculative=True)
    assert verdict.passed, verdict.reasons
    assert verdict.agreement == 1.0 and verdict.diverged == ()
    assert verdict.accept[0.0] == pytest.approx(64 / 16)
    assert verdict.floors[0.0].value == DEFAULT_ACCEPT_FLOOR


def test_agreement_counts_tokens_up_to_each_prompts_first_divergence() -> None:
    after = [list(t) for t in BASE]
    after[2][60] += 1  # one late near-tie flip: 4 of 384 tokens lost
    share = agreement(_answers(BASE), _answers(after))
    assert share.share == pytest.approx((384 - 4) / 384)
    assert share.diverged == ((SPEC.prompts[2].id, 60),)
    # ... which the default threshold tolerates (0.9896 >= 0.98)
    assert judge_gate(SPEC, _answers(BASE), {0.0: _answers(after)}, speculative=False).passed


def test_wrong_greedy_tokens_fail_naming_where_they_diverged() -> None:
    wrong = [[t + 1 if j > 0 else t for j, t in enumerate(toks)] for toks in BASE]
    verdict = judge_gate(SPEC, _answers(BASE), {0.0: _answers(wrong)}, speculative=False)
    assert not verdict.passed
    assert verdict.agreement == pytest.approx(6 / 384)
    assert "greedy agreement 0.016" in verdict.reasons[0] and "@1" in verdict.reasons[0]


def test_collapsed_acceptance_fails_against_the_floor_at_each_temperature() -> None:
    collapsed = {0.0: _answers(BASE, verify=64), 0.7: _answers(BASE, verify=64)}
    verdict = judge_gate(SPEC, _answers(BASE), collapsed, speculative=True)
    assert not verdict.passed
    assert [r.split(" at ")[1].split(" ")[0] for r in verdict.reasons] == ["T=0", "T=0.7"]
    # An AR server does not speculate: no floor is checked.
    assert judge_gate(SPEC, _answers(BASE), collapsed, speculative=False).passed


def test_a_failed_request_fails_the_gate() -> None:
    after = list(_answers(BASE, verify=24))
    after[3] = GateAnswer(after[3].prompt, None, None, 0, 0, "RemoteDisconnected: connection closed")
    verdict = judge_gate(SPEC, _answers(BASE), {0.0: _answers(BASE), 0.7: tuple(after)}, speculative=True)
    assert not verdict.passed and verdict.failed_requests == 1
    assert "RemoteDisconnected" in verdict.describe()


def test_the_agent_reply_becomes_answers_and_a_dead_server_fails_every_one() -> None:
    reply = {"alive": True, "results": [
        {"status": 200, "output_ids": [1, 2, 3], "completion_tokens": 3, "spec_verify_ct": 2, "text": "x"}
        for _ in SPEC.prompts]}
    got = answers(reply, SPEC)
    assert all(a.ok and a.tokens == (1, 2, 3) and a.verify_ct == 2 for a in got)
    reply["results"][1] = {"status": 500, "error": "boom"}
    assert answers(reply, SPEC)[1].error == "boom"
    assert all(not a.ok for a in answers(dict(reply, alive=False), SPEC))


def test_floors_come_from_the_ledgers_median_for_the_machine_type_and_tree() -> None:
    rows = [
        {"status": "ok", "gpu_name": "GPU X", "algorithm": "DDTREE", "budget": 16, "topk": 4, "temperature": 0.0,
         "accept_length": v} for v in (2.0, 3.0, 4.0)
    ] + [
        {"status": "ok", "gpu_name": "GPU Y", "algorithm": "DDTREE", "budget": 16, "topk": 4, "temperature": 0.0,
         "accept_length": 9.0},
        {"status": "failed", "gpu_name": "GPU X", "algorithm": "DDTREE", "budget": 16, "topk": 4,
         "temperature": 0.0, "accept_length": 0.5},
        {"status": "ok", "gpu_name": "GPU X", "algorithm": "DDTREE", "budget": 8, "topk": 4, "temperature": 0.0,
         "accept_length": 9.0},
    ]
    floors = ledger_floors(rows, machine_type="GPU X", run=RunConfig("DDTREE", budget=16, topk=4),
                           temperatures=(0.0, 0.7))
    assert floors[0.0].value == pytest.approx(0.75 * 3.0)
    assert "median 3.00 of 3 row(s)" in floors[0.0].source
    assert 0.7 not in floors  # no row at that temperature: the default stands
    assert GateSpec(floors=floors).floor(0.7).value == DEFAULT_ACCEPT_FLOOR
    assert ledger_floors(rows, machine_type=None, run=RunConfig("DDTREE", budget=16, topk=4),
                         temperatures=(0.0,)) == {}
