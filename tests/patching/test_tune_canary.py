"""``tune --deploy --canary`` under the process manager: the gate around a tuned policy,
and a rollback that takes the policy with the bundle.

Where no server runs on the canary, the gate first launches the target alone (AR) for
its baseline answers; a policy whose server misbehaves (the simulator's
``SIM_DDTREE_FAULT=accept_collapse``) fails the gate, and the canary is put back: the
policy file removed, the local record as it was, the server as it was before (none). A
good policy passes and is remembered.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from cli_json import json_data, read_envelope
from report.report_rows import make_row
from service.simhosts import run_cli

from ddtree_ops.bench.ledger import append_row
from ddtree_ops.inventory import load_inventory
from ddtree_ops.service.manager import ProcessManager
from ddtree_ops.state import StateStore
from ddtree_ops.transport.local import LocalTransport
from patching.conftest import MiniHost, sim_inventory

B300 = "NVIDIA B300 SXM6 AC (simulated)"


def _ledger(path: Path) -> Path:
    for (budget, topk, concurrency), tok_s in {(8, 4, 1): 400.0, (4, 2, 1): 300.0}.items():
        append_row(path, make_row(host="b1", gpu_name=B300, budget=budget, topk=topk, concurrency=concurrency,
                                  output_tok_s=tok_s, accept_length=2.0))
    return path


def _with_env(inv: Path, **env: str) -> Path:
    doc = yaml.safe_load(inv.read_text())
    doc["all"]["children"]["b"]["hosts"]["b1"]["ddtree"]["server"]["env"].update(env)
    inv.write_text(yaml.safe_dump(doc))
    return inv


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["accept_collapse", None])
def test_a_canary_gates_a_tuned_policy_and_a_failed_one_is_put_back(
    tmp_path: Path, mini: MiniHost, fault: str | None
) -> None:
    inv = sim_inventory(tmp_path, mini)
    if fault is not None:
        _with_env(inv, SIM_DDTREE_FAULT=fault)
    state = tmp_path / "state.json"
    host = load_inventory([inv]).hosts["b1"]
    svc = ProcessManager(LocalTransport("b1"), host)
    ledger = _ledger(tmp_path / "l.jsonl")
    policy_file = mini.state_dir / "placed" / "ddtree-policy.json"
    try:
        assert run_cli(inv, "deploy", "b1", state=state).returncode == 0
        assert not svc.status(lines=0)["alive"]  # nothing serves: the gate must launch the target first
        done = run_cli(inv, "--json", "tune", str(ledger), "--deploy", "b1", "--canary", "b1",
                       "--gate-ledger", str(ledger), state=state)
        env = read_envelope(done.stdout)
        rollout = env["data"]["deploy"]["rollout"]
        assert rollout["baseline"] == {"b1": "no server answered on b1: launched the target alone (AR) for the "
                                             "baseline"}
        gate = rollout["gates"]["b1"]
        # The floor comes from the ledger: 0.75 x the median acceptance of b=8 k=4 (2.0).
        assert gate["floors"]["0"] == {"value": 1.5, "source": "0.75 x the ledger's median 2.00 of 1 row(s)"}
        if fault is None:
            assert done.returncode == 0, done.stdout + done.stderr
            assert gate["passed"] and gate["agreement"] == 1.0
            assert policy_file.exists() and StateStore(state).policy_for("b1") is not None
            assert svc.status(lines=0)["alive"]
            # A rollback takes the policy with the bundle: its file and the local record.
            back = run_cli(inv, "--json", "rollback", "b1", state=state)
            assert back.returncode == 0, back.stdout + back.stderr
            assert f"removed {policy_file} (placed beside the bundle)" in json_data(back.stdout)[0]["message"]
            assert not policy_file.exists() and StateStore(state).policy_for("b1") is None
            return
        assert done.returncode == 4, done.stdout + done.stderr
        error = next(e for e in env["errors"] if e["host"] == "b1")
        assert error["code"] == "canary_rejected" and "at T=0 is below the floor 1.50" in error["message"]
        assert "policy file removed" in error["message"] and "stopped (no server ran before)" in error["message"]
        assert not gate["passed"] and rollout["rolled_back"] == ["b1"]
        # Put back: no policy file, no record, and no server (none ran before the change).
        assert not policy_file.exists() and StateStore(state).policy_for("b1") is None
        assert not svc.status(lines=0)["alive"]
        assert json_data(done.stdout)["deploy"]["hosts"][0]["ok"] is False
    finally:
        svc.stop(grace_s=5)
