"""The canary gate's verdict (pure): each rule and its boundary — a changed greedy token
passes only as a near-tie of the baseline's own log-probabilities, enough tokens compared,
decode speed, acceptance floors, failed requests."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ddtree_ops.errors import (
    CanaryFailed,
    CommandTimeout,
    ConfigError,
    DriftError,
    Interrupted,
    LeaseHeld,
    ReadinessTimeout,
    ServerCrashed,
    ServiceError,
    UnitRefused,
    VerifyError,
)
from ddtree_ops.rollout.gate import (
    DEFAULT_ACCEPT_FLOOR,
    DEFAULT_TIE_EPSILON,
    TOP_LOGPROBS,
    GateAnswer,
    GateSpec,
    agreement,
    answers,
    decode_rate,
    gate_prompts,
    judge_gate,
    ledger_floors,
    rejects_canary,
    speed,
)
from ddtree_ops.service.launch import RunConfig

SPEC = GateSpec()
N = len(SPEC.prompts)
# Each prompt's baseline: distinct tokens; at every position the baseline's own token with
# logprob -0.1 and a runner-up (token + 10000) CONFIDENT nats below it.
BASE = [[i * 1000 + j for j in range(SPEC.tokens(p))] for i, p in enumerate(SPEC.prompts)]
CONFIDENT = 2.0


def _top(tokens: list[int], gaps: dict[int, float] | None = None) -> tuple[tuple[tuple[int, float], ...], ...]:
    """Per position the baseline's best two: its token, then token + 10000 ``gaps[pos]`` below."""
    gaps = gaps or {}
    return tuple(((t, -0.1), (t + 10000, -0.1 - gaps.get(j, CONFIDENT))) for j, t in enumerate(tokens))


def _answers(tokens: list[list[int]], *, verify: int = 16, rate: float | None = 100.0, scale: float | None = None,
             gaps: dict[int, dict[int, float]] | None = None, logprobs: bool = True) -> tuple[GateAnswer, ...]:
    gaps = gaps or {}
    return tuple(GateAnswer(p.id, tuple(t), None, len(t), verify, None,
                            top_logprobs=_top(t, gaps.get(i)) if logprobs else None, decode_tok_s=rate,
                            sim_time_scale=scale)
                 for i, (p, t) in enumerate(zip(SPEC.prompts, tokens, strict=True)))


def _with(tokens: list[list[int]], prompt: int, at: int, token: int) -> list[list[int]]:
    out = [list(t) for t in tokens]
    out[prompt][at] = token
    return out


def test_the_gate_prompts_two_long_all_in_one_batch_and_only_greedy_ones_ask_for_logprobs() -> None:
    prompts = gate_prompts()
    assert [p.category for p in prompts] == ["chat", "chat", "code", "code", "math", "math"]
    assert len({p.text for p in prompts}) == 6
    assert [SPEC.tokens(p) for p in prompts] == [256, 64, 256, 64, 64, 64]
    greedy = SPEC.round(0.0)
    assert [r["sampling_params"]["max_new_tokens"] for r in greedy] == [256, 64, 256, 64, 64, 64]
    assert all(r["return_logprob"] is True and r["top_logprobs_num"] == TOP_LOGPROBS and r["logprob_start_len"] == -1
               and "sampling_seed" not in r["sampling_params"] for r in greedy)
    assert all("return_logprob" not in r for r in SPEC.round(0.0, logprobs=False))
    sampled = SPEC.round(0.7)
    assert all(r["sampling_params"]["temperature"] == 0.7 and "sampling_seed" in r["sampling_params"]
               and "return_logprob" not in r for r in sampled)
    assert "2 x 256 + 4 x 64 tokens" in SPEC.describe() and "decode speed >= 0.9 x before" in SPEC.describe()


def test_identical_greedy_tokens_good_speed_and_acceptance_pass() -> None:
    after = {0.0: _answers(BASE, rate=180.0), 0.7: _answers(BASE, verify=24)}
    verdict = judge_gate(SPEC, _answers(BASE), after, speculative=True)
    assert verdict.passed, verdict.reasons
    assert verdict.agreement == 1.0 and verdict.divergences == () and verdict.baseline_logprobs
    assert verdict.accept[0.0] == pytest.approx(sum(map(len, BASE)) / (16 * N))
    assert verdict.floors[0.0].value == DEFAULT_ACCEPT_FLOOR
    assert verdict.speed is not None and verdict.speed.judged and verdict.speed.ratio == pytest.approx(1.8)
    assert "decode 1.80x before (100.0 -> 180.0 tok/s per request)" in verdict.describe()


