"""Tree rejection sampling is lossless: emitted tokens follow the target distribution.

Setup per case (fixed seed): a vocabulary of V tokens (8..64), a target "model" given
by root logits ``L0[V]`` and next-step logits ``L1[a]`` after first token ``a``, a
drafter whose per-position top-k is a noisy copy of the target (so both accepts and
rejects happen), and the DDTree built from it. Row ``i`` of the verify logits is the
target at node ``i``'s context: ``L0`` at the root, ``L1[token]`` at depth 1, anything
deeper (it only affects the third token).

Statistical bound. For n i.i.d. samples of a distribution p over K cells, the empirical
total-variation distance TV = 1/2 sum |p_hat_i - p_i| satisfies
E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / n) (Jensen per cell), and TV changes by at
most 1/n when one sample changes, so McDiarmid gives
P(TV >= E[TV] + t) <= exp(-2 n t^2). With t = sqrt(ln(1/delta) / (2n)) and
delta = 1e-6, a correct sampler fails a check with probability below 1e-6; the bound
is computed from the exact p of each case. The mutant test shows the same bound
rejects a lossy sampler (threshold_acc < 1), so the check has power.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

DELTA = 1e-6
CHUNK = 8192
N_SAMPLES = 40_000


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """These loops are many small ops on [8192]-sized tensors: one intra-op thread is
    faster than two fighting over a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tv_bound(p: torch.Tensor, n: int) -> float:
    p = p.double().reshape(-1)
    mean_bound = 0.5 * torch.sqrt(p * (1 - p) / n).sum().item()
    return mean_bound + math.sqrt(math.log(1 / DELTA) / (2 * n))


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    counts = counts.double().reshape(-1)
    return 0.5 * (counts / counts.sum() - p.double().reshape(-1)).abs().sum().item()


@dataclass(frozen=True)
class Case:
    tree: object
    node_logits: torch.Tensor  # [N, V]
    l0: torch.Tensor  # [V]
    l1: torch.Tensor  # [V, V]


def make_case(ref: ModuleType, seed: int) -> Case:
    g = torch.Generator().manual_seed(seed)
    vocab = int(torch.randint(8, 65, (1,), generator=g))
    depth = int(torch.randint(2, 5, (1,), generator=g))
    k = int(torch.randint(2, 5, (1,), generator=g))
    budget = int(torch.randint(4, 17, (1,), generator=g))
    l0 = torch.randn(vocab, generator=g) * 2.0
    l1 = torch.randn(vocab, vocab, generator=g) * 2.0
    # Drafter: position 0 mimics L0, position 1 mimics the target after L0's favourite.
    draft_logits = [l0 + 2 * torch.randn(vocab, generator=g), l1[int(l0.argmax())] + torch.randn(vocab, generator=g)]
    draft_logits += [torch.randn(vocab, generator=g) * 2.0 for _ in range(depth - 2)]
    lp = torch.log_softmax(torch.stack(draft_logits), dim=-1)
    top = lp.topk(k, dim=-1)
    tree = ref.build_ddtree_tree_from_topk(top.indices, top.values, budget, root_token=0)
    rows = []
    for i, d in enumerate(tree.depths):
        if d == 0:
            rows.append(l0)
        elif d == 1:
            rows.append(l1[tree.token_ids[i]])
        else:
            rows.append(torch.randn(vocab, generator=g) * 2.0)
    return Case(tree, torch.stack(rows), l0, l1)


