"""`ddtree-ops bench` as a user runs it: a subprocess, real inventory and sweep files."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from cli_json import json_data
from minisglang import deployed_python
from testports import free_port
from workload.test_datasets import LAYOUTS

from ddtree_ops.bench import ledger
from ddtree_ops.bench.sweep import load_sweep, sweep_hash

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ddtree_ops", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def write_inventory(tmp_path: Path, port: int, **env: str) -> Path:
    """One local simulated host; ``env`` adds to the simulator's environment."""
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"all": {"children": {"local": {"hosts": {"sim-x": {
        "ansible_connection": "local",
        "ddtree": {"python": deployed_python(), "run_dir": str(tmp_path / "run"), "server": {
            "command": "{python} -m ddtree_ops.sim", "model_path": "sim/m", "draft_model_path": "sim/d",
            "port": port, "expected_load_s": 2,
            "env": {"SIM_GPU": "rtx-pro-6000", "SIM_LOAD_S": "0.5", "SIM_TIME_SCALE": "0.5", **env}}}}}}}}}))
    return inv


def write_sweep(tmp_path: Path, **extra: object) -> Path:
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello there"}\n{"prompt": "general kenobi"}\n')
    path = tmp_path / "s.yaml"
    doc = {"name": "cli", "targets": ["local"], "grid": {"algorithm": ["autoregressive"],
           "temperature": [0.0, 0.6, 1.0], "concurrency": [1, 2]},
           "workload": {"prompt_files": ["p.jsonl"], "num_prompts": 4, "max_new_tokens": 48}, "warmup": 0} | extra
    path.write_text(yaml.safe_dump(doc))
    return path