def test_one_late_confident_token_fails_whatever_the_share_of_agreeing_tokens() -> None:
    # The operator's case: one token late in one long prompt; 99.2% of the tokens agree (the old
    # gate's 0.98 passed it).
    after = _with(BASE, 2, 250, BASE[2][250] + 10000)
    verdict = judge_gate(SPEC, _answers(BASE), {0.0: _answers(after)}, speculative=False)
    assert verdict.agreement > 0.99 and not verdict.passed and len(verdict.reasons) == 1
    assert verdict.divergences[0].gap == pytest.approx(CONFIDENT) and not verdict.divergences[0].tie
    assert f"{SPEC.prompts[2].id}@250" in verdict.reasons[0] and "not below the tie epsilon 0.125" in verdict.reasons[0]
    assert "greedy agreement 0.992" in verdict.describe()  # what the old gate passed


def test_a_divergence_is_forgiven_only_below_the_tie_epsilon() -> None:
    def judged(gap: float, spec: GateSpec = SPEC) -> bool:
        before = _answers(BASE, gaps={1: {40: gap}})
        after = _answers(_with(BASE, 1, 40, BASE[1][40] + 10000))
        return judge_gate(spec, before, {0.0: after}, speculative=False).passed

    assert judged(0.0)  # an exact tie
    assert judged(DEFAULT_TIE_EPSILON - 1e-6)
    assert not judged(DEFAULT_TIE_EPSILON)  # "below": the epsilon itself is a decision
    assert judged(0.3, replace(SPEC, tie_epsilon=0.31))
    assert not judged(0.0, replace(SPEC, tie_epsilon=0.0))  # 0 forgives nothing, not even an exact tie


def test_a_tie_ends_the_prompts_comparison_and_the_rest_may_differ() -> None:
    after = [list(t) for t in BASE]
    after[3][40:] = [t + 10000 for t in BASE[3][40:]]  # the runner-up at 40, then another text
    verdict = judge_gate(SPEC, _answers(BASE, gaps={3: {40: 0.0}}), {0.0: _answers(after)}, speculative=False)
    assert verdict.passed, verdict.reasons
    (tie,) = verdict.divergences
    assert (tie.prompt, tie.at, tie.tie, tie.gap) == (SPEC.prompts[3].id, 40, True, 0.0)
    assert verdict.agreement == pytest.approx((sum(map(len, BASE)) - 24) / sum(map(len, BASE)))
    assert "1 near-tie divergence(s)" in verdict.describe() and "a near-tie" in verdict.describe()


def test_a_token_the_baseline_did_not_list_or_no_baseline_logprobs_is_never_a_tie() -> None:
    stranger = _with(BASE, 0, 10, 77777)  # not among the baseline's best
    verdict = judge_gate(SPEC, _answers(BASE, gaps={0: {10: 0.0}}), {0.0: _answers(stranger)}, speculative=False)
    assert not verdict.passed and "not among the baseline's best 2" in verdict.reasons[0]
    flip = _with(BASE, 0, 10, BASE[0][10] + 10000)
    verdict = judge_gate(SPEC, _answers(BASE, logprobs=False), {0.0: _answers(flip)}, speculative=False)
    assert not verdict.passed and not verdict.baseline_logprobs
    assert "no baseline log-probabilities there" in verdict.reasons[0]
    # ... while identical tokens need none.
    assert judge_gate(SPEC, _answers(BASE, logprobs=False), {0.0: _answers(BASE)}, speculative=False).passed


def test_an_answer_that_ends_early_diverges_where_it_ended() -> None:
    short = [list(t) for t in BASE]
    short[2] = short[2][:100]
    agree = agreement(_answers(BASE), _answers(short))
    (d,) = agree.divergences
    assert (d.at, d.got, d.tie) == (100, None, False) and "ended early" in d.describe()


def test_too_few_tokens_compared_fails_at_the_agreement_floor() -> None:
    total = sum(map(len, BASE))
    # Ties at position 0 of every prompt but the first long one: only its 256 tokens compared.
    after = [list(t) for t in BASE]
    gaps: dict[int, dict[int, float]] = {}
    for i in range(1, N):
        after[i][0] += 10000
        gaps[i] = {0: 0.0}
    before = _answers(BASE, gaps=gaps)
    share = 256 / total
    at_floor = judge_gate(replace(SPEC, agreement=share), before, {0.0: _answers(after)}, speculative=False)
    assert at_floor.passed, at_floor.reasons
    below = judge_gate(replace(SPEC, agreement=share + 0.01), before, {0.0: _answers(after)}, speculative=False)
    assert not below.passed and "too few tokens compared" in below.reasons[0]


