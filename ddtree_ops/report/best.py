"""The best-configuration rule: which cell to recommend in each situation, and why not others.

A situation is one machine in one run (:mod:`.runs`; all runs pooled into one with
``--pool-runs``) under one sampling setting, concurrency, request rate and workload (and
one CUDA-graph mode unless modes are mixed on purpose). Its candidates
are the cells of the per-machine tidy table; the recommendation is the cheapest cell
whose robust score is within a tolerance of the best, because a bigger tree that is not
measurably faster is not worth deploying. Cells that cannot be trusted (failures, too
few repeats) are refused, each with its reason, rather than silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from ddtree_ops.report.aggregation import CONDITION_KEYS, as_dtype

#: Candidates within this fraction of the best score count as ties (cheapest wins).
TIE_TOLERANCE = 0.01
DEFAULT_MIN_REPEATS = 3
#: At one repeat there is no spread to score with: a runner-up this close may be noise.
ONE_REPEAT_NOISE = 0.05

BEST_COLUMNS: tuple[str, ...] = (
    "machine",
    "run",
    "temperature",
    "top_p",
    "top_k",
    "concurrency",
    "request_rate",
    "workload_name",
    "modes",
    "algorithm",
    "budget",
    "topk",
    "cuda_graph",
    "output_tok_s_median",
    "output_tok_s_mad",
    "score",
    "n",
    "accept_length_median",
    "speedup_vs_ar",
    "speedup_vs_dflash",
    "t0_match_frac",
    "candidates",
    "refused",
    "runner_up",
    "note",
)
#: Columns of the best table with a fixed dtype; the others keep what their values give.
_BEST_DTYPES: dict[str, str] = {
    "budget": "Int64",
    "topk": "Int64",
    "top_k": "Int64",
    "concurrency": "Int64",
    "n": "Int64",
    "candidates": "Int64",
    "refused": "Int64",
    "cuda_graph": "boolean",
    "runner_up": "object",
    "note": "object",
    "algorithm": "object",
    "run": "object",
}

#: One recommendation per distinct combination of these (plus ``cuda_graph`` unless mixed).
_SITUATION_KEYS: tuple[str, ...] = ("machine", "run", *CONDITION_KEYS)
#: Copied into a situation's row from its first cell (the workload by name, not hash).
_SITUATION_COLUMNS: tuple[str, ...] = (
    "machine", "run", "temperature", "top_p", "top_k", "concurrency", "request_rate", "workload_name"
)
#: Copied into a situation's row from the recommended cell.
_PICK_COLUMNS: tuple[str, ...] = (
    "algorithm", "budget", "topk", "cuda_graph", "output_tok_s_median", "output_tok_s_mad", "score", "n",
    "accept_length_median", "speedup_vs_ar", "speedup_vs_dflash", "t0_match_frac",
)
#: Deployment cost order of the algorithms (an unknown one is the most expensive).
_ALGO_COST = {"AR": 0, "DFLASH": 1, "DDTREE": 2}


@dataclass(frozen=True)
class BestConfigs:
    """Recommendations, and every cell that was refused with the reason."""

    best: pd.DataFrame
    refusals: pd.DataFrame  # machine, run, temperature, concurrency, cell, reason


def describe_cell(row: Any) -> str:
    """Short human label of a cell: ``DDTREE b=16 k=4``, ``DFLASH n=9`` (its draft tokens;
    plain ``DFLASH`` at the drafter's own block), ``AR`` (+ ``eager``)."""
    text = str(row["algorithm"])
    if text == "DDTREE":
        text += f" b={_int_text(row['budget'])} k={_int_text(row['topk'])}"
    elif text == "DFLASH" and not (row["budget"] is None or pd.isna(row["budget"])):
        text += f" n={_int_text(row['budget'])}"
    if not bool(row["cuda_graph"]):
        text += " eager"
    return text


def _int_text(value: Any) -> str:
    return "?" if value is None or pd.isna(value) else str(int(value))


def best_configs(
    grouped: pd.DataFrame,
    *,
    min_repeats: int = DEFAULT_MIN_REPEATS,
    mix_modes: bool = False,
    tie_tolerance: float = TIE_TOLERANCE,
) -> BestConfigs:
    """Best configuration per (machine, run, temperature, concurrency[, graph mode]).

    Highest ``score`` (median − 1.4826·MAD of output tok/s); among candidates within
    ``tie_tolerance`` of it the cheapest wins (AR < DFLASH < DDTREE, then smaller budget,
    then smaller top-k): a bigger tree that is not measurably faster is not worth it.
    Cells with failed rows/requests or fewer than ``min_repeats`` repeats are refused.
    Graph and eager cells are ranked separately unless ``mix_modes``.
    """
    situation_keys = list(_SITUATION_KEYS)
    if not mix_modes:
        situation_keys.append("cuda_graph")
    if grouped.empty:
        return BestConfigs(best=pd.DataFrame(columns=list(BEST_COLUMNS)), refusals=_refusal_frame([]))
    if "run" not in grouped:  # cells that name no run (built by hand) are of one run
        grouped = grouped.assign(run=None)

    reasons = _refusal_reasons(grouped, min_repeats)
    refused = reasons != ""
    refusals = _refusal_frame(
        [
            (row["machine"], row["run"], row["temperature"], row["concurrency"], describe_cell(row), reason)
            for (_, row), reason in zip(grouped[refused].iterrows(), reasons[refused], strict=True)
        ]
    )

    # Sort keys as columns: a missing budget/top-k (AR, DFLASH) sorts as 0, an unknown
    # algorithm after DDTREE.
    candidates = grouped.assign(
        _refused=refused,
        _cost=grouped["algorithm"].map(_ALGO_COST).fillna(3),
        _budget=grouped["budget"].astype("float64").fillna(0),
        _topk=grouped["topk"].astype("float64").fillna(0),
        _label=[describe_cell(row) for _, row in grouped.iterrows()],
    )
    candidates["_situation"] = candidates.groupby(situation_keys, dropna=False, sort=True).ngroup()
    counts = candidates.groupby("_situation").agg(
        candidates=("_label", "size"),
        refused=("_refused", "sum"),
        any_eager=("cuda_graph", lambda graph: not graph.all()),
        any_graph=("cuda_graph", "any"),
    )
    ranking = _rank(candidates[~candidates["_refused"]].copy(), tie_tolerance)
    situations = candidates.drop_duplicates("_situation").set_index("_situation").sort_index()
    rows = [
        _best_row(situation, situations.loc[situation], counts.loc[situation], ranking, tie_tolerance)
        for situation in situations.index.tolist()
    ]
    best = pd.DataFrame(rows).reindex(columns=list(BEST_COLUMNS))
    for name, dtype in _BEST_DTYPES.items():
        best[name] = as_dtype(best[name], dtype)
    return BestConfigs(best=best, refusals=refusals)


def _refusal_reasons(grouped: pd.DataFrame, min_repeats: int) -> pd.Series:
    """Why each cell may not be recommended, reasons joined by "; " ("" when it may)."""
    failed_rows, failed_requests, repeats = grouped["n_failed_rows"], grouped["failed_requests"], grouped["n"]
    reasons = pd.Series("", index=grouped.index)
    reasons = _append_reason(reasons, failed_rows > 0, failed_rows.astype(str) + " failed repeat(s)")
    reasons = _append_reason(reasons, failed_requests > 0, failed_requests.astype(str) + " failed request(s)")
    too_few = "n=" + repeats.astype(str) + f" < min repeats {min_repeats}"
    return _append_reason(reasons, repeats < min_repeats, too_few)


def _append_reason(reasons: pd.Series, mask: pd.Series, text: pd.Series | str) -> pd.Series:
    add = text if isinstance(text, pd.Series) else pd.Series(text, index=reasons.index)
    joined = reasons.where(reasons == "", reasons + "; ") + add
    return reasons.where(~mask, joined)


def _refusal_frame(items: list[tuple[Any, ...]]) -> pd.DataFrame:
    return pd.DataFrame(items, columns=["machine", "run", "temperature", "concurrency", "cell", "reason"])


@dataclass(frozen=True)
class _Ranking:
    """The eligible (not refused) cells of every situation, ranked two ways."""

    by_score: pd.DataFrame  # all of them, highest score first within each situation
    top_scorer: pd.DataFrame  # per situation (the index): its highest-scoring cell
    pick: pd.DataFrame  # per situation (the index): the cheapest cell within tolerance of the top


def _rank(eligible: pd.DataFrame, tie_tolerance: float) -> _Ranking:
    top_score = eligible.groupby("_situation")["score"].transform("max")
    # A NaN score is never within tolerance: a situation left with only those has no pick.
    eligible["_within"] = eligible["score"] >= top_score - tie_tolerance * top_score.abs()
    by_score = eligible.sort_values(["_situation", "score"], ascending=[True, False])
    cheapest_first = eligible[eligible["_within"]].sort_values(
        ["_situation", "_cost", "_budget", "_topk", "score"], ascending=[True, True, True, True, False]
    )
    return _Ranking(
        by_score=by_score,
        top_scorer=by_score.drop_duplicates("_situation").set_index("_situation"),
        pick=cheapest_first.drop_duplicates("_situation").set_index("_situation"),
    )


def _best_row(
    situation: int, first_cell: pd.Series, counts: pd.Series, ranking: _Ranking, tie_tolerance: float
) -> dict[str, Any]:
    """One row of the best table: the situation, its pick, a runner-up and notes."""
    if counts["any_graph"] and counts["any_eager"]:
        modes = "graph+eager"
    else:
        modes = "graph" if counts["any_graph"] else "eager"
    row: dict[str, Any] = {name: first_cell[name] for name in _SITUATION_COLUMNS}
    row.update(modes=modes, candidates=int(counts["candidates"]), refused=int(counts["refused"]))
    if situation not in ranking.pick.index:
        row.update(note=f"no eligible cell: all {int(counts['candidates'])} refused (see refusals)")
        return row
    pick = ranking.pick.loc[situation]
    for name in _PICK_COLUMNS:
        row[name] = pick[name]
    notes = []
    top = ranking.top_scorer.loc[situation]
    if top["_label"] != pick["_label"]:
        higher = _pct(top["score"], pick["score"])
        notes.append(f"{top['_label']} scored {higher} higher (within {tie_tolerance:.0%}): cheaper config kept")
    by_score = ranking.by_score
    others = by_score[(by_score["_situation"] == situation) & (by_score["_label"] != pick["_label"])]
    if len(others):
        runner_up = others.iloc[0]
        row["runner_up"] = f"{runner_up['_label']} ({_pct(runner_up['score'], pick['score'])})"
        repeats: Any = pick["n"]
        single = bool(pd.isna(repeats)) or float(repeats) < 2
        gap = abs(runner_up["score"] / pick["score"] - 1) if pick["score"] else float("inf")
        if single and not pd.isna(gap) and gap < ONE_REPEAT_NOISE:
            # Said as what it means: the gap is too small for one measurement to show it.
            notes.append(f"one repeat: {runner_up['_label']} is within {gap:.1%}, too close for one measurement to "
                         f"tell apart: more repeats decide it")
    speedup = pick["speedup_vs_ar"]
    if pick["algorithm"] != "AR" and not pd.isna(speedup) and speedup < 1.0:
        # The best of its mode (say eager) is still slower than plain AR: not a recommendation.
        notes.append(f"slower than the AR baseline ({speedup:.2f}x): not worth deploying, AR serves faster")
    if modes == "graph+eager":
        notes.append("eager and CUDA-graph cells compared (--mix-modes)")
    if bool(pick["modes_mixed"]):
        notes.append("speedup against a baseline in the other graph mode")
    match = pick["t0_match_frac"]
    if not pd.isna(match) and match < 1.0:
        notes.append(f"T=0 outputs differ from AR on {1 - match:.0%} of prompts: the verify is lossy here")
    if bool(pick["ignore_eos_on_chat"]):
        notes.append("chat with ignore_eos (lengths forced)")
    row["note"] = "; ".join(notes)
    return row


def _pct(value: Any, ref: Any) -> str:
    """``value`` over ``ref`` as a signed percentage; "n/a" where either is missing (NA)."""
    if not ref or pd.isna(ref) or pd.isna(value):
        return "n/a"
    return f"{(value / ref - 1) * 100:+.1f}%"
