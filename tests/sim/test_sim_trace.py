"""The simulator's tree trace (issue 43): the same switch, validation and record code as the
deployed bundle (``ddtree_trace.py``), from the simulator's own drafter and target; off by
default and absent from responses while off; each round's verdicts agree with the round's
own verification; a recorded round commits one token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from ddtree_ops.ddtree_core import load_ddtree_trace
from ddtree_ops.predict.acceptance import round_moments, traced_moments
from ddtree_ops.predict.trace import parse_trace, trace_switch

DDTREE_8_4 = ("--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", "9", "--speculative-eagle-topk",
              "4")
GRID = ((4, 2), (8, 4), (2, 1))


def _generate(url: str, temperature: float, seed: int = 3) -> dict[str, Any]:
    r = httpx.post(url + "/generate", json={"text": "def add(a, b): return a + b", "sampling_params": {
        "temperature": temperature, "max_new_tokens": 40, "ignore_eos": True, "sampling_seed": seed}}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _switch(url: str, server_args: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/set_internal_state", json={"server_args": server_args}, timeout=10)


def test_the_trace_is_off_by_default_and_on_gives_rounds_that_agree_with_the_verification(
    sim_factory: Any, tmp_path: Path
) -> None:
    config = tmp_path / "ddtree.json"
    config.write_text(json.dumps({"ddtree": {"budgets": [8, 16], "topk_max": 4}}))
    sim = sim_factory(*DDTREE_8_4, "--speculative-adaptive-config", str(config), env={"SIM_LOAD_S": "0.5"})
    sim.wait_ready()
    off = _generate(sim.url, 0.0)
    assert "ddtree_trace" not in off["meta_info"]
    info = httpx.get(sim.url + "/server_info", timeout=10).json()["internal_states"][0]["ddtree"]
    assert info["trace"] == {"on": False}

    # The toolkit's switch is the bundle's own request; the union (2 + 8 + 4 nodes at most)
    # is verified in the smallest state that holds it.
    body = trace_switch(GRID, max_rounds=64)
    assert body == load_ddtree_trace().trace_request([list(g) for g in GRID], 64)
    assert (_switch(sim.url, body).status_code, _switch(sim.url, body).json()) == (200, [True])
    described = httpx.get(sim.url + "/server_info", timeout=10).json()["internal_states"][0]["ddtree"]["trace"]
    assert described["on"] is True and described["state_budget"] == 16

    greedy = _generate(sim.url, 0.0)
    # Greedy decoding is lossless whatever tree verifies it: the trace changes no token.
    assert greedy["output_ids"] == off["output_ids"]
    trace = parse_trace(greedy["meta_info"]["ddtree_trace"])
    assert trace.grid == tuple(sorted(GRID)) and trace.block == 16 and trace.sampling.temperature == 0.0
    assert len(trace.rounds) == greedy["meta_info"]["spec_verify_ct"]
    for rnd in trace.rounds:
        # At T = 0 a round's path products are the greedy walk: exactly what it accepted.
        assert traced_moments(rnd).mean == rnd.accepted + 1
        assert round_moments(rnd, GRID, block=trace.block)[(8, 4)].mean <= rnd.accepted + 1
    # A recorded round commits one token: a round at every position, the roots the stream,
    # and the greedy path of each round the stream ahead of it.
    assert [r.prefix - trace.rounds[0].prefix for r in trace.rounds] == list(range(len(trace.rounds)))
    assert [r.root for r in trace.rounds] == greedy["output_ids"][: len(trace.rounds)]
    for i, rnd in enumerate(trace.rounds[:-1]):
        if rnd.accepted:
            assert trace.rounds[i + 1].root == rnd.token[[j for j, par in enumerate(rnd.parent)
                                                           if par == 0 and rnd.argmax[j]][0]]

    sampled = parse_trace(_generate(sim.url, 1.0)["meta_info"]["ddtree_trace"])
    assert sampled.sampling.temperature == 1.0
    assert any(0.0 < p < 1.0 for rnd in sampled.rounds for p in rnd.p)

    refused = _switch(sim.url, {"ddtree_trace": 1, "ddtree_trace_grid_64x4": 1})
    assert refused.status_code == 400 and "budget >= " in refused.json()["detail"]
    assert _switch(sim.url, {"ddtree_trace": 0}).status_code == 200
    assert "ddtree_trace" not in _generate(sim.url, 0.0)["meta_info"]
