"""Issue 42: eager fallbacks per runtime budget, end to end through the real CLI.

The host is the simulator on its B300 profile (verify capture crashes above budget 8)
behind a ``nvidia-smi`` stand-in reporting ``sm_103``. A fallback recorded at budget 9
used to send a tuned policy of budgets [8, 16] (launched at 16, its smallest batch's tree)
eager as a whole, draft graphs and budget 8 included. Now the policy file lists 16 in the
bundle's ``ddtree.eager_budgets``, the server launches at 8 with decode graphs on, and
only 16 serves eager; a record at another top-k is applied too, and said so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cli_json import json_data
from fleetlib import write_nvidia_smi
from report.report_rows import make_row
from service.simhosts import run_cli

from ddtree_ops.bench.ledger import append_row
from ddtree_ops.inventory import load_inventory
from ddtree_ops.inventory_types import Host
from ddtree_ops.service.manager import ProcessManager
from ddtree_ops.state import StateStore
from ddtree_ops.transport import Script
from ddtree_ops.transport.local import LocalTransport
from patching.conftest import MiniHost, sim_inventory

B300 = "NVIDIA B300 SXM6 AC (simulated)"
_HTTP_GET = (
    "import json, sys, urllib.request\n"
    "with urllib.request.urlopen(sys.argv[1], timeout=10) as r:\n"
    "    sys.stdout.write(r.read().decode())\n"
)


def _live(host: Host) -> dict[str, Any]:
    url = f"http://127.0.0.1:{host.ddtree.server.port}/server_info"
    out = LocalTransport("b1").run(Script(argv=(host.python, "-", url), source=_HTTP_GET), timeout=30, check=True)
    return dict(json.loads(out.stdout)["internal_states"][0]["ddtree"])


def _argv(host: Host) -> list[str]:
    return list(ProcessManager(LocalTransport("b1"), host).status(lines=0)["record"]["argv"])


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _ledger(tmp_path: Path) -> Path:
    """Graph rows of b1 whose policy is budgets [8, 16]: batch 1 best at 16 (the launch
    state), batch 8 at 8."""
    ledger = tmp_path / "l.jsonl"
    for (budget, topk, concurrency), tok_s in {(16, 4, 1): 500.0, (8, 4, 1): 400.0, (8, 4, 8): 900.0,
                                               (16, 4, 8): 800.0}.items():
        append_row(ledger, make_row(host="b1", gpu_name=B300, budget=budget, topk=topk, concurrency=concurrency,
                                    output_tok_s=tok_s))
    return ledger


def _b300_host(tmp_path: Path, mini: MiniHost) -> tuple[Path, Path, Path, Host, Path]:
    """(inventory, state file, bin dir with a B300 nvidia-smi, host b1, ledger) of one test."""
    inv = sim_inventory(tmp_path, mini)
    bin_dir = tmp_path / "bin"
    write_nvidia_smi(bin_dir, "b300")
    return inv, tmp_path / "state.json", bin_dir, load_inventory([inv]).hosts["b1"], _ledger(tmp_path)


def _restart_row(stdout: str) -> dict[str, Any]:
    (row,) = json_data(stdout)["hosts"]
    return dict(row["result"])


def test_a_b300_record_at_9_sends_only_budget_16_of_a_policy_eager(tmp_path: Path, mini: MiniHost) -> None:
    inv, state, bin_dir, host, ledger = _b300_host(tmp_path, mini)
    try:
        assert run_cli(inv, "deploy", "b1", state=state).returncode == 0
        # The record at budget 9, learned the real way: the capture crashed, eager served.
        first = run_cli(inv, "--json", "restart", "b1", "--algorithm", "DDTREE", "--budget", "9", "--topk", "4",
                        state=state, path_first=bin_dir)
        assert first.returncode == 0, first.stdout + first.stderr
        assert [(r.key.gpu_arch, r.key.budget, r.key.topk) for r in StateStore(state).fallbacks()] == [
            ("sm_103", 9, 4)]

        tuned = run_cli(inv, "--json", "tune", str(ledger), "--deploy", "b1", state=state, path_first=bin_dir)
        assert tuned.returncode == 0, tuned.stdout + tuned.stderr
        placed = json.loads((mini.state_dir / "placed" / "ddtree-policy.json").read_text())["ddtree"]
        assert placed["budgets"] == [8, 16] and placed["eager_budgets"] == [16], placed
        argv = _argv(host)
        # decode graphs on, launched at 8 (the bundle refuses the launch budget in eager_budgets)
        assert "--cuda-graph-backend-decode" not in argv and "--disable-cuda-graph" not in argv, argv
        assert _flag(argv, "--speculative-num-draft-tokens") == "9"
        live = _live(host)
        assert live["mode"] == "policy", live
        graphs = {s["budget"]: (s["cuda_graph"], s["reason"]) for s in live["states"]}
        assert graphs == {8: ("captured", None), 16: ("eager", "listed in ddtree.eager_budgets")}, graphs
        (server,) = json_data(tuned.stdout)["deploy"]["hosts"][0]["result"]["servers"]
        assert server["cuda_graph"] is True and server["attempts"] == 1, server
        assert "eager_budgets [16]" in server["fallback_reason"], server
        remembered = StateStore(state).policy_for("b1")
        assert remembered is not None and remembered.budget == 8

        # A plain restart keeps the policy, its eager budget and its graphs.
        plain = run_cli(inv, "--json", "restart", "b1", "--algorithm", "DDTREE", state=state, path_first=bin_dir)
        assert plain.returncode == 0, plain.stdout + plain.stderr
        row = _restart_row(plain.stdout)
        assert row["cuda_graph"] is True and row["attempts"] == 1 and "eager_budgets [16]" in row["fallback_reason"]

        # Another top-k: the record at top-k 4 is taken as likely, eager at once, said so.
        other = run_cli(inv, "--json", "restart", "b1", "--algorithm", "DDTREE", "--budget", "12", "--topk", "2",
                        "--no-policy", state=state, path_first=bin_dir)
        assert other.returncode == 0, other.stdout + other.stderr
        row = _restart_row(other.stdout)
        assert row["cuda_graph"] is False and row["attempts"] == 1, row
        assert "recorded fallback at top-k 4, taken as likely at top-k 2" in row["fallback_reason"], row
        # the record keeps its own top-k: nothing new was recorded at top-k 2
        assert sorted((r.key.budget, r.key.topk) for r in StateStore(state).fallbacks()) == [(9, 4)]
    finally:
        ProcessManager(LocalTransport("b1"), host).stop(grace_s=5)


def test_a_restart_with_a_policy_lists_the_budgets_recorded_since_tune(tmp_path: Path, mini: MiniHost) -> None:
    inv, state, bin_dir, host, ledger = _b300_host(tmp_path, mini)
    policy_file = mini.state_dir / "placed" / "ddtree-policy.json"
    try:
        assert run_cli(inv, "deploy", "b1", state=state).returncode == 0
        # Nothing recorded yet: tune launches at 16, its capture crashes, the server goes eager
        # as a whole once, and the crash is recorded at 16.
        tuned = run_cli(inv, "--json", "tune", str(ledger), "--deploy", "b1", state=state, path_first=bin_dir)
        assert tuned.returncode == 0, tuned.stdout + tuned.stderr
        assert "eager_budgets" not in json.loads(policy_file.read_text())["ddtree"]
        assert [(r.key.budget, r.key.topk) for r in StateStore(state).fallbacks()] == [(16, 4)]

        # The next restart with the policy rewrites its file: 16 eager, launched at 8 with graphs.
        plain = run_cli(inv, "--json", "restart", "b1", "--algorithm", "DDTREE", state=state, path_first=bin_dir)
        assert plain.returncode == 0, plain.stdout + plain.stderr
        row = _restart_row(plain.stdout)
        assert row["cuda_graph"] is True and row["attempts"] == 1 and "eager_budgets [16]" in row["fallback_reason"]
        placed = json.loads(policy_file.read_text())["ddtree"]
        assert placed["eager_budgets"] == [16] and placed["budgets"] == [8, 16]
        assert _flag(_argv(host), "--speculative-num-draft-tokens") == "9"
        assert {s["budget"]: s["cuda_graph"] for s in _live(host)["states"]} == {8: "captured", 16: "eager"}
        remembered = StateStore(state).policy_for("b1")
        assert remembered is not None and remembered.budget == 8 and json.loads(remembered.config) == {
            "ddtree": placed}
        # and the one after that finds the file it expects (no drift), unchanged
        again = run_cli(inv, "--json", "restart", "b1", "--algorithm", "DDTREE", state=state, path_first=bin_dir)
        assert again.returncode == 0, again.stdout + again.stderr
        assert json.loads(policy_file.read_text())["ddtree"] == placed
    finally:
        ProcessManager(LocalTransport("b1"), host).stop(grace_s=5)
