"""From traced rounds to a sweep's cells: acceptance per tree, round times, tok/s, and the
cells worth measuring.

**Why the naive average is biased, and the correction.** Per round, :mod:`.acceptance`
gives the exact expected committed tokens ``a_S(r)`` of any tree S over the round's draft.
The naive estimator averages ``a_S(r)`` over the traced rounds. But the traced rounds start
where the *traced* (union) tree's accepts ended: they sample the token stream once every
``a_T`` tokens, densely where the traced tree accepts little and sparsely where it accepts
a lot. The smaller tree's own rounds would be spread differently. Treat each request's
decoding as a renewal process along its output: over a stretch whose acceptance rate for
S is ``a_S``, S spends ``tokens / a_S`` rounds, so what the server counts (tokens over
rounds, summed over requests) is a token-weighted *harmonic* mean of the stretches' rates,
while the naive mean weights each stretch by the traced tree's rounds there. A stretch is
one request (the traced rounds of one response): its rate for S is the mean of ``a_S(r)``
over its rounds, and it stands for the ``sum a_T(r)`` tokens the traced tree covered there
(its expected committed tokens, computed from the trace like any other tree's). So

    corrected  A_S = sum_req tokens_req / sum_req (tokens_req / mean_r a_S(r))
    naive      A_S = mean over all rounds of a_S(r)

-- each request weighted by the rounds the smaller tree would have spent on it. Easy
requests (code) are where both trees accept more; the traced tree leaves them in fewer
rounds, so the traced rounds under-sample exactly the requests where a smaller tree is
relatively good: the naive mean *under*-predicts smaller trees and so over-predicts how
much the large trees gain over them (the vLLM port's "+15 % predicted for +3.4 %
measured" is such a gain). For the traced tree itself both forms agree. The stretch must
be long enough to average out a round's own luck: weighting single rounds (``a_T(r) /
a_S(r)`` per round) treats that noise as a rate and over-corrects (on the simulator,
median error 6 %, max 15 %, against 2.2 % / 3.2 % naive and 0.6 % / 1.3 % per request).
The same weights give a smaller tree's second moment ``E[c^2]`` (the rounds a request
needs, :func:`rounds_per_request`, depends on it through the last round's overshoot).

What it does not model: variation inside a request (the stretch's rate is its mean), and
that a round's start follows the traced tree's own last rejection;
``benchmarks/predict_accuracy.py`` measures what is left.

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


def _combine(
    traced: Sequence[Sequence[RoundMoments]], tree: Sequence[Sequence[RoundMoments]]
) -> tuple[float, float, float, float]:
    """(naive, corrected, naive m2, corrected m2) from per-stretch round moments (one
    stretch per request: its traced rounds, and the tree's over the same rounds)."""
    rounds = [m for stretch in tree for m in stretch]
    naive = sum(m.mean for m in rounds) / len(rounds)
    m2_naive = sum(m.m2 for m in rounds) / len(rounds)
    covered: list[float] = []  # tokens of the stream each stretch stands for
    spent: list[float] = []  # rounds the tree would spend on it
    m2s: list[float] = []
    for t_stretch, stretch in zip(traced, tree, strict=True):
        if not stretch:
            continue
        tokens = sum(t.mean for t in t_stretch)
        rate = sum(m.mean for m in stretch) / len(stretch)
        covered.append(tokens)
        spent.append(tokens / rate)
        m2s.append(sum(m.m2 for m in stretch) / len(stretch))
    corrected = sum(covered) / sum(spent)
    m2 = sum(s * v for s, v in zip(spent, m2s, strict=True)) / sum(spent)
    return naive, corrected, m2_naive, m2


def predict_acceptance(traces: Sequence[RequestTrace], trees: Iterable[Tree]) -> dict[Tree, AcceptPrediction]:
    """(budget, topk) -> :class:`AcceptPrediction` over every round of ``traces``."""
    wanted = list(dict.fromkeys(trees))
    traced: list[list[RoundMoments]] = []
    per_tree: dict[Tree, list[list[RoundMoments]]] = {t: [] for t in wanted}
    realised: list[int] = []
    for trace in traces:
        t_moments, tree_moments = moments_table(trace.rounds, wanted, block=trace.block)
        traced.append(t_moments)
        for tree in wanted:
            per_tree[tree].append(tree_moments[tree])
        realised.extend(r.accepted + 1 for r in trace.rounds)
    if not realised:
        raise ValueError("the traces hold no verify round")
    out: dict[Tree, AcceptPrediction] = {}
    for (budget, topk), moments in per_tree.items():
        naive, corrected, m2_naive, m2 = _combine(traced, moments)
        out[(budget, topk)] = AcceptPrediction(budget, topk, naive, corrected, m2_naive, m2, len(realised),
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
