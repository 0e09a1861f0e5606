"""The pure-torch twin of SGLang 0.5.23 ``tree_speculative_sampling_target_only``.

Each case is worked out by hand from the kernel source
(``sgl_kernel/speculative/sampling.cuh``): which child is accepted for a given coin,
what lands in ``predicts`` / ``accept_index`` / ``accept_token_num`` / ``draft_probs``,
and which token the bonus draw picks.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

# design.md worked example: root -> {1, 4}, 1 -> {2, 5}, 2 -> {3}.
TOKENS = [7, 0, 1, 2, 1, 2]
NEXT_TOKEN = [1, 2, 3, -1, -1, -1]
NEXT_SIBLING = [-1, 4, 5, -1, -1, -1]
N, V = 6, 8


def _buffers(bs: int = 1, spec: int = 4, fill: int = -1) -> dict[str, torch.Tensor]:
    return {
        "predicts": torch.full((bs * N,), 77, dtype=torch.int32),
        "accept_index": torch.full((bs, spec), fill, dtype=torch.int32),
        "accept_token_num": torch.full((bs,), 99, dtype=torch.int32),
        "candidates": torch.tensor([TOKENS] * bs, dtype=torch.int64),
        "retrive_index": torch.arange(bs * N, dtype=torch.int64).reshape(bs, N),
        "retrive_next_token": torch.tensor([NEXT_TOKEN] * bs, dtype=torch.int64),
        "retrive_next_sibling": torch.tensor([NEXT_SIBLING] * bs, dtype=torch.int64),
    }


def _probs(rows: dict[int, list[float]]) -> torch.Tensor:
    """[1, N, V] target probs; rows not given are uniform."""
    tp = torch.full((1, N, V), 1.0 / V)
    for r, vals in rows.items():
        tp[0, r] = torch.tensor(vals)
    return tp


def _run(du: ModuleType, tp: torch.Tensor, coins: list[float], final: float, **kw: float) -> dict[str, torch.Tensor]:
    bufs = _buffers(bs=tp.shape[0], spec=kw.pop("spec", 4))
    bufs["draft_probs"] = kw.pop("draft_probs", torch.zeros_like(tp))
    du.reference_tree_speculative_sampling(
        uniform_samples=torch.tensor([coins], dtype=torch.float32),
        uniform_samples_for_final_sampling=torch.tensor([final], dtype=torch.float32),
        target_probs=tp,
        **bufs,
        **kw,
    )
    return bufs


ROOT = [0.3, 0.5, 0.0, 0.0, 0.1, 0.1, 0.0, 0.0]  # q(child 1: tok 0)=0.3, q(child 4: tok 1)=0.5


def test_running_sum_accepts_second_sibling_and_records_rejected_mass(du: ModuleType) -> None:
    # coin 0.6: child 1 (0.3) fails, running sum 0.8 > 0.6 accepts child 4 (leaf).
    node4 = [0.0, 0.0, 0.0, 0.0, 0.0, 0.25, 0.25, 0.5]
    out = _run(du, _probs({0: ROOT, 4: node4}), [0.6, 0.0, 0.0, 0.0, 0.0, 0.0], final=0.4)
    assert out["accept_token_num"].tolist() == [1]
    assert out["accept_index"].tolist() == [[0, 4, -1, -1]]  # tail untouched
    # Bonus at node 4 from relu(q - 0): u = 0.4 * 1.0 falls in token 6's bucket (0.25, 0.5].
    assert out["predicts"].tolist() == [1, 77, 77, 77, 6, 77]
    expected_draft = torch.zeros(1, N, V)
    expected_draft[0, 0, 0] = 0.3
    assert torch.equal(out["draft_probs"], expected_draft)


def test_all_children_rejected_bonus_excludes_them(du: ModuleType) -> None:
    # coin 0.9 > 0.3 + 0.5: both root children rejected; bonus from {4: 0.1, 5: 0.1}.
    out = _run(du, _probs({0: ROOT}), [0.9, 0, 0, 0, 0, 0], final=0.75)
    assert out["accept_token_num"].tolist() == [0]
    assert out["accept_index"].tolist() == [[0, -1, -1, -1]]
    # relu mass 0.2, u = 0.15 -> second bucket: token 5.
    assert out["predicts"].tolist() == [5, 77, 77, 77, 77, 77]
    assert out["draft_probs"][0, 0].tolist() == pytest.approx([0.3, 0.5, 0, 0, 0, 0, 0, 0])


def test_deep_accept_uses_each_parents_coin(du: ModuleType) -> None:
    # Root coin accepts child 1; node 1's coin (index 1) then decides among {2, 5}.
    node1 = [0.0, 0.2, 0.6, 0.0, 0.0, 0.0, 0.2, 0.0]  # child 2 = tok 1 (0.2), child 5 = tok 2 (0.6)
    node5 = [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    out = _run(du, _probs({0: ROOT, 1: node1, 5: node5}), [0.1, 0.5, 0.99, 0.99, 0.99, 0.0], final=0.5)
    assert out["accept_token_num"].tolist() == [2]
    assert out["accept_index"].tolist() == [[0, 1, 5, -1]]
    assert out["predicts"].tolist() == [0, 2, 77, 77, 77, 3]
    assert out["draft_probs"][0, 1, 1].item() == pytest.approx(0.2)


def test_spec_limit_ignores_draft_probs_for_the_bonus(du: ModuleType) -> None:
    # S = 2: the walk stops after one accept; the kernel then samples from q alone,
    # even if draft_probs holds something at that row.
    node1 = [0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    pre = torch.zeros(1, N, V)
    pre[0, 1, 0] = 0.5
    out = _run(du, _probs({0: ROOT, 1: node1}), [0.1, 0.0, 0, 0, 0, 0], final=0.25, spec=2, draft_probs=pre)
    assert out["accept_index"].tolist() == [[0, 1]]
    assert out["predicts"][1].item() == 0  # with draft_probs honoured it would be token 1
    # With room for one more step the same pre-filled row is honoured.
    pre2 = pre.clone()
    node1_leafy = _probs({0: ROOT, 1: node1})
    out = _run(du, node1_leafy, [0.1, 0.99, 0, 0, 0, 0], final=0.25, spec=4, draft_probs=pre2)
    # Node 1's children are tok 1 (q 0.5, rejected: 0.5 < 0.99) and tok 2 (q 0): relu = {0: 0, 1: 0}.
    # Every positive entry is gone, so the kernel falls back to the last index V-1.
    assert out["accept_index"].tolist() == [[0, 1, -1, -1]]
    assert out["predicts"][1].item() == V - 1


def test_threshold_single_accepts_but_never_zero_mass(du: ModuleType) -> None:
    # threshold_single 0.25: child 1's q 0.3 >= 0.25 accepts despite a high coin.
    out = _run(du, _probs({0: ROOT}), [0.95, 0, 0, 0, 0, 0], final=0.0, threshold_single=0.25)
    assert out["accept_index"][0, :2].tolist() == [0, 1]
    # threshold_single 0 would accept anything, except a child with no target mass.
    zero_first = [0.0, 0.5, 0.0, 0.0, 0.25, 0.25, 0.0, 0.0]
    out = _run(du, _probs({0: zero_first}), [0.95, 0, 0, 0, 0, 0], final=0.0, threshold_single=0.0)
    assert out["accept_index"][0, :2].tolist() == [0, 4]


def test_threshold_acc_scales_the_running_sum(du: ModuleType) -> None:
    # coin 0.5 vs 0.3 / 0.5 = 0.6: accepted with threshold_acc 0.5, rejected at 1.0.
    loose = _run(du, _probs({0: ROOT}), [0.5, 0, 0, 0, 0, 0], final=0.0, threshold_acc=0.5)
    exact = _run(du, _probs({0: ROOT}), [0.5, 0, 0, 0, 0, 0], final=0.0)
    assert loose["accept_index"][0, 1].item() == 1
    assert exact["accept_index"][0, 1].item() == 4


def test_coin_one_walks_past_every_bucket(du: ModuleType) -> None:
    # A 1.0 coin is never below a running sum of at most 1; the bonus coin 1.0 finds no
    # bucket above u and takes the last positive entry (SGLang clamps coins below 1).
    out = _run(du, _probs({0: ROOT}), [1.0, 0, 0, 0, 0, 0], final=1.0)
    assert out["accept_token_num"].tolist() == [0]
    assert out["predicts"][0].item() == 5


def test_batch_rows_use_flat_offsets(du: ModuleType) -> None:
    tp = torch.cat([_probs({0: ROOT}), _probs({0: ROOT})])
    bufs = _buffers(bs=2)
    bufs["draft_probs"] = torch.zeros_like(tp)
    du.reference_tree_speculative_sampling(
        uniform_samples=torch.tensor([[0.1] + [0.0] * 5, [0.6] + [0.0] * 5]),
        uniform_samples_for_final_sampling=torch.tensor([0.0, 0.0]),
        target_probs=tp,
        **bufs,
    )
    assert bufs["accept_index"][:, :2].tolist() == [[0, 1], [6, 10]]
    assert bufs["predicts"][0].item() == 0 and bufs["predicts"][6].item() == 1


def test_rejects_wrong_dtypes_and_shapes(du: ModuleType) -> None:
    tp = _probs({0: ROOT})
    bufs = _buffers()
    bufs["accept_index"] = bufs["accept_index"].long()
    with pytest.raises(ValueError, match="accept_index"):
        du.reference_tree_speculative_sampling(
            uniform_samples=torch.zeros(1, N),
            uniform_samples_for_final_sampling=torch.zeros(1),
            target_probs=tp,
            draft_probs=torch.zeros_like(tp),
            **bufs,
        )


def test_signature_matches_sglang_wrapper(du: ModuleType) -> None:
    import inspect

    names = list(inspect.signature(du.reference_tree_speculative_sampling).parameters)
    assert names == [
        "predicts", "accept_index", "accept_token_num", "candidates", "retrive_index",
        "retrive_next_token", "retrive_next_sibling", "uniform_samples",
        "uniform_samples_for_final_sampling", "target_probs", "draft_probs",
        "threshold_single", "threshold_acc", "deterministic",
    ]
