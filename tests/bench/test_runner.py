"""The sweep runner against real simulated servers: local hosts and the real sshd fleet.

Faults are real: the server process is SIGKILLed mid-cell, a host's sshd is stopped
mid-sweep, the runner itself is SIGKILLed and resumed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from minisglang import deployed_python
from testports import free_port

from ddtree_ops.bench import ledger
from ddtree_ops.bench.lifetime import SweepOptions
from ddtree_ops.bench.plan import plan_sweep
from ddtree_ops.bench.prepare import prepare_sweep
from ddtree_ops.bench.runner import Progress, SweepRunner
from ddtree_ops.bench.services import default_services
from ddtree_ops.bench.sweep import parse_sweep
from ddtree_ops.inventory_types import DdtreeSettings, Host, ServerSettings
from ddtree_ops.service import lifecycle
from ddtree_ops.transport import open_transport
from ddtree_ops.transport.local import LocalTransport
from ddtree_ops.workload.draw import build_workload

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def sim_server(gpu: str, *, time_scale: float = 0.2, port: int | None = None) -> ServerSettings:
    return ServerSettings(
        model_path="sim/qwen3-8b",
        draft_model_path="sim/qwen3-8b-dflash",
        port=port or free_port(),
        env={"SIM_GPU": gpu, "SIM_LOAD_S": "0.5", "SIM_TIME_SCALE": str(time_scale)},
        expected_load_s=2.0,
        command="{python} -m ddtree_ops.sim",
    )


def local_host(tmp_path: Path, name: str, *, gpu: str = "rtx-pro-6000", time_scale: float = 0.2) -> Host:
    return Host(
        name=name,
        connection="local",
        ddtree=DdtreeSettings(python=deployed_python(), run_dir=str(tmp_path / name), gpu=gpu,
                              server=sim_server(gpu, time_scale=time_scale)),
        source="<test>",
    )


def sweep(tmp_path: Path, **overrides: object):
    (tmp_path / "p.jsonl").write_text(
        "".join(json.dumps({"prompt": f"def f{i}(x): return x + {i}"}) + "\n" for i in range(4))
    )
    doc = {
        "name": "t",
        "targets": ["all"],
        "baselines": ["autoregressive"],
        "grid": {"algorithm": ["ddtree"], "budget": [4], "topk": [2], "temperature": [0.0, 0.6], "concurrency": [2]},
        "workload": {"prompt_files": ["p.jsonl"], "num_prompts": 4, "max_new_tokens": 16},
        "warmup": 0,
        "request_timeout_s": 60,
    } | overrides
    return parse_sweep(doc, tmp_path / "s.yaml")


def rows_of(path: Path) -> list[dict]:
    read = ledger.read_ledger(path)
    assert read.bad_lines == []
    return read.rows


def stop_all(hosts: list[Host]) -> None:
    for h in hosts:
        with open_transport(h, host_key_policy="strict") as t:
            try:
                lifecycle.stop(t, h, grace_s=2.0)
            except Exception:
                pass


def test_server_killed_mid_cell_fails_that_row_and_is_restarted(tmp_path: Path) -> None:
    host = local_host(tmp_path, "sim-a", time_scale=0.3)
    spec = sweep(tmp_path, grid={"algorithm": ["autoregressive"], "temperature": [0.0, 0.6], "concurrency": [1]},
                 baselines=[], workload={"prompt_files": ["p.jsonl"], "num_prompts": 4, "max_new_tokens": 64})
    workload = build_workload(spec.workload)
    killed = threading.Event()

    def on_progress(p: Progress) -> None:
        # Once the first cell's first request has come back (its others still to come): the
        # kill lands mid-cell however fast or slow the machine (a kill 0.4 s after the cell
        # began could land after a fast cell, or before a slow one sent anything).
        if p.phase == "running" and p.done == 0 and p.message == "1/4 requests" and not killed.is_set():
            st = lifecycle.service_status(LocalTransport(host.name), host)
            os.kill(st.pid, signal.SIGKILL)
            killed.set()

    out = tmp_path / "ledger.jsonl"
    try:
        outcome = SweepRunner(prepare_sweep(spec, [host]), workload, ledger_path=out, on_progress=on_progress).run()
    finally:
        stop_all([host])
    rows = rows_of(out)
    assert killed.is_set()
    assert [r["status"] for r in rows] == ["failed", "ok"]
    assert "requests failed" in rows[0]["error"]
    assert rows[1]["completed"] == 4 and rows[1]["total_output_tokens"] == 4 * 64
    # Provenance from each launch's /server_info: the serving simulator's version, and
    # (no nvidia-smi on a local test host) its simulated GPU, on rows of both launches.
    for r in rows:
        assert r["sglang_version"] == "0.5.23-sim", r
        if shutil.which("nvidia-smi") is None:
            assert r["gpu_name"] == "NVIDIA RTX PRO 6000 Blackwell Workstation Edition (simulated)", r
            assert r["gpu_arch"] == "sm_120" and r["gpu_count"] == 8 and r["driver"] is None, r
        else:  # a real GPU found by the probe always wins over the simulated one
            assert "(simulated)" not in (r["gpu_name"] or ""), r
    summary = outcome.hosts[0]
    assert summary.restarts == 2 and summary.failed_rows == 1 and summary.ok_rows == 1


def test_runner_sigkilled_during_a_restart_then_resume_completes_only_missing_rows(tmp_path: Path) -> None:
    """The kill lands while the runner's restart holds the host's restart lock: the resumed
    runner (same controller) takes the dead holder's lock over at once instead of waiting
    minutes for it to expire, and runs exactly the rows that are missing."""
    run_dir = tmp_path / "run"
    host = local_host(tmp_path, "sim-r")
    # what stop_all stops
    host = dataclasses.replace(host, ddtree=dataclasses.replace(host.ddtree, run_dir=str(run_dir)))
    inv = tmp_path / "inv.yaml"
    srv = host.ddtree.server
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"sim-r": {"ansible_connection": "local", "ddtree": {
        "python": deployed_python(), "run_dir": str(run_dir),
        "server": {"command": srv.command, "model_path": srv.model_path, "draft_model_path": srv.draft_model_path,
                   "port": srv.port, "env": dict(srv.env), "expected_load_s": 2}}}}}}))
    # Two server configurations, so the runner restarts between them; repeats make the resume key matter.
    grid = {"algorithm": ["autoregressive", "ddtree"], "budget": [4], "topk": [2], "temperature": [0.0, 0.6],
            "concurrency": [1]}
    spec = sweep(tmp_path, grid=grid, baselines=[], repeats=2)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({
        "name": "t", "targets": ["sim-r"], "grid": grid, "repeats": 2,
        "workload": {"prompt_files": ["p.jsonl"], "num_prompts": 4, "max_new_tokens": 16}, "warmup": 0}))
    out = tmp_path / "ledger.jsonl"
    lock = run_dir / "restart.lock"
    per_server = plan_sweep(spec).runs // 2
    cli = [sys.executable, "-m", "ddtree_ops", "-i", str(inv), "bench", "--sweep", str(tmp_path / "s.yaml"),
           "--out", str(out)]
    env = dict(os.environ, DDTREE_OPS_STATE=str(tmp_path / "state.json"))
    proc = subprocess.Popen(cli, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        # The first server's rows are written and its restart lock released, so a lock
        # seen now is the second server's restart, in progress.
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and len(out.read_bytes().splitlines()) >= per_server and lock.exists():
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        held = json.loads(lock.read_text())
        assert held["holder"]["pid"] == proc.pid  # the dead runner's restart still holds the lock
        assert held["expires_at"] - time.time() > 300  # expiry is minutes away
        # A crash mid-write leaves a partial line; resume cuts it off.
        with out.open("ab") as fh:
            fh.write(b'{"schema_version": 1, "host": "sim-r", "stat')
        before = ledger.read_ledger(out)
        assert [b[1] for b in before.bad_lines] == ["truncated last line (a writer stopped mid-line)"]
        first = [r for r in before.rows if r["status"] == "ok"]
        assert len(before.rows) == len(first) == per_server
        assert {r["algorithm"] for r in first} == {"AR"}  # only the first server configuration
        # Its repeats ran as passes over its cells (schedule.plan_runs): both temperatures, then again.
        assert [(r["repeat"], r["temperature"]) for r in first] == [(0, 0.0), (0, 0.6), (1, 0.0), (1, 0.6)]
        done = subprocess.run(cli + ["--resume"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert f"{out}:{per_server + 1}: removed a truncated last line" in done.stderr
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_all([host])
    assert not lock.exists()
    after = ledger.read_ledger(out)
    assert after.bad_lines == []  # resume cut the partial line off before appending
    keys = Counter(ledger.row_key(r) for r in after.rows if r["status"] == "ok")
    expected = plan_sweep(spec).runs
    assert len(keys) == expected and set(keys.values()) == {1}  # every run exactly once
    assert len(after.rows) == expected  # nothing re-run that was already done
    assert len({r["run_id"] for r in after.rows}) == 2


@pytest.mark.fleet
def test_sshd_stopped_mid_sweep_fails_that_host_only(ssh_fleet, tmp_path: Path) -> None:
    inventory = ssh_fleet.load()
    fh_ct, fh_b3 = ssh_fleet.hosts[0], ssh_fleet.hosts[1]
    assert (fh_ct.gpu, fh_b3.gpu) == ("rtx-pro-6000", "b300")

    def with_sim(fleet_host) -> Host:
        h = inventory.hosts[fleet_host.name]
        server = sim_server(fleet_host.gpu, port=fleet_host.server_port)
        # An interpreter with the DDTree bundle deployed (the fleet hosts' own have none).
        return dataclasses.replace(h, ddtree=dataclasses.replace(h.ddtree, python=deployed_python(), server=server))

    cut, survivor = with_sim(fh_ct), with_sim(fh_b3)
    # AR first, then DDTree budget 16: the B300 profile cannot capture CUDA graphs there.
    spec = sweep(tmp_path, grid={"algorithm": ["ddtree"], "budget": [16], "topk": [4], "temperature": [0.0],
                                 "concurrency": [2]})
    workload = build_workload(spec.workload)
    stopped = threading.Event()

    def on_progress(p: Progress) -> None:
        if p.host == cut.name and p.phase == "row" and not stopped.is_set():
            ssh_fleet.stop(cut.name)
            stopped.set()

    out = tmp_path / "ledger.jsonl"
    try:
        outcome = SweepRunner(prepare_sweep(spec, [cut, survivor]), workload, ledger_path=out, on_progress=on_progress,
                              services=default_services(host_key_policy="strict")).run()
    finally:
        ssh_fleet.start(cut.name)
        stop_all([cut, survivor])
    rows = rows_of(out)
    by_host = {h: [r for r in rows if r["host"] == h] for h in (cut.name, survivor.name)}
    assert [r["status"] for r in by_host[survivor.name]] == ["ok", "ok"]
    eager = [r for r in by_host[survivor.name] if r["algorithm"] == "DDTREE"][0]
    assert eager["cuda_graph"] is False and "capture" in eager["fallback_reason"].lower()
    # The serving process is the simulator; the prefix holds the real SGLang 0.5.23.
    assert eager["sglang_version"] == "0.5.23-sim" and eager["sglang_installed_version"] == "0.5.23"
    assert eager["server_argv"]
    # The host's nvidia-smi found a GPU: it wins over the simulator's simulated_gpu.
    assert eager["gpu_name"] == "NVIDIA B300 SXM6 AC" and eager["gpu_arch"] == "sm_103" and eager["gpu_count"] == 8
    assert [r["status"] for r in by_host[cut.name]] == ["ok", "failed"]
    assert by_host[cut.name][1]["error"]
    summary = {h.host: h for h in outcome.hosts}
    assert summary[cut.name].error and not summary[survivor.name].error


def test_unreachable_host_fails_its_rows_and_fail_fast_stops_the_others(tmp_path: Path) -> None:
    gone = Host(name="gone", connection="ssh", address="127.0.0.1", port=free_port(), user="root",
                ddtree=DdtreeSettings(server=sim_server("h200")), source="<test>")
    alive = local_host(tmp_path, "sim-f")
    spec = sweep(tmp_path)
    workload = build_workload(spec.workload)
    out = tmp_path / "ledger.jsonl"
    try:
        outcome = SweepRunner(prepare_sweep(spec, [gone, alive]), workload, ledger_path=out,
                              options=SweepOptions(fail_fast=True)).run()
    finally:
        stop_all([alive])
    rows = rows_of(out)
    runs = plan_sweep(spec).runs
    assert [r["host"] for r in rows] == ["gone"] * runs
    assert all(r["status"] == "failed" and r["error"] for r in rows)
    summary = {h.host: h for h in outcome.hosts}
    assert summary["gone"].error and summary["gone"].failed_rows == runs
    # What ended it is kept by class, so the CLI exits 3 (connection) as other commands do.
    assert summary["gone"].error_type == "ConnectError"
    # fail-fast: the healthy host stops before its next row, here before the first one
    assert summary["sim-f"].ok_rows == 0 and summary["sim-f"].failed_rows == 0
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", alive.ddtree.server.port)) != 0
