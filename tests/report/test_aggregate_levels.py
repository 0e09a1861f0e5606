"""Grouping once at the finest level must give what grouping each level over the rows gives.

The reference below is the direct per-row pandas formulation (one groupby over every row
per machine grouping); ``aggregate_levels`` derives the levels from one fine grouping.
The ledger is random (fixed seed) with the cases that make that derivation delicate:
a host whose GPU name is missing on some rows, per-repeat fallback reasons (first
non-null in file order wins), failed rows, and several hosts per GPU type.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from report_rows import make_row

from ddtree_ops import report as rep
from ddtree_ops.bench.ledger import append_row
from ddtree_ops.errors import ConfigError


def reference(frame: pd.DataFrame, by: str) -> pd.DataFrame:
    machine = frame["host"] if by == "host" else frame["gpu_name"].where(frame["gpu_name"].notna(), frame["host"])
    frame = frame.assign(machine=machine)
    keys = ["machine", *rep.CELL_KEYS]
    grouped = frame.groupby(keys, dropna=False, sort=True)
    out = grouped[list(rep.CELL_KEYS)].first().reset_index(drop=True)  # NA keys come back as NA too
    out.insert(0, "machine", grouped["machine"].first().to_numpy())
    out["hosts"] = grouped["host"].agg(lambda s: ",".join(sorted(set(s)))).to_numpy()
    for c in ("gpu_name", "gpu_arch", "workload_name", "fallback_reason"):
        out[c] = grouped[c].first().to_numpy()
    per = []
    for _, rows in grouped:
        good = rows[rows["status"] == "ok"]
        tok = good["output_tok_s"]
        per.append(
            {
                "n": len(good),
                "n_failed_rows": int((rows["status"] != "ok").sum()),
                "failed_requests": good["failed"].fillna(0).sum(),
                "n_client_bound": int(good["client_bound"].sum()),
                "output_tok_s_median": tok.median(),
                "output_tok_s_mad": (tok - tok.median()).abs().median(),
                "accept_length_median": good["accept_length"].median(),
                "ttft_ms_median": good["ttft_ms_median"].median(),
            }
        )
    return pd.concat([out, pd.DataFrame(per)], axis=1)


@pytest.fixture(scope="module")
def frame(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    rng = random.Random(7)
    path: Path = tmp_path_factory.mktemp("agg") / "l.jsonl"
    hosts = {"a": "RTX PRO 6000", "b": "RTX PRO 6000", "c": "B300", "d": None}
    for i in range(600):
        host = rng.choice(sorted(hosts))
        gpu = hosts[host] if rng.random() > 0.1 else None  # provenance sometimes unknown
        algorithm = rng.choice(("AR", "DFLASH", "DDTREE", "DDTREE"))
        graph = rng.random() > 0.2
        status = "failed" if rng.random() < 0.05 else "ok"
        row = make_row(
            host=host, gpu_name=gpu, algorithm=algorithm, budget=rng.choice((8, 16)), cuda_graph=graph,
            temperature=rng.choice((0.0, 1.0)), repeat=i, output_tok_s=rng.gauss(300, 30),
            accept_length=rng.gauss(3, 0.3), failed=rng.choice((0, 0, 0, 1)), status=status,
            client_bound=rng.choice((None, False, False, True)),
        )
        if not graph:
            row["fallback_reason"] = rng.choice(("capture failed: illegal memory access", "capture failed: OOM", None))
        append_row(path, row)
    return rep.load_ledgers([path]).frame


@pytest.mark.parametrize("by", ["host", "gpu"])
def test_levels_match_the_per_row_reference(frame: pd.DataFrame, by: str) -> None:
    got = rep.aggregate_levels(frame, ("host", "gpu"))[by]
    want = reference(frame, by)
    assert len(got) == len(want) > 20
    assert list(got["machine"]) == list(want["machine"])  # same sorted cell order
    for c in ("hosts", "gpu_name", "gpu_arch", "workload_name", "fallback_reason"):
        assert list(got[c]) == [None if v is None or v != v else v for v in want[c]], c
    for c in ("n", "n_failed_rows", "failed_requests", "n_client_bound"):
        assert got[c].astype(int).tolist() == want[c].astype(int).tolist(), c
    for c in ("output_tok_s_median", "output_tok_s_mad", "accept_length_median", "ttft_ms_median"):
        np.testing.assert_array_equal(got[c].to_numpy(dtype=float), want[c].to_numpy(dtype=float), err_msg=c)
    assert set(got["fallback_reason"].dropna()) == {"capture failed: illegal memory access", "capture failed: OOM"}
    pd.testing.assert_frame_equal(got, rep.aggregate(frame, by=by))  # type: ignore[arg-type]


def test_unknown_level_is_a_config_error(frame: pd.DataFrame) -> None:
    with pytest.raises(ConfigError, match="--group-by must be 'host' or 'gpu', not 'rack'"):
        rep.aggregate_levels(frame, ("host", "rack"))  # type: ignore[arg-type]
