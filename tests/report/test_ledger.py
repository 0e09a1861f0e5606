"""The ledger contract: what bench writes, report and --resume read back."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
from report_rows import make_row

from ddtree_ops.bench import ledger
from ddtree_ops.errors import BenchError, ConfigError

README = Path(__file__).resolve().parents[2] / "results" / "README.md"


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "l.jsonl"
    rows = [make_row(repeat=i, output_tok_s=100.0 + i) for i in range(3)]
    for row in rows:
        ledger.append_row(path, row)
    got = ledger.read_ledger(path)
    assert got.bad_lines == []
    assert got.rows == rows
    assert list(got.rows[0]) == list(ledger.FIELDS)


def test_unknown_and_missing_fields_refused_at_write(tmp_path: Path) -> None:
    path = tmp_path / "l.jsonl"
    with pytest.raises(BenchError, match="unknown field.*ttft_p99"):
        ledger.append_row(path, make_row(ttft_p99=1.0))
    bad = make_row()
    del bad["workload_hash"]
    with pytest.raises(BenchError, match="missing field.*workload_hash"):
        ledger.append_row(path, bad)
    with pytest.raises(BenchError, match="algorithm 'EAGLE'"):
        ledger.append_row(path, make_row(algorithm="EAGLE"))
    assert not path.exists() or path.read_bytes() == b""


def test_nan_metric_written_as_null(tmp_path: Path) -> None:
    path = tmp_path / "l.jsonl"
    ledger.append_row(path, make_row(accept_length=float("nan")))
    assert json.loads(path.read_text())["accept_length"] is None


def test_truncated_last_line_reported_and_not_glued_to_next_row(tmp_path: Path) -> None:
    path = tmp_path / "l.jsonl"
    ledger.append_row(path, make_row(repeat=0))
    full = ledger.encode_row(make_row(repeat=1))
    with open(path, "ab") as fh:  # a writer killed mid-line
        fh.write(full[: len(full) // 2])
    first = ledger.read_ledger(path)
    assert [r["repeat"] for r in first.rows] == [0]
    assert first.bad_lines == [(2, "truncated last line (a writer stopped mid-line)")]

    ledger.append_row(path, make_row(repeat=2))
    second = ledger.read_ledger(path)
    assert [r["repeat"] for r in second.rows] == [0, 2]
    assert len(second.bad_lines) == 1 and second.bad_lines[0][0] == 2
    assert second.bad_lines[0][1].startswith("not valid JSON")


def test_heal_cuts_only_a_truncated_last_line(tmp_path: Path) -> None:
    path = tmp_path / "l.jsonl"
    assert ledger.heal_truncated_tail(path) == 0  # no file: nothing to do, nothing created
    assert not path.exists()
    ledger.append_row(path, make_row(repeat=0))
    complete = path.read_bytes()
    assert ledger.heal_truncated_tail(path) == 0 and path.read_bytes() == complete
    full = ledger.encode_row(make_row(repeat=1))
    with open(path, "ab") as fh:  # a writer killed mid-line
        fh.write(full[:100])
    assert ledger.heal_truncated_tail(path) == 100
    assert path.read_bytes() == complete
    ledger.append_row(path, make_row(repeat=1))
    assert [r["repeat"] for r in ledger.read_ledger(path).rows] == [0, 1]
    assert ledger.read_ledger(path).bad_lines == []
    # A complete row whose newline alone is missing is a row, not a crash artefact: kept.
    with open(path, "ab") as fh:
        fh.write(full[:-1])
    assert ledger.heal_truncated_tail(path) == 0 and len(ledger.read_ledger(path).rows) == 3
    # A file that is one truncated line becomes empty.
    one = tmp_path / "one.jsonl"
    one.write_bytes(full[:50])
    assert ledger.heal_truncated_tail(one) == 50 and one.read_bytes() == b""


def test_check_writable_names_the_path(tmp_path: Path) -> None:
    ledger.check_writable(tmp_path / "new" / "deeper" / "l.jsonl")  # created later by append_row
    (tmp_path / "l.jsonl").write_text("")
    ledger.check_writable(tmp_path / "l.jsonl")
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=r"afile/l\.jsonl: cannot create the ledger: .*afile is not a directory"):
        ledger.check_writable(tmp_path / "afile" / "l.jsonl")
    with pytest.raises(ConfigError, match="is a directory"):
        ledger.check_writable(tmp_path)
    # Root passes os.access everywhere; /proc still takes no file and no directory.
    for where in ("/proc/l.jsonl", "/proc/nope/l.jsonl"):
        with pytest.raises(ConfigError, match=rf"^{where}: cannot create the ledger in /proc: "):
            ledger.check_writable(where)
    # The probes leave nothing behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "l.jsonl"]


def test_check_same_sweep_names_both_sweeps_and_the_ledger() -> None:
    rows = [make_row(sweep="old", sweep_hash="a" * 64), make_row(sweep="old", sweep_hash=None)]
    ledger.check_same_sweep(rows, sweep="old", sweep_hash="a" * 64, path="l.jsonl")
    ledger.check_same_sweep(rows[1:], sweep="new", sweep_hash="b" * 64, path="l.jsonl")  # rows predating the field
    with pytest.raises(ConfigError) as info:
        ledger.check_same_sweep(rows, sweep="new", sweep_hash="b" * 64, path="l.jsonl")
    message = str(info.value)
    assert message.startswith("l.jsonl: ") and "\n" not in message
    assert "'old' (aaaaaaaaaaaa)" in message and "'new' (bbbbbbbbbbbb)" in message


def test_bad_lines_counted_with_reasons(tmp_path: Path) -> None:
    path = tmp_path / "l.jsonl"
    good = ledger.encode_row(make_row()).decode()
    old = json.dumps({**make_row(), "schema_version": 0})
    path.write_text(good + "{oops\n" + "\n" + "[1, 2]\n" + old + "\n" + good)
    got = ledger.read_ledger(path)
    assert len(got.rows) == 2
    assert [n for n, _ in got.bad_lines] == [2, 4, 5]
    assert "not valid JSON" in got.bad_lines[0][1]
    assert got.bad_lines[1][1] == "not a JSON object"
    assert "schema_version 0" in got.bad_lines[2][1]


def test_missing_ledger_reads_empty(tmp_path: Path) -> None:
    assert ledger.read_ledger(tmp_path / "none.jsonl") == ledger.LedgerRead(rows=[], bad_lines=[])


def test_concurrent_appends_never_interleave(tmp_path: Path) -> None:
    path = tmp_path / "l.jsonl"

    def worker(host: str) -> None:
        for i in range(50):
            ledger.append_row(path, make_row(host=host, repeat=i, error="x" * 3000))

    threads = [threading.Thread(target=worker, args=(f"h{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = ledger.read_ledger(path)
    assert got.bad_lines == []
    assert len(got.rows) == 200
    assert len({ledger.row_key(r) for r in got.rows}) == 200


def test_row_key_matches_planned_cell_across_int_float() -> None:
    row = make_row(temperature=0.0, concurrency=4, repeat=1)
    planned = {k: row[k] for k in ledger.KEY_FIELDS}
    planned["temperature"] = 0  # YAML gives an int
    assert ledger.row_key(planned) == ledger.row_key(row)
    assert ledger.row_key(make_row(repeat=2)) != ledger.row_key(make_row(repeat=1))
    # eager fallback is an outcome, not part of the identity
    assert ledger.row_key(make_row(cuda_graph=False)) == ledger.row_key(make_row(cuda_graph=True))


def test_completed_keys_retries_failed_rows() -> None:
    ok, failed = make_row(repeat=0), make_row(repeat=1, status="failed")
    assert ledger.completed_keys([ok, failed]) == {ledger.row_key(ok)}
    assert ledger.completed_keys([ok, failed], include_failed=True) == {ledger.row_key(ok), ledger.row_key(failed)}


def test_readme_documents_every_field() -> None:
    text = README.read_text()
    documented = set(re.findall(r"`([a-z0-9_]+)`", text))
    missing = [name for name in ledger.FIELDS if name not in documented]
    assert missing == []
    assert f"Current `schema_version`: **{ledger.SCHEMA_VERSION}**" in text
