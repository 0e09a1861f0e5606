"""Live tree switching in a sweep, against real simulated servers (issue 25): one DDTree
launch per host for the whole budget x top-k grid, each cell's tree switched and proven
through ``/server_info`` before it is measured, eager states recorded as eager, and a
refused switch recorded as a failed row."""

from __future__ import annotations

from pathlib import Path

import pytest
from minisglang import deployed_python

from ddtree_ops.bench import ledger
from ddtree_ops.bench.lifetime import SweepOptions
from ddtree_ops.bench.prepare import prepare_sweep
from ddtree_ops.bench.runner import SweepRunner
from ddtree_ops.bench.sweep import sweep_hash
from ddtree_ops.inventory_types import DdtreeSettings, Host, ServerSettings
from ddtree_ops.workload.draw import build_workload

from .test_runner import free_port, rows_of, stop_all, sweep

pytestmark = pytest.mark.slow


def host(tmp_path: Path, name: str, gpu: str, **env: str) -> Host:
    server = ServerSettings(
        model_path="sim/qwen3-8b", draft_model_path="sim/qwen3-8b-dflash", port=free_port(),
        env={"SIM_GPU": gpu, "SIM_LOAD_S": "0.5", "SIM_TIME_SCALE": "0.2", "SIM_WARMUP_S": "0.5", **env},
        expected_load_s=2.0, command="{python} -m ddtree_ops.sim",
    )
    return Host(name=name, connection="local", source="<test>",
                ddtree=DdtreeSettings(python=deployed_python(), run_dir=str(tmp_path / name), gpu=gpu, server=server))


def run(tmp_path: Path, h: Host, out: Path, **overrides: object):
    spec = sweep(tmp_path, **overrides)
    try:
        outcome = SweepRunner(prepare_sweep(spec, [h]), build_workload(spec.workload), ledger_path=out).run()
    finally:
        stop_all([h])
    return spec, outcome


GRID = {"algorithm": ["ddtree"], "budget": [4, 16], "topk": [2, 4], "temperature": [0.0], "concurrency": [2]}


def test_one_ddtree_launch_serves_every_tree_and_eager_states_stay_eager(tmp_path: Path) -> None:
    b300 = host(tmp_path, "sim-b3", "b300")
    out = tmp_path / "ledger.jsonl"
    spec, outcome = run(tmp_path, b300, out, grid=GRID, baselines=["autoregressive"])
    rows = rows_of(out)
    (summary,) = outcome.hosts
    assert summary.restarts == 2 and summary.failed_rows == 0 and summary.ok_rows == 5  # AR + one DDTree launch
    assert all(r["status"] == "ok" for r in rows), [r["error"] for r in rows]
    ar = [r for r in rows if r["algorithm"] == "AR"]
    trees = {(r["budget"], r["topk"]): r for r in rows if r["algorithm"] == "DDTREE"}
    assert set(trees) == {(4, 2), (4, 4), (16, 2), (16, 4)}
    assert [r["tree_switched"] for r in ar] == [False]
    assert all(r["tree_switched"] is True for r in trees.values())
    # One launch served every tree: one launch id, one argv (naming the runtime-state file).
    assert len({r["launch_id"] for r in trees.values()}) == 1 and ar[0]["launch_id"] not in {
        r["launch_id"] for r in trees.values()}
    assert len({r["launch_argv_hash"] for r in trees.values()}) == 1
    argv = trees[(4, 2)]["server_argv"]
    name = argv[argv.index("--speculative-adaptive-config") + 1]
    assert name.startswith("runtime-states-") and (Path(b300.ddtree.run_dir) / name).is_file()
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "5"  # launched at the first tree
    # B300: budget 16's verify graph does not capture, so its rows say eager (and why);
    # budget 4 keeps its graph on the same server.
    for (budget, _), r in trees.items():
        if budget == 16:
            assert r["cuda_graph"] is False and r["verify_cuda_graph"] is False, r
            assert r["fallback_reason"].startswith("runtime state budget 16: verify graph not captured"), r
            assert "illegal memory access" in r["fallback_reason"]
        else:
            assert r["cuda_graph"] is True and r["verify_cuda_graph"] is True and r["fallback_reason"] is None, r
    # The switch really changed the tree: a 16-node tree accepts more than a 4-node one.
    assert trees[(16, 4)]["accept_length"] > trees[(4, 4)]["accept_length"]

    # --resume in the other mode: the same sweep (same hash), the same cells, nothing left.
    again = sweep(tmp_path, grid=GRID, baselines=["autoregressive"], relaunch="always")
    assert sweep_hash(again) == sweep_hash(spec)
    resumed = SweepRunner(prepare_sweep(again, [b300]), build_workload(again.workload), ledger_path=out,
                          options=SweepOptions(resume=True)).run()
    assert [(h.skipped, h.restarts, h.ok_rows) for h in resumed.hosts] == [(5, 0, 0)]
    assert len(rows_of(out)) == 5


