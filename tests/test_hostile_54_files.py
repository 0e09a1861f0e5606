"""Issue 54 (files): every file the toolkit writes at a path it was given, written as a
careful operator expects, and the ledger read with the report's own row check.

- ``bench --out`` creates a new ledger or appends to a ledger of this sweep only (never to
  ``/etc/passwd``, a prompt file or another sweep's ledger), never through a symbolic link;
  ``--resume`` alike; ``--predict``'s traces folder is checked before any host is touched.
- ``report --csv*`` refuses a link and a ledger it reads; ``--plots`` and ``tune --out``
  replace their files atomically (a link planted at a name is replaced, never followed).
- A full disk (a real tmpfs filled up, ENOSPC) is one line naming the file: before any
  host where the sweep's rows cannot fit, and mid-sweep with the rows so far kept.
- ``read_ledger`` (``--resume``, the canary gate's floors) skips what the report skips.
- ``tune --deploy --dry-run`` says the sha256 of the file the deploy places, eager budgets
  included.
- A sweep holds each host under one lease from its start to its end, the phases of
  ``bench --predict`` included: a ``restart`` is refused the whole time.

The table runs in-process through the real entry point (:func:`test_hostile_input_is_refused_in_one_line`'s
checks, plus links); the rest use the simulator where the case needs a server.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_json import json_data, read_envelope
from report.report_rows import make_row
from test_cli_basics import one_error_line
from test_hostile_inputs import FIFO, INV, SWEEP, fallback, inventory, ledger, row, state
from testports import free_port

from ddtree_ops.bench import ledger as ledger_mod
from ddtree_ops.bench.sweep import load_sweep, sweep_hash
from ddtree_ops.inventory import load_inventory
from ddtree_ops.service import lifecycle, manager
from ddtree_ops.transport.local import LocalTransport

PASSWD = "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"
BENCH = (*INV, "bench", "--sweep", "{tmp}/s.yaml")
# The sweep's files, and a ledger row of this sweep (its name) and of another.
SWEEP_FILES = {"inv.yaml": inventory(), "s.yaml": yaml.safe_dump(SWEEP), "p.jsonl": '{"prompt": "hi"}\n'}
OURS = row(sweep=SWEEP["name"], host="h")
OTHER = row(sweep="other", sweep_hash="f" * 64, host="h")
AR = row(algorithm="AR")
TREE = row(budget=8, topk=4)


@dataclass(frozen=True)
class Case:
    name: str
    files: Mapping[str, Any]  # name in the tmp dir -> text ("{tmp}": the tmp dir), or FIFO
    args: tuple[str, ...]
    exit_code: int
    line: str  # a substring of the one "error: " line ("": the command succeeds, stderr empty)
    output: str = ""  # a substring of stdout
    links: Mapping[str, str] = field(default_factory=dict)  # name -> what the symbolic link points to
    absent: tuple[str, ...] = ()  # names that must not exist afterwards (a host's run dir: untouched)
    replaced: tuple[str, ...] = ()  # links the command replaces by regular files (written atomically)


CASES: tuple[Case, ...] = (
    # bench --out: a new ledger, or one of this sweep; nothing else, and never through a link.
    Case("bench --out: a text file that is no ledger", {**SWEEP_FILES, "passwd": PASSWD},
         (*BENCH, "--out", "{tmp}/passwd"), 2, "passwd: is not a ledger (line 1: not JSON)", absent=("run",)),
    Case("bench --resume --out: a text file whose last line has no newline (it was cut off)",
         {**SWEEP_FILES, "passwd": PASSWD + "games:x:5:60"}, (*BENCH, "--out", "{tmp}/passwd", "--resume"), 2,
         "passwd: is not a ledger (line 1: not JSON)", absent=("run",)),
    Case("bench --out: a prompt file (JSON lines that are no rows)", SWEEP_FILES,
         (*BENCH, "--out", "{tmp}/p.jsonl"), 2,
         "p.jsonl: is not a ledger (line 1: a JSON object that is no ledger row)", absent=("run",)),
    Case("bench --out: another sweep's ledger", {**SWEEP_FILES, "o.jsonl": ledger(OTHER)},
         (*BENCH, "--out", "{tmp}/o.jsonl"), 2, "o.jsonl: holds rows of sweep 'other' (ffffffffffff) (line 1), "
         "this is sweep 'hostile'", absent=("run",)),
    Case("bench --out: this sweep's ledger, then another sweep's rows",
         {**SWEEP_FILES, "o.jsonl": ledger(OURS, OTHER)}, (*BENCH, "--out", "{tmp}/o.jsonl"), 2,
         "o.jsonl: holds rows of sweep 'other' (ffffffffffff) (line 2)", absent=("run",)),
    Case("bench --resume: another sweep's row with a budget [4] (used to be a TypeError)",
         {**SWEEP_FILES, "o.jsonl": ledger(row(sweep="other", sweep_hash="f" * 64, budget=[4]))},
         (*BENCH, "--out", "{tmp}/o.jsonl", "--resume"), 2,
         "o.jsonl: --resume refused: the ledger holds sweep 'other' (ffffffffffff)", absent=("run",)),
    Case("bench --out: a symbolic link to this sweep's ledger", {**SWEEP_FILES, "real.jsonl": ledger(OURS)},
         (*BENCH, "--out", "{tmp}/o.jsonl"), 2, "o.jsonl: is a symbolic link (ddtree-ops never writes through one)",
         links={"o.jsonl": "real.jsonl"}, absent=("run",)),
    Case("bench --out: a dangling symbolic link", SWEEP_FILES, (*BENCH, "--out", "{tmp}/o.jsonl"), 2,
         "o.jsonl: is a symbolic link", links={"o.jsonl": "elsewhere.jsonl"}, absent=("run", "elsewhere.jsonl")),
    Case("bench --resume --out: a symbolic link", {**SWEEP_FILES, "real.jsonl": ledger(OURS)},
         (*BENCH, "--out", "{tmp}/o.jsonl", "--resume"), 2, "o.jsonl: is a symbolic link",
         links={"o.jsonl": "real.jsonl"}, absent=("run",)),
    Case("bench --predict: <out>.traces is a file (used to be a FileExistsError after the hosts were used)",
         {**SWEEP_FILES, "o.jsonl.traces": "not a folder\n"}, (*BENCH, "--out", "{tmp}/o.jsonl", "--predict"), 2,
         "o.jsonl.traces: exists and is not a folder", absent=("run", "o.jsonl")),
    Case("bench --predict: <out>.traces is a symbolic link", {**SWEEP_FILES, "d/keep": "x\n"},
         (*BENCH, "--out", "{tmp}/o.jsonl", "--predict"), 2, "o.jsonl.traces: the traces folder is a symbolic link",
         links={"o.jsonl.traces": "d"}, absent=("run", "o.jsonl")),
    # report: never through a link, never over a ledger it reads; plots replaced atomically.
    *(Case(f"report {option}: a symbolic link", {"l.jsonl": ledger(AR, TREE), "real.csv": "keep me\n"},
           ("report", "{tmp}/l.jsonl", option, "{tmp}/out.csv"), 2,
           f"{option} {{tmp}}/out.csv: is a symbolic link (ddtree-ops never writes through one)",
           links={"out.csv": "real.csv"})
      for option in ("--csv", "--csv-best", "--csv-categories")),
    Case("report --csv: the ledger it reads", {"l.jsonl": ledger(AR, TREE)},
         ("report", "{tmp}/l.jsonl", "--csv", "{tmp}/l.jsonl"), 2,
         "--csv {tmp}/l.jsonl: is a ledger this report reads"),
    Case("report --plots: links planted at the figures' names are replaced, not followed",
         {"l.jsonl": ledger(AR, TREE), "real.png": "keep me\n", "plots/.keep": ""},
         ("report", "{tmp}/l.jsonl", "--plots", "{tmp}/plots"), 0, "",
         links={f"plots/rtx-pro-6000-{kind}.png": "../real.png" for kind in ("throughput", "accept-length")},
         replaced=tuple(f"plots/rtx-pro-6000-{kind}.png" for kind in ("throughput", "accept-length"))),
    Case("tune --out: a link planted at the policy's name is replaced, not followed",
         {"l.jsonl": ledger(AR, TREE), "real.json": "keep me\n", "pol/.keep": ""},
         ("tune", "{tmp}/l.jsonl", "--out", "{tmp}/pol"), 0, "", links={"pol/rtx-pro-6000.json": "../real.json"},
         replaced=("pol/rtx-pro-6000.json",)),
    # Rows no verify step gives: a bad line for every reader (report, --resume, the gate).
    Case("report: accept_length 1e308", {"l.jsonl": ledger(AR, TREE, row(budget=8, topk=4, accept_length=1e308,
                                                                           repeat=1))},
         ("report", "{tmp}/l.jsonl"), 0, "", output="l.jsonl:3: out of range: accept_length=1e+308 (expected 0..10"),
    Case("report: accept_length -3", {"l.jsonl": ledger(AR, TREE, row(budget=8, topk=4, accept_length=-3.0,
                                                                        repeat=1))},
         ("report", "{tmp}/l.jsonl"), 0, "", output="l.jsonl:3: out of range: accept_length=-3.0"),
    # The canary gate's floors (read_ledger): a host {...} used to crash them (unhashable), an
    # accept_length 1e308 to set a floor no canary passes.
    Case("tune --deploy --dry-run: gate floors from a hostile ledger",
         {"inv.yaml": inventory(), "l.jsonl": ledger(row(host="h", gpu_name="B300")),
          "g.jsonl": ledger(row(host="h", gpu_name="B300"), row(host={"a": 1}, gpu_name="B300", repeat=1),
                            row(host="h", gpu_name="B300", accept_length=1e308, repeat=2))},
         (*INV, "tune", "{tmp}/l.jsonl", "--deploy", "h", "--canary", "h", "--dry-run", "--gate-ledger",
          "{tmp}/g.jsonl"), 0, "", output="acceptance floor T=0 2.25 (0.75 x the ledger's median 3.00 of 1 row(s))"),
)


def write_case(tmp: Path, case: Case) -> None:
    for name, content in case.files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        if content is FIFO:
            os.mkfifo(tmp / name)
        else:
            (tmp / name).write_text(str(content).replace("{tmp}", str(tmp)))
    for name, target in case.links.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).symlink_to(target)


def snapshot(tmp: Path) -> dict[str, tuple[str, bytes | str, int]]:
    """Every file and link under ``tmp``: kind, content (a link: its target), mtime."""
    out: dict[str, tuple[str, bytes | str, int]] = {}
    for path in sorted(tmp.rglob("*")):
        name = str(path.relative_to(tmp))
        if path.is_symlink():
            out[name] = ("link", os.readlink(path), path.lstat().st_mtime_ns)
        elif path.is_file():
            out[name] = ("file", path.read_bytes(), path.stat().st_mtime_ns)
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_files_are_refused_in_one_line(
    case: Case, cli: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_case(tmp_path, case)
    monkeypatch.setenv("DDTREE_OPS_STATE", str(tmp_path / "state.json"))
    monkeypatch.setenv("COLUMNS", "200")
    before = snapshot(tmp_path)
    res = cli(*(a.replace("{tmp}", str(tmp_path)) for a in case.args))
    assert res.exit_code == case.exit_code, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stdout + res.stderr
    if case.line:
        assert case.line.replace("{tmp}", str(tmp_path)) in one_error_line(res.stderr)
    else:
        assert res.stderr.strip() == ""
    if case.output:
        assert "".join(case.output.split()) in "".join(res.stdout.split()), res.stdout[-3000:]
    after = snapshot(tmp_path)
    # Nothing written through a link, nothing appended, nothing half-changed: every file is
    # as it was; each link is too, but those the command replaced by a file of its own.
    for name, (kind, content, mtime) in before.items():
        if name in case.replaced:
            assert after[name][0] == "file" and after[name][1] != content, name
        else:
            assert after.get(name) == (kind, content, mtime), name
    assert not [name for name in case.absent if (tmp_path / name).exists() or (tmp_path / name).is_symlink()]


# --- --resume and the ledger's row check ----------------------------------------------------


def test_resume_re_measures_a_row_the_report_would_skip(cli: Callable[..., Any], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``ok`` row of this sweep's very cell whose throughput is no number: ``report``
    skips it as a bad line, so ``--resume`` must measure the cell again (it used to count
    it done: the cell was never measured)."""
    write_case(tmp_path, Case("", SWEEP_FILES, (), 0, ""))
    monkeypatch.setenv("DDTREE_OPS_STATE", str(tmp_path / "state.json"))
    sweep = tmp_path / "s.yaml"
    plan = json_data(cli("-i", str(tmp_path / "inv.yaml"), "--json", "bench", "--sweep", str(sweep),
                         "--dry-run").stdout)
    key = {"host": "h", "algorithm": "DDTREE", "budget": 8, "topk": 4, "temperature": 0.0, "top_p": 1.0,
           "top_k": -1, "concurrency": 1, "request_rate": None, "repeat": 0,
           "workload_hash": plan["workload"]["hash"], "sweep": SWEEP["name"],
           "sweep_hash": sweep_hash(load_sweep(sweep))}
    good, bad = row(**key), row(**key, output_tok_s="fast")
    out = tmp_path / "o.jsonl"
    for rows, done in (([good], 1), ([bad], 0)):
        out.write_text(ledger(*rows))
        res = cli("-i", str(tmp_path / "inv.yaml"), "--json", "bench", "--sweep", str(sweep), "--out", str(out),
                  "--resume", "--dry-run")
        assert res.exit_code == 0, res.stderr
        assert json_data(res.stdout)["resume"]["hosts"]["h"] == {"done": done, "left": 1 - done}
    # The reader says why: the report's own words.
    assert ledger_mod.read_ledger(out).bad_lines == [(1, "not a number: output_tok_s='fast'")]


