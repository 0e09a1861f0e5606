"""Ledger -> pandas -> tidy per-cell table, best configurations, comparisons.

The report answers: on this machine, at this temperature and concurrency, which
algorithm/budget/top-k is fastest, by how much over autoregressive decoding and over
plain DFlash, and how sure are we. The steps, one module each, in data-flow order:

- :mod:`.loading`: ledger files -> one frame of the columns the report reads (the
  costly part: memory-mapped, parsed by pyarrow, bad lines counted, never fatal), each
  row with its run (:mod:`.runs`: two runs are never repeats of one cell unless pooled);
- :mod:`.aggregation`: rows -> the tidy table, one row per (machine, cell);
- :mod:`.best`: the best-configuration rule over that table, with refusals;
- :mod:`.comparison`: two tidy tables -> the changes larger than the noise;
- :mod:`.build`: the entry points that chain them (:func:`build_report`, :func:`load_tidy`);
- :mod:`.plots`: PNG figures of the per-machine table. Not imported here: matplotlib
  adds about half a second to the import, and only ``report --plots`` draws.

Nothing here prints; the CLI renders.
"""

from __future__ import annotations

from ddtree_ops.report.aggregation import (
    CELL_KEYS,
    MAD_TO_SIGMA,
    TIDY_DTYPES,
    GroupBy,
    aggregate,
    aggregate_levels,
)
from ddtree_ops.report.best import (
    BEST_COLUMNS,
    DEFAULT_MIN_REPEATS,
    TIE_TOLERANCE,
    BestConfigs,
    best_configs,
    describe_cell,
)
from ddtree_ops.report.build import Report, build_report, load_tidy
from ddtree_ops.report.comparison import COMPARE_KEYS, compare
from ddtree_ops.report.loading import (
    FRAME_COLUMNS,
    LOAD_COLUMNS,
    LoadedLedgers,
    find_ledgers,
    load_ledgers,
)
from ddtree_ops.report.runs import Run

__all__ = [
    "BEST_COLUMNS",
    "CELL_KEYS",
    "COMPARE_KEYS",
    "DEFAULT_MIN_REPEATS",
    "FRAME_COLUMNS",
    "LOAD_COLUMNS",
    "MAD_TO_SIGMA",
    "TIDY_DTYPES",
    "TIE_TOLERANCE",
    "BestConfigs",
    "GroupBy",
    "LoadedLedgers",
    "Report",
    "Run",
    "aggregate",
    "aggregate_levels",
    "best_configs",
    "build_report",
    "compare",
    "describe_cell",
    "find_ledgers",
    "load_ledgers",
    "load_tidy",
]