def test_dry_run_plan_as_json(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, free_port())
    sweep = write_sweep(tmp_path, baselines=["dflash"], grid={"algorithm": ["ddtree"], "budget": [4, 8],
                                                              "temperature": [0.0, 0.6]})
    done = cli("--json", "-i", str(inv), "bench", "--sweep", str(sweep), "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    plan = json_data(done.stdout)
    # Live switching (the default): the two budgets share one DDTree launch; DFlash runs one
    # chain per verify width (root + 4, root + 8 drafted tokens), each its own launch.
    assert plan["hosts"] == ["sim-x"] and plan["restarts_per_host"] == 3 and plan["rows_per_host"] == 8
    assert plan["relaunch"] == "never" and plan["switches_per_host"] == 4
    assert [g["server"] for g in plan["groups"]] == ["dflash-n5", "dflash-n9", "ddtree-states-b4,8-topk4"]
    assert [(g["live"], g["budgets"]) for g in plan["groups"]] == [(False, []), (False, []), (True, [4, 8])]
    assert plan["estimated_s"]["sim-x"] > 2 * 2  # at least the expected load time per launch
    # Both modes side by side: relaunching per tree costs one launch more here.
    modes = plan["modes"]
    assert (modes["never"]["launches_per_host"], modes["always"]["launches_per_host"]) == (3, 4)
    assert modes["always"]["estimated_s"]["sim-x"] > 0 and modes["never"]["switches_per_host"] == 4
    assert modes["never"]["estimated_s"]["sim-x"] == plan["estimated_s"]["sim-x"]
    old = json_data(cli("--json", "-i", str(inv), "bench", "--sweep", str(write_sweep(
        tmp_path, baselines=["dflash"], relaunch="always",
        grid={"algorithm": ["ddtree"], "budget": [4, 8], "temperature": [0.0, 0.6]})), "--dry-run",
        cwd=tmp_path).stdout)
    assert [g["server"] for g in old["groups"]] == ["dflash-n5", "dflash-n9", "ddtree-b4-topk4", "ddtree-b8-topk4"]
    assert old["restarts_per_host"] == 4 and old["switches_per_host"] == 0
    assert plan["clients"] == {"sim-x": "host"}  # the server binds loopback: load from the host
    assert not (tmp_path / "results").exists()
    text = cli("-i", str(inv), "bench", "--sweep", str(write_sweep(tmp_path, client="local")), "--dry-run",
               cwd=tmp_path)
    assert "sim-x: client local, estimated" in text.stdout


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"grid": {"budget": [0]}}, "grid.budget: must be an integer from 1 to 256"),
        ({"targets": ["nowhere"]}, "unknown target 'nowhere'"),
        ({"colour": "blue"}, "colour: unknown key"),
        ({"client": "laptop"}, "client: must be one of local, host, got 'laptop'"),
        ({"relaunch": "sometimes"}, "s.yaml: relaunch: must be one of never, always"),
        ({"predict": {"max_repeats": 1}}, "s.yaml: predict.max_repeats: must be an integer from 2 to 1000"),
    ],
)
def test_bad_sweep_is_one_line_exit_2(tmp_path: Path, extra: dict, needle: str) -> None:
    inv = write_inventory(tmp_path, free_port())
    sweep = write_sweep(tmp_path, **extra)
    done = cli("-i", str(inv), "bench", "--sweep", str(sweep), "--dry-run", cwd=tmp_path)
    assert done.returncode == 2
    assert needle in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_bad_prompt_line_names_file_and_line(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, free_port())
    sweep = write_sweep(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "ok"}\n{"prompt": \n')
    done = cli("-i", str(inv), "bench", "--sweep", str(sweep), "--out", str(tmp_path / "l.jsonl"), cwd=tmp_path)
    assert done.returncode == 2 and f"{tmp_path / 'p.jsonl'}:2: not valid JSON" in done.stderr


def _interrupted_bench(
    tmp_path: Path, *, ctrl_c: int, before: tuple[str, ...] = (), **env: str
) -> tuple[subprocess.Popen[str], str, str, int, Path]:
    """A real `bench` process, Ctrl-C'd ``ctrl_c`` times once its first row is written, each
    further one once the server the run stops in its wind-down has begun to drain (its log
    says so): (process, stdout, stderr, the server port, the ledger). ``before``: a
    `restart` launched first, with these arguments (what the sweep must put back); its launch
    record is copied to ``before-launch.json``."""
    port = free_port()
    inv = write_inventory(tmp_path, port, **env)
    out = tmp_path / "ledger.jsonl"
    if before:
        done = cli("-i", str(inv), "restart", "sim-x", *before, cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        (tmp_path / "before-launch.json").write_bytes((tmp_path / "run" / "launch.json").read_bytes())
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddtree_ops", "-i", str(inv), "bench", "--sweep", str(write_sweep(tmp_path)),
         "--out", str(out)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None and not (out.exists() and out.read_bytes()):
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        log, seen = tmp_path / "run" / "server.log", 0
        for i in range(ctrl_c):
            if i:  # in the wind-down of the one before, however slow the machine
                deadline = time.monotonic() + 90
                while "Received SIGTERM; draining" not in log.read_bytes()[seen:].decode(errors="replace"):
                    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
                    time.sleep(0.05)
            seen = log.stat().st_size
            proc.send_signal(signal.SIGINT)
        stdout, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
        if ctrl_c > 1:  # an abort may leave the server it started (one Ctrl-C must stop it itself)
            subprocess.run([sys.executable, "-m", "ddtree_ops", "-i", str(inv), "stop", "all"],
                           capture_output=True, cwd=tmp_path, timeout=60)
    return proc, stdout, err, port, out


@pytest.mark.slow
def test_ctrl_c_finishes_row_puts_the_previous_server_back_exits_130(tmp_path: Path) -> None:
    try:
        _ctrl_c_puts_back(tmp_path)
    finally:  # the server put back
        cli("-i", str(tmp_path / "inv.yaml"), "stop", "all", cwd=tmp_path)


def _ctrl_c_puts_back(tmp_path: Path) -> None:
    proc, stdout, err, port, out = _interrupted_bench(
        tmp_path, ctrl_c=1, before=("--algorithm", "DDTREE", "--budget", "4", "--topk", "2"))
    record = json.loads((tmp_path / "before-launch.json").read_text())
    assert proc.returncode == 130, err[-2000:]
    assert "--resume" in err and "Traceback" not in err
    # The host's progress line says it was interrupted (with its rows), not that it finished.
    last = [line for line in stdout.splitlines() if line.startswith("sim-x ")][-1]
    assert " interrupted — " in last and "finished" not in last, stdout[-1500:]
    read = ledger.read_ledger(out)
    assert read.bad_lines == [] and 1 <= len(read.rows) < 6  # whole rows only, sweep not finished
    # The server that ran before the sweep is back: a new process of the same launch (the
    # host's launch record: the sweep's AR launches never replaced it), answering on the port.
    now = json.loads((tmp_path / "run" / "launch.json").read_text())
    assert now["argv"] == record["argv"] and now["pid"] != record["pid"]
    assert "relaunched" in stdout  # the summary's put-back column (wrapped at 80 columns)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) == 0
    assert not (tmp_path / "run" / "sweep.lease").exists()  # the host is given back


def test_a_ctrl_c_while_the_sweeps_thread_starts_winds_the_sweep_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """A Ctrl-C that lands while bench's runner thread starts (start() waits for it to come
    up; on a loaded machine that wait is long enough to be hit) is taken as one in bench's
    watch loop: the sweep winds down, exit 130, no server of the sweep left running, instead
    of the interruption leaving bench while its thread goes on sweeping."""
    port = free_port()
    inv, sweep = write_inventory(tmp_path, port), write_sweep(tmp_path)
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        real_start(self)
        if self.name == "bench-runner":
            raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", start)
    done = request.getfixturevalue("cli")("-i", str(inv), "bench", "--sweep", str(sweep), "--out",
                                          str(tmp_path / "l.jsonl"))
    assert done.exit_code == 130, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Ctrl-C again to abort" in done.stdout + done.stderr and "Traceback" not in done.stderr
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing serves: no sweep server left behind


def test_resume_onto_another_sweeps_ledger_is_refused_before_launch(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, free_port())
    sweep = write_sweep(tmp_path)
    out = tmp_path / "l.jsonl"
    foreign = {"schema_version": 1, "sweep": "older", "sweep_hash": "f" * 64, "status": "ok"}
    out.write_text(json.dumps(foreign) + "\n")
    before = out.read_bytes()
    done = cli("-i", str(inv), "bench", "--sweep", str(sweep), "--out", str(out), "--resume", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    own = sweep_hash(load_sweep(sweep))
    assert str(out) in lines[0] and "'older' (ffffffffffff)" in lines[0] and f"'cli' ({own[:12]})" in lines[0]
    assert out.read_bytes() == before and not (tmp_path / "run").exists()  # no server was launched


def test_resume_with_the_other_client_mode_is_refused_before_launch(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, free_port())
    sweep = write_sweep(tmp_path)  # no client key: host, since sim-x binds loopback
    out = tmp_path / "l.jsonl"
    own = sweep_hash(load_sweep(sweep))
    measured = {"schema_version": 1, "sweep": "cli", "sweep_hash": own, "host": "sim-x", "client": "local",
                "status": "ok"}
    out.write_text(json.dumps(measured) + "\n")
    done = cli("-i", str(inv), "bench", "--sweep", str(sweep), "--out", str(out), "--resume", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert str(out) in line and "'sim-x' was measured with client 'local'" in line and "'host'" in line
    assert not (tmp_path / "run").exists()  # no server was launched


@pytest.mark.parametrize("where", ["afile", "/proc/nope", "/proc"])
def test_unwritable_out_is_refused_before_any_host(tmp_path: Path, where: str) -> None:
    inv = write_inventory(tmp_path, free_port())
    sweep = write_sweep(tmp_path)
    (tmp_path / "afile").write_text("")
    out = tmp_path / where / "l.jsonl"  # /proc: root passes os.access there, yet cannot create
    done = cli("-i", str(inv), "bench", "--sweep", str(sweep), "--out", str(out), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(out) in lines[0] and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()  # the host was never touched


@pytest.mark.slow
def test_resume_cuts_a_truncated_last_line_and_stamps_the_sweep_hash(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, free_port())
    sweep = write_sweep(tmp_path, grid={"algorithm": ["autoregressive"], "concurrency": [1, 2]})
    out = tmp_path / "l.jsonl"
    first = cli("-i", str(inv), "bench", "--sweep", str(sweep), "--out", str(out), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    lines = out.read_bytes().splitlines(keepends=True)
    assert len(lines) == 2
    out.write_bytes(lines[0] + lines[1][: len(lines[1]) // 2])  # the second row's write was cut by a crash

    # The dry run says what the ledger has and what is left, before any host is touched.
    plan = cli("--json", "-i", str(inv), "bench", "--sweep", str(sweep), "--out", str(out), "--resume",
               "--dry-run", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert json_data(plan.stdout)["resume"] == {"ledger": str(out), "hosts": {"sim-x": {"done": 1, "left": 1}}}
    text = cli("-i", str(inv), "bench", "--sweep", str(sweep), "--out", str(out), "--resume", "--dry-run",
               cwd=tmp_path).stdout
    # a long path may wrap anywhere at 80 columns: compare without whitespace
    assert "".join(f"--resume from {out}: sim-x: 1 of 2 row(s) done, 1 left".split()) in "".join(text.split())
    # A mistyped --out does not start the sweep over under a new name.
    typo = cli("-i", str(inv), "bench", "--sweep", str(sweep), "--out", str(tmp_path / "l2.jsonl"), "--resume",
               cwd=tmp_path)
    assert typo.returncode == 2 and "--resume: no such ledger to continue" in typo.stderr
    assert not (tmp_path / "l2.jsonl").exists()

    done = cli("--json", "-i", str(inv), "bench", "--sweep", str(sweep), "--out", str(out), "--resume",
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("removed a truncated last line") == 1 and f"{out}:2" in done.stderr
    data = json_data(done.stdout)
    assert "truncated" in data["ledger_healed"] and data["bad_ledger_lines"] == []
    assert [h["skipped"] for h in data["hosts"]] == [1] and [h["ok_rows"] for h in data["hosts"]] == [1]
    read = ledger.read_ledger(out)
    assert read.bad_lines == [] and sorted(r["concurrency"] for r in read.rows) == [1, 2]
    assert {r["sweep_hash"] for r in read.rows} == {sweep_hash(load_sweep(sweep))}


DRY_RUN_SETS = [(n, p, w, r) for n, p, w, r in LAYOUTS if n != "gsm8k" or p.endswith(".jsonl")]


@pytest.mark.parametrize(("name", "relpath", "write", "records"), DRY_RUN_SETS + [("humaneval", "", None, [])],
                         ids=[n for n, *_ in DRY_RUN_SETS] + ["humaneval-package"])
def test_dry_run_lists_the_prompts_of_a_data_set_in_its_published_layout(
    tmp_path: Path, name: str, relpath: str, write, records: list
) -> None:
    inv = write_inventory(tmp_path, free_port())
    workload: dict = {"dataset": name, "num_prompts": 3, "max_new_tokens": 16}
    if write is not None:
        workload["path"] = str(write(tmp_path / "data" / relpath, records))
    sweep = write_sweep(tmp_path, workload=workload)
    done = cli("--json", "-i", str(inv), "bench", "--sweep", str(sweep), "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    wl = json_data(done.stdout)["workload"]
    assert wl["name"] == name and len(wl["prompts"]) == 3
    assert {p["dataset"] for p in wl["prompts"]} == {name}
    fmt = "text" if name == "humaneval" else "chat"
    assert {p["format"] for p in wl["prompts"]} == {fmt}
    assert wl["prompt_format"] == ("text" if fmt == "text" else "chat-template")
    first = wl["prompts"][0]
    shown = first["text"] if fmt == "text" else first["messages"][-1]["content"]
    text = cli("-i", str(inv), "bench", "--sweep", str(sweep), "--dry-run", "--wide", cwd=tmp_path)
    assert text.returncode == 0 and f"workload {name}: 3 prompts" in " ".join(text.stdout.split())
    assert " ".join(shown.split())[:20] in text.stdout


def test_dry_run_names_a_bad_data_file_and_line_and_never_prints_escapes_raw(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, free_port())
    data = tmp_path / "test.jsonl"
    data.write_text('{"question": "fine"}\n{"question": "\\u001b[2Jcleared?"}\n')
    sweep = write_sweep(tmp_path, workload={"dataset": "gsm8k", "path": str(data), "num_prompts": 2})
    done = cli("-i", str(inv), "bench", "--sweep", str(sweep), "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "\x1b[2J" not in done.stdout and "\\x1b[2Jcleared?" in done.stdout
    data.write_text('{"question": "fine"}\n{"answer": "#### 4"}\n')
    done = cli("-i", str(inv), "bench", "--sweep", str(sweep), "--dry-run", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith(f"error: {data}:2: no 'question' text")
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_sweep_on_an_unreachable_host_exits_with_the_connection_code(tmp_path: Path) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"all": {"children": {"local": {"hosts": {"gone": {
        "ansible_host": "127.0.0.1", "ansible_port": free_port(), "ansible_user": "root",
        "ddtree": {"server": {"model_path": "sim/m"}}}}}}}}))
    done = cli("--json", "-i", str(inv), "bench", "--sweep", str(write_sweep(tmp_path)), "--out",
               str(tmp_path / "out.jsonl"), cwd=tmp_path)
    # Its rows are failed in the ledger, and the exit says why: no connection (3), as every other
    # command says it, not a failed measurement (6).
    assert done.returncode == 3, done.stdout + done.stderr
    errors = json.loads(done.stdout)["errors"]
    assert [e["code"] for e in errors] == ["fleet", "connect"] and errors[1]["host"] == "gone"
    assert {r["status"] for r in ledger.read_ledger(tmp_path / "out.jsonl").rows} == {"failed"}


def test_resume_after_an_edited_sweep_says_what_changed(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, free_port())
    out = tmp_path / "l.jsonl"
    first = write_sweep(tmp_path, grid={"algorithm": ["autoregressive"], "concurrency": [1]})
    assert cli("-i", str(inv), "bench", "--sweep", str(first), "--out", str(out), cwd=tmp_path).returncode == 0
    edited = write_sweep(tmp_path, grid={"algorithm": ["autoregressive"], "concurrency": [1, 4]})
    done = cli("-i", str(inv), "bench", "--sweep", str(edited), "--out", str(out), "--resume", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "changed: cells only in this sweep: algorithm=AR temperature=0.0 concurrency=4" in done.stderr


def test_a_second_ctrl_c_aborts_at_once_with_130_and_says_so(tmp_path: Path) -> None:
    # The server takes 2 s to stop (the simulator's shutdown drain, 4 s at time scale 0.5), and
    # the second Ctrl-C is sent once it has begun to: it lands in the first one's wind-down.
    # Sent a fixed time after the first instead, it can miss the wind-down on a loaded
    # machine, and the run exits "interrupted".
    proc, stdout, err, _, _ = _interrupted_bench(tmp_path, ctrl_c=2, SIM_SHUTDOWN_DRAIN_S="4")
    assert proc.returncode == 130, (stdout[-2000:], err[-2000:])
    assert "Traceback" not in err and "aborted" in err and "--resume" in err
