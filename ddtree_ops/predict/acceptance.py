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

The same sampler fixes what a tree commits *given the stream* (the tokens the request
went on to return): a child is accepted only as its own token, and after every child of a
node was tried and rejected the bonus is drawn from ``relu(q - p)`` with each tried
child's mass in ``p``, so the bonus is never a child. The stream's next token is a child
of the last accepted node exactly when the walk accepted it: the tree commits ``1 +
matched`` tokens, ``matched`` the depth to which it holds the stream (at T = 0 and T > 0).

A (budget, top-k) tree is rebuilt with the bundle's own builder
(``build_ddtree_tree_from_topk``) from the round's draft table truncated to k columns; each
node is found in the trace by its token path. The builder pops best first, so the tree of
budget b is the first b pops of the tree of any larger budget (a node at depth d needs d
pops, so the depth bound min(block - 1, b) never removes a node a b-node tree could hold):
one build at the largest budget per top-k gives every budget by prefix sums.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ddtree_ops.predict.trace import TraceRound


class NotCovered(ValueError):
    """A rebuilt tree holds a node the trace did not verify (the trace's grid is smaller)."""


@dataclass(frozen=True)
class RoundMoments:
    """One round's committed tokens for one tree: ``mean`` = E[c] (the expected accepted
    length, bonus token included) and ``m2`` = E[c^2]; ``matched``: how deep the tree
    holds the request's own continuation (the stream tokens after the root, where the
    trace knows them): what the tree would have accepted there (module docstring)."""

    mean: float
    m2: float
    matched: int = 0


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
    rnd: TraceRound, trees: Iterable[tuple[int, int]], *, block: int, builder: Any = None,
    ahead: Sequence[int] = (),
) -> dict[tuple[int, int], RoundMoments]:
    """(budget, topk) -> the round's :class:`RoundMoments` for that tree, for every tree of
    ``trees``; :class:`NotCovered` if one holds a node the trace did not verify. ``ahead``:
    the stream's tokens after the root, as far as known (``matched`` follows them)."""
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
        path = _stream_path(tree, ahead)
        for budget in budgets:
            n = min(budget, len(tree.parents) - 1)  # a narrow, shallow table holds fewer nodes
            # Path indices rise with depth, so the budget-n tree holds a prefix of the path.
            out[(budget, topk)] = RoundMoments(cum_mean[n], cum_m2[n], sum(1 for i in path if i <= n))
    return out


def _stream_path(tree: Any, ahead: Sequence[int]) -> list[int]:
    """Node indices of ``tree`` along the stream's tokens ``ahead`` from the root."""
    kids: dict[tuple[int, int], int] = {}
    for i in range(1, len(tree.parents)):
        kids.setdefault((tree.parents[i], tree.token_ids[i]), i)
    path: list[int] = []
    at = 0
    for token in ahead:
        nxt = kids.get((at, token))
        if nxt is None:
            break
        path.append(nxt)
        at = nxt
    return path


def moments_table(
    rounds: Sequence[TraceRound], trees: Iterable[tuple[int, int]], *, block: int
) -> tuple[list[RoundMoments], dict[tuple[int, int], list[RoundMoments]]]:
    """For every round: the traced tree's moments, and each tree's (lists in round order),
    ``matched`` along the stream the following rounds' roots spell (a recorded round
    commits one token, so the round at the next position holds the next token)."""
    wanted = list(dict.fromkeys(trees))
    build = _builder()
    traced: list[RoundMoments] = []
    per_tree: dict[tuple[int, int], list[RoundMoments]] = {t: [] for t in wanted}
    for i, rnd in enumerate(rounds):
        ahead: list[int] = []
        for j in range(i + 1, min(len(rounds), i + block)):
            if rounds[j].prefix != rnd.prefix + len(ahead) + 1:
                break
            ahead.append(rounds[j].root)
        traced.append(traced_moments(rnd))
        for tree, m in round_moments(rnd, wanted, block=block, builder=build, ahead=ahead).items():
            per_tree[tree].append(m)
    return traced, per_tree


__all__ = ["NotCovered", "RoundMoments", "moments_table", "round_moments", "traced_moments"]
