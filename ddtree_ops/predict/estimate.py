"""From traced rounds to a sweep's cells: acceptance per tree, round times, tok/s, and the
cells worth measuring.

**Why the naive average is biased, and the correction.** Per round, :mod:`.acceptance`
gives the exact expected committed tokens ``a_S(r)`` of any tree S over the round's draft.
The naive estimator averages ``a_S(r)`` over the traced rounds. But the traced rounds start
where the *traced* (union) tree's accepts ended: they sample the token stream once every
``a_T`` tokens, densely where the traced tree accepts little and sparsely where it accepts
a lot. The smaller tree's own rounds would start elsewhere. Treat each tree's decoding as a
renewal process along the stream: where the local acceptance is ``a_S(x)`` the tree spends
``1 / a_S(x)`` rounds per token, so its tokens per round over a stretch of L tokens are
``L / integral(dx / a_S(x))`` -- a token-weighted harmonic mean, not a round-weighted
arithmetic one. A traced round r stands for the ``a_T(r)`` tokens the traced tree covered
from it (its expected committed tokens, computed from the trace like any other tree's), so

    corrected  A_S = sum_r a_T(r) / sum_r (a_T(r) / a_S(r))
    naive      A_S = mean_r a_S(r)

The corrected form weights each traced round by the rounds the smaller tree would have spent
on that round's stretch of the stream (``a_T(r) / a_S(r)``) -- importance weights from the
traced tree's walk to the smaller tree's. For the traced tree itself both forms give its
own mean (``a_S = a_T``), so the correction only moves the *other* trees, and it moves them
in the direction the trace's sampling hides: where the stream is easy both trees accept
more, the traced tree leaves such stretches in fewer rounds, so the traced rounds
under-sample exactly the stretches where a smaller tree is relatively good. The naive
average therefore under-predicts smaller trees and over-predicts how much the large trees
gain over them (the vLLM port's "+15 % predicted for +3.4 % measured" is such a gain).
The same weights give a smaller tree's second moment ``E[c^2]`` (the rounds a request
needs, :func:`rounds_per_request`, depends on it through the last round's overshoot).

What it does not model: that a round's start also follows the traced tree's *own* last
rejection (the bonus token the traced tree could not draft), which a smaller tree's start
only sometimes does; ``benchmarks/predict_accuracy.py`` measures what is left.

**Round time and tok/s.** A request of M tokens gets its first token from the prefill and
the rest from verify rounds; a renewal process with committed tokens c per round (mean μ,
second moment m2) needs ``E[N] = (M - 1 + (m2 - μ) / (2 μ)) / μ`` rounds to reach M - 1
tokens (the lattice renewal's mean overshoot). The ledger's accept length is what the
server counts, ``M / N``. The round time comes from a probe at the cell's concurrency and
verify width (:class:`RoundTime`: seconds per round, and the per-request overhead its
prefill and admission cost), so ``tok/s = c * M / (overhead + E[N] * round)`` -- for long
outputs ``concurrency x acceptance / round time``.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ddtree_ops.predict.acceptance import RoundMoments, moments_table
from ddtree_ops.predict.trace import RequestTrace

Tree = tuple[int, int]


@dataclass(frozen=True)
class AcceptPrediction:
    """One tree's per-round committed tokens (bonus included) from a set of traces:
    ``naive`` the plain mean over traced rounds, ``corrected`` the renewal-weighted one
    (module docstring); ``m2`` / ``m2_naive`` their second moments; ``traced`` the traced
    tree's realised mean (accepted + 1 per round, as it ran)."""

    budget: int
    topk: int
    naive: float
    corrected: float
    m2_naive: float
    m2: float
    rounds: int
    traced: float


def _combine(traced: Sequence[RoundMoments], tree: Sequence[RoundMoments]) -> tuple[float, float, float, float]:
    n = len(tree)
    naive = sum(m.mean for m in tree) / n
    m2_naive = sum(m.m2 for m in tree) / n
    # Rounds the tree would spend on each traced round's stretch of the stream.
    spent = [t.mean / m.mean for t, m in zip(traced, tree, strict=True)]
    corrected = sum(t.mean for t in traced) / sum(spent)
    m2 = sum(s * m.m2 for s, m in zip(spent, tree, strict=True)) / sum(spent)
    return naive, corrected, m2_naive, m2


def predict_acceptance(traces: Sequence[RequestTrace], trees: Iterable[Tree]) -> dict[Tree, AcceptPrediction]:
    """(budget, topk) -> :class:`AcceptPrediction` over every round of ``traces``."""
    wanted = list(dict.fromkeys(trees))
    traced: list[RoundMoments] = []
    per_tree: dict[Tree, list[RoundMoments]] = {t: [] for t in wanted}
    realised: list[int] = []
    for trace in traces:
        t_moments, tree_moments = moments_table(trace.rounds, wanted, block=trace.block)
        traced.extend(t_moments)
        for tree in wanted:
            per_tree[tree].extend(tree_moments[tree])
        realised.extend(r.accepted + 1 for r in trace.rounds)
    if not traced:
        raise ValueError("the traces hold no verify round")
    out: dict[Tree, AcceptPrediction] = {}
    for (budget, topk), moments in per_tree.items():
        naive, corrected, m2_naive, m2 = _combine(traced, moments)
        out[(budget, topk)] = AcceptPrediction(budget, topk, naive, corrected, m2_naive, m2, len(traced),
                                               sum(realised) / len(realised))
    return out


