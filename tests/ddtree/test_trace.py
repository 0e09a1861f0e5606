"""The tree trace's pure part (``ddtree_trace.py``, loaded by path as deployed): the
switch's validation, the union of the grid's trees, the per-node probabilities and
the bounded per-request record. The server side is tests/sglang_real/test_ddtree_trace.py."""

from __future__ import annotations

import json
import random
import struct
from types import ModuleType
from typing import Any

import pytest
import torch

from ddtree_ops.ddtree_core import BUNDLE_SPECULATIVE_DIR, load_module_file

BLOCK = 8


@pytest.fixture(scope="module")
def tr() -> ModuleType:
    return load_module_file(BUNDLE_SPECULATIVE_DIR / "ddtree_trace.py")


def _table(seed: int, depth: int, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """A draft top-k table: distinct ids per row, log-probs sorted descending (float32
    values, as the server's candidate head gives them)."""
    rng = random.Random(seed)
    ids, lps = [], []
    for _ in range(depth):
        ids.append(rng.sample(range(100), k))
        row = sorted((torch.tensor(rng.uniform(-6.0, -0.01), dtype=torch.float32).item() for _ in range(k)),
                     reverse=True)
        lps.append(row)
    return ids, lps


def _paths(tree: Any) -> set[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for i in range(1, len(tree.parents)):
        out.append(out[tree.parents[i]] + (tree.token_ids[i],))
    return set(out[1:])


def _config(tr: ModuleType, grid: list[list[int]], budgets=(4, 8, 16, 32, 64, 128), topk_max: int = 8):
    return tr.parse_trace_request(tr.trace_request(grid), budgets=list(budgets), topk_max=topk_max, block_size=BLOCK)


GRIDS = {
    "one cell": [[8, 4]],
    "budgets at one top-k": [[4, 2], [8, 2], [16, 2]],
    "budgets x top-k": [[b, k] for b in (4, 8, 16) for k in (1, 2, 4)],
    "deep chain and wide": [[16, 1], [16, 8]],
}


@pytest.mark.parametrize("name", sorted(GRIDS))
@pytest.mark.parametrize("seed", range(6))
def test_the_union_holds_every_grid_tree_by_token_path(tr, ref, name, seed):
    config = _config(tr, GRIDS[name])
    ids, lps = _table(seed, config.depth, config.topk)
    union = tr.union_tree(ids, lps, 7, config, ref.build_ddtree_tree_from_topk)
    assert union.parents[0] == -1 and union.token_ids[0] == 7
    # Parents before children, depths consistent, no two siblings with one token.
    seen = set()
    for i in range(1, len(union.parents)):
        p = union.parents[i]
        assert 0 <= p < i and union.depths[i] == union.depths[p] + 1
        assert (p, union.token_ids[i]) not in seen
        seen.add((p, union.token_ids[i]))
    # Non-increasing cumulative log-prob: the verifier's sibling order is the builder's.
    assert all(a >= b for a, b in zip(union.node_logws[1:], union.node_logws[2:], strict=False))
    got = _paths(union)
    for budget, topk in config.grid:
        rows = min(BLOCK - 1, budget)
        tree = ref.build_ddtree_tree_from_topk([r[:topk] for r in ids[:rows]], [r[:topk] for r in lps[:rows]],
                                               budget, 7)
        assert _paths(tree) <= got, (budget, topk)
    assert len(union.parents) - 1 <= config.union_bound <= config.state_budget


def test_the_union_bound_and_the_state_it_picks(tr):
    config = _config(tr, [[b, k] for b in (4, 8, 16) for k in (1, 2, 4)])
    # 16 per top-k, three top-k: 48 worst case (top-k 1 at budget 16 is a chain of 7).
    assert config.union_bound == 7 + 16 + 16 and config.state_budget == 64 and config.width == 65
    assert (config.depth, config.topk) == (7, 4)
    assert config.trees == ((1, 16), (2, 16), (4, 16))
    # Capped by the product tree: top-k 2 at depth 2 has 6 nodes.
    assert tr.union_bound([(2, 2), (100, 2)], 3) == 6
    assert tr.parse_trace_request({"ddtree_trace": 0}, budgets=[4], topk_max=4, block_size=BLOCK) is None
    assert tr.trace_request([[8, 4], [4, 1]], 16) == {
        "ddtree_trace": 1, "ddtree_trace_grid_8x4": 1, "ddtree_trace_grid_4x1": 1, "ddtree_trace_max_rounds": 16}
    config = tr.parse_trace_request(tr.trace_request([[8, 4], [4, 1]], 16), budgets=[16], topk_max=4, block_size=BLOCK)
    assert (config.grid, config.max_rounds, config.state_budget) == (((4, 1), (8, 4)), 16, 16)
    # Only the trace's own keys (SGLang's and the switch keys are someone else's).
    assert tr.trace_keys({"ddtree_trace": 1, "ddtree_trace_grid_4x1": 1, "ddtree_budget": 4, "x": 1}) == [
        "ddtree_trace", "ddtree_trace_grid_4x1"]


ON = {"ddtree_trace": 1}
REFUSED = {
    "no runtime states": ({**ON, "ddtree_trace_grid_4x2": 1}, None, "a trace needs the runtime tree states"),
    "a cell without ddtree_trace": ({"ddtree_trace_grid_4x2": 1}, [64], "goes with ddtree_trace (1 = on, 0 = off)"),
    "ddtree_trace 2": ({"ddtree_trace": 2}, [64], "ddtree_trace must be 0 (off) or 1 (on)"),
    "off with a cell": ({"ddtree_trace": 0, "ddtree_trace_grid_4x2": 1}, [64], "0 (off) goes alone"),
    "unknown key": ({**ON, "ddtree_trace_rounds": 3}, [64], "ddtree_trace_rounds is not a trace key"),
    "empty grid": (ON, [64], "a trace needs a grid"),
    "cell not 1": ({**ON, "ddtree_trace_grid_4x2": 2}, [64], "ddtree_trace_grid_4x2 must be 1"),
    "fractional max_rounds": ({**ON, "ddtree_trace_grid_4x2": 1, "ddtree_trace_max_rounds": 2.5}, [64],
                              "must be an integer"),
    "bool on": ({"ddtree_trace": True, "ddtree_trace_grid_4x2": 1}, [64], "must be an integer"),
    "zero budget": ({**ON, "ddtree_trace_grid_0x2": 1}, [64], "budget must be >= 1"),
    "top-k above topk_max": ({**ON, "ddtree_trace_grid_4x9": 1}, [64], "top-k 9 is outside 1..8"),
    "max_rounds zero": ({**ON, "ddtree_trace_grid_4x2": 1, "ddtree_trace_max_rounds": 0}, [64],
                        "ddtree_trace_max_rounds must be in 1..4096"),
    "union too big": ({**ON, "ddtree_trace_grid_16x2": 1, "ddtree_trace_grid_16x4": 1}, [4, 16],
                      "can hold 32 nodes, more than the largest runtime state (budget 16); "
                      "relaunch with a budget >= 32"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_bad_trace_request_is_refused_in_one_line(tr, case):
    value, budgets, message = REFUSED[case]
    with pytest.raises(tr.TraceRefused) as err:
        tr.parse_trace_request(value, budgets=budgets, topk_max=8, block_size=BLOCK)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_node_probabilities_read_the_parents_row(tr):
    tokens = torch.tensor([[5, 1, 2, 3]])
    parents = torch.tensor([[-1, 0, 0, 1]])
    probs = torch.zeros(1, 4, 6)
    probs[0, 0, 1], probs[0, 0, 2], probs[0, 1, 3] = 0.7, 0.2, 0.4
    argmax = torch.tensor([1, 3, 0, 0])
    p, is_argmax = tr.node_probabilities(tokens, parents, argmax, probs)
    assert p[0, 1:].tolist() == pytest.approx([0.7, 0.2, 0.4])
    assert is_argmax[0, 1:].tolist() == [True, False, True]
    greedy, flags = tr.node_probabilities(tokens, parents, argmax, None)
    assert greedy[0, 1:].tolist() == [1.0, 0.0, 1.0] and flags.equal(is_argmax)


@pytest.mark.parametrize("x", [0.1, 1.0 / 3.0, 1e-8, 0.999999, 0.0, 1.0])
def test_short_floats_read_back_as_the_same_float32(tr, x):
    f32 = torch.tensor(x, dtype=torch.float32).item()
    y = tr.short_float(f32)
    assert struct.pack("<f", y) == struct.pack("<f", f32) and len(repr(y)) <= len(repr(f32))


class _Params:
    def __init__(self, temperature: float, top_k: int, top_p: float = 1.0, min_p: float = 0.0):
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p


class _Req:
    def __init__(self, params: _Params) -> None:
        self.sampling_params = params
        self.done = False

    def finished(self) -> bool:
        return self.done


def test_a_request_trace_is_bounded_and_returned_once_at_the_end(tr, ref):
    config = tr.parse_trace_request(tr.trace_request([[4, 2]], 2), budgets=[8], topk_max=4, block_size=BLOCK)
    ids, lps = _table(0, config.depth, config.topk)
    tree = tr.union_tree(ids, lps, 9, config, ref.build_ddtree_tree_from_topk)
    req = _Req(_Params(1.0, 1))  # SGLang's temperature 0
    n = len(tree.parents)
    for prefix in (10, 13, 15):
        tr.record_rounds([req], config, prefix_lens=[prefix], roots=[9], draft_ids=[ids], draft_logp=[lps],
                         trees=[tree], p=[[1.0] * n], argmax=[[True] * n], accepted=[2])
    assert tr.finished_payload(req, 100) is None  # not finished yet
    # Two rounds recorded (max_rounds 2): the next one is not, so it commits its whole path.
    assert tr.recording_rows([req, _Req(_Params(1.0, 1))]) == [False, True]
    req.done = True
    payload = tr.finished_payload(req, 100)
    assert tr.finished_payload(req, 100) is None  # returned once
    assert payload["truncated"] and [r["prefix"] for r in payload["rounds"]] == [10, 13]
    assert payload["sampling"] == {"temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0}
    assert (payload["version"], payload["grid"], payload["block"]) == (2, [[4, 2]], BLOCK)
    first = payload["rounds"][0]
    assert set(first) == {"prefix", "root", "draft_ids", "draft_logp", "parent", "token", "p", "argmax", "accepted"}
    assert len(first["parent"]) == len(first["token"]) == len(first["p"]) == n - 1
    # Plain JSON: the draft log-probs survive exactly (the builder rebuilds the same tree).
    again = json.loads(json.dumps(payload))
    assert again["rounds"][0]["draft_logp"] == lps
    # A round starting at or past the request's end (the overlap scheduler's extra one) is dropped.
    req2 = _Req(_Params(0.7, 1 << 30, 0.9, 0.05))
    for prefix in (10, 20):
        tr.record_rounds([req2], config, prefix_lens=[prefix], roots=[9], draft_ids=[ids], draft_logp=[lps],
                         trees=[tree], p=[[0.5] * n], argmax=[[False] * n], accepted=[0])
    req2.done = True
    late = tr.finished_payload(req2, 20)
    assert [r["prefix"] for r in late["rounds"]] == [10] and not late["truncated"]
    assert late["sampling"] == {"temperature": 0.7, "top_k": -1, "top_p": 0.9, "min_p": 0.05}


def test_a_recorded_row_commits_only_its_first_token(tr):
    """commit_first_only keeps entry 0 of a recorded row (the root and the token emitted
    after it) and repeats it along the row, as AcceptedPaths wants past its length; the
    other rows are untouched."""
    from ddtree_ops.ddtree_core import load_module_file as load

    utils = load(BUNDLE_SPECULATIVE_DIR / "ddtree_utils.py")
    paths = utils.AcceptedPaths(nodes=torch.tensor([[0, 2, 5, 5], [0, 1, 3, 4]]),
                                tokens=torch.tensor([[7, 8, 9, 9], [4, 5, 6, 7]]),
                                commit_lens=torch.tensor([3, 4]))
    cut = tr.commit_first_only(paths, [True, False])
    assert isinstance(cut, utils.AcceptedPaths)
    assert cut.commit_lens.tolist() == [1, 4]
    assert cut.nodes.tolist() == [[0, 0, 0, 0], [0, 1, 3, 4]]
    assert cut.tokens.tolist() == [[7, 7, 7, 7], [4, 5, 6, 7]]