# --- tune --deploy --dry-run: the checksum of the file the deploy places --------------------


def test_tune_dry_run_says_the_sha256_of_the_file_the_deploy_places(
    cli: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fallback is recorded for the host's budget 9 (it covers 16): the file placed lists 16
    in ``eager_budgets`` and launches at 8. The dry run's sha256 is that file's, not the
    ``--out`` file's (which the ``tune`` table above it shows)."""
    from ddtree_ops.report.policy import tune_ledgers

    write_case(tmp_path, Case("", {"inv.yaml": inventory()}, (), 0, ""))
    host = load_inventory([tmp_path / "inv.yaml"]).hosts["h"]
    with LocalTransport("h") as t:
        version = lifecycle.launch_facts(t, host).sglang_version or "unknown"
    record = fallback()
    for entry in record.values():
        entry["key"]["sglang_version"] = version
    (tmp_path / "state.json").write_text(state(fallbacks=record))
    monkeypatch.setenv("DDTREE_OPS_STATE", str(tmp_path / "state.json"))
    rows = [make_row(host="h", gpu_name="B300", budget=b, topk=4, concurrency=c, output_tok_s=tok_s)
            for (b, c), tok_s in {(16, 1): 500.0, (8, 1): 400.0, (8, 8): 900.0, (16, 8): 800.0}.items()]
    (tmp_path / "l.jsonl").write_text(ledger(*rows))

    res = cli("-i", str(tmp_path / "inv.yaml"), "--json", "tune", str(tmp_path / "l.jsonl"), "--deploy", "h",
              "--dry-run")
    assert res.exit_code == 0, res.stderr
    data = json_data(res.stdout)
    (policy,) = tune_ledgers([tmp_path / "l.jsonl"]).policies
    placed = policy.render((16,))
    assert json.loads(placed)["ddtree"]["eager_budgets"] == [16]
    (planned,) = data["deploy"]
    assert planned["sha256"] == hashlib.sha256(placed.encode()).hexdigest() != data["policies"][0]["sha256"]
    assert (planned["eager_budgets"], planned["launch"]) == ([16], {"budget": 8, "topk": 4})
    text = cli("-i", str(tmp_path / "inv.yaml"), "tune", str(tmp_path / "l.jsonl"), "--deploy", "h", "--dry-run")
    assert f"h: the file placed: sha256 {planned['sha256'][:12]}; eager_budgets [16]" in text.stdout


# --- a full disk: a real tmpfs, filled ------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """``mount(kib)``: a tmpfs of ``kib`` KiB under ``tmp_path`` (root only; skipped where a
    tmpfs cannot be mounted), unmounted afterwards."""
    mounted: list[Path] = []

    def mount(kib: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    try:
        yield mount
    finally:
        for where in mounted:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(disk: Path) -> None:
    """Take every byte left on ``disk``."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (1 << 16, 1 << 12, 1 << 9, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_a_full_disk_is_one_line_naming_the_file(
    cli: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_disk: Callable[[int], Path]
) -> None:
    write_case(tmp_path, Case("", {**SWEEP_FILES, "l.jsonl": ledger(AR, TREE)}, (), 0, ""))
    monkeypatch.setenv("DDTREE_OPS_STATE", str(tmp_path / "state.json"))
    disk = small_disk(64)
    (disk / "plots").mkdir()
    (disk / "pol").mkdir()
    fill(disk)
    cases = (
        (("report", str(tmp_path / "l.jsonl"), "--csv", str(disk / "out.csv")), f"{disk}/out.csv: cannot write "
         "the CSV: the disk is full (No space left on device)"),
        (("report", str(tmp_path / "l.jsonl"), "--plots", str(disk / "plots")), "cannot write the plot: the disk "
         "is full (No space left on device)"),
        (("tune", str(tmp_path / "l.jsonl"), "--out", str(disk / "pol")), "cannot write rtx-pro-6000.json: the "
         "disk is full (No space left on device)"),
        # Before any host: the sweep's rows cannot fit (the host's run dir never made).
        (("-i", str(tmp_path / "inv.yaml"), "bench", "--sweep", str(tmp_path / "s.yaml"), "--out",
          str(disk / "o.jsonl")), f"{disk}/o.jsonl: the disk is nearly full"),
    )
    for args, line in cases:
        res = cli(*args)
        assert res.exit_code == 2, res.stdout[-2000:] + res.stderr[-2000:]
        assert line in one_error_line(res.stderr)
    # Nothing half-written left behind: no partial CSV, figure, policy or temp file.
    assert sorted(str(p.relative_to(disk)) for p in disk.rglob("*")) == ["filler", "plots", "pol"]
    assert not (tmp_path / "run").exists()


