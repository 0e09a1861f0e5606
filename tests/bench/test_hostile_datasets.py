"""Hostile data-set inputs (issue 41): each is refused up front in one line naming the file
and key, with the README's exit code (2: bad local input), no traceback, within seconds;
and a ledger string that reaches a plot never reaches the terminal raw.

One table, run through the real CLI in-process. The sweep cases run ``bench --dry-run``
on a local host whose run dir is in the test's directory: the sweep is refused while it
is read, so the run dir must not exist afterwards.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from report.report_rows import make_row

INVENTORY = """\
all:
  hosts:
    h1:
      ansible_connection: local
      ddtree: {run_dir: "{tmp}/run"}
"""
BENCH = ("-i", "{tmp}/inv.yaml", "bench", "--sweep", "{tmp}/s.yaml", "--dry-run")
REPORT = ("report", "{tmp}/ledger.jsonl", "--plots", "{tmp}/plots")


@dataclass(frozen=True)
class Link:
    """A symbolic link to ``target`` (which may not exist, or link back)."""

    target: str


@dataclass(frozen=True)
class Fifo:
    """A named pipe with no writer."""


def sweep(workload: str) -> str:
    return f"name: s\ntargets: [h1]\ngrid: {{budget: [4]}}\nworkload: {workload}\n"


def ledger(gpu_name: str) -> str:
    return "".join(json.dumps(make_row(algorithm=a, gpu_name=gpu_name, output_tok_s=100.0 * (i + 1))) + "\n"
                   for i, a in enumerate(("AR", "DDTREE")))


DEEP = "[" * 200_000 + "]" * 200_000


@dataclass(frozen=True)
class Case:
    name: str
    files: dict[str, str | Link | Fifo]  # relative path -> content ({tmp} is the test's directory)
    args: tuple[str, ...]
    code: int
    expect: str  # a substring of the one stderr line ({tmp} as above)


CASES = [
    # --- a path that is a symlink loop: pathlib raised RuntimeError while resolving it
    Case("data-set path: a symlink loop",
         {"s.yaml": sweep("{dataset: gsm8k, path: loop1}"), "loop1": Link("loop2"), "loop2": Link("loop1")},
         BENCH, 2, "{tmp}/s.yaml: workload.path: {tmp}/loop1: a symlink loop"),
    Case("data-set list path: a symlink loop",
         {"s.yaml": sweep("{datasets: [{name: mbpp, path: loop1}]}"), "loop1": Link("loop1")},
         BENCH, 2, "{tmp}/s.yaml: workload.datasets[0].path: {tmp}/loop1: a symlink loop"),
    Case("prompt file: a symlink loop",
         {"s.yaml": sweep("{prompt_files: [loop1]}"), "loop1": Link("loop1")},
         BENCH, 2, "{tmp}/s.yaml: workload.prompt_files: {tmp}/loop1: a symlink loop"),
    # --- JSON nested deeper than the parser recurses: RecursionError, not JSONDecodeError
    Case("data-set JSONL line nested 200,000 deep",
         {"s.yaml": sweep("{dataset: gsm8k, path: test.jsonl}"), "test.jsonl": '{"question": "q"}\n' + DEEP + "\n"},
         BENCH, 2, "{tmp}/test.jsonl:2: not valid JSON: nested too deeply"),
    Case("data-set JSON file nested 200,000 deep",
         {"s.yaml": sweep("{dataset: alpaca, path: alpaca.json}"), "alpaca.json": DEEP},
         BENCH, 2, "{tmp}/alpaca.json:1: not valid JSON: nested too deeply"),
    Case("prompt file line nested 200,000 deep",
         {"s.yaml": sweep("{prompt_files: [p.jsonl]}"), "p.jsonl": DEEP + "\n"},
         BENCH, 2, "{tmp}/p.jsonl:1: not valid JSON: nested too deeply"),
    # --- an integer longer than Python converts (4300 digits): a plain ValueError
    Case("data-set JSONL line with a 5000-digit number",
         {"s.yaml": sweep("{dataset: gsm8k, path: test.jsonl}"), "test.jsonl": '{"id": ' + "9" * 5000 + "}\n"},
         BENCH, 2, "{tmp}/test.jsonl:1: not valid JSON: Exceeds the limit (4300 digits)"),
    # --- a GSM8K folder that holds the train split only: never sent as the test set
    Case("GSM8K folder with train.jsonl only",
         {"s.yaml": sweep("{dataset: gsm8k, path: gsm}"), "gsm/train.jsonl": '{"question": "q", "answer": "1"}\n'},
         BENCH, 2, "{tmp}/gsm: no 'test' split file for GSM8K among train.jsonl"),
    # --- an unknown key of a data-set entry is named, with the key it is closest to
    Case("data-set entry key pth",
         {"s.yaml": sweep("{datasets: [{name: humaneval, pth: x}]}")},
         BENCH, 2, "{tmp}/s.yaml: workload.datasets[0].pth: unknown key (did you mean 'path'?; expected one of name, "
                   "path)"),
    Case("data-set entry without its name",
         {"s.yaml": sweep("{datasets: [{nme: humaneval}]}")},
         BENCH, 2, "{tmp}/s.yaml: workload.datasets[0].nme: unknown key (did you mean 'name'?"),
    # --- a GPU name with control characters, drawn in a plot: matplotlib's missing-glyph
    # warning quotes the character; it reaches the terminal escaped, once
    # --- a FIFO named like a data file: reading it would block the sweep forever
    Case("data-set file that is a FIFO",
         {"s.yaml": sweep("{dataset: gsm8k, path: test.jsonl}"), "test.jsonl": Fifo()},
         BENCH, 2, "{tmp}/test.jsonl: not a regular file or folder"),
    Case("GPU name with an escape, plotted",
         {"ledger.jsonl": ledger("RTX\x1b[2J\x1b[31mPRO")},
         REPORT, 0, "warning: Glyph 27 (\\x1b) missing from font"),
]


def _write(tmp_path: Path, files: dict[str, str | Link | Fifo]) -> None:
    for rel, content in {"inv.yaml": INVENTORY, **files}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Link):
            path.symlink_to(content.target)
        elif isinstance(content, Fifo):
            os.mkfifo(path)
        else:
            path.write_text(content.replace("{tmp}", str(tmp_path)), encoding="utf-8")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_dataset_input(case: Case, tmp_path: Path, cli, clean_home: Path) -> None:
    _write(tmp_path, case.files)
    cli("--version")  # the command modules imported: the time below is the command's own
    started = time.monotonic()
    res = cli(*(arg.replace("{tmp}", str(tmp_path)) for arg in case.args))
    elapsed = time.monotonic() - started
    assert res.exit_code == case.code, res
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert case.expect.replace("{tmp}", str(tmp_path)) in lines[0], res.stderr
    assert case.code == 0 or lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr
    # Shown safely: no raw control character (a newline ends the line, nothing else).
    assert all(ch.isprintable() or ch == "\n" for ch in res.stdout + res.stderr), repr(res.stdout + res.stderr)
    assert not (tmp_path / "run").exists(), "a host was touched"
    # A hang guard (a read that blocks, a parser that never ends), not a speed target: speed
    # is never asserted in tests. Refusals take ~0.01 s here, the plot case ~1.5 s.
    assert elapsed < 30.0, f"took {elapsed:.2f} s"
