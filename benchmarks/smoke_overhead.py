"""What the speculative smoke adds to a restart, on the simulator at real speed.

Restarts a local simulated H200 (``SIM_TIME_SCALE=1``) through ``lifecycle.restart``
``--restarts`` times per configuration and prints the smoke's seconds (median, all
values) beside the load time (launch -> the server answers) and the ready time (launch
-> smoke passed). Configurations: AR greedy, DDTREE budget 16 / top-k 4 greedy, and the
same with a sampled setting (T=0.7) added, which doubles the requests. The host's SGLang is
a small real 0.5.23 prefix with the DDTree bundle deployed into it by the toolkit's deploy
(``tests/minisglang.py``), made at the start: the simulator serves DDTREE only from it.

    .venv/bin/python benchmarks/smoke_overhead.py --restarts 3 [--json]
    .venv/bin/python benchmarks/smoke_overhead.py --quick      # one restart, the DDTREE greedy + T0.7 case
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from ddtree_ops.inventory_types import DdtreeSettings, Host, ServerSettings
from ddtree_ops.service import LaunchFacts, RestartRequest, RunConfig, lifecycle
from ddtree_ops.service.smoke import SmokeSampling, SmokeSpec
from ddtree_ops.state import StateStore
from ddtree_ops.transport.local import LocalTransport

# The simulator serves DDTREE only from the bundle deployed into its host's SGLang (as SGLang
# loads a plugin): the host runs an interpreter the toolkit deployed it into, as the tests' do.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from minisglang import deployed_python  # noqa: E402
from testports import free_port  # noqa: E402


def _host(run_dir: Path, *, quick: bool) -> Host:
    # Below the ephemeral range: the server is relaunched on it (tests/testports.py).
    port = free_port()
    server = ServerSettings(
        model_path="sim/qwen3-8b", draft_model_path="sim/qwen3-8b-dflash", port=port, expected_load_s=10,
        env={"SIM_GPU": "h200", "SIM_LOAD_S": "0.2" if quick else "1", "SIM_TIME_SCALE": "1"},
        command="{python} -m ddtree_ops.sim",
        # --quick: graphs up to batch 4 (a capture 2.04 s, not 2 + 0.01 x the default max
        # batch): the load is not what this measures.
        extra_args=("--cuda-graph-max-bs-decode", "4") if quick else (),
    )
    ddtree = DdtreeSettings(python=deployed_python(), run_dir=str(run_dir), gpu="h200", server=server)
    return Host(name="sim", connection="local", ddtree=ddtree, source="<benchmark>")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    ap.add_argument("--quick", action="store_true",
                    help="the last configuration only (its smoke holds the others'), one restart, a shorter load")
    args = ap.parse_args()
    if args.quick:
        args.restarts = 1
    cases = [
        ("AR, greedy", RunConfig("AR"), SmokeSpec()),
        ("DDTREE b16 k4, greedy", RunConfig("DDTREE", budget=16, topk=4), SmokeSpec()),
        ("DDTREE b16 k4, greedy + T0.7", RunConfig("DDTREE", budget=16, topk=4),
         SmokeSpec.for_samplings([SmokeSampling(0.7)])),
    ]
    if args.quick:
        cases = cases[-1:]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        host = _host(Path(tmp) / "run", quick=args.quick)
        state = StateStore(Path(tmp) / "state.json")
        with LocalTransport("sim") as t:
            try:
                for label, run, smoke in cases:
                    results = [
                        lifecycle.restart(t, RestartRequest(host, run, LaunchFacts("0.5.23"), smoke=smoke), state=state)
                        for _ in range(args.restarts)
                    ]
                    secs = [r.smoke.seconds for r in results if r.smoke is not None]
                    rows.append({
                        "case": label,
                        "requests": results[-1].smoke.requests if results[-1].smoke else 0,
                        "smoke_s_median": round(statistics.median(secs), 3),
                        "smoke_s": [round(s, 3) for s in secs],
                        "load_s_median": round(statistics.median(r.load_s for r in results), 2),
                        "ready_s_median": round(statistics.median(r.ready_s for r in results), 2),
                    })
            finally:
                lifecycle.stop(t, host, grace_s=5.0)
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        print(f"{r['case']:<30} {r['requests']:>2} requests: smoke {r['smoke_s_median']:.2f} s median "
              f"({', '.join(f'{s:.2f}' for s in r['smoke_s'])}); load {r['load_s_median']:.1f} s, "
              f"ready {r['ready_s_median']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