def sim_inventory(tmp: Path, *, load_s: str = "0.3") -> Path:
    """One local simulated host ``sim-x`` (fast: compressed time)."""
    from minisglang import deployed_python

    inv = tmp / "inv.yaml"
    inv.write_text(yaml.safe_dump({"all": {"children": {"local": {"hosts": {"sim-x": {
        "ansible_connection": "local",
        "ddtree": {"python": deployed_python(), "run_dir": str(tmp / "run"), "server": {
            "command": "{python} -m ddtree_ops.sim", "model_path": "sim/m", "draft_model_path": "sim/d",
            "port": free_port(), "expected_load_s": 2,
            "env": {"SIM_GPU": "rtx-pro-6000", "SIM_LOAD_S": load_s, "SIM_TIME_SCALE": "0.2"}}}}}}}}}))
    return inv


def sim_sweep(tmp: Path, *, max_new_tokens: int = 16, **extra: Any) -> Path:
    """Two DDTree cells of one live launch (``--predict`` walks traces of more than 16 rounds:
    it needs longer answers)."""
    (tmp / "p.jsonl").write_text('{"prompt": "hello there"}\n{"prompt": "general kenobi"}\n')
    path = tmp / "s.yaml"
    doc = {"name": "files54", "targets": ["local"], "grid": {"algorithm": ["ddtree"], "budget": [4, 8],
                                                             "temperature": [0.0], "concurrency": [1]},
           "workload": {"prompt_files": ["p.jsonl"], "num_prompts": 2, "max_new_tokens": max_new_tokens},
           "warmup": 0} | extra
    path.write_text(yaml.safe_dump(doc))
    return path


