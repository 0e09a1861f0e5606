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

**The stream walk (T = 0).** Where acceptance depends on *where* a round starts (a target
that continues text periodically accepts a whole period from one position and nothing
from the next), the traced rounds start at the wrong places for a smaller tree S, and no
reweighting of them fixes that. At T = 0 verification is lossless and deterministic: every
tree commits the same greedy token stream, and the trace holds it (per round the root,
then the ``accepted`` nodes along the argmax path; the next round's root is the bonus).
So S's own rounds can be replayed along the stream (:func:`stream_walk`): start at the
first traced round's position q; S commits ``a_S`` tokens there (at T = 0 an integer, 1 +
the depth of the argmax path inside S) -- from the traced round that starts exactly at q
if there is one, else from the traced rounds (of any request of the set) whose start has
the longest matching context (the same last n stream tokens ending at the root, n in
:data:`WALK_CONTEXT`), else the request's mean ``a_S``; q advances by ``a_S``; the walk
counts S's rounds until the request's output is committed. What the server counts is
tokens over rounds summed over requests, so ``walk = sum (M - 1) / sum rounds`` (M - 1
tokens after the prefill's first; a truncated trace's rounds scaled up to M - 1). It
assumes that matching context predicts the round's acceptance, which holds for a drafter
whose proposals are determined by the context (DFlash's draft is); for the traced tree
itself every start is exact and the walk reproduces its rounds. At T > 0 the stream
differs per tree (and the trace does not say which branch was accepted), so the walk is
not defined there (:attr:`AcceptPrediction.walk` is None).

Measured (``benchmarks/predict_accuracy.py --part real_cpu``, perturbed tiny pair, whose
greedy stream has period 4): the walk's context lookup is right (a traced round's
committed tokens predicted from the other rounds with the same 32-token context: mean
abs error 0.016 tokens), yet the walk over-predicts every tree but the traced one by
~0.2-0.3 tokens per round (median error 16 % at T = 0 against naive 2.6 %, corrected
8.6 %): the smaller trees' real rounds do not land where the walk puts them, so the
server's stream or round starts differ from the trace's (not found yet). So
:func:`predict_cell` keeps the corrected estimate; the walk is reported beside it.

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
    tree's realised mean (accepted + 1 per round, as it ran); ``walk`` the stream walk's
    tokens per round (T = 0 traces whose rounds chain; else None)."""

    budget: int
    topk: int
    naive: float
    corrected: float
    m2_naive: float
    m2: float
    rounds: int
    traced: float
    walk: float | None = None


#: Context lengths (stream tokens ending at a round's root) the walk matches, longest first.
WALK_CONTEXT: tuple[int, ...] = (32, 24, 16, 12, 8, 6, 4, 3, 2, 1)


def greedy_stream(trace: RequestTrace) -> tuple[int, ...] | None:
    """The committed token stream a T = 0 trace holds, from the first round's root (its
    index 0 is position ``rounds[0].prefix``) to the last round's last accepted token (the
    last bonus is not traced); None if a round does not start where the previous one's
    commits ended or its accepted nodes are not an argmax chain."""
    if not trace.rounds:
        return None
    start = trace.rounds[0].prefix
    out: list[int] = []
    for rnd in trace.rounds:
        if rnd.prefix != start + len(out):
            return None
        out.append(rnd.root)
        best = {par: i + 1 for i, (par, am) in enumerate(zip(rnd.parent, rnd.argmax, strict=True)) if am}
        at = 0
        for _ in range(rnd.accepted):
            nxt = best.get(at)
            if nxt is None:
                return None
            out.append(rnd.token[nxt - 1])
            at = nxt
    return tuple(out)


def _context_index(
    streams: Sequence[tuple[int, ...]], starts: Sequence[Sequence[int]]
) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """Context (last n stream tokens ending at a round's root, every n of WALK_CONTEXT) ->
    the (request, round) that start after it."""
    index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for req, (stream, offs) in enumerate(zip(streams, starts, strict=True)):
        for rnd, j in enumerate(offs):
            for n in WALK_CONTEXT:
                if j - n + 1 >= 0:
                    index.setdefault(stream[j - n + 1:j + 1], []).append((req, rnd))
    return index


def stream_walk(
    traces: Sequence[RequestTrace], per_round: Sequence[Sequence[float]], *, tokens: int | None = None
) -> float | None:
    """One tree's stream-walk tokens per round (module docstring) over ``traces``, given its
    expected committed tokens in every traced round (``per_round[request][round]``), for
    requests of ``tokens`` output tokens (None: what each trace covered). None if a trace
    is not T = 0 or its rounds do not chain."""
    streams: list[tuple[int, ...]] = []
    for trace in traces:
        stream = greedy_stream(trace) if trace.sampling.temperature == 0 else None
        if stream is None:
            return None
        streams.append(stream)
    starts = [[r.prefix - t.rounds[0].prefix for r in t.rounds] for t in traces]
    index = _context_index(streams, starts)
    total_tokens = 0.0
    total_rounds = 0.0
    for req, (stream, offs) in enumerate(zip(streams, starts, strict=True)):
        values = per_round[req]
        exact = dict(zip(offs, values, strict=True))
        mean = sum(values) / len(values)
        covered = len(stream)  # tokens committed after the first root (the last bonus included)
        need = covered if tokens is None else min(tokens - 1, covered)
        q, rounds = 0.0, 0
        while q < need:
            j = round(q)
            a = exact.get(j)
            if a is None:
                a = _matched(stream, j, index, per_round, mean)
            q += max(a, 1.0)
            rounds += 1
        want = need if tokens is None else tokens - 1
        total_tokens += want
        total_rounds += rounds * want / need if need else 0.0
    return total_tokens / total_rounds if total_rounds else None


def _matched(
    stream: tuple[int, ...], j: int, index: Mapping[tuple[int, ...], list[tuple[int, int]]],
    per_round: Sequence[Sequence[float]], fallback: float,
) -> float:
    for n in WALK_CONTEXT:
        if j - n + 1 < 0:
            continue
        hits = index.get(stream[j - n + 1:j + 1])
        if hits:
            return sum(per_round[r][k] for r, k in hits) / len(hits)
    return fallback


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


def predict_acceptance(
    traces: Sequence[RequestTrace], trees: Iterable[Tree], *, tokens: int | None = None
) -> dict[Tree, AcceptPrediction]:
    """(budget, topk) -> :class:`AcceptPrediction` over every round of ``traces`` (the walk
    for requests of ``tokens`` output tokens; None: what each trace covered)."""
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
        kept = [(t, [m.mean for m in ms]) for t, ms in zip(traces, moments, strict=True) if t.rounds]
        walk = stream_walk([t for t, _ in kept], [v for _, v in kept], tokens=tokens)
        out[(budget, topk)] = AcceptPrediction(budget, topk, naive, corrected, m2_naive, m2, len(realised),
                                               sum(realised) / len(realised), walk)
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
    """The cell (accept's tree, rt's concurrency) for requests of ``tokens`` output tokens
    (the corrected estimate; the stream walk measured worse on the real server, module
    docstring)."""
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
    "WALK_CONTEXT",
    "greedy_stream",
    "round_time_for",
    "rounds_per_request",
    "stream_walk",
    "top_cells",
]
