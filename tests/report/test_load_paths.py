"""The fast (pyarrow, block-wise) and careful (line-by-line) loaders must agree exactly.

Blocks are shrunk to a few KB so that a small ledger crosses many block boundaries and
every refusal is bisected down to the line-by-line slice.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from report_rows import make_row

from ddtree_ops.bench.ledger import encode_row
from ddtree_ops.report import loading as rep


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rep, "_BLOCK_BYTES", 8 << 10)
    monkeypatch.setattr(rep, "_CAREFUL_BYTES", 2 << 10)
    monkeypatch.setattr(rep, "_COUNT_BYTES", 1000)


def good(i: int) -> bytes:
    return encode_row(make_row(host=f"h{i % 3}", budget=(4, 8, 16)[i % 3], repeat=i, output_tok_s=100.0 + i))


def normalised(frame: pd.DataFrame) -> pd.DataFrame:
    # The careful path yields object columns; the values are what must match.
    return frame.astype(dict.fromkeys(rep._STR_COLS, object)).map(lambda v: None if v is None or v != v else v)


def assert_paths_agree(path: Path) -> rep.LoadedLedgers:
    fast = rep.load_ledgers([path])
    careful = rep.load_ledgers([path], use_arrow=False)
    pd.testing.assert_frame_equal(normalised(fast.frame), normalised(careful.frame))
    assert fast.bad_lines == careful.bad_lines
    return fast


def test_scattered_bad_lines_same_rows_and_line_numbers(tmp_path: Path, small_blocks: None) -> None:
    lines = [good(i) for i in range(300)]
    two_on_one_line = good(1000).rstrip(b"\n") + b" " + good(1001)
    broken = {
        10: b"garbage\n",
        40: b"\n",  # blank: skipped silently, but later line numbers still count it
        41: b"   \n",
        77: two_on_one_line,  # pyarrow reads 2 rows here; json.loads says "Extra data"
        120: json.dumps({**make_row(), "schema_version": 2}).encode() + b"\n",
        150: json.dumps({**make_row(), "cuda_graph": None}).encode() + b"\n",
        151: json.dumps({**make_row(repeat=151), "budget": 16.0}).encode() + b"\n",  # a float for an int: kept
        200: b"[1, 2]\n",
    }
    for i, line in broken.items():
        lines[i] = line
    path = tmp_path / "l.jsonl"
    path.write_bytes(b"".join(lines) + good(300)[:40])  # a writer killed mid-line
    loaded = assert_paths_agree(path)
    assert [(n, reason.split(":")[0]) for _, n, reason in loaded.bad_lines] == [
        (11, "not valid JSON"),
        (78, "not valid JSON"),
        (121, "unsupported schema_version 2 (this reader knows 1)"),
        (151, "missing field(s)"),
        (201, "not a JSON object"),
        (301, "truncated last line (a writer stopped mid-line)"),
    ]
    assert len(loaded.frame) == 300 - 8 + 1  # 8 replaced lines, one of them still a row
    assert 16.0 in set(loaded.frame["budget"])


def test_line_longer_than_a_block_and_no_final_newline(tmp_path: Path, small_blocks: None) -> None:
    long_row = encode_row(make_row(repeat=1, error="x" * 20_000))  # ~2.5 blocks on its own
    path = tmp_path / "l.jsonl"
    path.write_bytes(good(0) + long_row + good(2) + good(3).rstrip(b"\n"))
    loaded = assert_paths_agree(path)
    assert loaded.bad_lines == () and list(loaded.frame["output_tok_s"]) == [100.0, 100.0, 102.0, 103.0]


def test_empty_and_blank_only_files(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_bytes(b"")
    (tmp_path / "b.jsonl").write_bytes(b"\n\n  ")
    loaded = rep.load_ledgers([tmp_path])
    assert loaded.frame.empty and loaded.bad_lines == ()
    assert list(loaded.frame.columns) == list(rep.FRAME_COLUMNS)


def test_non_finite_metrics_refused_with_file_and_line_on_both_paths(tmp_path: Path, small_blocks: None) -> None:
    lines = [good(i) for i in range(200)]

    def with_value(i: int, **values: float) -> bytes:
        # json.dumps writes NaN / Infinity as bare words (what another writer could leave);
        # 1e999 is a valid JSON number that overflows to infinity.
        return json.dumps({**json.loads(good(i)), **values}).encode() + b"\n"

    lines[5] = with_value(5, output_tok_s=float("nan"))
    lines[60] = with_value(60, ttft_ms_p99=float("inf"), accept_length=float("-inf"))
    lines[61] = with_value(61, itl_ms_median=1.0).replace(b'"itl_ms_median": 1.0', b'"itl_ms_median": 1e999')
    lines[150] = with_value(150, ttft_ms_mean=float("nan"))  # a stat the report does not read: kept
    path = tmp_path / "l.jsonl"
    path.write_bytes(b"".join(lines))
    loaded = assert_paths_agree(path)
    assert [(f, n, r) for f, n, r in loaded.bad_lines] == [
        (str(path), 6, "non-finite metric(s): output_tok_s=nan"),
        (str(path), 61, "non-finite metric(s): accept_length=-inf, ttft_ms_p99=inf"),
        (str(path), 62, "non-finite metric(s): itl_ms_median=inf"),
    ]
    assert len(loaded.frame) == 197 and 150 in set(loaded.frame["repeat"])


def test_a_field_that_is_not_a_number_is_a_bad_line_never_a_duplicate(tmp_path: Path, small_blocks: None) -> None:
    # 32 rows of one cell whose budget is "x": coerced to NaN they read as 31 copies of one row.
    lines = [good(i) for i in range(100)]
    for i in range(40, 72):
        lines[i] = json.dumps({**json.loads(good(i)), "budget": "x"}).encode() + b"\n"
    lines[80] = json.dumps({**json.loads(good(80)), "concurrency": True}).encode() + b"\n"
    path = tmp_path / "l.jsonl"
    path.write_bytes(b"".join(lines))
    loaded = assert_paths_agree(path)
    assert [(n, r) for _, n, r in loaded.bad_lines] == [
        *((i + 1, "not a number: budget='x'") for i in range(40, 72)),
        (81, "not a number: concurrency=True"),
    ]
    assert loaded.duplicates == () and len(loaded.frame) == 100 - 33


def test_duplicate_rows_counted_once_and_attributed_to_their_ledger(tmp_path: Path, small_blocks: None) -> None:
    lines = [good(i) for i in range(100)]
    first = tmp_path / "a.jsonl"
    first.write_bytes(b"".join(lines) + lines[7])  # one row written twice
    (tmp_path / "copy").mkdir()
    copy = tmp_path / "copy" / "b.jsonl"
    # a copy of the first 50 rows, and one row of another run (not a copy: a measurement)
    again = json.dumps({**json.loads(lines[3]), "run_id": "run-2"}).encode() + b"\n"
    copy.write_bytes(b"".join(lines[:50]) + again)
    for use_arrow in (None, False):
        loaded = rep.load_ledgers([first, copy], use_arrow=use_arrow)
        assert loaded.duplicates == ((str(first), 1), (str(copy), 50)) and loaded.duplicate_rows == 51
        assert len(loaded.frame) == 101 and list(loaded.frame["repeat"][:100]) == list(range(100))
        assert loaded.bad_lines == ()
    alone = rep.load_ledgers([copy])
    assert alone.duplicates == () and len(alone.frame) == 51