def start_bench(tmp: Path, inv: Path, sweep: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ddtree_ops", "--json", "-i", str(inv), "bench", "--sweep", str(sweep), "--out",
         str(out), *extra],
        cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "DDTREE_OPS_STATE": str(tmp / "state.json")},
    )


def wait_for(proc: subprocess.Popen[str], event: Callable[[], bool], what: str) -> None:
    """Poll for ``event`` while ``proc`` runs (a wide deadline: a hang guard, not a timing claim)."""
    deadline = time.monotonic() + 240
    while not event():
        if proc.poll() is not None:
            pytest.fail(f"the sweep ended before {what}: {proc.communicate()[1][-2000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} in 240 s")
        time.sleep(0.02)


def rows_of(out: Path, **match: Any) -> list[dict[str, Any]]:
    rows = ledger_mod.read_ledger(out).rows if out.exists() else []
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def stop_sim(inv: Path) -> None:
    host = load_inventory([inv]).hosts["sim-x"]
    with LocalTransport(host.name) as t:
        lifecycle.stop(t, host, grace_s=2.0, lease=manager.LeasePass(force=True))


@pytest.mark.timeout(300)
def test_the_disk_filling_mid_sweep_stops_it_in_one_line_with_the_rows_kept(
    tmp_path: Path, small_disk: Callable[[int], Path]
) -> None:
    disk = small_disk(512)
    inv, sweep, out = sim_inventory(tmp_path), sim_sweep(tmp_path, repeats=2), disk / "o.jsonl"
    bench = start_bench(tmp_path, inv, sweep, out)
    try:
        wait_for(bench, lambda: len(rows_of(out)) >= 1, "first row")
        # Held while the disk fills, so that the next row is the one that meets it.
        os.kill(bench.pid, signal.SIGSTOP)
        try:
            kept = out.read_bytes()
            fill(disk)
        finally:
            os.kill(bench.pid, signal.SIGCONT)
        stdout, stderr = bench.communicate(timeout=240)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)
        stop_sim(inv)
    assert bench.returncode == 6, stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    line = one_error_line(stderr)
    assert f"{out}: cannot append to the ledger: the disk is full (No space left on device)" in line, line
    assert "the sweep stopped on every host" in line and "`bench --resume`" in line, line
    # The rows before are kept, whole: the ledger is a clean prefix of rows (no torn line).
    rows = ledger_mod.read_ledger(out)
    assert rows.bad_lines == [] and 1 <= len(rows.rows) < 4
    assert out.read_bytes().startswith(kept) and out.read_bytes().endswith(b"\n")
    (host,) = json_data(stdout)["hosts"]
    assert host["put_back"][0]["ok"] and not (tmp_path / "run" / manager.LEASE_FILE).exists()
    assert read_envelope(stdout)["errors"][0]["code"] == "bench"


