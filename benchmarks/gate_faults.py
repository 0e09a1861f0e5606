"""Every fault the simulator has, through a real canary rollout: the gate's verdict.

For each row a fresh local host (a small real SGLang 0.5.23 prefix, tests/minisglang.py)
first serves the target alone (AR) with a clean environment (the model knob
SIM_TARGET_TIE_AT kept: it is the model's, before and after), then the real CLI runs

    ddtree-ops --json deploy c1 --restart --budget B --topk 4 --canary c1

with the row's environment (and arguments) in the inventory: the patch goes in, the canary
relaunches with the fault, the gate judges it against the AR server that ran before.
The simulator runs in real time (SIM_TIME_SCALE=1, profile b300), so decode speed is
judged. Prints one Markdown row per fault (``--json``: the rows as JSON).

    .venv/bin/python benchmarks/gate_faults.py [--only NAME ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from minisglang import expose_toolkit, make_prefix  # noqa: E402


@dataclass(frozen=True)
class Fault:
    name: str
    env: dict[str, str]
    what: str
    budget: int = 4
    extra_args: tuple[str, ...] = ()
    # Kept in the AR server that runs before (the model's own properties).
    model_env: dict[str, str] = field(default_factory=dict)


FAULTS = [
    Fault("none", {}, "a healthy canary"),
    Fault("SIM_DDTREE_FAULT=accept_collapse", {"SIM_DDTREE_FAULT": "accept_collapse"},
          "every verify round keeps one token (acceptance 1.0), tokens right"),
    Fault("SIM_DDTREE_FAULT=wrong_greedy", {"SIM_DDTREE_FAULT": "wrong_greedy"},
          "the last token of every greedy round off by one"),
    Fault("SIM_DDTREE_FAULT=crash_sampled", {"SIM_DDTREE_FAULT": "crash_sampled"},
          "a decode holding a sampled request takes the server down"),
    Fault("SIM_DDTREE_FAULT=late_token", {"SIM_DDTREE_FAULT": "late_token"},
          "one confident token at output index >= 200 of each code prompt replaced by the runner-up"),
    Fault("SIM_DDTREE_FAULT=tie_flip + SIM_TARGET_TIE_AT=40",
          {"SIM_DDTREE_FAULT": "tie_flip", "SIM_TARGET_TIE_AT": "40"},
          "the target ties exactly at index 40 of code prompts; the plugin takes the other tied token",
          model_env={"SIM_TARGET_TIE_AT": "40"}),
    Fault("SIM_TARGET_TIE_AT=40", {"SIM_TARGET_TIE_AT": "40"},
          "the target ties exactly (both servers break it the same way)", model_env={"SIM_TARGET_TIE_AT": "40"}),
    Fault("SIM_DDTREE_FAULT=slow", {"SIM_DDTREE_FAULT": "slow"}, "every DDTREE decode step 4x the cost model"),
    Fault("SIM_DDTREE_FAULT=crash_load", {"SIM_DDTREE_FAULT": "crash_load"},
          "the plugin's worker raises while the server loads"),
    Fault("SIM_CRASH_SAMPLED=1", {"SIM_CRASH_SAMPLED": "1"},
          "any server dies at a decode holding a sampled request"),
    Fault("SIM_REPLAY_CRASH_BUDGET_OVER=2", {"SIM_REPLAY_CRASH_BUDGET_OVER": "2"},
          "a verify-graph replay faults at the first decode (budget 4 > 2)"),
    Fault("SIM_STALL_AT_S=0.1", {"SIM_STALL_AT_S": "0.1"}, "the canary's load hangs, silent"),
    Fault("CUDA_VISIBLE_DEVICES=0 + --tp-size 2", {"CUDA_VISIBLE_DEVICES": "0"},
          "TP 2 on one visible GPU: invalid device ordinal at start", extra_args=("--tp-size", "2")),
    Fault("b300 budget 16 (SIM_CAPTURE_FAULT=verify)", {"SIM_CAPTURE_FAULT": "verify"},
          "the verify graph's capture crashes (illegal memory access)", budget=16),
    Fault("b300 budget 16, SIM_CAPTURE_FAULT=candidate_head", {"SIM_CAPTURE_FAULT": "candidate_head"},
          "the capture crash lies in the draft graph's candidate head", budget=16),
    Fault("b300 budget 16, SIM_CAPTURE_STICKY=1", {"SIM_CAPTURE_STICKY": "1"},
          "a runtime state's capture crash poisons the context", budget=16),
    Fault("SIM_NO_RUNTIME_STATES=1", {"SIM_NO_RUNTIME_STATES": "1"},
          "a plugin without runtime states (a fixed launch needs none)"),
    Fault("SIM_SHUTDOWN_DRAIN_S=3", {"SIM_SHUTDOWN_DRAIN_S": "3"},
          "the old server answers /health 200 for 3 s after SIGTERM"),
]

BASE_ENV = {"SIM_GPU": "b300", "SIM_LOAD_S": "0.2", "SIM_WARMUP_S": "0.2", "SIM_TIME_SCALE": "1", "SIM_SEED": "0"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _inventory(path: Path, prefix: Path, run_dir: Path, port: int, env: dict[str, str],
               extra_args: tuple[str, ...]) -> Path:
    server = {"command": "{python} -m ddtree_ops.sim", "model_path": "sim/qwen3-8b",
              "draft_model_path": "sim/qwen3-8b-dflash", "port": port, "expected_load_s": 5,
              "extra_args": ["--cuda-graph-max-bs-decode", "8", *extra_args], "env": {**BASE_ENV, **env}}
    host = {"ansible_connection": "local",
            "ddtree": {"python": str(prefix / "bin" / "python"), "run_dir": str(run_dir), "gpu": "b300",
                       "server": server}}
    path.write_text(yaml.safe_dump({"all": {"hosts": {"c1": host}}}))
    return path


def _cli(inv: Path, state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DDTREE_OPS_STATE=str(state), COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "ddtree_ops", "-i", str(inv), *args], capture_output=True,
                          text=True, env=env, timeout=900)


def _fallbacks(state: Path) -> list[str]:
    """Why the restarts recorded an eager fallback (a capture or replay crash sends a launch
    eager), from the local state file."""
    try:
        records = json.loads(state.read_text()).get("fallbacks") or {}
    except (OSError, ValueError, AttributeError):
        return []
    return [str(r.get("reason")) for r in records.values() if isinstance(r, dict)]


def run(fault: Fault) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gate-fault-") as tmp:
        root = Path(tmp)
        prefix = make_prefix(root / "prefix")
        expose_toolkit(prefix)
        port, run_dir, state = _port(), root / "run", root / "state.json"
        clean = _inventory(root / "clean.yaml", prefix, run_dir, port, fault.model_env, ())
        faulty = _inventory(root / "faulty.yaml", prefix, run_dir, port, fault.env, fault.extra_args)
        try:
            before = _cli(clean, state, "restart", "c1", "--algorithm", "AR")
            if before.returncode != 0:
                return {"fault": fault.name, "error": f"the AR server before did not start: {before.stderr[-500:]}"}
            started = time.monotonic()
            done = _cli(faulty, state, "--json", "deploy", "c1", "--restart", "--budget", str(fault.budget),
                        "--topk", "4", "--canary", "c1")
            seconds = time.monotonic() - started
        finally:
            _cli(faulty, state, "stop", "c1")
        envelope = json.loads(done.stdout)
        rows = envelope["data"] if isinstance(envelope["data"], list) else []
        row = next((r for r in rows if r.get("host") == "c1"), {})
        gate = ((row.get("rollout") or {}).get("gates") or {}).get("c1")
        errors = [e for e in envelope["errors"] if e.get("host") == "c1"]
        return {"fault": fault.name, "what": fault.what, "exit": done.returncode, "seconds": round(seconds, 1),
                "fallbacks": _fallbacks(state),
                "code": errors[0]["code"] if errors else None, "error": errors[0]["message"] if errors else None,
                "gate": gate}


def verdict(row: dict[str, Any]) -> str:
    gate = row.get("gate")
    if gate is None:
        cause = (row.get("error") or "").split("; rolled back")[0]
        return f"rejected before its gate: {cause[:220]}" if row.get("error") else "no gate ran"
    eager = " (relaunched eager after: " + "; ".join(row["fallbacks"])[:120] + ")" if row.get("fallbacks") else ""
    if gate["passed"]:
        speed = gate.get("speed") or {}
        ties = [d for d in gate.get("divergences", []) if d["tie"]]
        tie = f", {len(ties)} near-tie divergence(s) forgiven" if ties else ""
        return f"passed (speed {speed.get('ratio', 0):.2f}x{tie}){eager}"
    return "rejected: " + "; ".join(gate["reasons"])[:260] + eager


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="run only the faults whose name contains one of these")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    faults = [f for f in FAULTS if not args.only or any(o in f.name for o in args.only)]
    rows = []
    for fault in faults:
        row = run(fault)
        rows.append(row)
        print(f"{fault.name}: exit {row.get('exit')} ({row.get('seconds')} s)", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("| fault | what it does | exit | the gate's verdict |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        code = f" `{row['code']}`" if row.get("code") else ""
        print(f"| `{row['fault']}` | {row.get('what', '')} | {row.get('exit')}{code} | {verdict(row)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
