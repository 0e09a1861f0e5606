"""The best configuration for a named traffic mix: weights per data set.

A fleet that serves 70% code and 30% chat wants the tree that is fastest for that mix,
not for whatever the benchmark's prompt pool happened to hold. From the per-category
table (:mod:`.categories`) each cell's per-user speedup over AR is taken per data set
(its categories pooled, weighted by requests), and the mix's speedup is the weighted
mean over the named sets. Per machine, run, temperature, concurrency, workload and
CUDA-graph mode (eager and graph cells are never ranked together) the cell with the
highest mix speedup is picked; within :data:`~.best.TIE_TOLERANCE` of it, the cheapest.
A cell that lacks one of the named sets is not a candidate: its speedup for the mix is
unknown.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from ddtree_ops.errors import ConfigError
from ddtree_ops.numbers import parse_float
from ddtree_ops.report.aggregation import CELL_KEYS, CONDITION_KEYS
from ddtree_ops.report.best import TIE_TOLERANCE
from ddtree_ops.report.categories import speedup_vs_ar

MIX_COLUMNS: tuple[str, ...] = (
    "machine", "run", *CONDITION_KEYS, "workload_name", "cuda_graph", "algorithm", "budget", "topk", "mix_speedup",
    "per_set", "candidates",
)
_COST = {"AR": 0, "DFLASH": 1, "DDTREE": 2}


def parse_mix(text: str) -> dict[str, float]:
    """``gsm8k=0.5,humaneval=0.3,mtbench=0.2`` -> weights summing to 1 (ConfigError naming
    the bad part: ``--mix``'s value is the input at fault)."""
    weights: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, value = part.partition("=")
        name = name.strip()
        weight = parse_float(value.strip())  # ASCII digits, finite: float() reads '٠.٥' and 'inf'
        if not sep or not name or weight is None or weight <= 0:
            raise ConfigError(f"--mix: {part!r} is not data_set=weight with a positive weight "
                              "(e.g. --mix gsm8k=0.5,humaneval=0.5)")
        if name in weights:
            raise ConfigError(f"--mix: {name!r} is named twice")
        weights[name] = weight
    total = sum(weights.values())
    return {name: w / total for name, w in weights.items()}


def _per_set(categories: pd.DataFrame) -> pd.DataFrame:
    """Per (machine, cell, data set): per-user tok/s pooled over its categories by requests."""
    frame = categories.assign(
        dataset=categories["category"].astype(str).str.split("/", n=1).str[0],
        weighted=categories["user_tok_s_median"].astype(float) * categories["requests"].astype(float),
    ).dropna(subset=["weighted"])
    keys = ["machine", "run", *CELL_KEYS, "workload_name", "dataset"]
    pooled = frame.groupby(keys, dropna=False, sort=True).agg(weighted=("weighted", "sum"),
                                                             requests=("requests", "sum")).reset_index()
    # In the per-category table's shape, so that the AR reference is chosen the same way.
    pooled["category"] = pooled["dataset"]
    pooled["user_tok_s_median"] = pooled["weighted"] / pooled["requests"].astype(float)
    return pooled.assign(speedup=speedup_vs_ar(pooled).to_numpy())


def best_for_mix(categories: pd.DataFrame, weights: Mapping[str, float]) -> pd.DataFrame:
    """One row per situation (machine, run, conditions, CUDA-graph mode): the pick for the mix."""
    if categories.empty:
        raise ConfigError("--mix: the ledgers' rows carry no per-category figures (rows written before data "
                          "sets, or failed ones); nothing to weigh")
    per_set = _per_set(categories)
    known = sorted(set(per_set["dataset"]))
    missing = [name for name in weights if name not in known]
    if missing:
        raise ConfigError(f"--mix: no rows measured {', '.join(map(repr, missing))} (the ledgers hold: "
                          f"{', '.join(known)})")
    named = per_set[per_set["dataset"].isin(list(weights))]
    cell_keys = ["machine", "run", *CELL_KEYS, "workload_name"]
    rows = []
    for cell, group in named.groupby(cell_keys, dropna=False, sort=True):
        speedups = dict(zip(group["dataset"], group["speedup"], strict=True))
        if set(speedups) != set(weights) or any(pd.isna(v) for v in speedups.values()):
            continue
        mix = sum(weights[name] * float(speedups[name]) for name in weights)
        rows.append(dict(zip(cell_keys, cell, strict=True)) | {
            "mix_speedup": mix,
            "per_set": ", ".join(f"{name} {float(speedups[name]):.2f}x" for name in weights),
        })
    if not rows:
        raise ConfigError(f"--mix: no cell measured every one of {', '.join(weights)}")
    cells = pd.DataFrame.from_records(rows)
    picks = []
    situation = ["machine", "run", *CONDITION_KEYS, "cuda_graph"]
    for _, group in cells.groupby(situation, dropna=False, sort=True):
        top = float(group["mix_speedup"].max())
        close = group[group["mix_speedup"] >= top * (1 - TIE_TOLERANCE)]
        cost = close.assign(
            _algo=close["algorithm"].map(lambda a: _COST.get(str(a), 3)),
            # An AR cell's budget is NA (pd.NA in these records: astype(float) refuses it).
            _budget=pd.to_numeric(close["budget"], errors="coerce").astype(float).fillna(0.0),
            _topk=pd.to_numeric(close["topk"], errors="coerce").astype(float).fillna(0.0),
        ).sort_values(["_algo", "_budget", "_topk"])
        picks.append(cost.iloc[0].to_dict() | {"candidates": len(group)})
    return pd.DataFrame.from_records(picks)[list(MIX_COLUMNS)]


__all__ = ["MIX_COLUMNS", "best_for_mix", "parse_mix"]
