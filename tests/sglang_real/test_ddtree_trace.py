"""DDTREE's tree trace inside the real SGLang 0.5.23 server on CPU.

One server with runtime states (budgets 4, 8, 32; top-k up to 4) serves every case, on
the *perturbed* pair (models.write_perturbed_pair: a target whose samples at T = 1 leave
its greedy continuation, and a draft whose copy is blurred, so its first choice is often
wrong and acceptance has real spread), ``--enable-deterministic-inference`` (each
request's ``sampling_seed`` fixes its coins), the kernel branch of the sampled verify
(the CUDA op replaced by its pure-torch twin). What is checked:

* off, nothing is written and nothing changes: a request before the trace was ever on
  and the same request after it was on and off give the same tokens and verify counts,
  and no ``ddtree_trace`` key;
* on, at T = 0: the traced requests return the untraced server's tokens; a round at
  every position (a recorded round commits one token), the roots spelling the returned
  tokens; each round's argmax flags equal its ``p`` and the accepted path is the argmax
  path, which is the stream; the verified tree holds each grid tree rebuilt from the
  trace's own draft table with the bundle's builder; a bad trace request is refused
  with its reason;
* on, at T = 1: the expected accepted length of a smaller tree computed from the trace
  (1 + the sum over its nodes of the product of ``p`` along the path) matches what that
  tree accepts, (a) on the first round of each request, whose context both runs share
  (an unbiased comparison), and (b) over whole requests, the predictor's walk against
  the tree pinned without a trace, within 4 standard errors (test (3)'s docstring); a
  control: the (16, 4) tree's prediction is rejected against the same measurement.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import httpx
import pytest

from ddtree_ops.ddtree_core import BUNDLE_SPECULATIVE_DIR, load_ddtree_reference, load_module_file
from ddtree_ops.predict.estimate import predict_acceptance, rounds_per_request
from ddtree_ops.predict.trace import parse_trace

from . import models
from .test_ddtree_real import SAMPLER_ENV, ddtree_args

pytestmark = [pytest.mark.slow, pytest.mark.sglang_real, pytest.mark.timeout(900)]

BLOCK = 8
BUDGETS = [4, 8, 32]
TOPK_MAX = 4
LAUNCH = (4, 2)
# Union of the grid's trees: top-k 1 at 4 (a chain of 4), top-k 2 at 8, top-k 4 at 16:
# at most 4 + 8 + 16 = 28 nodes, verified by the budget-32 state.
GRID = [[4, 1], [4, 2], [8, 2], [8, 4], [16, 4]]
SMALL = (4, 2)  # the smaller tree test (3) predicts
CHAIN = (4, 1)
BIG = (16, 4)  # the control of test (3)
DETERMINISTIC = ["--enable-deterministic-inference"]


def _prompts(n: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 260) for _ in range(rng.randrange(6, 12))] for _ in range(n)]


PROMPTS = _prompts(48)


@pytest.fixture(scope="module")
def perturbed(sglang_cpu_env, tmp_path_factory) -> dict[str, Path]:
    return models.write_perturbed_pair(tmp_path_factory.mktemp("perturbed"), block_size=BLOCK)


@pytest.fixture
def trace_server(real_servers, ddtree_python, perturbed, tmp_path_factory):
    config = tmp_path_factory.getbasetemp() / "trace-runtime.json"
    config.write_text(json.dumps({"ddtree": {"budgets": BUDGETS, "topk_max": TOPK_MAX}}))
    return real_servers.get(
        "ddtree-trace", perturbed["target"],
        [*ddtree_args(perturbed["draft"], LAUNCH[0], LAUNCH[1]), *DETERMINISTIC,
         "--speculative-adaptive-config", str(config)],
        env=SAMPLER_ENV["kernel"], python=ddtree_python,
    )


def switch(srv, **server_args: Any) -> httpx.Response:
    return httpx.post(srv.url + "/set_internal_state", json={"server_args": server_args}, timeout=60)


def pin(srv, budget: int, topk: int) -> None:
    resp = switch(srv, ddtree_budget=budget, ddtree_topk=topk)
    assert resp.status_code == 200 and resp.json() == [True], resp.text


TRACE = load_module_file(BUNDLE_SPECULATIVE_DIR / "ddtree_trace.py")


def trace(srv, grid: list[list[int]] | None, max_rounds: int | None = None) -> None:
    """Turn the trace on for ``grid`` (None: off)."""
    args = {"ddtree_trace": 0} if grid is None else TRACE.trace_request(grid, max_rounds)
    resp = switch(srv, **args)
    assert resp.status_code == 200 and resp.json() == [True], resp.text
    state = srv.server_info()["internal_states"][0]["ddtree"]["trace"]
    assert state["on"] == (grid is not None), state


def _run(srv, prompts, tokens: int, temperature: float, seed0: int = 1000) -> list:
    params = [{"temperature": temperature, "max_new_tokens": tokens, "ignore_eos": True, "sampling_seed": seed0 + i}
              for i in range(len(prompts))]
    srv.flush_cache()
    return srv.generate_each(prompts, params)


def _paths(parents: list[int], tokens: list[int]) -> list[tuple[int, ...]]:
    """Token path of every node (index 0 the root, its path empty)."""
    out: list[tuple[int, ...]] = [()]
    for p, t in zip(parents, tokens, strict=True):
        out.append(out[p] + (t,))
    return out


def rebuilt(rnd: dict, budget: int, topk: int) -> Any:
    """The (budget, topk) tree the server would build from this round's draft table."""
    rows = min(BLOCK - 1, budget)
    ref = load_ddtree_reference()
    return ref.build_ddtree_tree_from_topk([r[:topk] for r in rnd["draft_ids"][:rows]],
                                           [r[:topk] for r in rnd["draft_logp"][:rows]], budget, rnd["root"])


