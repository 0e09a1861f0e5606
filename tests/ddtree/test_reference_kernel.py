"""The pure-torch twin of SGLang 0.5.23 ``tree_speculative_sampling_target_only``.

Each case is worked out by hand from the kernel source
(``sgl_kernel/speculative/sampling.cuh``): which child is accepted for a given coin,
what lands in ``predicts`` / ``accept_index`` / ``accept_token_num`` / ``draft_probs``,
and which token the bonus draw picks.
"""

from __future__ import annotations

import itertools
import struct
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


def _run(ref: ModuleType, tp: torch.Tensor, coins: list[float], final: float, **kw: float) -> dict[str, torch.Tensor]:
    bufs = _buffers(bs=tp.shape[0], spec=kw.pop("spec", 4))
    bufs["draft_probs"] = kw.pop("draft_probs", torch.zeros_like(tp))
    ref.reference_tree_speculative_sampling(
        uniform_samples=torch.tensor([coins], dtype=torch.float32),
        uniform_samples_for_final_sampling=torch.tensor([final], dtype=torch.float32),
        target_probs=tp,
        **bufs,
        **kw,
    )
    return bufs


ROOT = [0.3, 0.5, 0.0, 0.0, 0.1, 0.1, 0.0, 0.0]  # q(child 1: tok 0)=0.3, q(child 4: tok 1)=0.5


def test_running_sum_accepts_second_sibling_and_records_rejected_mass(ref: ModuleType) -> None:
    # coin 0.6: child 1 (0.3) fails, running sum 0.8 > 0.6 accepts child 4 (leaf).
    node4 = [0.0, 0.0, 0.0, 0.0, 0.0, 0.25, 0.25, 0.5]
    out = _run(ref, _probs({0: ROOT, 4: node4}), [0.6, 0.0, 0.0, 0.0, 0.0, 0.0], final=0.4)
    assert out["accept_token_num"].tolist() == [1]
    assert out["accept_index"].tolist() == [[0, 4, -1, -1]]  # tail untouched
    # Bonus at node 4 from relu(q - 0): u = 0.4 * 1.0 falls in token 6's bucket (0.25, 0.5].
    assert out["predicts"].tolist() == [1, 77, 77, 77, 6, 77]
    expected_draft = torch.zeros(1, N, V)
    expected_draft[0, 0, 0] = 0.3
    assert torch.equal(out["draft_probs"], expected_draft)


def test_all_children_rejected_bonus_excludes_them(ref: ModuleType) -> None:
    # coin 0.9 > 0.3 + 0.5: both root children rejected; bonus from {4: 0.1, 5: 0.1}.
    out = _run(ref, _probs({0: ROOT}), [0.9, 0, 0, 0, 0, 0], final=0.75)
    assert out["accept_token_num"].tolist() == [0]
    assert out["accept_index"].tolist() == [[0, -1, -1, -1]]
    # relu mass 0.2, u = 0.15 -> second bucket: token 5.
    assert out["predicts"].tolist() == [5, 77, 77, 77, 77, 77]
    assert out["draft_probs"][0, 0].tolist() == pytest.approx([0.3, 0.5, 0, 0, 0, 0, 0, 0])