def test_a_switched_cell_measures_what_a_fresh_launch_of_its_tree_measures(tmp_path: Path) -> None:
    """T = 0 makes every request's tokens and verify rounds a function of its tree alone,
    so the same cell on the live launch and on a launch of its own must count the same."""
    grid = {"algorithm": ["ddtree"], "budget": [4, 16], "topk": [2], "temperature": [0.0], "concurrency": [2]}
    live_out, fresh_out = tmp_path / "live.jsonl", tmp_path / "fresh.jsonl"
    # The live sweep loads from here (``client: local``): that client's switch path too.
    _, live = run(tmp_path, host(tmp_path, "sim-l", "rtx-pro-6000"), live_out, grid=grid, baselines=[],
                  client="local")
    _, fresh = run(tmp_path, host(tmp_path, "sim-f", "rtx-pro-6000"), fresh_out, grid=grid, baselines=[],
                   relaunch="always")
    assert [h.restarts for h in live.hosts] == [1] and [h.restarts for h in fresh.hosts] == [2]
    by_tree = {mode: {(r["budget"], r["topk"]): r for r in rows_of(path)}
               for mode, path in (("live", live_out), ("fresh", fresh_out))}
    assert set(by_tree["live"]) == set(by_tree["fresh"]) == {(4, 2), (16, 2)}
    assert {r["client"] for r in by_tree["live"].values()} == {"local"}
    for tree, switched in by_tree["live"].items():
        launched = by_tree["fresh"][tree]
        assert (switched["tree_switched"], launched["tree_switched"]) == (True, False)
        assert "--speculative-adaptive-config" not in launched["server_argv"]
        for key in ("accept_length", "verify_ct", "total_output_tokens", "cuda_graph"):
            assert switched[key] == launched[key], (tree, key)
    assert by_tree["fresh"][(4, 2)]["launch_id"] != by_tree["fresh"][(16, 2)]["launch_id"]


def test_a_refused_switch_is_a_failed_row_never_a_measurement(tmp_path: Path) -> None:
    # A DDTree plugin that predates runtime states: it runs the launch tree and refuses switches.
    old = host(tmp_path, "sim-old", "rtx-pro-6000", SIM_NO_RUNTIME_STATES="1")
    out = tmp_path / "ledger.jsonl"
    _, outcome = run(tmp_path, old, out, grid=GRID, baselines=["autoregressive"])
    rows = rows_of(out)
    (summary,) = outcome.hosts
    assert summary.restarts == 2  # the server still serves after a refusal: no relaunch
    assert [r["status"] for r in rows if r["algorithm"] == "AR"] == ["ok"]
    tree_rows = [r for r in rows if r["algorithm"] == "DDTREE"]
    assert len(tree_rows) == 4
    for r in tree_rows:
        assert r["status"] == "failed" and r["tree_switched"] is True, r
        assert r["error"].startswith(f"live switch to budget {r['budget']} top-k {r['topk']} refused (HTTP 400)"), r
        assert "no runtime states" in r["error"], r
        assert r["output_tok_s"] is None and r["completed"] is None  # nothing was measured
    assert ledger.completed_keys(rows) == {ledger.row_key(r) for r in rows if r["algorithm"] == "AR"}


def test_the_dflash_baseline_runs_the_chain_of_each_verify_width(tmp_path: Path) -> None:
    """A tree of budget B is compared with DFlash verifying as many tokens (root + B),
    up to the drafter's block: each width its own launch, its row saying which."""
    from ddtree_ops import report

    grid = {"algorithm": ["ddtree"], "budget": [4, 16], "topk": [2], "temperature": [0.0], "concurrency": [2]}
    out = tmp_path / "ledger.jsonl"
    _, outcome = run(tmp_path, host(tmp_path, "sim-d", "rtx-pro-6000"), out, grid=grid, baselines=["dflash"])
    rows = rows_of(out)
    assert all(r["status"] == "ok" for r in rows), [r["error"] for r in rows]
    assert [h.restarts for h in outcome.hosts] == [3]  # chains of 5 and 16, one DDTree launch
    chains = {r["budget"]: r for r in rows if r["algorithm"] == "DFLASH"}
    assert set(chains) == {5, 16}  # root + 4; root + 16 capped at the block of 16
    for width, r in chains.items():
        argv = r["server_argv"]
        assert argv[argv.index("--speculative-num-draft-tokens") + 1] == str(width)
    assert chains[16]["accept_length"] > chains[5]["accept_length"]  # the longer chain was really launched
    tidy = report.build_report([out], group_by="host").tidy
    trees = tidy[tidy["algorithm"] == "DDTREE"].set_index("budget")
    assert trees.loc[4, "dflash_width"] == 5 and trees.loc[16, "dflash_width"] == 16
    dflash = tidy[tidy["algorithm"] == "DFLASH"].set_index("budget")["output_tok_s_median"]
    assert trees.loc[4, "speedup_vs_dflash"] == pytest.approx(trees.loc[4, "output_tok_s_median"] / dflash.loc[5])


def test_a_live_sweep_needs_no_sftp_on_the_host(tmp_path: Path, ssh_fleet) -> None:
    """The runtime-states file reaches the host through the agent's stdin: a host whose sshd
    offers no SFTP subsystem (deploy works there too) measures every switched cell."""
    from dataclasses import replace

    from fleetlib import SshdServer, known_hosts_line
    from testports import free_port as free_tcp_port

    base = ssh_fleet.hosts[0]
    sshd = SshdServer(root=tmp_path / "sshd", port=free_tcp_port(), host_key=base.server.host_key,
                      authorized_keys=base.server.authorized_keys, path_env=base.server.path_env,
                      home=tmp_path / "home", sftp=False)
    sshd.start()
    try:
        known = tmp_path / "known_hosts"
        known.write_text(known_hosts_line(sshd.port, base.server.host_key) + "\n")
        local = host(tmp_path, "nosftp", "rtx-pro-6000")
        remote = replace(local, connection="ssh", address="127.0.0.1", port=sshd.port, user="root",
                         key_file=str(ssh_fleet.client_key),
                         ddtree=replace(local.ddtree, known_hosts=str(known)))
        out = tmp_path / "ledger.jsonl"
        run(tmp_path, remote, out, grid={**GRID, "budget": [4, 8]})
        rows = [r for r in rows_of(out) if r["algorithm"] == "DDTREE"]
        assert [r["status"] for r in rows] == ["ok"] * 4, [r["error"] for r in rows]
        assert all(r["tree_switched"] for r in rows)
    finally:
        sshd.stop()