def expected_accept(rnd: dict, budget: int, topk: int) -> float:
    """1 + sum over the rebuilt tree's nodes of the product of p along the path, each
    node found in the verified tree by its token path."""
    at = {path: i for i, path in enumerate(_paths(rnd["parent"], rnd["token"]))}
    tree = rebuilt(rnd, budget, topk)
    prob = [1.0]
    for i in range(1, len(tree.parents)):
        path = _paths(tree.parents[1:], tree.token_ids[1:])[i]
        prob.append(prob[tree.parents[i]] * rnd["p"][at[path] - 1])
    return sum(prob)


def test_the_trace_off_writes_nothing_and_changes_nothing(trace_server):
    srv = trace_server
    pin(srv, 8, 4)
    before = _run(srv, PROMPTS[:3], 32, 0.0)
    trace(srv, GRID)
    trace(srv, None)
    pin(srv, 8, 4)
    after = _run(srv, PROMPTS[:3], 32, 0.0)
    for b, a in zip(before, after, strict=True):
        assert "ddtree_trace" not in b.meta_info and "ddtree_trace" not in a.meta_info
        assert a.output_ids == b.output_ids and a.meta_info["spec_verify_ct"] == b.meta_info["spec_verify_ct"]


def test_a_greedy_trace_agrees_with_the_committed_tokens_and_holds_each_grid_tree(trace_server):
    srv = trace_server
    prompts = PROMPTS[:6]
    pin(srv, *LAUNCH)
    plain = _run(srv, prompts, 40, 0.0)
    trace(srv, GRID, 64)
    state = srv.server_info()["internal_states"][0]["ddtree"]["trace"]
    assert (state["union_bound"], state["state_budget"], state["width"]) == (28, 32, 33), state
    try:
        outs = _run(srv, prompts, 40, 0.0)
    finally:
        trace(srv, None)
    sizes = []
    for o, p in zip(outs, plain, strict=True):
        # A recorded round commits one token; at T = 0 it is the greedy token, so the
        # traced request returns exactly what the untraced server returns.
        assert o.output_ids == p.output_ids
        t = o.meta_info["ddtree_trace"]
        assert (t["version"], t["grid"], t["block"], t["truncated"]) == (TRACE.VERSION, GRID, BLOCK, False)
        assert t["sampling"]["temperature"] == 0.0 and t["sampling"]["top_k"] == 1
        rounds = t["rounds"]
        assert len(rounds) == o.meta_info["spec_verify_ct"], (
            [(r["prefix"], r["accepted"]) for r in rounds], o.meta_info["prompt_tokens"], len(o.output_ids),
            o.meta_info["spec_verify_ct"])
        # A round at every position: the roots are the returned tokens (the first the prefill's).
        assert [r["prefix"] - rounds[0]["prefix"] for r in rounds] == list(range(len(rounds)))
        assert [r["root"] for r in rounds] == o.output_ids[: len(rounds)]
        for r, rnd in enumerate(rounds):
            n = len(rnd["parent"])
            sizes.append(n)
            assert len(rnd["token"]) == len(rnd["p"]) == len(rnd["argmax"]) == n <= 28
            assert rnd["p"] == [float(a) for a in rnd["argmax"]]  # T = 0: p is 1 at the argmax, else 0
            assert len(rnd["draft_ids"]) == len(rnd["draft_logp"]) == min(BLOCK - 1, 16)
            assert all(len(row) == 4 for row in rnd["draft_ids"])
            # The accepted path is the argmax path from the root, and it is the stream.
            node, path = 0, []
            while True:
                nxt = [i + 1 for i in range(n) if rnd["parent"][i] == node and rnd["argmax"][i]]
                assert len(nxt) <= 1
                if not nxt:
                    break
                node = nxt[0]
                path.append(rnd["token"][node - 1])
            assert len(path) == rnd["accepted"]
            ahead = o.output_ids[r + 1: r + 1 + len(path)]
            assert path[: len(ahead)] == ahead
            # Every grid tree, rebuilt from the trace with the bundle's builder, was verified.
            verified = set(_paths(rnd["parent"], rnd["token"]))
            for budget, topk in GRID:
                tree = rebuilt(rnd, budget, topk)
                assert set(_paths(tree.parents[1:], tree.token_ids[1:])) <= verified, (budget, topk)
    rounds = [r for o in outs for r in o.meta_info["ddtree_trace"]["rounds"]]
    accepts = [r["accepted"] + 1 for r in rounds]
    # At T = 0 a tree's expected accept length is its accept length (p is 0 or 1).
    chain = [expected_accept(r, *CHAIN) for r in rounds]
    small = [expected_accept(r, *SMALL) for r in rounds]
    print(f"greedy trace: union sizes min {min(sizes)} mean {sum(sizes) / len(sizes):.1f} max {max(sizes)}; "
          f"accept length per position: union {sum(accepts) / len(accepts):.2f} {sorted(set(accepts))}, "
          f"(4, 2) {sum(small) / len(small):.2f} {sorted(set(small))}, chain {sum(chain) / len(chain):.2f} "
          f"{sorted(set(chain))}")
    assert len(set(chain)) >= 3, "the perturbed draft should give acceptance with spread"


