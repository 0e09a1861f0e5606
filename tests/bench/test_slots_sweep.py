"""A sweep across the GPU slots of one host: each server configuration goes to whichever
slot frees first, every slot runs its own server (real simulator processes, each seeing
only its CUDA_VISIBLE_DEVICES) and its own load generator, and the rows say which slot and
GPUs served them."""

from __future__ import annotations

import socket
from collections import Counter
from pathlib import Path

import pytest
import yaml
from cli_json import json_data
from minisglang import deployed_python

from ddtree_ops.bench import ledger

from .test_cli_bench import cli, free_port

pytestmark = pytest.mark.timeout(240)


def write_inventory(tmp_path: Path) -> Path:
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"all": {"children": {"local": {"hosts": {"sim-x": {
        "ansible_connection": "local",
        "ddtree": {"python": deployed_python(), "run_dir": str(tmp_path / "run"), "server": {
            "command": "{python} -m ddtree_ops.sim", "model_path": "sim/m", "draft_model_path": "sim/d",
            "expected_load_s": 2,
            "env": {"SIM_GPU": "rtx-pro-6000", "SIM_LOAD_S": "0.5", "SIM_TIME_SCALE": "0.5"},
            "slots": [{"gpus": "0,1,2,3", "port": free_port()}, {"gpus": "4,5,6,7", "port": free_port()}]}}}}}}}}))
    return inv


def write_sweep(tmp_path: Path, relaunch: str = "never") -> Path:
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello there"}\n{"prompt": "general kenobi"}\n')
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({
        "name": "slots", "targets": ["local"], "repeats": 2, "baselines": ["autoregressive"],
        "grid": {"algorithm": ["ddtree"], "budget": [4, 8], "topk": [2], "temperature": [0.0], "concurrency": [1, 2]},
        "workload": {"prompt_files": ["p.jsonl"], "num_prompts": 2, "max_new_tokens": 24}, "warmup": 0,
        "relaunch": relaunch}))
    return path


