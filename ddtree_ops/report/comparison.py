"""Two tidy tables -> per-cell ratios, flagging only changes larger than the noise.

``ddtree-ops report --compare`` answers "did this patch, driver or host change make a
cell faster or slower?" A difference counts only when it exceeds what the repeats'
spread explains, so a rerun of the same configuration reads as "unchanged".
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddtree_ops.report.aggregation import CELL_KEYS, MAD_TO_SIGMA

#: What matches a cell of one table with a cell of the other (see ``compare`` on cuda_graph).
#: Not the run: comparing runs is the point; a side that holds a cell of several runs gives a
#: row per pair of runs, each named (``run_a``, ``run_b``).
COMPARE_KEYS: tuple[str, ...] = ("machine", *(key for key in CELL_KEYS if key != "cuda_graph"))


def compare(base: pd.DataFrame, other: pd.DataFrame, *, sigmas: float = 2.0, floor: float = 0.01) -> pd.DataFrame:
    """Per-cell ratio ``other / base`` of median output tok/s, flagging real changes.

    A change is flagged when ``|Δ| > sigmas·(σ_base + σ_other)`` with σ = 1.4826·MAD —
    the two medians' spread intervals do not overlap — and, when both spreads are zero
    (a single repeat, a deterministic simulator), when it exceeds ``floor`` relative.
    Cells present on one side only are listed with ``only_in``. ``cuda_graph`` is not a
    key: a fallback appearing or disappearing is exactly what a comparison must show.
    """
    columns = [*COMPARE_KEYS, "run", "cuda_graph", "n", "output_tok_s_median", "output_tok_s_mad",
               "accept_length_median"]
    base, other = (t if "run" in t else t.assign(run=None) for t in (base, other))
    # Side "a" is ``base``, side "b" is ``other``: the output's column suffixes.
    merged = base[columns].merge(
        other[columns], on=list(COMPARE_KEYS), how="outer", suffixes=("_a", "_b"), indicator=True
    )
    tok_s_a, tok_s_b = merged["output_tok_s_median_a"], merged["output_tok_s_median_b"]
    # A side without a spread (no such cell there, or no ok repeat) adds none.
    mads = merged["output_tok_s_mad_a"].fillna(0) + merged["output_tok_s_mad_b"].fillna(0)
    threshold = np.maximum(sigmas * MAD_TO_SIGMA * mads, floor * tok_s_a.abs())
    delta = tok_s_b - tok_s_a
    out = merged[list(COMPARE_KEYS)].copy()
    out["run_a"] = merged["run_a"].astype(object).where(merged["run_a"].notna(), None)
    out["run_b"] = merged["run_b"].astype(object).where(merged["run_b"].notna(), None)
    out["cuda_graph_a"] = merged["cuda_graph_a"].astype("boolean")
    out["cuda_graph_b"] = merged["cuda_graph_b"].astype("boolean")
    out["n_a"] = merged["n_a"].astype("Int64")
    out["n_b"] = merged["n_b"].astype("Int64")
    out["output_tok_s_a"] = tok_s_a
    out["output_tok_s_b"] = tok_s_b
    out["ratio"] = tok_s_b / tok_s_a
    out["threshold"] = threshold
    out["accept_length_a"] = merged["accept_length_median_a"]
    out["accept_length_b"] = merged["accept_length_median_b"]
    out["changed"] = (delta.abs() > threshold).fillna(False).astype(bool)
    out["direction"] = np.where(~out["changed"], "", np.where(delta > 0, "faster", "slower"))
    out["only_in"] = merged["_merge"].map({"left_only": "a", "right_only": "b", "both": ""}).astype(object)
    return out.reset_index(drop=True)
