#!/usr/bin/env python3
"""The DDTree bundle's coverage under the real-server tests, checked against its README.

The real-server lane (``make test``, ``make test-sglang``) runs ``tests/sglang_real`` with
``DDTREE_COVERAGE_RC`` naming ``bundle-coverage.ini``: every process the tests start
in the SGLang test venv -- the servers' launcher, scheduler and detokenizer processes,
and the one-interpreter checks -- measures the bundle's six modules where they were
deployed (``standins/.../coverage_startup.py``). Afterwards, with the test venv's python::

    bundle_coverage.py --check patches/ddtree_temperature/README.md
    bundle_coverage.py --write patches/ddtree_temperature/README.md

combines the data and compares it with the README section between the
``<!-- bundle-coverage -->`` markers: a table of per-file line and branch figures, and a
table of every line not executed, each range with the reason. ``--check`` fails (exit 1)
when a line not executed is not listed, when a listed line was executed (a stale entry),
or when a reason is missing; ``--write`` rewrites the section from the data, keeping the
reason an entry gave for the same code -- a function by its name, a range by the text of
its first line -- (new ones get ``TODO``, which ``--check`` refuses).

Environment: ``DDTREE_COVERAGE_DIR`` (the data files) and ``DDTREE_BUNDLE_FILES`` (the
bundle's ``files/`` directory), as the lane sets them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "bundle-coverage.ini"
MODULES = (
    "ddtree_reference.py",
    "ddtree_utils.py",
    "ddtree_info.py",
    "ddtree_runtime.py",
    "ddtree_trace.py",
    "ddtree_worker_v2.py",
    "ddtree_registration.py",
    "ddtree_plugin.py",
)
BEGIN, END = "<!-- bundle-coverage:begin -->", "<!-- bundle-coverage:end -->"
TODO = "TODO"


@dataclass(frozen=True)
class FileCoverage:
    name: str
    statements: int
    missing: tuple[int, ...]
    executed: tuple[int, ...]
    branches: int
    partial: int
    covered_branches: int

    @property
    def line_pct(self) -> float:
        return 100.0 * (self.statements - len(self.missing)) / self.statements if self.statements else 100.0

    @property
    def branch_pct(self) -> float:
        return 100.0 * self.covered_branches / self.branches if self.branches else 100.0


@dataclass(frozen=True)
class Entry:
    file: str
    lines: tuple[int, ...]
    first: str
    why: str


def measure() -> dict[str, FileCoverage]:
    """Combine the lane's data files; per module of the bundle, what was executed."""
    import coverage

    data_dir = Path(os.environ["DDTREE_COVERAGE_DIR"])
    files = Path(os.environ["DDTREE_BUNDLE_FILES"]) / "srt" / "speculative"
    cov = coverage.Coverage(config_file=str(CONFIG), data_file=str(data_dir / "bundle"))
    try:
        cov.combine(data_paths=[str(data_dir)], keep=True)
        cov.save()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "coverage.json"
            cov.json_report(outfile=str(out), include=[str(files / "ddtree_*.py")], ignore_errors=True)
            report = json.loads(out.read_text())["files"]
    except coverage.exceptions.NoDataError:
        raise SystemExit(f"bundle_coverage: no coverage data in {data_dir}: did the real-server lane run with "
                         f"DDTREE_COVERAGE_RC={CONFIG}?") from None
    got: dict[str, FileCoverage] = {}
    for path, entry in report.items():
        name = Path(path).name
        summary = entry["summary"]
        got[name] = FileCoverage(
            name=name,
            statements=int(summary["num_statements"]),
            missing=tuple(entry["missing_lines"]),
            executed=tuple(entry["executed_lines"]),
            branches=int(summary.get("num_branches", 0)),
            partial=int(summary.get("num_partial_branches", 0)),
            covered_branches=int(summary.get("covered_branches", 0)),
        )
    absent = [m for m in MODULES if m not in got]
    if absent:
        raise SystemExit(f"bundle_coverage: no data for {', '.join(absent)} in {data_dir}: did the lane run with "
                         f"DDTREE_COVERAGE_RC={CONFIG}?")
    return got


def _functions(source: str) -> list[tuple[str, int, int]]:
    """``(qualname, first body line, last line)`` of every function and method."""
    import ast

    out: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                out.append((name, child.body[0].lineno, child.end_lineno or child.body[-1].lineno))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")

    visit(ast.parse(source), "")
    return out


def _whole_functions(source: str, missing: set[int], statements: set[int]) -> list[tuple[str, tuple[int, ...]]]:
    """The outermost functions none of whose statements ran, with their lines."""
    found: list[tuple[str, tuple[int, ...]]] = []
    for name, first, last in _functions(source):
        span = set(range(first, last + 1))
        body = span & statements
        if body and body <= missing and not any(set(lines) >= span for _, lines in found):
            found.append((name, tuple(sorted(span))))
    return found


def _ranges(lines: tuple[int, ...], statements: set[int]) -> list[tuple[int, ...]]:
    """Missing lines grouped into runs that only skip non-statement lines (comments,
    blank lines, continuation lines)."""
    groups: list[list[int]] = []
    for line in sorted(lines):
        if groups and not any(x in statements for x in range(groups[-1][-1] + 1, line)):
            groups[-1].append(line)
        else:
            groups.append([line])
    return [tuple(g) for g in groups]


def _fmt_lines(lines: tuple[int, ...]) -> str:
    return str(lines[0]) if len(lines) == 1 else f"{lines[0]}-{lines[-1]}"