def test_dry_run_shows_the_slot_schedule_and_its_time_against_one_server(tmp_path: Path) -> None:
    # One launch per tree, so that there are more launches than slots to place.
    inv, sweep = write_inventory(tmp_path), write_sweep(tmp_path, relaunch="always")
    done = cli("--json", "-i", str(inv), "bench", "--sweep", str(sweep), "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    plan = json_data(done.stdout)
    sched = plan["slot_schedules"]["sim-x"]
    assert [s["slot"] for s in sched["slots"]] == ["sim-x/0", "sim-x/1"]
    assert [s["gpus"] for s in sched["slots"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    placed = sorted({j["server"] for s in sched["slots"] for j in s["jobs"]})
    assert placed == ["autoregressive", "ddtree-b4-topk2", "ddtree-b8-topk2"]
    assert all(s["jobs"] for s in sched["slots"])  # three launches on two slots: none idle
    # Every row placed once (a launch split over both slots by repeats where that ends sooner).
    assert sum(j["rows"] for s in sched["slots"] for j in s["jobs"]) == 3 * 2 * 2
    assert sched["wall_s"] < plan["estimated_s"]["sim-x"]
    text = cli("-i", str(inv), "bench", "--sweep", str(sweep), "--dry-run", cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert "sim-x: client host, 2 GPU slots, estimated" in text.stdout and "(one server:" in text.stdout
    assert "sim-x/0 (GPUs 0,1,2,3): " in text.stdout and "sim-x/1 (GPUs 4,5,6,7): " in text.stdout
    # Live switching (the default): both launches split by repeat over the two slots (10.3 s
    # expected, against 11.8 s with the live launch on one slot): each slot launches each once.
    live = json_data(cli("--json", "-i", str(inv), "bench", "--sweep", str(write_sweep(tmp_path)), "--dry-run",
                         cwd=tmp_path).stdout)["slot_schedules"]["sim-x"]
    for s in live["slots"]:
        assert sorted((j["server"], j["repeats"], j["rows"]) for j in s["jobs"]) in (
            [("autoregressive", [r], 2), ("ddtree-states-b4,8-topk2", [r], 4)] for r in (0, 1))
    assert live["wall_s"] < 0.95 * (2 + 2 * 2 * (0.96 + 0.48) + 8 * 0.5)


def test_a_sweep_runs_on_every_slot_and_rows_name_slot_and_gpus(tmp_path: Path) -> None:
    inv, sweep = write_inventory(tmp_path), write_sweep(tmp_path)
    out = tmp_path / "ledger.jsonl"
    done = cli("--json", "-i", str(inv), "bench", "--sweep", str(sweep), "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    [summary] = json_data(done.stdout)["hosts"]
    # Each slot launches the baseline and the live DDTree launch once and measures one repeat of each.
    assert (summary["host"], summary["ok_rows"], summary["failed_rows"], summary["restarts"]) == ("sim-x", 12, 0, 4)
    rows = ledger.read_ledger(out).rows
    assert len(rows) == 12 and {r["status"] for r in rows} == {"ok"}
    assert {r["host"] for r in rows} == {"sim-x"}  # the report groups by machine / GPU type, not slot
    by_slot = Counter(r["slot"] for r in rows)
    assert set(by_slot) == {0, 1}, by_slot
    for r in rows:
        assert r["gpu_indices"] == ([0, 1, 2, 3] if r["slot"] == 0 else [4, 5, 6, 7])
        assert r["gpu_count"] == 4 and r["client"] == "host"
    assert {r["tree_switched"] for r in rows if r["algorithm"] == "DDTREE"} == {True}
    # One live launch per slot, each serving every tree; a repeat's rows share a slot, and
    # the two repeats of a configuration ran on different GPUs.
    assert len({(r["slot"], r["launch_id"]) for r in rows if r["algorithm"] == "DDTREE"}) == 2
    for config in ("AR", "DDTREE"):
        by_repeat = {n: {r["slot"] for r in rows if r["algorithm"] == config and r["repeat"] == n} for n in (0, 1)}
        assert all(len(s) == 1 for s in by_repeat.values()) and by_repeat[0] != by_repeat[1], (config, by_repeat)
    # Nothing ran before: both slots' servers were stopped at the end, nothing listens, and
    # neither slot has a launch record (the sweep's launches kept their own, gone with them).
    assert [(p["place"], p["action"], p["before"], p["running"]) for p in summary["put_back"]] == [
        ("sim-x/0", "stopped", "no server", False), ("sim-x/1", "stopped", "no server", False)]
    assert_slots_stopped(inv)
    assert sorted(p.name for p in (tmp_path / "run").glob("slot-*/*launch.json")) == []


def assert_slots_stopped(inv: Path) -> None:
    """Nothing listens on the ports of ``inv``'s slots (from :func:`write_inventory`)."""
    slots = yaml.safe_load(inv.read_text())["all"]["children"]["local"]["hosts"]["sim-x"]["ddtree"]["server"]["slots"]
    for slot in slots:
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):
            s.connect(("127.0.0.1", slot["port"]))


def test_a_launch_costs_the_last_whole_restart_else_the_last_load_else_the_inventory(tmp_path: Path) -> None:
    from ddtree_ops.bench.prepare import expected_launch_s
    from ddtree_ops.inventory import load_inventory
    from ddtree_ops.state import StateStore

    slot0, slot1 = load_inventory([write_inventory(tmp_path)]).hosts["sim-x"].slot_hosts()
    assert expected_launch_s(slot0) == 2  # the inventory's expected_load_s
    StateStore().record_load_time("sim-x/0", "sim/m", 3.5)
    assert expected_launch_s(slot0) == 3.5
    StateStore().record_load_time("sim-x/0", "sim/m", 3.5, restart_s=5.25)
    assert (expected_launch_s(slot0), expected_launch_s(slot1)) == (5.25, 2)  # learned per slot
