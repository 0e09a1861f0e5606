"""``tune --deploy`` end to end: the real CLI, a host prefix with SGLang's files and an
applied bundle, the simulator serving the runtime-state contract (B300 profile), on the
local transport; and every failure leaving the host as it was.

The ledger is hand-built (the policy choice has its own tests in tests/report); what is
tested here is what reaches the host: the file beside the bundle, the server restarted
with ``--speculative-adaptive-config`` and following the policy, the policy remembered by
later restarts, and the rollback.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from cli_json import json_data, read_envelope
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
# GET a URL from the host (stdlib only), as the service agent does.
_HTTP_GET = (
    "import json, sys, urllib.request\n"
    "with urllib.request.urlopen(sys.argv[1], timeout=10) as r:\n"
    "    sys.stdout.write(r.read().decode())\n"
)


def _ledger(path: Path, trees: dict[tuple[int, int, int], float]) -> Path:
    """Graph-mode DDTREE cells of host b1 ((budget, topk, concurrency) -> tok/s)."""
    for (budget, topk, concurrency), tok_s in trees.items():
        append_row(path, make_row(host="b1", gpu_name=B300, budget=budget, topk=topk, concurrency=concurrency,
                                  output_tok_s=tok_s))
    return path


def _live(host: Host) -> dict[str, Any]:
    """``/server_info.internal_states[0].ddtree`` of the host's server, asked from the host."""
    url = f"http://127.0.0.1:{host.ddtree.server.port}/server_info"
    out = LocalTransport("b1").run(Script(argv=(host.python, "-", url), source=_HTTP_GET), timeout=30, check=True)
    return dict(json.loads(out.stdout)["internal_states"][0]["ddtree"])


def _record(host: Host) -> dict[str, Any]:
    return dict(ProcessManager(LocalTransport("b1"), host).status(lines=0)["record"])


def _policy_file(mini: MiniHost) -> Path:
    return mini.state_dir / "placed" / "ddtree-policy.json"


@pytest.mark.slow
def test_tune_deploys_the_policy_and_later_restarts_keep_it(tmp_path: Path, mini: MiniHost) -> None:
    inv = sim_inventory(tmp_path, mini)
    state = tmp_path / "state.json"
    host = load_inventory([inv]).hosts["b1"]
    ledger = _ledger(tmp_path / "l.jsonl", {(8, 4, 1): 400.0, (4, 2, 1): 300.0, (4, 2, 8): 900.0, (8, 4, 8): 800.0})
    policy = {"1": {"budget": 8, "topk": 4}, "8": {"budget": 4, "topk": 2}}
    try:
        deployed = run_cli(inv, "deploy", "b1", state=state)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr

        tuned = run_cli(inv, "--json", "tune", str(ledger), "--deploy", "b1", state=state)
        assert tuned.returncode == 0, tuned.stdout + tuned.stderr
        (row,) = json_data(tuned.stdout)["deploy"]["hosts"]
        assert row["ok"] and row["result"]["learned_from"] == "ledger", row
        # the file beside the bundle, exactly the policy, and the server following it
        assert json.loads(_policy_file(mini).read_text()) == {"ddtree": {"budgets": [4, 8], "topk_max": 4,
                                                                        "policy": policy}}
        live = _live(host)
        assert live["mode"] == "policy" and live["policy"] == policy, live
        argv = _record(host)["argv"]
        assert argv[argv.index("--speculative-adaptive-config") + 1] == str(_policy_file(mini))
        assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "9"  # launch state b=8 (batch 1)
        remembered = StateStore(state).policy_for("b1")
        assert remembered is not None and remembered.policy == policy and remembered.machine_type == B300

        # A plain restart keeps the policy, its launch state the policy's.
        plain = run_cli(inv, "restart", "b1", "--algorithm", "DDTREE", state=state)
        assert plain.returncode == 0, plain.stdout + plain.stderr
        assert _live(host)["mode"] == "policy" and "--speculative-adaptive-config" in _record(host)["argv"]

        # A launch state outside the policy is refused before the server is touched.
        pid = _record(host)["pid"]
        outside = run_cli(inv, "restart", "b1", "--algorithm", "DDTREE", "--budget", "16", "--topk", "4",
                          state=state)
        assert outside.returncode == 2, outside.stdout + outside.stderr
        assert "has no state budget=16 topk=4 (budgets [4, 8], top-k up to 4)" in " ".join(outside.stdout.split())
        assert _record(host)["pid"] == pid and ProcessManager(LocalTransport("b1"), host).status(lines=0)["alive"]

        # --no-policy launches without it and forgets it.
        dropped = run_cli(inv, "restart", "b1", "--algorithm", "DDTREE", "--budget", "16", "--topk", "4",
                          "--no-policy", state=state)
        assert dropped.returncode == 0, dropped.stdout + dropped.stderr
        assert _live(host)["mode"] == "fixed" and "--speculative-adaptive-config" not in _record(host)["argv"]
        assert StateStore(state).policy_for("b1") is None
    finally:
        ProcessManager(LocalTransport("b1"), host).stop(grace_s=5)


