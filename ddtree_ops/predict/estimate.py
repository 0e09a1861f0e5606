"""From traced rounds to a sweep's cells: acceptance per tree, round times, tok/s, and the
cells worth measuring.

**Why the plain average is biased, and the walk that corrects it.** Per traced round,
:mod:`.acceptance` gives the exact expected committed tokens ``a_S(q)`` of any tree S
started at that round's position q. The *naive* estimator averages ``a_S`` over the
traced rounds. But a tree's own rounds do not start at every position: they start where
its previous round's accepts ended, q' = q + c. Which positions those are matters
whenever acceptance depends on the position (a target that continues text periodically
accepts a whole period from one place and nothing from the next; code, boilerplate and
free prose in one response): averaging over positions weights them by one, the server
weights them by how often the tree lands there.

A recorded round commits one token (the bundle's ``ddtree_trace.py``), so the trace
holds a round at every position of each response, and the request's own stream (the
roots of consecutive rounds). Given the stream, what S commits at q is determined: the
verifier accepts a child only as that child's token, and after a rejection it draws the
bonus from ``relu(q - p)``, which excludes every child it tried; so S accepts exactly the
longest path of its tree along the stream (``RoundMoments.matched``), at T = 0 and at
T > 0 alike. The *walk* replays S's rounds along each response: start at the first
traced position, commit ``c = 1 + matched``, move on c positions, until the last
positions where a round's verdict could still depend on tokens past the trace (the
draft block's depth before its end). The rate is ``sum c / rounds`` over the walks of
every response (what the server counts: tokens over rounds, summed over requests), and
``E[c^2]`` beside it. At T = 0 the stream is the greedy one every tree commits and the
walk reproduces each tree's rounds exactly; at T > 0 the stream is one sample of the
target's, which every tree's output follows (lossless verification), so the walk is an
unbiased replay with that sample's noise. ``expected`` is the same walk counting
``a_S(q)`` (the path products) at the starts instead of the realised c: also consistent
(``c - a_S(q)`` has mean zero given the walk so far), with less noise at T > 0 (the
coins of the walk's own rounds averaged out); :func:`predict_cell` uses it.

**Round time and tok/s.** A request of M tokens gets its first token from the prefill and
the rest from verify rounds; a renewal process with committed tokens c per round (mean μ,
second moment m2) needs ``E[N] = (M - 1 + (m2 - μ) / (2 μ)) / μ`` rounds to reach M - 1
tokens (the lattice renewal's mean overshoot). The ledger's accept length is what the
server counts, ``M / N``. The round time comes from a probe at the cell's concurrency,
verify width and verify path -- greedy or sampled: a sampled round computes the target's
probabilities and walks the tree by rejection, work that grows with the verify width
(:class:`RoundTime`: seconds per round, and the per-request overhead its prefill and
admission cost), so ``tok/s = c * M / (overhead + E[N] * round)`` -- for long
outputs ``concurrency x acceptance / round time``.

**Probes pooled before use** (:func:`smooth_round_times`). The best trees of a grid are
often within a few per cent of each other, less than one short probe's scatter (on the
CPU server a probe's round time moves +-15 % from budget to budget, not in order). Two
facts of the server remove most of it: a wider verify does not run faster (the round time
is non-decreasing in the budget at one verify path, concurrency and graph mode), and the
per-request overhead (prefill, admission) does not depend on the tree. So the round times
of one (verify path, concurrency, graph mode) are fitted non-decreasing in budget (isotonic
least squares), and every probe at a (verify path, concurrency) gets their median overhead.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ddtree_ops.predict.acceptance import RoundMoments, moments_table
from ddtree_ops.predict.trace import RequestTrace, TraceRound

Tree = tuple[int, int]
# A probe's identity: (verify path, concurrency, budget).
ProbeKey = tuple[str, int, int]


@dataclass(frozen=True)
class AcceptPrediction:
    """One tree's committed tokens per round (bonus token included) from a set of traces:
    ``walk`` the walk's rate (module docstring), ``m2`` its E[c^2]; ``expected`` the walk
    counting the path products (what :func:`predict_cell` uses); ``naive`` / ``m2_naive``
    the plain mean over the traced rounds; ``rounds`` traced rounds, ``walk_rounds`` the
    tree's rounds in the walks; ``traced``: the union's expected committed tokens per
    traced round."""

    budget: int
    topk: int
    walk: float
    m2: float
    expected: float
    naive: float
    m2_naive: float
    rounds: int
    walk_rounds: int
    traced: float


def _segments(rounds: Sequence[TraceRound]) -> list[tuple[int, int]]:
    """[start, end) of each run of rounds at consecutive positions."""
    out: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(rounds) + 1):
        if i == len(rounds) or rounds[i].prefix != rounds[i - 1].prefix + 1:
            out.append((start, i))
            start = i
    return out


@dataclass
class _Walk:
    tokens: float = 0.0
    squares: float = 0.0
    expected: float = 0.0
    rounds: int = 0

    def replay(self, moments: Sequence[RoundMoments], start: int, end: int, depth: int) -> None:
        """S's rounds along positions [start, end): a round at i needs the stream to
        i + depth to know its verdict, so the walk stops past ``end - 1 - depth`` (a
        position bound, not the round's outcome: no round is dropped for being long)."""
        i = start
        while i <= end - 1 - depth:
            m = moments[i]
            c = 1 + m.matched
            self.tokens += c
            self.squares += c * c
            self.expected += m.mean
            self.rounds += 1
            i += c


def predict_acceptance(
    traces: Sequence[RequestTrace], trees: Iterable[Tree]
) -> dict[Tree, AcceptPrediction]:
    """(budget, topk) -> :class:`AcceptPrediction` over every round of ``traces``."""
    wanted = list(dict.fromkeys(trees))
    walks = {t: _Walk() for t in wanted}
    rounds: dict[Tree, list[RoundMoments]] = {t: [] for t in wanted}
    traced: list[float] = []
    for trace in traces:
        t_moments, tree_moments = moments_table(trace.rounds, wanted, block=trace.block)
        traced.extend(m.mean for m in t_moments)
        segments = _segments(trace.rounds)
        for tree in wanted:
            rounds[tree].extend(tree_moments[tree])
            for start, end in segments:
                walks[tree].replay(tree_moments[tree], start, end, trace.block - 1)
    if not traced:
        raise ValueError("the traces hold no verify round")
    out: dict[Tree, AcceptPrediction] = {}
    for (budget, topk), walk in walks.items():
        if not walk.rounds:
            raise ValueError(f"the traces are too short to walk: each response needs more than "
                             f"{traces[0].block} traced rounds")
        ms = rounds[(budget, topk)]
        out[(budget, topk)] = AcceptPrediction(
            budget, topk, walk=walk.tokens / walk.rounds, m2=walk.squares / walk.rounds,
            expected=walk.expected / walk.rounds, naive=sum(m.mean for m in ms) / len(ms),
            m2_naive=sum(m.m2 for m in ms) / len(ms), rounds=len(ms), walk_rounds=walk.rounds,
            traced=sum(traced) / len(traced))
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
    """A probe's result at one (verify path, concurrency, budget): seconds per verify round,
    and the per-request seconds beyond its rounds (prefill, admission); ``cuda_graph``:
    whether the probed state replayed its verify graph; ``verify_path``: the sampling's
    verify branch (``greedy``, ``sampled``...: ``bench.plan.Sampling.verify_path``)."""

    concurrency: int
    budget: int
    round_s: float
    overhead_s: float
    cuda_graph: bool = True
    verify_path: str = "greedy"

    @property
    def key(self) -> ProbeKey:
        return (self.verify_path, self.concurrency, self.budget)

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
    requests: Sequence[ProbeRequest], *, concurrency: int, budget: int, duration_s: float, cuda_graph: bool = True,
    verify_path: str = "greedy",
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
    return RoundTime(concurrency, budget, round_s, max(0.0, per_slot - mean_rounds * round_s), cuda_graph,
                     verify_path)


@dataclass(frozen=True)
class CellPrediction:
    """One DDTree cell predicted: acceptance as the ledger counts it (tokens / verify
    rounds) and output tok/s, by the walk and naive."""

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
    overhead_s: float
    cuda_graph: bool


def _tok_s(concurrency: int, tokens: int, rounds: float, rt: RoundTime) -> float:
    return concurrency * tokens / (rt.overhead_s + rounds * rt.round_s)


def predict_cell(
    accept: AcceptPrediction, rt: RoundTime, *, tokens: int, temperature: float, top_p: float = 1.0,
    top_k: int = -1,
) -> CellPrediction:
    """The cell (accept's tree, rt's concurrency) for requests of ``tokens`` output tokens
    (the walk's estimate, module docstring; the naive one beside it)."""
    rounds = rounds_per_request(accept.expected, accept.m2, tokens)
    rounds_naive = rounds_per_request(accept.naive, accept.m2_naive, tokens)
    return CellPrediction(
        budget=accept.budget, topk=accept.topk, temperature=temperature, top_p=top_p, top_k=top_k,
        concurrency=rt.concurrency,
        accept_length=tokens / rounds if rounds else accept.expected,
        accept_length_naive=tokens / rounds_naive if rounds_naive else accept.naive,
        output_tok_s=_tok_s(rt.concurrency, tokens, rounds, rt),
        output_tok_s_naive=_tok_s(rt.concurrency, tokens, rounds_naive, rt),
        round_s=rt.round_s, overhead_s=rt.overhead_s, cuda_graph=rt.cuda_graph,
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


def _nondecreasing(values: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing fit of ``values`` (pool adjacent violators). Written
    out: a dozen lines, where scipy's ``isotonic_regression`` would be a new dependency."""
    blocks: list[tuple[float, int]] = []  # (mean, count), means non-decreasing
    for v in values:
        mean, count = float(v), 1
        while blocks and blocks[-1][0] > mean:
            prev, n = blocks.pop()
            mean, count = (prev * n + mean * count) / (n + count), n + count
        blocks.append((mean, count))
    return [mean for mean, count in blocks for _ in range(count)]


def smooth_round_times(times: Iterable[RoundTime]) -> dict[ProbeKey, RoundTime]:
    """The probes as the predictor uses them (module docstring), by :attr:`RoundTime.key`:
    per (verify path, concurrency, graph mode) the round time fitted non-decreasing in
    budget; per (verify path, concurrency) the median overhead."""
    out: dict[ProbeKey, RoundTime] = {}
    groups: dict[tuple[str, int], list[RoundTime]] = {}
    for rt in times:
        groups.setdefault((rt.verify_path, rt.concurrency), []).append(rt)
    for mine in groups.values():
        overhead = statistics.median(rt.overhead_s for rt in mine)
        for graph in {rt.cuda_graph for rt in mine}:
            ordered = sorted((rt for rt in mine if rt.cuda_graph == graph), key=lambda rt: rt.budget)
            fitted = _nondecreasing([rt.round_s for rt in ordered])
            for rt, round_s in zip(ordered, fitted, strict=True):
                out[rt.key] = dataclasses.replace(rt, round_s=round_s, overhead_s=overhead)
    return out


__all__ = [
    "AcceptPrediction",
    "CellPrediction",
    "ProbeKey",
    "ProbeRequest",
    "RoundTime",
    "measure_round_time",
    "predict_acceptance",
    "predict_cell",
    "rounds_per_request",
    "smooth_round_times",
    "top_cells",
]
