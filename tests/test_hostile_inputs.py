"""A hostile operator's inputs (issue 41): each is refused in one line naming the file, key
or host, with the documented exit code, no traceback, nothing half-changed, and at once.

One table, :data:`CASES`: the files a case writes into its tmp dir (a ledger, a sweep, an
inventory, a state file, or a FIFO where a file is expected), the command, the exit code,
and the one ``error:`` line on stderr (or, where the code base skips a malformed row with a
counted warning, that warning on stdout and exit 0). Each runs in-process through the real
entry point; a case whose input used to hang the command (a FIFO, a grid too large to
plan) first runs as a subprocess with a short timeout: a hang guard, not a timing claim.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from report.report_rows import make_row
from test_cli_basics import one_error_line
from testports import free_port

from ddtree_ops import limits
from ddtree_ops.errors import ConfigError
from ddtree_ops.report.policy import Policy, PolicyEntry
from ddtree_ops.state import StateStore

REPO = Path(__file__).resolve().parents[1]
FIFO = object()  # a file to create as a FIFO that nothing ever writes to or reads from

# --- the files the cases write -------------------------------------------------------


def ledger(*rows: Mapping[str, Any]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def row(**fields: Any) -> dict[str, Any]:
    """A valid ledger row with ``fields`` written over it as they come (any JSON value)."""
    over = {k: v for k, v in fields.items() if k in ("algorithm", "concurrency", "repeat")}
    return {**make_row(**over), **fields}


AR = row(algorithm="AR")
TREE = row(budget=8, topk=4)
# The per-request output hashes send a row through the report's second reader too (the
# lossless table re-reads raw lines): a budget of [4] used to be unhashable there.
HASHED = {"output_hashes": ["a", "b"]}

SWEEP = {
    "name": "hostile", "targets": ["h"],
    "grid": {"algorithm": ["ddtree"], "budget": [8], "topk": [4], "concurrency": [1]},
    "workload": {"prompt_files": ["p.jsonl"], "num_prompts": 2, "max_new_tokens": 8}, "warmup": 0,
}
# 256 budgets x 256 top-ks x 4096 concurrencies x 4 temperatures: 1.07e9 cells.
HUGE_GRID = {**SWEEP, "grid": {"algorithm": ["ddtree"], "budget": list(range(1, 257)), "topk": list(range(1, 257)),
                               "concurrency": list(range(1, 4097)), "temperature": [0.0, 0.5, 1.0, 1.5]}}


def inventory() -> str:
    """One local host ``h`` (a B300) whose interpreter is this one."""
    server = {"command": "{python} -m ddtree_ops.sim", "model_path": "sim/qwen3-8b",
              "draft_model_path": "sim/qwen3-8b-dflash", "port": free_port(), "expected_load_s": 5}
    host = {"ansible_connection": "local", "ddtree": {"python": sys.executable, "run_dir": "{tmp}/run",
                                                       "gpu": "b300", "server": server}}
    return yaml.safe_dump({"all": {"hosts": {"h": host}}})


def state(**sections: Mapping[str, Any]) -> str:
    return json.dumps({"version": 1, "load_times": {}, "fallbacks": {}, "policies": {}, **sections})


def fallback(budget: Any = 9, recorded_at: Any = 1.0) -> dict[str, Any]:
    """An eager fallback of ``h`` that a DDTREE restart there consults (no GPU probed: the
    inventory's ``gpu``; no SGLang there: its version unknown)."""
    key = {"host": "h", "gpu_arch": "b300", "sglang_version": "unknown", "algorithm": "DDTREE",
           "budget": budget, "topk": 4}
    return {"h|b300|unknown|DDTREE|x|4": {"key": key, "reason": "capture failed", "recorded_at": recorded_at}}


POLICY_TEXT = json.dumps({"ddtree": {"budgets": [16], "topk_max": 4, "policy": {"1": {"budget": 16, "topk": 4}}}})


def policy(path: str = "/nowhere/ddtree-policy.json", **over: Any) -> dict[str, Any]:
    record = {"host": "h", "path": path, "sha256": "0" * 64, "config": POLICY_TEXT, "machine_type": "B300",
              "temperature": 0.0, "budget": 16, "topk": 4, "recorded_at": 1.0}
    return {"h": {**record, **over}}


def load_time(load_s: Any) -> dict[str, Any]:
    return {"h|sim/qwen3-8b": {"host": "h", "model": "sim/qwen3-8b", "load_s": load_s, "recorded_at": 1.0,
                               "restart_s": None}}


# --- the table -----------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    files: Mapping[str, Any]  # name in the tmp dir -> text, or FIFO; "{tmp}" in text is the tmp dir
    args: tuple[str, ...]  # "{tmp}" is the tmp dir
    exit_code: int
    line: str  # a substring of the one "error: " line on stderr ("": the command succeeds)
    output: str = ""  # a substring of stdout: a skipped row's warning, a failed host's reason
    hang: bool = False  # the input used to block the command: run it as a subprocess first
    state: str = "state.json"  # the state file ($DDTREE_OPS_STATE), among ``files`` or not
    absent: tuple[str, ...] = ()  # names in the tmp dir that must not exist afterwards (nothing written)


INV = ("-i", "{tmp}/inv.yaml")
RESTART = (*INV, "restart", "h", "--algorithm", "DDTREE", "--budget", "16", "--topk", "4")
STATE_FIX = "remove that record from the state file"

CASES: tuple[Case, ...] = (
    # Ledger rows, read once by report/loading.py for every consumer.
    Case("tune: a DDTREE row with budget null", {"l.jsonl": ledger(AR, row(budget=None))},
         ("tune", "{tmp}/l.jsonl"), 2, "l.jsonl: machine type RTX PRO 6000: no DDTREE rows (only AR); nothing to "
         "tune (1 bad line(s) skipped"),
    Case("tune: a budget-null row beside good ones is skipped, counted",
         {"l.jsonl": ledger(AR, TREE, row(budget=None, repeat=1))}, ("tune", "{tmp}/l.jsonl"), 0, "",
         output="Skipped 1 bad line(s)"),
    Case("report: concurrency 1e30", {"l.jsonl": ledger(AR, TREE, row(concurrency=1e30, **HASHED))},
         ("report", "{tmp}/l.jsonl"), 0, "",
         output="l.jsonl:3: out of range: concurrency=1e+30 (expected an integer in 1..4096)"),
    Case("report: budget [4]", {"l.jsonl": ledger({**AR, **HASHED}, {**TREE, **HASHED}, row(budget=[4], **HASHED))},
         ("report", "{tmp}/l.jsonl"), 0, "", output="l.jsonl:3: not a number: budget=[4]"),
    # Each used to become a policy the server refuses (b=-4, k=0, batch size 0...), written.
    *(Case(f"tune --out: {field_name} {value} from the ledger", {"l.jsonl": ledger(AR, row(**{field_name: value}))},
           ("tune", "{tmp}/l.jsonl", "--out", "{tmp}/policies"), 2,
           "no DDTREE rows (only AR); nothing to tune (1 bad line(s) skipped", absent=("policies",))
      for field_name, value in (("budget", -4), ("budget", 0), ("budget", 10**12), ("topk", 0), ("topk", -1),
                                ("topk", 10**9), ("concurrency", 0), ("concurrency", -1))),
    # The local state file: validated where it is read, refused before any host is touched.
    Case("restart: fallback budget 'abc'", {"inv.yaml": inventory(), "state.json": state(fallbacks=fallback("abc"))},
         RESTART, 2, "state.json: fallbacks['h|b300|unknown|DDTREE|x|4'].key.budget: 'abc' is not an integer"),
    Case("restart: fallback budget [9]", {"inv.yaml": inventory(), "state.json": state(fallbacks=fallback([9]))},
         RESTART, 2, f".key.budget: [9] is not an integer in 1..257 or null; {STATE_FIX}"),
    Case("restart: fallback recorded_at 'x'",
         {"inv.yaml": inventory(), "state.json": state(fallbacks=fallback(recorded_at="x"))},
         RESTART, 2, "fallbacks['h|b300|unknown|DDTREE|x|4'].recorded_at: 'x' is not a time"),
    Case("restart: policy config 5", {"inv.yaml": inventory(), "state.json": state(policies=policy(config=5))},
         RESTART, 2, "state.json: policies['h'].config: 5 is not the policy file's text"),
    Case("restart: policy topk null", {"inv.yaml": inventory(), "state.json": state(policies=policy(topk=None))},
         RESTART, 2, f"policies['h'].topk: top-k None is not an integer in 1..256; {STATE_FIX}"),
    Case("restart: a learned load time of 1e308 s",
         {"inv.yaml": inventory(), "state.json": state(load_times=load_time(1e308))},
         RESTART, 2, "load_times['h|sim/qwen3-8b'].load_s: 1e+308 is not a number of seconds in (0, 86400]"),
    Case("bench --dry-run: a learned load time of 1e308 s (estimated inf min)",
         {"inv.yaml": inventory(), "s.yaml": yaml.safe_dump(SWEEP), "p.jsonl": '{"prompt": "hi"}\n',
          "state.json": state(load_times=load_time(1e308))},
         (*INV, "bench", "--sweep", "{tmp}/s.yaml", "--dry-run"), 2, "load_times['h|sim/qwen3-8b'].load_s: 1e+308"),
    Case("selftest --bisect-budgets: fallback budget 'abc'",
         {"inv.yaml": inventory(), "state.json": state(fallbacks=fallback("abc"))},
         (*INV, "selftest", "h", "--e2e", "--bisect-budgets"), 2, ".key.budget: 'abc' is not an integer"),
    # FIFOs where a regular file is expected: refused, never waited on.
    Case("report --csv FIFO", {"l.jsonl": ledger(AR, TREE), "out.csv": FIFO},
         ("report", "{tmp}/l.jsonl", "--csv", "{tmp}/out.csv"), 2, "out.csv: is not a regular file", hang=True),
    Case("bench --out FIFO (the ledger)",
         {"inv.yaml": inventory(), "s.yaml": yaml.safe_dump(SWEEP), "p.jsonl": '{"prompt": "hi"}\n', "l.jsonl": FIFO},
         (*INV, "bench", "--sweep", "{tmp}/s.yaml", "--out", "{tmp}/l.jsonl"), 2, "l.jsonl: is not a regular file",
         hang=True),
    Case("report: a FIFO named *.jsonl in a ledger folder", {"d/l.jsonl": FIFO}, ("report", "{tmp}/d"), 2,
         "d/l.jsonl: is not a regular file: a ledger is one", hang=True),
    Case("the state file a FIFO", {"inv.yaml": inventory(), "fifo-state": FIFO}, RESTART, 2,
         "fifo-state: the state file is not a regular file", hang=True, state="fifo-state"),
    Case("the placed policy file a FIFO",
         {"inv.yaml": inventory(), "placed.json": FIFO, "state.json": state(policies=policy("{tmp}/placed.json"))},
         (*INV, "restart", "h", "--algorithm", "DDTREE"), 4, "restart failed on 1 of 1 host(s): h",
         output="placed.json: not a regular file", hang=True),
    # A grid counted from its axes, refused before it is expanded.
    Case("bench --dry-run: a grid of 10^9 cells",
         {"inv.yaml": inventory(), "s.yaml": yaml.safe_dump(HUGE_GRID), "p.jsonl": '{"prompt": "hi"}\n'},
         (*INV, "bench", "--sweep", "{tmp}/s.yaml", "--dry-run"), 2,
         "s.yaml: grid: 1,073,741,824 cells (256 budget x 256 topk x 4 temperature x 4096 concurrency), more than "
         "the 100,000 a sweep may have", hang=True),
)


def write_files(tmp: Path, files: Mapping[str, Any]) -> None:
    for name, content in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        if content is FIFO:
            os.mkfifo(tmp / name)
        else:
            (tmp / name).write_text(str(content).replace("{tmp}", str(tmp)))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_input_is_refused_in_one_line(
    case: Case, cli: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_files(tmp_path, case.files)
    args = [a.replace("{tmp}", str(tmp_path)) for a in case.args]
    env = {"DDTREE_OPS_STATE": str(tmp_path / case.state), "COLUMNS": "200"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    if case.hang:
        # The hang guard: a command blocked on a FIFO (or planning 10^9 cells) never returns.
        try:
            done = subprocess.run([sys.executable, "-m", "ddtree_ops", *args], capture_output=True, text=True,
                                  timeout=20, env={**os.environ, **env}, cwd=tmp_path)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{case.name}: still running after 20 s (blocked)")
        assert done.returncode == case.exit_code, done.stdout[-2000:] + done.stderr[-2000:]
        assert case.line in one_error_line(done.stderr)
    res = cli(*args)
    assert res.exit_code == case.exit_code, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stdout + res.stderr
    if case.line:
        assert case.line in one_error_line(res.stderr)
    else:
        assert res.stderr.strip() == ""
    if case.output:
        # Compared without whitespace: a long tmp path folds wherever the 80 columns end,
        # inside a word too (CI's paths are longer than ours).
        assert "".join(case.output.split()) in "".join(res.stdout.split()), res.stdout[-3000:]
    # Nothing half-changed: every file the case wrote is as it was (a refused state file or
    # ledger is not rewritten, a FIFO not replaced).
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.name in before} == before
    assert not [name for name in case.absent if (tmp_path / name).exists()]


def test_the_bounds_are_the_servers() -> None:
    """The DDTree plugin runs on the host without this package and keeps its own copy of
    the budget bound: the two must agree, or a tree one accepts the other refuses."""
    source = (REPO / "patches/ddtree_temperature/files/srt/speculative/ddtree_registration.py").read_text()
    match = re.search(r"^MAX_DDTREE_BUDGET = (\d+)$", source, re.M)
    assert match and int(match.group(1)) == limits.MAX_DDTREE_BUDGET


@pytest.mark.parametrize(("budget", "topk", "batch"), [(-4, 4, 1), (0, 4, 1), (10**12, 4, 1), (8, 0, 1),
                                                      (8, -1, 1), (8, 10**9, 1), (8, 4, 0), (8, 4, -1)])
def test_a_policy_the_server_would_refuse_is_never_made(budget: int, topk: int, batch: int) -> None:
    """Whatever its rows said: ``tune`` builds every policy it writes or deploys as a Policy."""
    entry = PolicyEntry(concurrency=batch, budget=budget, topk=topk, output_tok_s=1.0, output_tok_s_mad=0.0, n=1,
                        accept_length=None, speedup_vs_ar=None, runner_up=None, note=None)
    with pytest.raises(ConfigError, match=r"^policy for machine type B300: ddtree\.\S+"):
        Policy(machine="B300", temperature=0.0, cuda_graph=True, entries=(entry,), hosts=("h",))


def test_a_load_time_out_of_bounds_is_never_remembered(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.json")
    store.record_load_time("h", "m", 30.0, restart_s=40.0)
    for load_s, restart_s in ((1e308, None), (float("inf"), None), (-1.0, None), (10.0, 1e308)):
        store.record_load_time("h", "m", load_s, restart_s=restart_s)
    assert (store.learned_load_s("h", "m"), store.learned_restart_s("h", "m")) == (30.0, 40.0)