def test_deep_accept_uses_each_parents_coin(ref: ModuleType) -> None:
    # Root coin accepts child 1; node 1's coin (index 1) then decides among {2, 5}.
    node1 = [0.0, 0.2, 0.6, 0.0, 0.0, 0.0, 0.2, 0.0]  # child 2 = tok 1 (0.2), child 5 = tok 2 (0.6)
    node5 = [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    out = _run(ref, _probs({0: ROOT, 1: node1, 5: node5}), [0.1, 0.5, 0.99, 0.99, 0.99, 0.0], final=0.5)
    assert out["accept_token_num"].tolist() == [2]
    assert out["accept_index"].tolist() == [[0, 1, 5, -1]]
    assert out["predicts"].tolist() == [0, 2, 77, 77, 77, 3]
    assert out["draft_probs"][0, 1, 1].item() == pytest.approx(0.2)


def test_spec_limit_ignores_draft_probs_for_the_bonus(ref: ModuleType) -> None:
    # S = 2: the walk stops after one accept; the kernel then samples from q alone,
    # even if draft_probs holds something at that row.
    node1 = [0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    pre = torch.zeros(1, N, V)
    pre[0, 1, 0] = 0.5
    out = _run(ref, _probs({0: ROOT, 1: node1}), [0.1, 0.0, 0, 0, 0, 0], final=0.25, spec=2, draft_probs=pre)
    assert out["accept_index"].tolist() == [[0, 1]]
    assert out["predicts"][1].item() == 0  # with draft_probs honoured it would be token 1
    # With room for one more step the same pre-filled row is honoured.
    pre2 = pre.clone()
    node1_leafy = _probs({0: ROOT, 1: node1})
    out = _run(ref, node1_leafy, [0.1, 0.99, 0, 0, 0, 0], final=0.25, spec=4, draft_probs=pre2)
    # Node 1's children are tok 1 (q 0.5, rejected: 0.5 < 0.99) and tok 2 (q 0): relu = {0: 0, 1: 0}.
    # Every positive entry is gone, so the kernel falls back to the last index V-1.
    assert out["accept_index"].tolist() == [[0, 1, -1, -1]]
    assert out["predicts"][1].item() == V - 1


def test_threshold_single_accepts_but_never_zero_mass(ref: ModuleType) -> None:
    # threshold_single 0.25: child 1's q 0.3 >= 0.25 accepts despite a high coin.
    out = _run(ref, _probs({0: ROOT}), [0.95, 0, 0, 0, 0, 0], final=0.0, threshold_single=0.25)
    assert out["accept_index"][0, :2].tolist() == [0, 1]
    # threshold_single 0 would accept anything, except a child with no target mass.
    zero_first = [0.0, 0.5, 0.0, 0.0, 0.25, 0.25, 0.0, 0.0]
    out = _run(ref, _probs({0: zero_first}), [0.95, 0, 0, 0, 0, 0], final=0.0, threshold_single=0.0)
    assert out["accept_index"][0, :2].tolist() == [0, 4]


def test_threshold_acc_scales_the_running_sum(ref: ModuleType) -> None:
    # coin 0.5 vs 0.3 / 0.5 = 0.6: accepted with threshold_acc 0.5, rejected at 1.0.
    loose = _run(ref, _probs({0: ROOT}), [0.5, 0, 0, 0, 0, 0], final=0.0, threshold_acc=0.5)
    exact = _run(ref, _probs({0: ROOT}), [0.5, 0, 0, 0, 0, 0], final=0.0)
    assert loose["accept_index"][0, 1].item() == 1
    assert exact["accept_index"][0, 1].item() == 4


def test_coin_one_walks_past_every_bucket(ref: ModuleType) -> None:
    # A 1.0 coin is never below a running sum of at most 1; the bonus coin 1.0 finds no
    # bucket above u and takes the last positive entry (SGLang clamps coins below 1).
    out = _run(ref, _probs({0: ROOT}), [1.0, 0, 0, 0, 0, 0], final=1.0)
    assert out["accept_token_num"].tolist() == [0]
    assert out["predicts"][0].item() == 5


def test_batch_rows_use_flat_offsets(ref: ModuleType) -> None:
    tp = torch.cat([_probs({0: ROOT}), _probs({0: ROOT})])
    bufs = _buffers(bs=2)
    bufs["draft_probs"] = torch.zeros_like(tp)
    ref.reference_tree_speculative_sampling(
        uniform_samples=torch.tensor([[0.1] + [0.0] * 5, [0.6] + [0.0] * 5]),
        uniform_samples_for_final_sampling=torch.tensor([0.0, 0.0]),
        target_probs=tp,
        **bufs,
    )
    assert bufs["accept_index"][:, :2].tolist() == [[0, 1], [6, 10]]
    assert bufs["predicts"][0].item() == 0 and bufs["predicts"][6].item() == 1


def test_rejects_wrong_dtypes_and_shapes(ref: ModuleType) -> None:
    tp = _probs({0: ROOT})
    bufs = _buffers()
    bufs["accept_index"] = bufs["accept_index"].long()
    with pytest.raises(ValueError, match="accept_index"):
        ref.reference_tree_speculative_sampling(
            uniform_samples=torch.zeros(1, N),
            uniform_samples_for_final_sampling=torch.zeros(1),
            target_probs=tp,
            draft_probs=torch.zeros_like(tp),
            **bufs,
        )


def test_signature_matches_sglang_wrapper(ref: ModuleType) -> None:
    import inspect

    names = list(inspect.signature(ref.reference_tree_speculative_sampling).parameters)
    assert names == [
        "predicts", "accept_index", "accept_token_num", "candidates", "retrive_index",
        "retrive_next_token", "retrive_next_sibling", "uniform_samples",
        "uniform_samples_for_final_sampling", "target_probs", "draft_probs",
        "threshold_single", "threshold_acc", "deterministic",
    ]


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _sequential_kernel(case: dict) -> dict:
    """Line-by-line transcription of the CUDA kernel's per-request loop (one thread's
    view, float32 arithmetic emulated with struct), used as an independent oracle."""
    bs, n = case["candidates"].shape
    s = case["accept_index"].shape[1]
    vocab = case["target_probs"].shape[2]
    tp = case["target_probs"].reshape(-1).tolist()
    dp = case["draft_probs"].reshape(-1).tolist()
    cand = case["candidates"].reshape(-1).tolist()
    ri = case["retrive_index"].reshape(-1).tolist()
    nt = case["retrive_next_token"].reshape(-1).tolist()
    ns = case["retrive_next_sibling"].reshape(-1).tolist()
    us = case["uniform_samples"].reshape(-1).tolist()
    uf = case["uniform_samples_for_final_sampling"].tolist()
    pred = case["predicts"].tolist()
    acc = case["accept_index"].reshape(-1).tolist()
    num_out = []
    thr_single = _f32(case["threshold_single"])
    thr_acc = max(_f32(case["threshold_acc"]), _f32(1e-9))
    for bx in range(bs):
        prob_acc = 0.0
        off = bx * n * vocab
        coin = us[bx * n]
        last = ri[bx * n]
        acc[bx * s] = last
        num = 0
        cur = 0
        for _ in range(1, s):
            cur = nt[bx * n + cur]
            while cur != -1:
                draft_index = ri[bx * n + cur]
                tok = cand[bx * n + cur]
                q = tp[off + tok]
                prob_acc = _f32(prob_acc + q)
                if q > 0 and (coin < _f32(prob_acc / thr_acc) or q >= thr_single):
                    prob_acc = 0.0
                    off = (bx * n + cur) * vocab
                    coin = us[bx * n + cur]
                    pred[last] = tok
                    num += 1
                    acc[bx * s + num] = draft_index
                    last = draft_index
                    break
                dp[off + tok] = tp[off + tok]
                cur = ns[bx * n + cur]
            if cur == -1:
                break
        num_out.append(num)
        relu = [max(_f32(tp[off + v] - (dp[off + v] if num != s - 1 else 0.0)), 0.0) for v in range(vocab)]
        total = 0.0
        for r in relu:
            total = _f32(total + r)
        u = _f32(uf[bx] * total)
        sampled, running, last_valid = vocab, 0.0, -1
        for v, r in enumerate(relu):
            running = _f32(running + r)
            if r > 0:
                last_valid = v
                if running > u and sampled == vocab:
                    sampled = v
        if sampled == vocab:
            sampled = last_valid if last_valid != -1 else vocab - 1
        pred[last] = sampled
    return {
        "predicts": pred,
        "accept_index": [acc[b * s:(b + 1) * s] for b in range(bs)],
        "accept_token_num": num_out,
        "draft_probs": dp,
    }


def _random_case(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    rnd = lambda hi: int(torch.randint(0, hi, (1,), generator=g))  # noqa: E731
    bs, n, vocab = 1 + rnd(6), 2 + rnd(12), 4 + rnd(13)
    s = 1 + rnd(6)
    cand = torch.randint(0, vocab, (bs, n), generator=g)
    nt = torch.full((bs, n), -1, dtype=torch.int64)
    ns = torch.full((bs, n), -1, dtype=torch.int64)
    for b in range(bs):
        kids: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            kids[rnd(i)].append(i)
        for p in range(n):
            order = [kids[p][j] for j in torch.randperm(len(kids[p]), generator=g).tolist()]
            if order:
                nt[b, p] = order[0]
                for a, c in itertools.pairwise(order):
                    ns[b, a] = c
    probs = torch.rand(bs, n, vocab, generator=g) * (torch.rand(bs, n, vocab, generator=g) < 0.6)
    probs[..., 0] += 1e-3  # every row keeps some mass
    probs = probs / probs.sum(-1, keepdim=True)
    draft = torch.zeros_like(probs) if rnd(2) else torch.rand(bs, n, vocab, generator=g) * 0.2
    return {
        "predicts": torch.full((bs * n,), -5, dtype=torch.int32),
        "accept_index": torch.full((bs, s), -1, dtype=torch.int32),
        "accept_token_num": torch.zeros(bs, dtype=torch.int32),
        "candidates": cand,
        "retrive_index": torch.arange(bs * n).reshape(bs, n),
        "retrive_next_token": nt,
        "retrive_next_sibling": ns,
        "uniform_samples": torch.rand(bs, n, generator=g),
        "uniform_samples_for_final_sampling": torch.rand(bs, generator=g),
        "target_probs": probs,
        "draft_probs": draft,
        "threshold_single": [1.0, 0.3, 0.0][rnd(3)],
        "threshold_acc": [1.0, 0.5, 0.0][rnd(3)],
    }


@pytest.mark.parametrize("seed", range(60))
def test_vectorised_reference_equals_sequential_kernel_loop(ref: ModuleType, seed: int) -> None:
    case = _random_case(seed)
    expected = _sequential_kernel({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()})
    ref.reference_tree_speculative_sampling(**case)
    assert case["accept_token_num"].tolist() == expected["accept_token_num"]
    assert case["accept_index"].tolist() == expected["accept_index"]
    assert case["predicts"].tolist() == expected["predicts"]
    assert case["draft_probs"].reshape(-1).tolist() == expected["draft_probs"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_without_cuda_the_kernel_is_unavailable_and_forcing_it_fails(ref: ModuleType) -> None:
    assert ref.kernel_available() is False
    tree = ref.build_ddtree_tree_from_topk([[1, 2]], [[-0.1, -0.5]], 2)
    logits = torch.zeros(1, 3, 4)
    with pytest.raises(RuntimeError, match="not available"):
        ref.sample_tree_paths([tree], logits, [1.0], [-1], [1.0], use_kernel=True)
    accepted, proposed = ref.sample_tree_paths([tree], logits, [1.0], [-1], [1.0], use_kernel="auto")[0]
    assert accepted[0] == 0 and len(proposed) == len(accepted)
