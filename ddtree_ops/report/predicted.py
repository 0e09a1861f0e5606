"""Predicted cells beside measured ones (issue 43). Pure: frames in, frames out.

``bench --predict`` writes a ``predicted`` row for every DDTree cell and ``probe`` rows for
the round times; the loader keeps both out of the measured frame
(:attr:`~ddtree_ops.report.loading.LoadedLedgers.predicted`), so no ranking, best config
or policy ever holds a predicted number. This module lines them up with what was measured
of the same cell: every predicted cell, its measured median where the sweep measured it,
and ``measured: False`` (a predicted-only cell, marked so) where it did not.
"""

from __future__ import annotations

import pandas as pd

#: What identifies a cell across a prediction and its measurement (of one run: report.runs).
CELL_KEYS: tuple[str, ...] = ("host", "run", "temperature", "top_p", "top_k", "concurrency", "budget", "topk")
COLUMNS: tuple[str, ...] = (*CELL_KEYS, "gpu_name", "predicted_accept", "measured_accept", "accept_error",
                            "predicted_tok_s", "measured_tok_s", "tok_s_error", "predicted_accept_naive",
                            "predicted_tok_s_naive", "measured")


def predicted_vs_measured(predicted: pd.DataFrame | None, measured: pd.DataFrame) -> pd.DataFrame:
    """One row per predicted DDTree cell (:data:`COLUMNS`), fastest predicted first per
    (host, temperature, concurrency). ``*_error``: (predicted - measured) / measured, where
    measured; ``measured``: whether any ok row measured the cell."""
    if predicted is None or predicted.empty:
        return pd.DataFrame(columns=list(COLUMNS))
    pred = predicted.loc[predicted["source"] == "predicted"]
    if pred.empty:
        return pd.DataFrame(columns=list(COLUMNS))
    pred = pred.groupby(list(CELL_KEYS), dropna=False, sort=False).agg(
        gpu_name=("gpu_name", "first"), predicted_accept=("accept_length", "median"),
        predicted_tok_s=("output_tok_s", "median"), predicted_accept_naive=("predicted_accept_naive", "median"),
        predicted_tok_s_naive=("predicted_tok_s_naive", "median"),
    ).reset_index()
    ok = measured.loc[(measured["status"] == "ok") & (measured["algorithm"] == "DDTREE")]
    meas = ok.groupby(list(CELL_KEYS), dropna=False).agg(
        measured_accept=("accept_length", "median"), measured_tok_s=("output_tok_s", "median"),
    ).reset_index()
    out = pred.merge(meas, on=list(CELL_KEYS), how="left")
    out["measured"] = out["measured_tok_s"].notna()
    out["accept_error"] = (out["predicted_accept"] - out["measured_accept"]) / out["measured_accept"]
    out["tok_s_error"] = (out["predicted_tok_s"] - out["measured_tok_s"]) / out["measured_tok_s"]
    out = out.sort_values(["host", "temperature", "concurrency", "predicted_tok_s"],
                          ascending=[True, True, True, False], kind="stable")
    return out[list(COLUMNS)].reset_index(drop=True)


def probes(predicted: pd.DataFrame | None) -> pd.DataFrame:
    """The round-time probes: host, GPU, the sampling probed at (one per verify path: greedy
    and sampled rounds cost differently), concurrency, budget (verify width budget + 1),
    graph mode, round and overhead times."""
    cols = ["host", "gpu_name", "temperature", "top_p", "top_k", "concurrency", "budget", "cuda_graph", "round_ms",
            "overhead_ms"]
    if predicted is None or predicted.empty:
        return pd.DataFrame(columns=cols)
    rows = predicted.loc[predicted["source"] == "probe", cols]
    return rows.sort_values(["host", "temperature", "top_p", "top_k", "concurrency", "budget"],
                            kind="stable").reset_index(drop=True)


__all__ = ["COLUMNS", "predicted_vs_measured", "probes"]
