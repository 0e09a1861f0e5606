"""The predictor's per-round acceptance against the rejection-sampling walk, enumerated
exactly, what a tree holds of the stream, round times and tok/s (pure, no server; the walk
across rounds: test_walk.py)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from ddtree_ops.ddtree_core import load_ddtree_reference
from ddtree_ops.errors import ConfigError
from ddtree_ops.predict.acceptance import NotCovered, round_moments, traced_moments
from ddtree_ops.predict.estimate import (
    AcceptPrediction,
    ProbeRequest,
    RoundTime,
    measure_round_time,
    predict_cell,
    rounds_per_request,
    smooth_round_times,
    top_cells,
)
from ddtree_ops.predict.trace import TRACE_VERSION, TraceRound, load_trace_file, trace_line

BUILD = load_ddtree_reference().build_ddtree_tree_from_topk


def walk_distribution(parent: list[int], token: list[int], q: dict[int, dict[int, float]]) -> dict[int, float]:
    """P(the walk commits exactly c tokens), by enumerating the kernel's coin intervals.

    At the last accepted node one coin u ~ U[0, 1) is drawn; its children are tried in
    sibling order with the running sum S of their target probabilities, and the first with
    u < S is accepted: child i owns [S_(i-1), S_i). ``q[node]`` is the target distribution
    at ``node`` (over tokens); nodes are 0 (root) .. n."""
    children: dict[int, list[int]] = {}
    for i, par in enumerate(parent, 1):
        children.setdefault(par, []).append(i)
    out: dict[int, float] = {}

    def walk(node: int, depth: int, prob: float) -> None:
        running = 0.0
        for child in children.get(node, []):
            low, running = running, running + q[node].get(token[child - 1], 0.0)
            share = min(running, 1.0) - min(low, 1.0)  # |[low, running) inside [0, 1)|
            if share > 0:
                walk(child, depth + 1, prob * share)
        stop = 1.0 - min(running, 1.0)
        if stop > 0:
            out[depth + 1] = out.get(depth + 1, 0.0) + prob * stop

    walk(0, 0, 1.0)
    return out


def make_round(ids: list[list[int]], lps: list[list[float]], trees: list[tuple[int, int]], *, vocab: int,
               rng: random.Random, greedy: bool = False) -> tuple[TraceRound, dict[int, dict[int, float]]]:
    """A traced round over the union of ``trees`` built from the draft table, with a random
    target distribution at every node (its p's the union's verdicts); and those distributions."""
    parent: list[int] = []
    token: list[int] = []
    index: dict[tuple[int, int], int] = {}
    for budget, topk in trees:
        tree = BUILD([r[:topk] for r in ids], [r[:topk] for r in lps], budget, 5)
        mapped = [0] * len(tree.parents)
        for i in range(1, len(tree.parents)):
            key = (mapped[tree.parents[i]], tree.token_ids[i])
            if key not in index:
                parent.append(key[0])
                token.append(key[1])
                index[key] = len(token)
            mapped[i] = index[key]
    q: dict[int, dict[int, float]] = {}
    for node in range(len(token) + 1):
        if greedy:
            kids = [token[i] for i, par in enumerate(parent) if par == node]
            best = rng.choice(kids + [vocab + 1]) if kids and rng.random() < 0.8 else vocab + 1
            q[node] = {best: 1.0}
        else:
            weights = [rng.random() ** 3 for _ in range(vocab)]
            total = sum(weights)
            q[node] = {t: w / total for t, w in enumerate(weights)}
    p = [q[par].get(tok, 0.0) for par, tok in zip(parent, token, strict=True)]
    argmax = [int(max(q[par], key=q[par].__getitem__) == tok) for par, tok in zip(parent, token, strict=True)]
    rnd = TraceRound(prefix=10, root=5, draft_ids=tuple(map(tuple, ids)), draft_logp=tuple(map(tuple, lps)),
                     parent=tuple(parent), token=tuple(token), p=tuple(p), argmax=tuple(argmax), accepted=0)
    return rnd, q


def draft_table(rng: random.Random, depth: int, k: int, vocab: int) -> tuple[list[list[int]], list[list[float]]]:
    ids, lps = [], []
    for _ in range(depth):
        row = rng.sample(range(vocab), k)
        vals = sorted((math.log(rng.random() * 0.9 + 0.05) for _ in range(k)), reverse=True)
        ids.append(row)
        lps.append(vals)
    return ids, lps


def subtree(rnd: TraceRound, budget: int, topk: int) -> tuple[list[int], list[int]]:
    """The (budget, topk) tree as trace-indexed (parent, token) lists, for the enumeration."""
    tree = BUILD([r[:topk] for r in rnd.draft_ids], [r[:topk] for r in rnd.draft_logp], budget, rnd.root)
    parent, token = [], []
    for i in range(1, len(tree.parents)):
        parent.append(tree.parents[i])
        token.append(tree.token_ids[i])
    return parent, token


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_path_products_equal_the_walks_exact_expectation(seed: int, greedy: bool) -> None:
    rng = random.Random(seed)
    vocab = 12
    ids, lps = draft_table(rng, depth=5, k=4, vocab=vocab)
    trees = [(3, 1), (6, 2), (9, 4), (14, 4), (4, 3)]
    rnd, q = make_round(ids, lps, [(14, 4), (6, 2), (3, 1), (4, 3)], vocab=vocab, rng=rng, greedy=greedy)
    # The traced (union) tree itself.
    dist = walk_distribution(list(rnd.parent), list(rnd.token), q)
    assert sum(dist.values()) == pytest.approx(1.0)
    assert traced_moments(rnd).mean == pytest.approx(sum(c * w for c, w in dist.items()))
    assert traced_moments(rnd).m2 == pytest.approx(sum(c * c * w for c, w in dist.items()))
    # Every smaller tree, rebuilt and found by token path: q re-indexed to its own nodes.
    got = round_moments(rnd, trees, block=6)
    for budget, topk in trees:
        parent, token = subtree(rnd, budget, topk)
        # The subtree's node i is the trace node with its token path; map q onto it.
        at = [0]
        for par, tok in zip(parent, token, strict=True):
            at.append(rnd.children[(at[par], tok)])
        sub_q = {i: q[at[i]] for i in range(len(at))}
        exact = walk_distribution(parent, token, sub_q)
        assert got[(budget, topk)].mean == pytest.approx(sum(c * w for c, w in exact.items())), (budget, topk)
        assert got[(budget, topk)].m2 == pytest.approx(sum(c * c * w for c, w in exact.items())), (budget, topk)


def test_a_smaller_budget_is_the_larger_trees_first_pops() -> None:
    """round_moments builds once per top-k at the largest budget and reads the others off
    by prefix: equal to building each budget on its own, with depth min(block - 1, b)."""
    rng = random.Random(7)
    ids, lps = draft_table(rng, depth=7, k=3, vocab=20)
    rnd, _ = make_round(ids, lps, [(30, 3)], vocab=20, rng=rng)
    together = round_moments(rnd, [(b, 3) for b in (1, 2, 3, 5, 8, 13, 30)], block=8)
    for b in (1, 2, 3, 5, 8, 13, 30):
        alone = round_moments(rnd, [(b, 3)], block=8, builder=lambda i, lp, budget, root: BUILD(
            i[: min(7, budget)], lp[: min(7, budget)], budget, root))
        assert together[(b, 3)] == alone[(b, 3)]


def test_a_tree_the_trace_did_not_verify_is_refused() -> None:
    rng = random.Random(3)
    ids, lps = draft_table(rng, depth=4, k=4, vocab=10)
    rnd, _ = make_round(ids, lps, [(4, 2)], vocab=10, rng=rng)
    with pytest.raises(NotCovered, match="budget 8 top-k 4"):
        round_moments(rnd, [(8, 4)], block=5)


def _trace_obj(rounds: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    return {"version": TRACE_VERSION, "grid": [[2, 2]], "block": 4,
            "sampling": {"temperature": 0.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0},
            "truncated": False, "rounds": rounds} | top


GOOD_ROUND: dict[str, Any] = {"prefix": 3, "root": 1, "draft_ids": [[4, 5], [6, 7], [8, 9]],
                              "draft_logp": [[-0.1, -2.0], [-0.5, -1.0], [-0.2, -3.0]],
                              "parent": [0, 1], "token": [4, 6], "p": [1.0, 0.0], "argmax": [1, 0], "accepted": 1}


@pytest.mark.parametrize(("change", "why"), [
    ({"p": [1.5, 0.0]}, "round 1: p must be probabilities"),
    ({"parent": [0, 2]}, "round 1: node 2's parent 2 does not come before it"),
    ({"parent": [0, 0], "token": [4, 4]}, "round 1: node 2 repeats token 4"),
    ({"draft_logp": [[-2.0, -0.1], [-0.5, -1.0], [-0.2, -3.0]]}, "round 1: draft_logp[0] must be log-probs"),
    ({"draft_ids": [[4], [6], [8]], "draft_logp": [[-0.1], [-0.5], [-0.2]]}, "round 1: draft row 0 must hold"),
    ({"accepted": 3}, "round 1: accepted must be an integer in 0..2"),
    ({"argmax": [1]}, "round 1: parent, token, p and argmax must have one entry per node"),
    ({"prefix": None}, "round 1: prefix must be an integer"),
])
def test_the_loader_refuses_a_bad_round_naming_file_line_and_round(
    tmp_path: Path, change: dict[str, Any], why: str
) -> None:
    path = tmp_path / "t.ndjson"
    path.write_text(trace_line(_trace_obj([GOOD_ROUND])) + trace_line(_trace_obj([GOOD_ROUND, GOOD_ROUND | change])))
    with pytest.raises(ConfigError) as info:
        load_trace_file(path)
    assert str(info.value).startswith(f"{path}:2: {why}"), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("text", "why"), [
    ("", "holds no trace"),
    ("{not json\n", ":1: not valid JSON"),
    (json.dumps(_trace_obj([GOOD_ROUND], version=1)) + "\n", f":1: version 1 is not {TRACE_VERSION}"),
    (json.dumps(_trace_obj([GOOD_ROUND], grid=[[0, 2]])) + "\n", ":1: grid[0] budget must be an integer in 1..256"),
    (json.dumps(_trace_obj([GOOD_ROUND], truncated="no")) + "\n", ":1: truncated must be true or false"),
])
def test_the_loader_refuses_a_bad_file(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "t.ndjson"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_trace_file(path)
    assert str(info.value).startswith(f"{path}") and why in str(info.value), str(info.value)


def test_a_good_trace_loads_and_its_greedy_round_accepts_the_argmax_path(tmp_path: Path) -> None:
    path = tmp_path / "t.ndjson"
    path.write_text(trace_line(_trace_obj([GOOD_ROUND])))
    (trace,) = load_trace_file(path)
    assert trace.grid == ((2, 2),)
    assert traced_moments(trace.rounds[0]).mean == 2.0
    assert round_moments(trace.rounds[0], [(2, 2), (1, 1)], block=trace.block)[(2, 2)].mean == 2.0


def test_matched_follows_the_stream_inside_each_budget() -> None:
    """``matched``: how deep a tree holds the stream's next tokens. The union of (2, 2) here
    holds 4 -> 6 (the argmax path); a stream 4 6 is matched 2 deep by the budget-2 tree, 1
    deep by the budget-1 tree (its one node is 4), 0 deep where the stream goes 5."""
    rnd = load_round(GOOD_ROUND | {"parent": [0, 1], "token": [4, 6], "p": [1.0, 1.0], "argmax": [1, 1]})
    moments = round_moments(rnd, [(2, 2), (1, 2)], block=4, ahead=(4, 6, 9))
    assert (moments[(2, 2)].matched, moments[(1, 2)].matched) == (2, 1)
    assert round_moments(rnd, [(2, 2)], block=4, ahead=(5, 6))[(2, 2)].matched == 0
    # A stream that stops is followed as far as it goes.
    assert round_moments(rnd, [(2, 2)], block=4, ahead=(4,))[(2, 2)].matched == 1


def load_round(raw: dict[str, Any]) -> TraceRound:
    from ddtree_ops.predict.trace import parse_trace

    return parse_trace(_trace_obj([raw])).rounds[0]


def test_rounds_per_request_and_tok_s() -> None:
    # Every round commits exactly 4 tokens: 47 tokens after the prefill's first take 11.75
    # rounds plus the last round's mean overshoot (4 - 1) / 2 / 4.
    assert rounds_per_request(4.0, 16.0, 48) == pytest.approx((47 + 1.5) / 4)
    accept = AcceptPrediction(8, 2, walk=4.0, m2=16.0, expected=4.0, naive=3.0, m2_naive=9.0, rounds=10,
                              walk_rounds=8, traced=4.0)
    rt = RoundTime(concurrency=4, budget=8, round_s=0.02, overhead_s=0.05)
    cell = predict_cell(accept, rt, tokens=48, temperature=0.0)
    rounds = (47 + 1.5) / 4
    assert cell.accept_length == pytest.approx(48 / rounds)
    assert cell.output_tok_s == pytest.approx(4 * 48 / (0.05 + rounds * 0.02))
    assert cell.output_tok_s_naive < cell.output_tok_s
    faster = predict_cell(accept, RoundTime(4, 8, 0.01, 0.05), tokens=48, temperature=0.0)
    other_c = predict_cell(accept, RoundTime(1, 8, 0.01, 0.05), tokens=48, temperature=0.0)
    assert [(c.concurrency, c.round_s) for c in top_cells([cell, faster, other_c], 1)] == [(1, 0.01), (4, 0.01)]


def test_a_probe_measures_round_time_and_overhead() -> None:
    # 4 requests at concurrency 2: each 10 rounds of 20 ms after a 50 ms first token, in 0.5 s.
    reqs = [ProbeRequest(e2e_s=0.25, ttft_s=0.05, verify_ct=10)] * 4
    rt = measure_round_time(reqs, concurrency=2, budget=8, duration_s=0.5)
    assert rt is not None
    assert rt.round_s == pytest.approx(0.02) and rt.overhead_s == pytest.approx(0.05)
    assert measure_round_time([ProbeRequest(0.1, 0.1, 0)], concurrency=1, budget=8, duration_s=1.0) is None


def test_probes_are_fitted_non_decreasing_in_budget_with_one_overhead_per_concurrency() -> None:
    # The CPU server's probes at concurrency 8 (one predict_accuracy run): out of order by
    # budget, overheads 40-90 ms. Graph-replayed and eager probes are fitted apart, and so
    # are the greedy and the sampled verify paths.
    raw = {8: [(2, 9.03, 54.0), (3, 8.74, 39.6), (4, 9.66, 55.6), (5, 10.03, 48.7), (6, 10.02, 72.0),
               (8, 7.84, 89.7), (10, 9.46, 50.6), (12, 9.95, 53.2), (16, 12.91, 60.6)]}
    times = [RoundTime(8, b, r / 1000, o / 1000) for b, r, o in raw[8]]
    times += [RoundTime(1, 4, 0.005, 0.01), RoundTime(1, 8, 0.004, 0.03),
              RoundTime(1, 64, 0.009, 0.02, cuda_graph=False)]
    # Sampled rounds at concurrency 8: slower, and not pooled with the greedy ones (whose
    # fit at budget 2-3 is 8.885 ms: pooled together they would pull each other).
    times += [RoundTime(8, 2, 0.0102, 0.07, verify_path="sampled"),
              RoundTime(8, 3, 0.0100, 0.09, verify_path="sampled")]
    smooth = smooth_round_times(times)
    assert smooth.keys() == {rt.key for rt in times}
    fitted = [smooth[("greedy", 8, b)].round_s * 1000 for b, _, _ in raw[8]]
    # Pool adjacent violators by hand: (9.03, 8.74) -> 8.885; (9.66, 10.03, 10.02, 7.84) -> 9.3875.
    assert fitted == pytest.approx([8.885, 8.885, 9.3875, 9.3875, 9.3875, 9.3875, 9.46, 9.95, 12.91])
    assert all(a <= b for a, b in zip(fitted, fitted[1:], strict=False))
    # The fit keeps the probes' total (least squares with a free level does).
    assert sum(fitted) == pytest.approx(sum(r for _, r, _ in raw[8]))
    assert [smooth[("greedy", 8, b)].overhead_s for b, _, _ in raw[8]] == pytest.approx([0.054] * 9)  # the median
    # Concurrency 1: 5 ms then 4 ms pooled to 4.5 ms; the eager probe stands alone.
    assert smooth[("greedy", 1, 4)].round_s == smooth[("greedy", 1, 8)].round_s == pytest.approx(0.0045)
    assert smooth[("greedy", 1, 64)].round_s == pytest.approx(0.009) and smooth[("greedy", 1, 64)].cuda_graph is False
    assert [smooth[("greedy", 1, b)].overhead_s for b in (4, 8, 64)] == pytest.approx([0.02] * 3)
    # The sampled path: its own fit (10.2, 10.0 -> 10.1 ms) and its own overhead (80 ms).
    sampled = [smooth[("sampled", 8, b)] for b in (2, 3)]
    assert [rt.round_s for rt in sampled] == pytest.approx([0.0101] * 2)
    assert [rt.overhead_s for rt in sampled] == pytest.approx([0.08] * 2)
    assert all(rt.verify_path == "sampled" for rt in sampled)
    assert smooth_round_times([]) == {}