@pytest.mark.slow
def test_a_failed_tune_deploy_leaves_the_host_as_it_was(tmp_path: Path, mini: MiniHost) -> None:
    # A load of 1.5 s (15 simulated seconds at the inventory's time scale 0.1), slept by the
    # simulator: no launch is ready within the 1 s deadline, however fast the machine, while
    # the launches that must succeed have the load-aware deadline (60 s).
    inv = sim_inventory(tmp_path, mini, load_s=15.0)
    state = tmp_path / "state.json"
    host = load_inventory([inv]).hosts["b1"]
    first = _ledger(tmp_path / "first.jsonl", {(8, 4, 1): 400.0, (4, 2, 1): 300.0})
    second = _ledger(tmp_path / "second.jsonl", {(8, 4, 1): 300.0, (4, 2, 1): 400.0})
    try:
        assert run_cli(inv, "deploy", "b1", state=state).returncode == 0
        tuned = run_cli(inv, "tune", str(first), "--deploy", "b1", state=state)
        assert tuned.returncode == 0, tuned.stdout + tuned.stderr
        before_file, before_argv = _policy_file(mini).read_bytes(), _record(host)["argv"]
        before_record = StateStore(state).policy_for("b1")

        failed = run_cli(inv, "--json", "tune", str(second), "--deploy", "b1", "--timeout", "1", state=state)
        env = read_envelope(failed.stdout)
        assert failed.returncode == 5 and env["errors"][1]["code"] == "readiness_timeout", failed.stdout
        message = env["errors"][1]["message"]
        assert "rolled back: policy file restored, b1 relaunched the previous server (DDTREE budget=8 topk=4" in message
        # as it was: the file, the server's argv (relaunched, serving the first policy), the record
        assert _policy_file(mini).read_bytes() == before_file
        assert _record(host)["argv"] == before_argv
        assert _live(host)["policy"] == {"1": {"budget": 8, "topk": 4}}
        assert StateStore(state).policy_for("b1") == before_record
    finally:
        ProcessManager(LocalTransport("b1"), host).stop(grace_s=5)


def test_without_an_applied_bundle_nothing_is_touched(tmp_path: Path, mini: MiniHost) -> None:
    inv = sim_inventory(tmp_path, mini)
    state = tmp_path / "state.json"
    ledger = _ledger(tmp_path / "l.jsonl", {(8, 4, 1): 400.0})
    refused = run_cli(inv, "tune", str(ledger), "--deploy", "b1", state=state)
    assert refused.returncode == 4, refused.stdout + refused.stderr
    assert "no bundle is applied" in refused.stdout + refused.stderr
    assert not (mini.state_dir / "placed").exists() and StateStore(state).policy_for("b1") is None
    assert not (tmp_path / "run" / "launch.json").exists()  # no server was launched


@pytest.mark.slow
def test_a_restart_refused_before_it_stopped_anything_leaves_the_server_alone(tmp_path: Path, mini: MiniHost) -> None:
    inv = sim_inventory(tmp_path, mini)
    state = tmp_path / "state.json"
    host = load_inventory([inv]).hosts["b1"]
    ledger = _ledger(tmp_path / "l.jsonl", {(8, 4, 1): 400.0})
    try:
        assert run_cli(inv, "deploy", "b1", state=state).returncode == 0
        first = run_cli(inv, "restart", "b1", "--algorithm", "DDTREE", "--budget", "16", "--topk", "4", state=state)
        assert first.returncode == 0, first.stdout + first.stderr
        pid = _record(host)["pid"]
        # Another controller's restart holds the host: never provably dead from here.
        now = time.time()
        lock = {"token": "theirs", "taken_at": now, "expires_at": now + 600,
                "holder": {"controller": "elsewhere.example", "pid": 4242, "user": "ops", "command": "restart"}}
        (tmp_path / "run" / "restart.lock").write_text(json.dumps(lock))

        refused = run_cli(inv, "--json", "tune", str(ledger), "--deploy", "b1", state=state)
        env = read_envelope(refused.stdout)
        assert refused.returncode == 5 and env["errors"][1]["code"] == "service", refused.stdout
        assert env["errors"][1]["message"].endswith("rolled back: policy file removed, b1 untouched")
        assert _record(host)["pid"] == pid and ProcessManager(LocalTransport("b1"), host).status(lines=0)["alive"]
        assert not _policy_file(mini).exists() and StateStore(state).policy_for("b1") is None
    finally:
        (tmp_path / "run" / "restart.lock").unlink(missing_ok=True)
        ProcessManager(LocalTransport("b1"), host).stop(grace_s=5)