def sample_first_two(
    ref: ModuleType, case: Case, temp: float, top_k: int, top_p: float, n: int, seed: int, threshold_acc: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """n draws of (first, second) emitted token, and how many second tokens came from
    an accepted draft, straight through the reference kernel.

    One tree is replicated n times (flat offsets b*N, target probs as a stride-0 view).
    When a round emits only the bonus token, the second token is the next round's
    first one, which the first-token check shows is drawn from the target conditional;
    here it is drawn from that conditional directly.
    """
    tree = case.tree
    nn = len(tree)
    tp = ref.target_probs_from_logits(case.node_logits, temp, top_k, top_p)
    tp1 = ref.target_probs_from_logits(case.l1, temp, top_k, top_p)
    _, r_next, r_sib = ref.compile_ddtree_retrieve(tree.parents, tree.node_logws)
    spec = max(tree.depths) + 1
    cdf1 = torch.cumsum(tp1, dim=-1)
    g = torch.Generator().manual_seed(seed)
    firsts, seconds = [], []
    from_tree = 0
    draft = torch.zeros(CHUNK, nn, tp.shape[1])
    for start in range(0, n, CHUNK):
        bs = min(CHUNK, n - start)
        draft_probs = draft[:bs].zero_()
        predicts = torch.zeros(bs * nn, dtype=torch.int32)
        accept_index = torch.full((bs, spec), -1, dtype=torch.int32)
        accept_num = torch.empty(bs, dtype=torch.int32)
        cand = torch.tensor(tree.token_ids, dtype=torch.int64).expand(bs, nn)
        ref.reference_tree_speculative_sampling(
            predicts, accept_index, accept_num, cand,
            torch.arange(bs * nn, dtype=torch.int64).reshape(bs, nn),
            r_next.expand(bs, nn), r_sib.expand(bs, nn),
            torch.rand((bs, nn), generator=g), torch.rand((bs,), generator=g),
            tp.expand(bs, nn, -1), draft_probs,
            threshold_acc=threshold_acc,
        )
        first = predicts[accept_index[:, 0].long()].long()
        has_second = accept_num >= 1
        second_tree = predicts[accept_index[:, 1].clamp(min=0).long()].long()
        u = torch.rand((bs, 1), generator=g)
        second_fresh = torch.searchsorted(cdf1[first], u, right=True).squeeze(1).clamp(max=tp.shape[1] - 1)
        from_tree += int(has_second.sum())
        firsts.append(first)
        seconds.append(torch.where(has_second, second_tree, second_fresh))
    return torch.cat(firsts), torch.cat(seconds), from_tree


SETTINGS = [
    (0.5, -1, 1.0),
    (1.0, -1, 1.0),
    (1.5, -1, 1.0),
    (0.5, 5, 0.9),
    (1.0, 8, 0.8),
    (1.5, 6, 0.95),
]


@pytest.mark.parametrize(("seed", "temp", "top_k", "top_p"), [(11 + i, *s) for i, s in enumerate(SETTINGS)])
def test_first_and_two_step_distribution_match_target(
    ref: ModuleType, seed: int, temp: float, top_k: int, top_p: float
) -> None:
    case = make_case(ref, seed)
    vocab = case.l0.numel()
    n = N_SAMPLES
    first, second, from_tree = sample_first_two(ref, case, temp, top_k, top_p, n, seed=seed * 7 + 1)
    # Both branches of the sampler (accepted draft, bonus after rejections) must be exercised.
    assert 0.01 * n < from_tree < 0.99 * n
    p0 = ref.target_probs_from_logits(case.l0.unsqueeze(0), temp, top_k, top_p)[0]
    p1 = ref.target_probs_from_logits(case.l1, temp, top_k, top_p)
    joint = p0.unsqueeze(1) * p1

    c1 = torch.bincount(first, minlength=vocab)
    assert c1[p0 == 0].sum() == 0, "a token outside the target's support was emitted"
    assert tv(c1, p0) < tv_bound(p0, n)
    c2 = torch.bincount(first * vocab + second, minlength=vocab * vocab)
    assert tv(c2, joint) < tv_bound(joint, n)


def test_lossy_threshold_is_detected(ref: ModuleType) -> None:
    """threshold_acc < 1 over-accepts drafts; the same bound must catch it."""
    case = make_case(ref, 11)
    n = N_SAMPLES
    first, _, _ = sample_first_two(ref, case, 1.0, -1, 1.0, n, seed=5, threshold_acc=0.3)
    p0 = ref.target_probs_from_logits(case.l0.unsqueeze(0), 1.0, -1, 1.0)[0]
    assert tv(torch.bincount(first, minlength=p0.numel()), p0) > tv_bound(p0, n)


@pytest.mark.parametrize("seed", range(5))
def test_temperature_zero_equals_greedy_walk(ref: ModuleType, seed: int) -> None:
    """Greedy rows in a mixed batch go through the sampler, and must equal the greedy walk."""
    g = torch.Generator().manual_seed(100 + seed)
    trees, logits = [], []
    vocab, n_rows = 24, 17
    for _ in range(8):
        lp = torch.log_softmax(torch.randn(4, vocab, generator=g) * 2, dim=-1)
        top = lp.topk(3, dim=-1)
        tree = ref.build_ddtree_tree_from_topk(top.indices, top.values, 16, root_token=0)
        rows = torch.randn(n_rows, vocab, generator=g)
        # Make the target agree with the tree's best child most of the time.
        _, r_next, _ = ref.compile_ddtree_retrieve(tree.parents, tree.node_logws)
        for i in range(len(tree)):
            child = int(r_next[i])
            if child != -1 and torch.rand(1, generator=g).item() < 0.8:
                rows[i, tree.token_ids[child]] += 10.0
        trees.append(tree)
        logits.append(rows)
    target = torch.stack(logits)
    # SGLang encodes greedy as top_k == 1 at temperature 1: rows 2 and 6 use that form.
    temps = [0.0, 1.0, 1.0, 1.0] * 2
    top_ks = [-1, -1, 1, -1] * 2
    out = ref.sample_tree_paths(trees, target, temps, top_ks, [1.0] * 8, generator=g, use_kernel=False)
    greedy_rows = [0, 2, 4, 6]
    lengths = []
    for b in greedy_rows:
        expected = ref.follow_verified_tree(trees[b].parents, trees[b].token_ids, target[b].argmax(dim=-1))
        assert out[b] == expected
        lengths.append(len(expected[0]))
    assert max(lengths) > 1, "the case must exercise accepted drafts, not only bonus tokens"
    for b in range(8):
        accepted, proposed = out[b]
        assert accepted[0] == 0 and len(proposed) == len(accepted)
        # Each accepted node's token was proposed; the last proposed token is the bonus
        # token sampled after the tree.
        for (parent, child), tok in zip(itertools.pairwise(accepted), proposed[:-1], strict=True):
            assert trees[b].parents[child] == parent and trees[b].token_ids[child] == tok


def test_sample_tree_paths_first_token_through_batching(ref: ModuleType) -> None:
    """End to end through sample_tree_paths (padding, offsets, coin drawing, % N)."""
    case = make_case(ref, 21)
    tree = case.tree
    n_pad = len(tree) + 3  # rows beyond the tree are padding the sampler must never reach
    logits = torch.cat([case.node_logits, torch.zeros(3, case.l0.numel())])
    n = 4000
    out = ref.sample_tree_paths(
        [tree] * n, logits.expand(n, n_pad, -1), [1.0] * n, [-1] * n, [1.0] * n,
        generator=torch.Generator().manual_seed(3),
    )
    first = torch.tensor([proposed[0] for _, proposed in out])
    assert all(max(acc) < len(tree) for acc, _ in out)
    p0 = ref.target_probs_from_logits(case.l0.unsqueeze(0), 1.0, -1, 1.0)[0]
    assert tv(torch.bincount(first, minlength=p0.numel()), p0) < tv_bound(p0, n)