@pytest.mark.timeout(300)
def test_the_disk_filling_during_bench_predict_is_one_line(tmp_path: Path, small_disk: Callable[[int], Path]) -> None:
    """The predict phase writes probe rows, predicted rows and trace files beside the ledger:
    the disk filling there (it used to be an OSError traceback, after the hosts were used)
    stops the sweep in one line; the host is put back and given back."""
    disk = small_disk(512)
    inv, sweep, out = sim_inventory(tmp_path), sim_sweep(tmp_path, max_new_tokens=40), disk / "o.jsonl"
    lease = tmp_path / "run" / manager.LEASE_FILE
    bench = start_bench(tmp_path, inv, sweep, out, "--predict")
    try:
        wait_for(bench, lease.exists, "lease")
        os.kill(bench.pid, signal.SIGSTOP)
        try:
            fill(disk)
        finally:
            os.kill(bench.pid, signal.SIGCONT)
        stdout, stderr = bench.communicate(timeout=240)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)
        stop_sim(inv)
    assert bench.returncode == 6, stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    line = one_error_line(stderr)
    assert "the disk is full (No space left on device)" in line and str(out) in line, line
    assert "the sweep stopped on every host" in line, line
    (host,) = json_data(stdout)["hosts"]
    assert host["put_back"][0]["ok"] and not lease.exists()
    assert ledger_mod.read_ledger(out).bad_lines == []