def test_speed_is_the_median_of_per_prompt_ratios_with_its_boundary() -> None:
    before = _answers(BASE, rate=100.0)

    def after(rates: list[float]) -> tuple[GateAnswer, ...]:
        return tuple(replace(a, decode_tok_s=r) for a, r in zip(_answers(BASE), rates, strict=True))

    at_floor = judge_gate(SPEC, before, {0.0: after([90.0] * N)}, speculative=False)
    assert at_floor.passed and at_floor.speed is not None and at_floor.speed.ratio == pytest.approx(0.9)
    slow = judge_gate(SPEC, before, {0.0: after([89.0] * N)}, speculative=False)
    assert not slow.passed and "decode 0.89x before (100.0 -> 89.0 tok/s per request) is below 0.9" in slow.reasons[0]
    # One outlier (a prompt that stalled behind the machine's other work) does not decide it ...
    assert judge_gate(SPEC, before, {0.0: after([10.0, 150, 150, 150, 150, 150])}, speculative=False).passed
    # ... a canary 4x slower on every prompt does.
    quarter = judge_gate(SPEC, before, {0.0: after([25.0] * N)}, speculative=False)
    assert not quarter.passed and quarter.speed is not None and quarter.speed.ratio == pytest.approx(0.25)


def test_speed_is_not_judged_on_a_compressed_simulator_clock_or_when_switched_off() -> None:
    slow = tuple(replace(a, decode_tok_s=25.0) for a in _answers(BASE, scale=0.1))
    compressed = speed(_answers(BASE, scale=0.1), slow, min_speed=0.9)
    assert not compressed.judged and "SIM_TIME_SCALE 0.1" in compressed.note
    assert judge_gate(SPEC, _answers(BASE, scale=0.1), {0.0: slow}, speculative=False).passed
    # Real time (scale 1) is judged.
    real = tuple(replace(a, decode_tok_s=25.0) for a in _answers(BASE, scale=1.0))
    assert speed(_answers(BASE, scale=1.0), real, min_speed=0.9).judged
    off = judge_gate(replace(SPEC, min_speed=0.0), _answers(BASE), {0.0: slow}, speculative=False)
    assert off.passed and off.speed is not None and off.speed.note == "--gate-min-speed 0"
    unknown = speed(_answers(BASE, rate=None), _answers(BASE, rate=None), min_speed=0.9)
    assert not unknown.judged and unknown.ratio is None


def test_the_decode_rate_leaves_the_first_token_out_where_the_answer_allows() -> None:
    assert decode_rate({"decode_throughput": 80.0, "e2e_latency": 9.0}, 65) == 80.0
    assert decode_rate({"e2e_latency": 2.5, "first_token_latency": 0.5}, 65) == pytest.approx(64 / 2.0)
    assert decode_rate({"e2e_latency": 2.0, "seconds": 3.0}, 64) == pytest.approx(32.0)
    assert decode_rate({"seconds": 4.0}, 64) == pytest.approx(16.0)
    assert decode_rate({"e2e_latency": True, "seconds": 0}, 64) is None
    assert decode_rate({"seconds": 4.0}, 1) is None


def test_collapsed_acceptance_fails_against_the_floor_at_each_temperature() -> None:
    collapsed = {0.0: _answers(BASE, verify=256), 0.7: _answers(BASE, verify=256)}
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
        {"status": 200, "output_ids": [1, 2, 3], "completion_tokens": 3, "spec_verify_ct": 2, "text": "x",
         "e2e_latency": 0.5, "sim_time_scale": 1.0,
         "top_logprobs": [[[1, -0.5], [9, -0.2]], "junk", [[3, True], [3, -0.1]]]}
        for _ in SPEC.prompts]}
    got = answers(reply, SPEC)
    assert all(a.ok and a.tokens == (1, 2, 3) and a.verify_ct == 2 for a in got)
    # Best first; a malformed row (or pair) shows no tie there.
    assert got[0].top_logprobs == (((9, -0.2), (1, -0.5)), None, ((3, -0.1),))
    assert got[0].decode_tok_s == pytest.approx(6.0) and got[0].sim_time_scale == 1.0
    reply["results"][1] = {"status": 500, "error": "boom"}
    assert answers(reply, SPEC)[1].error == "boom"
    assert all(not a.ok for a in answers(dict(reply, alive=False), SPEC))


def test_failures_before_the_gate_that_reject_the_canary() -> None:
    for rejected in (ServerCrashed("exited 1"), ReadinessTimeout("hung"), ServiceError("start refused"),
                     VerifyError("verify failed")):
        assert rejects_canary(rejected), rejected
    for kept in (CommandTimeout("ssh"), ConfigError("bad"), DriftError("drift"), UnitRefused("masked"),
                 LeaseHeld("sweep"), CanaryFailed("gate"), Interrupted("^C")):
        assert not rejects_canary(kept), kept


def test_bad_gate_options_are_refused_naming_the_option() -> None:
    with pytest.raises(ConfigError, match="--gate-tie-epsilon -1"):
        GateSpec(tie_epsilon=-1)
    with pytest.raises(ConfigError, match="--gate-min-speed nan"):
        GateSpec(min_speed=float("nan"))
    with pytest.raises(ConfigError, match="--gate-agreement 1.5"):
        GateSpec(agreement=1.5)


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