def _parse_lines(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            a, b = part.split("-", 1)
            out.extend(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return tuple(out)


def _section(readme: str) -> tuple[str, str, str]:
    try:
        head, rest = readme.split(BEGIN, 1)
        body, tail = rest.split(END, 1)
    except ValueError:
        raise SystemExit(f"bundle_coverage: the README has no {BEGIN} ... {END} section") from None
    return head, body, tail


_ROW = re.compile(r"^\|\s*`?(ddtree_\w+\.py)`?\s*\|\s*`?([\w.]+\(\)|[\d,\s-]+)`?\s*\|\s*(.*?)\s*\|\s*(.*?)\s*\|\s*$")


def listed(readme: str) -> list[Entry]:
    """The README's entries; a ``name()`` entry stands for every line of that function."""
    _, body, _ = _section(readme)
    entries = []
    spans: dict[str, dict[str, tuple[int, ...]]] = {}
    in_list = False
    for row in body.splitlines():
        # The per-file figures come first: only the rows under the list's own header are entries.
        in_list = in_list or row.startswith("| module | lines |")
        m = _ROW.match(row) if in_list else None
        if not m:
            continue
        name, where = m.group(1), m.group(2)
        if where.endswith("()"):
            if name not in spans:
                spans[name] = {q: tuple(range(a, b + 1)) for q, a, b in _functions("\n".join(_source_lines(name)))}
            lines = spans[name].get(where[:-2], ())
        else:
            lines = _parse_lines(where)
        entries.append(Entry(name, lines, where if where.endswith("()") else m.group(3).strip("`"), m.group(4)))
    return entries


def _source_lines(name: str) -> list[str]:
    path = Path(os.environ["DDTREE_BUNDLE_FILES"]) / "srt" / "speculative" / name
    return path.read_text().splitlines()


def render(got: dict[str, FileCoverage], old: list[Entry]) -> str:
    lines = [
        "",
        "| module | statements | not executed | lines | branches | partial | branches covered |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in MODULES:
        c = got[name]
        lines.append(f"| `{name}` | {c.statements} | {len(c.missing)} | {c.line_pct:.1f} % | {c.branches} | "
                     f"{c.partial} | {c.branch_pct:.1f} % |")
    lines += ["", "| module | lines | first line | why not executed here |", "|---|---|---|---|"]
    for name in MODULES:
        c = got[name]
        src = _source_lines(name)
        statements = set(c.missing) | set(c.executed)
        missing = set(c.missing)
        rows: list[tuple[int, str, str, tuple[int, ...]]] = []
        for func, span in _whole_functions("\n".join(src), missing, statements):
            rows.append((span[0], f"`{func}()`", "(all of it)", span))
            missing -= set(span)
        for group in _ranges(tuple(sorted(missing)), statements):
            first = src[group[0] - 1].strip().replace("|", "\\|")[:60]
            rows.append((group[0], _fmt_lines(group), f"`{first}`", group))
        for _, where, first, group in sorted(rows):
            lines.append(f"| `{name}` | {where} | {first} | {_reason(name, where, first, group, old)} |")
    return "\n".join(lines) + "\n"


def _reason(name: str, where: str, first: str, group: tuple[int, ...], old: list[Entry]) -> str:
    """The reason an old entry gave for the same code: a function by its name, a range by
    the text of its first line (of several, the nearest in line numbers). Never by line
    numbers alone: an edit above a range moves it, and a reason kept by number then
    describes whatever line moved there (issue 55 found two such rows)."""
    where, first = where.strip("`"), first.strip("`")
    key = where if where.endswith("()") else first
    found = [e for e in old if e.file == name and e.first == key and e.why]
    if not found:
        return TODO
    return min(found, key=lambda e: abs((e.lines[0] if e.lines else 0) - group[0])).why


def check(got: dict[str, FileCoverage], entries: list[Entry]) -> list[str]:
    problems = []
    listed_lines = {(e.file, line) for e in entries for line in e.lines}
    for name, c in got.items():
        for line in c.missing:
            if (name, line) not in listed_lines:
                problems.append(f"{name}:{line} was not executed and is not listed")
    missing = {(n, line) for n, c in got.items() for line in c.missing}
    for e in entries:
        if not any((e.file, line) in missing for line in e.lines):
            problems.append(f"{e.file}:{_fmt_lines(e.lines)} is listed but was executed (stale entry)")
        if not e.why or e.why.startswith(TODO):
            problems.append(f"{e.file}:{_fmt_lines(e.lines)} has no reason")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", type=Path, metavar="README")
    mode.add_argument("--write", type=Path, metavar="README")
    args = ap.parse_args(argv)
    got = measure()
    readme_path = args.check or args.write
    readme = readme_path.read_text()
    entries = listed(readme)
    for name in MODULES:
        c = got[name]
        print(f"bundle coverage: {name}: lines {c.line_pct:.1f} % ({len(c.missing)} of {c.statements} not executed), "
              f"branches {c.branch_pct:.1f} % ({c.covered_branches} of {c.branches})")
    if args.write:
        head, _, tail = _section(readme)
        readme_path.write_text(head + BEGIN + render(got, entries) + END + tail)
        print(f"bundle coverage: wrote {readme_path}")
        return 0
    problems = check(got, entries)
    for p in problems:
        print(f"bundle coverage: {p}", file=sys.stderr)
    if problems:
        print(f"bundle coverage: {len(problems)} problem(s); after checking the reasons, rerun with --write "
              f"{readme_path} to refresh the section", file=sys.stderr)
        return 1
    print(f"bundle coverage: every line not executed is listed in {readme_path} with its reason")
    return 0


if __name__ == "__main__":
    sys.exit(main())
