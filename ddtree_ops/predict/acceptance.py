"""Expected accepted length of any (budget, top-k) tree in one traced round.

SGLang's target-only tree rejection sampling (``tree_speculative_sampling_target_only``,
thresholds 1) walks the children of the last accepted node in sibling order with one
coin ``u`` drawn at the parent and accepts the first child whose running sum of target
probabilities exceeds ``u``: child ``c`` is accepted with probability exactly ``p(c)``
(the intervals of the children partition [0, sum p)). So the walk reaches node ``u`` with
probability ``reach(u)`` = the product of ``p`` along its path, whatever the tree holds
beside that path, and the expected number of tokens a round commits (accepted + 1, the
bonus token) is ``1 + sum over non-root nodes of reach(u)``. Greedy verification is the
same with ``p`` in {0, 1}. The second moment follows the same way: a round that reaches
depth ``d`` commits ``c = d + 1`` tokens and ``c^2 = sum over the path's nodes (root
included) of (2 depth + 1)``, so ``E[c^2] = sum over the tree of (2 depth(u) + 1) reach(u)``.

A (budget, top-k) tree is rebuilt with the bundle's own builder
(``build_ddtree_tree_from_topk``) from the round's draft table truncated to k columns; each
node is found in the trace by its token path. The builder pops best first, so the tree of
budget b is the first b pops of the tree of any larger budget (a node at depth d needs d
pops, so the depth bound min(block - 1, b) never removes a node a b-node tree could hold):
one build at the largest budget per top-k gives every budget by prefix sums.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ddtree_ops.predict.trace import TraceRound


class NotCovered(ValueError):
    """A rebuilt tree holds a node the trace did not verify (the trace's grid is smaller)."""


@dataclass(frozen=True)
class RoundMoments:
    """One round's committed tokens for one tree: ``mean`` = E[c] (the expected accepted
    length, bonus token included) and ``m2`` = E[c^2]."""

    mean: float
    m2: float


def _builder() -> Any:
    from ddtree_ops.ddtree_core import load_ddtree_reference

    return load_ddtree_reference().build_ddtree_tree_from_topk


def traced_moments(rnd: TraceRound) -> RoundMoments:
    """The moments of the tree the round verified (every traced node)."""
    depth = [0]
    for par in rnd.parent:
        depth.append(depth[par] + 1)
    reach = rnd.reach
    return RoundMoments(sum(reach), sum((2 * d + 1) * r for d, r in zip(depth, reach, strict=True)))


def round_moments(
    rnd: TraceRound, trees: Iterable[tuple[int, int]], *, block: int, builder: Any = None
) -> dict[tuple[int, int], RoundMoments]:
    """(budget, topk) -> the round's :class:`RoundMoments` for that tree, for every tree of
    ``trees``; :class:`NotCovered` if one holds a node the trace did not verify."""
    build = builder or _builder()
    by_k: dict[int, list[int]] = {}
    for budget, topk in trees:
        by_k.setdefault(topk, []).append(budget)
    out: dict[tuple[int, int], RoundMoments] = {}
    reach = rnd.reach
    children = rnd.children
    for topk, budgets in by_k.items():
        top = max(budgets)
        depth = min(len(rnd.draft_ids), block - 1, top)
        tree = build([row[:topk] for row in rnd.draft_ids[:depth]], [row[:topk] for row in rnd.draft_logp[:depth]],
                     top, rnd.root)
        index = [0] * len(tree.parents)
        cum_mean = [1.0]
        cum_m2 = [1.0]
        for i in range(1, len(tree.parents)):
            at = children.get((index[tree.parents[i]], tree.token_ids[i]))
            if at is None:
                raise NotCovered(f"budget {top} top-k {topk}: node {i} (depth {tree.depths[i]}, token "
                                 f"{tree.token_ids[i]}) was not verified in the trace")
            index[i] = at
            cum_mean.append(cum_mean[-1] + reach[at])
            cum_m2.append(cum_m2[-1] + (2 * tree.depths[i] + 1) * reach[at])
        for budget in budgets:
            n = min(budget, len(tree.parents) - 1)  # a narrow, shallow table holds fewer nodes
            out[(budget, topk)] = RoundMoments(cum_mean[n], cum_m2[n])
    return out


def moments_table(
    rounds: Iterable[TraceRound], trees: Iterable[tuple[int, int]], *, block: int
) -> tuple[list[RoundMoments], dict[tuple[int, int], list[RoundMoments]]]:
    """For every round: the traced tree's moments, and each tree's (lists in round order)."""
    wanted = list(dict.fromkeys(trees))
    build = _builder()
    traced: list[RoundMoments] = []
    per_tree: dict[tuple[int, int], list[RoundMoments]] = {t: [] for t in wanted}
    for rnd in rounds:
        traced.append(traced_moments(rnd))
        for tree, m in round_moments(rnd, wanted, block=block, builder=build).items():
            per_tree[tree].append(m)
    return traced, per_tree


__all__ = ["NotCovered", "RoundMoments", "moments_table", "round_moments", "traced_moments"]
