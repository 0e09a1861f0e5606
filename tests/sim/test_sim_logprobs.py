"""The simulator's log-probabilities (``return_logprob`` / ``top_logprobs_num`` /
``logprob_start_len``, laid out as SGLang 0.5.23 returns them) and the DDTree plugin faults a
canary gate must tell apart: a target with an exact tie (``SIM_TARGET_TIE_AT``) that the
faulty plugin breaks the other way (``tie_flip``), a worker that cannot build
(``crash_load``). Real simulator processes. (``late_token`` and ``slow`` are judged through
the gate in tests/rollout/test_gate_canary.py.)"""

from __future__ import annotations

import math
import signal
from typing import Any

import httpx
import pytest

from ddtree_ops.sim.args import SimSettingsError, sim_settings_from_env

DDTREE = ("--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", "5", "--speculative-eagle-topk", "4")
CODE = "def merge(a, b): import heapq"  # the simulator's code category
CHAT = "Tell me about the weather in Lisbon today"
TIE_AT = 30


def _generate(sim: Any, text: str, tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"text": text, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
            **extra}
    reply = httpx.post(sim.url + "/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def test_logprobs_as_sglang_returns_them_and_an_exact_tie_broken_the_other_way(sim_factory: Any) -> None:
    env = {"SIM_TARGET_TIE_AT": str(TIE_AT)}
    target = sim_factory(env=env)  # the target alone, with the model's tie
    flip = sim_factory(*DDTREE, env={**env, "SIM_DDTREE_FAULT": "tie_flip"})
    for sim in (target, flip):
        sim.wait_ready()
    ask = {"return_logprob": True, "top_logprobs_num": 3}

    base = _generate(target, CODE, 256, **ask)
    ids, meta = base["output_ids"], base["meta_info"]
    # 0.5.23's layout: [logprob, token_id, None] per output token; top rows best first.
    assert meta["output_token_logprobs_length"] == len(meta["output_token_logprobs"]) == len(ids) == 256
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ids
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []  # logprob_start_len -1
    tops = meta["output_top_logprobs"]
    assert len(tops) == 256 and all(len(row) == 3 and row[0][2] is None for row in tops)
    for j, row in enumerate(tops):
        values = [v for v, _, _ in row]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        assert meta["output_token_logprobs"][j][0] == values[0]  # greedy: the emitted token is a best one
    # The model's exact tie, where it was put (a code prompt's output index TIE_AT), and nowhere else.
    assert tops[TIE_AT][0][0] == tops[TIE_AT][1][0]
    assert all(row[0][0] > row[1][0] for j, row in enumerate(tops) if j != TIE_AT)
    assert ids[TIE_AT] == min(tops[TIE_AT][0][1], tops[TIE_AT][1][1])  # argmax keeps the first of a tie
    chat = _generate(target, CHAT, 256, **ask)
    chat_tops = chat["meta_info"]["output_top_logprobs"]
    assert chat_tops[TIE_AT][0][0] > chat_tops[TIE_AT][1][0]  # a chat prompt has no tie there

    # tie_flip: the same tokens up to the tie, the other tied token there, the same log-probabilities.
    flipped = _generate(flip, CODE, 256, **ask)
    assert _first_divergence(ids, flipped["output_ids"]) == TIE_AT
    assert flipped["output_ids"][TIE_AT] == max(tops[TIE_AT][0][1], tops[TIE_AT][1][1])
    assert flipped["meta_info"]["output_top_logprobs"][:TIE_AT + 1] == tops[:TIE_AT + 1]
    assert _generate(flip, CHAT, 256)["output_ids"] == chat["output_ids"]
    # (late_token: tests/rollout/test_gate_canary.py, through the gate.)
    _logprob_start_len_and_bad_logprob_fields(target)


def _logprob_start_len_and_bad_logprob_fields(sim: Any) -> None:
    prompt = "one two three four five"
    meta = _generate(sim, prompt, 4, return_logprob=True, top_logprobs_num=2, logprob_start_len=2)["meta_info"]
    # From token 2 of the prompt: the first has nothing before it scored (None), as in 0.5.23.
    tokens = meta["input_token_logprobs"]
    assert len(tokens) == 3 and tokens[0][0] is None and all(v < 0 for v, _, _ in tokens[1:])
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == 3
    assert all(math.isfinite(v) for v, _, _ in meta["output_token_logprobs"])
    # Without return_logprob none of it (and the start is ignored, as the scheduler does).
    plain = _generate(sim, prompt, 4, logprob_start_len=99)["meta_info"]
    assert "output_token_logprobs" not in plain and plain["sim_time_scale"] == pytest.approx(0.02)  # FAST_ENV
    too_far = httpx.post(sim.url + "/generate", json={"text": prompt, "return_logprob": True,
                                                      "logprob_start_len": 6}, timeout=30)
    assert too_far.status_code == 400
    assert "req.logprob_start_len=6 is higher than the number of input tokens" in too_far.json()["error"]["message"]
    bad = httpx.post(sim.url + "/generate", json={"text": prompt, "return_logprob": "yes"}, timeout=30)
    assert bad.status_code == 400 and "return_logprob must be a boolean" in bad.text
    # A batch takes one value for all or one per prompt.
    batch = httpx.post(sim.url + "/generate", json={"input_ids": [[1, 2, 3], [4, 5, 6]],
                                                    "sampling_params": {"max_new_tokens": 3, "temperature": 0},
                                                    "return_logprob": [True, False]}, timeout=30).json()
    assert "output_token_logprobs" in batch[0]["meta_info"] and "output_token_logprobs" not in batch[1]["meta_info"]


def test_a_ddtree_worker_that_cannot_build_dies_while_loading(sim_factory: Any) -> None:
    # (The target alone starts with the same environment: tests/patching/test_canary_rejected.py.)
    failing = sim_factory(*DDTREE, env={"SIM_DDTREE_FAULT": "crash_load"})
    assert failing.wait_exit() == -signal.SIGKILL
    log = failing.log()
    assert "Load weight end." in log and "Scheduler hit an exception:" in log
    assert "RuntimeError: DDTREE: the verify buffers do not fit the draft block" in log
    assert "Capture cuda graph failed" not in log  # nothing an eager relaunch would avoid


def test_fault_settings_are_checked_naming_the_variable() -> None:
    assert sim_settings_from_env({"SIM_DDTREE_FAULT": "late_token"}).fault_at == 200
    settings = sim_settings_from_env({"SIM_FAULT_AT": "120", "SIM_TARGET_TIE_AT": "7"})
    assert (settings.fault_at, settings.target_tie_at) == (120, 7)
    with pytest.raises(SimSettingsError, match="SIM_TARGET_TIE_AT='0' must be at least 1"):
        sim_settings_from_env({"SIM_TARGET_TIE_AT": "0"})
    with pytest.raises(SimSettingsError, match="SIM_FAULT_AT='x' is not a non-negative integer"):
        sim_settings_from_env({"SIM_FAULT_AT": "x"})
    with pytest.raises(SimSettingsError, match="tie_flip, slow, crash_load"):
        sim_settings_from_env({"SIM_DDTREE_FAULT": "bogus"})