def rounds_per_request(mean: float, m2: float, tokens: int) -> float:
    """Expected verify rounds for a request of ``tokens`` output tokens (the first comes
    from the prefill) when each round commits c tokens with E[c] = ``mean``, E[c^2] = ``m2``."""
    if tokens <= 1:
        return 0.0
    overshoot = max(0.0, (m2 - mean) / (2 * mean))
    return (tokens - 1 + overshoot) / mean


@dataclass(frozen=True)
class RoundTime:
    """A probe's result at one (concurrency, budget): seconds per verify round, and the
    per-request seconds beyond its rounds (prefill, admission); ``cuda_graph``: whether the
    probed state replayed its verify graph."""

    concurrency: int
    budget: int
    round_s: float
    overhead_s: float
    cuda_graph: bool = True

    @property
    def verify_width(self) -> int:
        return self.budget + 1


@dataclass(frozen=True)
class ProbeRequest:
    """What a probe needs of one finished request."""

    e2e_s: float
    ttft_s: float
    verify_ct: int


def measure_round_time(
    requests: Sequence[ProbeRequest], *, concurrency: int, budget: int, duration_s: float, cuda_graph: bool = True
) -> RoundTime | None:
    """A probe's :class:`RoundTime` from its requests (all at ``concurrency``): the median
    decode time per round, and what each request slot's share of the wall time exceeds its
    rounds by. None without a request that verified."""
    good = [r for r in requests if r.verify_ct > 0 and r.e2e_s > r.ttft_s]
    if not good or duration_s <= 0:
        return None
    round_s = statistics.median((r.e2e_s - r.ttft_s) / r.verify_ct for r in good)
    per_slot = duration_s * concurrency / len(good)
    mean_rounds = sum(r.verify_ct for r in good) / len(good)
    return RoundTime(concurrency, budget, round_s, max(0.0, per_slot - mean_rounds * round_s), cuda_graph)


@dataclass(frozen=True)
class CellPrediction:
    """One DDTree cell predicted: acceptance as the ledger counts it (tokens / verify
    rounds) and output tok/s, corrected and naive."""

    budget: int
    topk: int
    temperature: float
    top_p: float
    top_k: int
    concurrency: int
    accept_length: float
    accept_length_naive: float
    output_tok_s: float
    output_tok_s_naive: float
    round_s: float
    cuda_graph: bool


def _tok_s(concurrency: int, tokens: int, rounds: float, rt: RoundTime) -> float:
    return concurrency * tokens / (rt.overhead_s + rounds * rt.round_s)


def predict_cell(
    accept: AcceptPrediction, rt: RoundTime, *, tokens: int, temperature: float, top_p: float = 1.0,
    top_k: int = -1,
) -> CellPrediction:
    """The cell (accept's tree, rt's concurrency) for requests of ``tokens`` output tokens."""
    rounds = rounds_per_request(accept.corrected, accept.m2, tokens)
    rounds_naive = rounds_per_request(accept.naive, accept.m2_naive, tokens)
    return CellPrediction(
        budget=accept.budget, topk=accept.topk, temperature=temperature, top_p=top_p, top_k=top_k,
        concurrency=rt.concurrency,
        accept_length=tokens / rounds if rounds else accept.corrected,
        accept_length_naive=tokens / rounds_naive if rounds_naive else accept.naive,
        output_tok_s=_tok_s(rt.concurrency, tokens, rounds, rt),
        output_tok_s_naive=_tok_s(rt.concurrency, tokens, rounds_naive, rt),
        round_s=rt.round_s, cuda_graph=rt.cuda_graph,
    )


def top_cells(predictions: Iterable[CellPrediction], n: int) -> list[CellPrediction]:
    """The ``n`` fastest predicted cells per (temperature, top_p, top_k, concurrency), fastest
    first within each; ties by the smaller tree."""
    groups: dict[tuple[float, float, int, int], list[CellPrediction]] = {}
    for p in predictions:
        groups.setdefault((p.temperature, p.top_p, p.top_k, p.concurrency), []).append(p)
    out: list[CellPrediction] = []
    for key in sorted(groups):
        ranked = sorted(groups[key], key=lambda p: (-p.output_tok_s, p.budget, p.topk))
        out.extend(ranked[:n])
    return out


def round_time_for(times: Mapping[tuple[int, int], RoundTime], concurrency: int, budget: int) -> RoundTime | None:
    """The probe at (concurrency, budget), else None."""
    return times.get((concurrency, budget))


__all__ = [
    "AcceptPrediction",
    "CellPrediction",
    "ProbeRequest",
    "RoundTime",
    "measure_round_time",
    "predict_acceptance",
    "predict_cell",
    "round_time_for",
    "rounds_per_request",
    "top_cells",
]