REFUSED = {
    "union larger than the widest state": (TRACE.trace_request([[32, 2], [32, 4]]),
                                           "can hold 64 nodes, more than the largest runtime state (budget 32)"),
    "top-k above topk_max": (TRACE.trace_request([[4, 5]]), "top-k 5 is outside 1..4"),
    "beside a switch key": ({**TRACE.trace_request([[4, 2]]), "ddtree_budget": 8}, "the ddtree_trace keys go alone"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_bad_trace_request_answers_400_with_the_reason(trace_server, case):
    value, message = REFUSED[case]
    resp = switch(trace_server, **value)
    assert resp.status_code == 400 and message in resp.json()["message"], resp.text
    assert trace_server.server_info()["internal_states"][0]["ddtree"]["trace"] == {"on": False}


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _accept(traces: list[Any], tree: tuple[int, int], tokens: int) -> float:
    """The walk's accept length for requests of ``tokens`` (as the server counts it)."""
    a = predict_acceptance(traces, [tree])[tree]
    return tokens / rounds_per_request(a.expected, a.m2, tokens)


def _ratio_se(pairs: list[tuple[float, float]]) -> float:
    """Standard error of sum(x) / sum(n) over independent requests (x_i, n_i): the delta
    method, sqrt(sum (x_i - R n_i)^2 / (k (k - 1))) / mean(n)."""
    k = len(pairs)
    ratio = sum(x for x, _ in pairs) / sum(n for _, n in pairs)
    spread = sum((x - ratio * n) ** 2 for x, n in pairs) / (k * (k - 1))
    return math.sqrt(spread) / (sum(n for _, n in pairs) / k)


def test_a_sampled_trace_predicts_the_acceptance_of_a_smaller_tree(trace_server):
    """(a) First rounds: a request's first round starts at the same context in every
    run (same prompt, same seeded prefill token), so the trace's expectation E_1 for
    the (4, 2) tree is exactly the mean of what that tree accepts there; a run traced
    with the grid [[4, 2]] alone verifies exactly that tree and records its accepted
    count a_1. The mean of a_1 + 1 - E_1 over the requests must be within 4 standard
    errors of 0 (fixed seeds: one deterministic outcome; under the model a failure of
    probability < 1e-4).

    (b) Whole requests: the predictor's walk along the traced responses (every position
    traced: a recorded round commits one token) against the (4, 2) tree's accept length
    pinned without a trace (tokens over verify rounds, as the server counts them). Both
    are one sample of T = 1 streams, ratios of sums over independent requests (tokens
    over rounds): the standard error of each is the delta method's over its requests (the
    walk per response, the pinned counts per response); the bound is 4 SE of the
    difference (a failure of probability < 1e-4 under the normal
    model; fixed seeds make the outcome one deterministic draw). Measured: predicted
    1.835, pinned 1.861, 4 SE = 0.36 (48 requests of 48 tokens; the perturbed target at
    T = 1 falls into long stretches that differ per request, so the spread is between
    requests). Control: the (16, 4) tree's prediction (2.285) is rejected against the
    same measurement."""
    srv = trace_server
    n = len(PROMPTS)
    tokens = 48
    trace(srv, GRID, 64)
    try:
        traced = _run(srv, PROMPTS, tokens, 1.0)
        trace(srv, [list(SMALL)])
        firsts = _run(srv, PROMPTS, 6, 1.0)
    finally:
        trace(srv, None)
    pin(srv, *SMALL)
    pinned = _run(srv, PROMPTS, tokens, 1.0)

    # (a) the first rounds
    diffs = []
    for t, f in zip(traced, firsts, strict=True):
        e1 = expected_accept(t.meta_info["ddtree_trace"]["rounds"][0], *SMALL)
        a1 = f.meta_info["ddtree_trace"]["rounds"][0]["accepted"] + 1
        diffs.append(a1 - e1)
    mean, sd = _mean_sd(diffs)
    se = sd / math.sqrt(n)
    print(f"first rounds: mean(a1 + 1 - E1) = {mean:+.3f}, SE {se:.3f} (n = {n})")
    assert abs(mean) <= 4 * se + 1e-9, (mean, se)

    # (b) whole requests
    traces = [parse_trace(t.meta_info["ddtree_trace"]) for t in traced]
    predicted = _accept(traces, SMALL, tokens)
    big = _accept(traces, BIG, tokens)
    walks = [predict_acceptance([t], [SMALL])[SMALL] for t in traces]
    pred_se = _ratio_se([(w.expected * w.walk_rounds, w.walk_rounds) for w in walks])
    meas_se = _ratio_se([(o.meta_info["completion_tokens"], o.meta_info["spec_verify_ct"]) for o in pinned])
    measured = sum(o.meta_info["completion_tokens"] for o in pinned) / sum(
        o.meta_info["spec_verify_ct"] for o in pinned)
    se = math.sqrt(pred_se**2 + meas_se**2)
    bound = 4 * se
    print(f"whole requests: predicted {predicted:.3f} ((16, 4): {big:.3f}) from {n} traced responses, "
          f"measured {measured:.3f} pinned; |diff| {abs(predicted - measured):.3f}, bound {bound:.3f} (4 SE)")
    assert abs(predicted - measured) <= bound
    assert abs(big - measured) > bound, "control: the (16, 4) tree's prediction should not pass for the (4, 2) tree"
