"""Greedy verification walk and the target distribution used for sampling."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

PARENTS = [-1, 0, 1, 2, 0, 1]  # design.md worked example
TOKENS = [7, 10, 20, 30, 11, 21]


@pytest.mark.parametrize(
    ("argmax", "accepted", "proposed"),
    [
        ([10, 20, 30, 99, 0, 0], [0, 1, 2, 3], [10, 20, 30, 99]),  # whole main chain + bonus
        ([11, 20, 30, 0, 42, 0], [0, 4], [11, 42]),  # rank-1 root child, then bonus
        ([10, 21, 0, 0, 0, 55], [0, 1, 5], [10, 21, 55]),  # sibling at depth 2
        ([12, 0, 0, 0, 0, 0], [0], [12]),  # nothing accepted: only the bonus
    ],
)
def test_follow_verified_tree(ref: ModuleType, argmax: list[int], accepted: list[int], proposed: list[int]) -> None:
    assert ref.follow_verified_tree(PARENTS, TOKENS, argmax) == (accepted, proposed)
    assert ref.follow_verified_tree(PARENTS, TOKENS, torch.tensor(argmax)) == (accepted, proposed)


def test_duplicate_sibling_tokens_take_lower_index(ref: ModuleType) -> None:
    assert ref.follow_verified_tree([-1, 0, 0], [0, 5, 5], [5, 1, 2]) == ([0, 1], [5, 1])


def test_target_probs_temperature_topk_topp(ref: ModuleType) -> None:
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]))
    plain = ref.target_probs_from_logits(logits, 1.0, -1, 1.0)
    torch.testing.assert_close(plain, torch.softmax(logits, -1))
    # top-k=2 keeps both 0.2s of row 0 (ties at the pivot survive, FlashInfer semantics).
    topk = ref.target_probs_from_logits(logits, 1.0, 2, 1.0)
    torch.testing.assert_close(topk[0], torch.tensor([0.5, 0.2, 0.2, 0.0]) / 0.9)
    torch.testing.assert_close(topk[1], torch.tensor([0.4, 0.3, 0.0, 0.0]) / 0.7)
    # top-p=0.6 on row 1: smallest set reaching 0.6 is {0.4, 0.3}.
    topp = ref.target_probs_from_logits(logits, 1.0, -1, 0.6)
    torch.testing.assert_close(topp[1], torch.tensor([0.4, 0.3, 0.0, 0.0]) / 0.7)
    # Per-row values, T=0 row becomes one-hot at the argmax; T=2 flattens.
    mixed = ref.target_probs_from_logits(logits, torch.tensor([0.0, 2.0, 1.0]), torch.tensor([-1, -1, 3]), 1.0)
    assert mixed[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(mixed[1], torch.softmax(logits[1] / 2.0, -1))
    torch.testing.assert_close(mixed[2], torch.tensor([0.0, 0.2, 0.3, 0.4]) / 0.9)


def test_sample_tree_paths_all_greedy_is_the_greedy_walk(ref: ModuleType) -> None:
    tree = ref.build_ddtree_tree_from_topk(
        [[10, 11], [20, 21], [30, 31]], [[-0.1, -0.8], [-0.5, -1.0], [-0.1, -2.0]], 5
    )
    logits = torch.full((1, 6, 40), -5.0)
    for node, tok in enumerate([10, 20, 30, 39, 0, 0]):
        logits[0, node, tok] = 5.0
    assert ref.sample_tree_paths([tree], logits, [0.0], [-1], [1.0]) == [([0, 1, 2, 3], [10, 20, 30, 39])]
    # SGLang's own greedy encoding: temperature 1, top_k 1.
    assert ref.sample_tree_paths([tree], logits, [1.0], [1], [1.0]) == [([0, 1, 2, 3], [10, 20, 30, 39])]
