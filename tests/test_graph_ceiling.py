"""The CUDA-graph ceiling per launch, on a simulated B300 with the bundle deployed (issue 42).

A launch with ``--cuda-graph-max-bs-decode 2`` captures verify graphs up to batch 2 only;
a round of more requests runs eager, silently on a real server. Here: ``/server_info``
names the ceiling per budget (none for budget 16, which the B300 serves eager), ``doctor``
shows it for the running server, ``selftest --e2e`` for each launch it makes, and the report
marks the cell measured at concurrency 4, above it -- not the eager cells, nor the one at 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml
from cli_json import json_data
from fleetlib import free_port
from minisglang import deployed_python

from ddtree_ops.graphceiling import BudgetCeiling, graph_ceilings

FAST_SIM = {"SIM_GPU": "b300", "SIM_LOAD_S": "0.5", "SIM_TIME_SCALE": "0.2", "SIM_WARMUP_S": "0.3"}
CEILING = 2


def _files(tmp_path: Path, port: int) -> tuple[Path, Path]:
    inv = {"all": {"hosts": {"b300": {"ansible_connection": "local", "ddtree": {
        "python": deployed_python(), "run_dir": str(tmp_path / "run"), "gpu": "b300",
        "server": {"command": "{python} -m ddtree_ops.sim", "model_path": "sim/qwen3-8b",
                   "draft_model_path": "sim/qwen3-8b-dflash", "port": port, "expected_load_s": 2, "env": FAST_SIM,
                   "extra_args": ["--cuda-graph-max-bs-decode", str(CEILING)]},
    }}}}}
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump(inv))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"def f{i}(x): return x + {i}"}) + "\n"
                                              for i in range(4)))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({
        "name": "ceiling", "targets": ["all"], "baselines": [], "warmup": 0, "request_timeout_s": 60,
        "grid": {"algorithm": ["ddtree"], "budget": [4, 16], "topk": [2], "temperature": [0.0],
                 "concurrency": [1, 4]},
        "workload": {"prompt_files": ["p.jsonl"], "num_prompts": 4, "max_new_tokens": 16},
    }))
    return inventory, sweep


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_graph_ceiling_is_named_per_launch_and_cells_above_it_are_marked(cli, tmp_path: Path) -> None:
    port = free_port()
    inv, sweep = _files(tmp_path, port)
    ledger = tmp_path / "ledger.jsonl"
    try:
        res = cli("-i", str(inv), "bench", "--sweep", str(sweep), "--out", str(ledger), "--keep-server")
        assert res.exit_code == 0, (res.stdout[-3000:], res.stderr[-2000:])

        # The kept server (the live launch holding both budgets) says it per budget.
        info = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=10).json()
        states = info["internal_states"][0]["ddtree"]["states"]
        assert [(s["budget"], s["cuda_graph"], s["cuda_graph_max_bs"]) for s in states] == [
            (4, "captured", CEILING), (16, "eager", None)]

        # doctor reads it from the running server, in the table and in --json.
        res = cli("-i", str(inv), "doctor", "b300")
        assert res.exit_code == 0, res.stderr
        text = " ".join(res.stdout.replace("│", " ").split())  # the cell's wrapped lines, joined
        assert (f"port {port}: budget 4: graphs up to batch {CEILING}; budget 16: no graph (eager); concurrency "
                "above a budget's ceiling runs eager") in text, res.stdout
        res = cli("-i", str(inv), "--json", "doctor", "b300")
        [server] = json_data(res.stdout)["hosts"][0]["result"]["servers"]
        assert server["port"] == port and server["algorithm"] == "DDTREE"
        assert server["ceilings"]["budgets"] == [{"budget": 4, "cuda_graph": "captured", "max_bs": CEILING},
                                                 {"budget": 16, "cuda_graph": "eager", "max_bs": None}]
        assert "concurrency above a budget's ceiling runs eager" in server["summary"]
    finally:
        cli("-i", str(inv), "stop", "b300")

    rows = {(r["budget"], r["concurrency"]): r for r in map(json.loads, ledger.read_text().splitlines())}
    assert {k: (r["cuda_graph"], r["cuda_graph_max_bs"]) for k, r in rows.items()} == {
        (4, 1): (True, CEILING), (4, 4): (True, CEILING), (16, 1): (False, None), (16, 4): (False, None)}

    # The report marks the one graph cell measured above its ceiling, with a caption line.
    res = cli("--json", "report", str(ledger))
    assert res.exit_code == 0, res.stderr
    cells = {(c["budget"], c["concurrency"]): c for c in json_data(res.stdout)["cells"]}
    assert {k: c["above_graph_ceiling"] for k, c in cells.items()} == {
        (4, 1): False, (4, 4): True, (16, 1): False, (16, 4): False}
    assert cells[(4, 4)]["cuda_graph_max_bs"] == CEILING and cells[(16, 4)]["cuda_graph_max_bs"] is None
    res = cli("report", str(ledger), "--wide")
    assert res.exit_code == 0, res.stderr
    assert "4‡" in res.stdout and f"to {CEILING}" in res.stdout and res.stdout.count("‡") == 2, res.stdout
    assert "‡ concurrency above the graph ceiling of the cell's tree" in " ".join(res.stdout.split())

    # selftest --e2e names the ceiling of each launch it makes; a launch without graphs has none.
    res = cli("-i", str(inv), "--json", "selftest", "b300", "--e2e", "--budgets", "4", "--graphs", "on,off")
    assert res.exit_code == 0, (res.stdout[-3000:], res.stderr[-2000:])
    [report] = json_data(res.stdout)
    assert [(r["budget"], r["graphs"], r["verify_cuda_graph_max_bs"]) for r in report["runs"]] == [
        (4, "on", CEILING), (4, "off", None)]


def test_the_ceilings_are_read_per_state_else_from_the_launch_state_and_never_guessed() -> None:
    states = [{"budget": 16, "cuda_graph": "eager", "cuda_graph_max_bs": None},
              {"budget": 4, "cuda_graph": "captured", "cuda_graph_max_bs": 48}]
    got = graph_ceilings({"internal_states": [{"ddtree": {"states": states}}], "ddtree": {"budget": 4}})
    assert got is not None and [(b.budget, b.max_bs) for b in got.budgets] == [(4, 48), (16, None)]
    four, sixteen = got.of(4), got.of(16)
    assert four is not None and sixteen is not None
    assert (four.above(48), four.above(49), sixteen.above(64)) == (False, True, False)
    # A launch without runtime states: the top-level ddtree object (the active state).
    top = graph_ceilings({"ddtree": {"budget": 8, "verify_cuda_graph_captured": False, "decode_cuda_graph": "disabled",
                                     "verify_cuda_graph_max_bs": None}})
    assert top is not None and top.budgets == (BudgetCeiling(8, "disabled", None),)
    assert top.describe() == "budget 8: no graph (disabled)"  # nothing runs a graph: nothing to say above it
    # A bundle that predates the field, an AR server, no answer: no ceiling, not "no graph".
    old = {"internal_states": [{"ddtree": {"states": [{"budget": 4, "cuda_graph": "captured"}]}}],
           "ddtree": {"budget": 4, "verify_cuda_graph_captured": True}}
    assert [graph_ceilings(i) for i in (old, {"speculative_algorithm": None}, None)] == [None, None, None]