# --- one lease from the sweep's start to its end, --predict's phases included --------------


@pytest.mark.timeout(300)
def test_a_sweep_holds_its_host_under_one_lease_through_both_phases(tmp_path: Path) -> None:
    """``bench --predict``: the predict phase, then the measuring on its server. A restart is
    refused as soon as the sweep has reached the host, and again once the measuring runs,
    where the lease is still the one the sweep took first (it used to be given back between
    the phases: a restart then was not refused, and the sweep's rows failed)."""
    inv, sweep, out = sim_inventory(tmp_path), sim_sweep(tmp_path, max_new_tokens=40), tmp_path / "o.jsonl"
    lease = tmp_path / "run" / manager.LEASE_FILE
    bench = start_bench(tmp_path, inv, sweep, out, "--predict")
    env = {**os.environ, "DDTREE_OPS_STATE": str(tmp_path / "state.json")}

    def restart() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ddtree_ops", "--json", "-i", str(inv), "restart", "sim-x",
                               "--algorithm", "AR", "--timeout", "60"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, env=env)

    tokens = []
    try:
        for event, what in ((lambda: lease.exists(), "lease"),
                            (lambda: bool(rows_of(out, source=None)), "measured row")):
            wait_for(bench, event, what)
            # Held (SIGSTOP) while the restart tries, so that the sweep cannot move on meanwhile.
            os.kill(bench.pid, signal.SIGSTOP)
            try:
                tokens.append(json.loads(lease.read_text())["token"])
                refused = restart()
            finally:
                os.kill(bench.pid, signal.SIGCONT)
            assert refused.returncode == 5, refused.stdout[-2000:] + refused.stderr[-2000:]
            [error] = read_envelope(refused.stdout)["errors"][1:]
            assert error["code"] == "lease_held" and "held by sweep files54" in error["message"], error
        stdout, stderr = bench.communicate(timeout=240)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)
        stop_sim(inv)
    assert bench.returncode == 0, stderr[-3000:]
    assert tokens[0] == tokens[1]  # one lease: never given back between the phases
    assert rows_of(out, source="predicted") and {r["status"] for r in rows_of(out, source=None)} == {"ok"}
    assert not lease.exists()
