"""Every script in ``benchmarks/`` runs from a fresh clone as its docstring says (issue 56
item 5): each one's quickest mode, each in a subprocess of its own, several at a time, in
one test. A benchmark sets up what it needs (the simulator serves DDTREE only from a bundle
deployed into its host's SGLang, so the ones that launch DDTREE deploy it into a prefix of
their own; the naive deploy baseline makes the folders scp will not). The figures of a
quick mode mean nothing; what is asserted is that the script ran to its end (exit 0) and
printed the line that ends its report. No timing is asserted.

A new script in ``benchmarks/`` must be listed here, with its quickest mode or the reason
it is not run (the test fails otherwise)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


@dataclass(frozen=True)
class Quick:
    args: tuple[str, ...]
    # Printed at the end of a run that got through every step.
    expect: str
    # Rough wall seconds alone on a 2-core machine: the longest start first.
    seconds: float


QUICK: dict[str, Quick] = {
    "predict_plan.py": Quick(("--quick",), "goals: plan_at_most_0.25x", 60),
    "sweep_slots.py": Quick(("--quick",), "2 slot(s): predict phase", 45),
    "predict_accuracy.py": Quick(("--quick", "--part", "sim"), "sim: accept error median", 40),
    "lease_refusal.py": Quick(("--quick",), "first sweep still running after the refusals: True", 30),
    "sweep_launches.py": Quick(("--quick",), "no_failed_rows yes", 30),
    # Its verdict judges decode speed (0.9x before): a busy machine can reject a healthy
    # canary, so only the row is expected, not its verdict.
    "gate_faults.py": Quick(("--only", "none"), "| `none` | a healthy canary |", 26),
    "smoke_overhead.py": Quick(("--quick",), "DDTREE b16 k4, greedy + T0.7", 25),
    "sim_capacity.py": Quick(("--quick",), "DDTREE-16       1     8", 23),
    "deploy_latency.py": Quick(("--quick",), "naive scp+ssh per file, 1 host:", 14),
    "client_accuracy.py": Quick(("--quick",), "ours-host", 12),
    "observe_overhead.py": Quick(("--hosts", "2", "--repeat", "1"), "status + smoke", 11),
    "readiness_overhead.py": Quick(("--quick",), "readiness overhead over 1 restarts", 10),
    "doctor_parallel.py": Quick(("--quick",), "CLI doctor all --max-parallel 3:", 8),
    "tree_build.py": Quick(("--quick", "--repeats", "1"), "per verify round", 5),
    "verify_round.py": Quick(("--quick", "--repeats", "1"), "old/new =", 3),
    "report_scale.py": Quick(("--quick",), "report: ", 2),
}
NOT_RUN = {
    "gpu_check.py": "needs a GPU; tests/benchmarks/test_gpu_check.py runs its harness here (--cpu-twin --quick)",
    "host_layout.py": "not a script: the baseline layout verify_round.py and tree_build.py import",
    "ansible_scale.py": "its quickest mode (--quick: 1 and 2 network-namespace hosts, ansible-playbook beside "
                        "ddtree-ops) ran over 5 minutes here, past this test's whole budget",
}
# predict_accuracy.py's real_cpu part needs the real-SGLang venv (.cache/sglang-cpu, built by
# `make sglang-cpu`, minutes and ~7 GB): its quick mode is the sim part alone.
PARALLEL = 8
TIMEOUT_S = 420.0


def test_every_benchmark_is_listed() -> None:
    scripts = {p.name for p in BENCHMARKS.glob("*.py")}
    assert scripts == set(QUICK) | set(NOT_RUN), (
        f"not listed here: {sorted(scripts - set(QUICK) - set(NOT_RUN))}; "
        f"listed but gone: {sorted(set(QUICK) | set(NOT_RUN) - scripts)}")


def _env(tmp: Path, slot: int) -> dict[str, str]:
    """Each run's own state file and its own slice of test ports: tests/testports.py splits
    the ports below the ephemeral range by pytest-xdist worker, so each subprocess gets a
    sub-slice of this worker's (another worker's tests keep theirs)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker) % count if worker.isdigit() else 0
    width = len(QUICK)
    return dict(os.environ, DDTREE_OPS_STATE=str(tmp / "state.json"), PYTHONUNBUFFERED="1", COLUMNS="200",
                PYTEST_XDIST_WORKER=f"gw{index * width + slot}", PYTEST_XDIST_WORKER_COUNT=str(count * width))


def test_each_benchmark_runs_its_quick_mode(tmp_path: Path) -> None:
    order = sorted(QUICK, key=lambda name: -QUICK[name].seconds)
    pending = list(enumerate(order))
    running: dict[str, tuple[subprocess.Popen[bytes], float, Path]] = {}
    done: dict[str, tuple[int | None, float, str]] = {}
    try:
        while pending or running:
            while pending and len(running) < PARALLEL:
                slot, name = pending.pop(0)
                work = tmp_path / name.removesuffix(".py")
                work.mkdir()
                log = work / "output.txt"
                with open(log, "wb") as out:
                    proc = subprocess.Popen([sys.executable, str(BENCHMARKS / name), *QUICK[name].args], cwd=REPO,
                                            env=_env(work, slot), stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
                running[name] = (proc, time.monotonic(), log)
            time.sleep(0.2)
            for name, (proc, started, log) in list(running.items()):
                code = proc.poll()
                late = time.monotonic() - started > TIMEOUT_S
                if code is None and not late:
                    continue
                if code is None:  # never resolves: stop its whole session, say so
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                done[name] = (code, time.monotonic() - started, log.read_text(errors="replace"))
                del running[name]
    finally:
        for proc, _, _ in running.values():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print("\n".join(f"{name}: exit {code}, {seconds:.1f} s" for name, (code, seconds, _) in done.items()))
    failed = {name: (code, out) for name, (code, _, out) in done.items()
              if code != 0 or QUICK[name].expect not in out}
    assert not failed, "\n\n".join(
        f"benchmarks/{name} {' '.join(QUICK[name].args)}: "
        + (f"killed after {TIMEOUT_S:.0f} s" if code is None else f"exit {code}")
        + f" (expected a line with {QUICK[name].expect!r}); output tail:\n{out[-3000:]}"
        for name, (code, out) in failed.items())
