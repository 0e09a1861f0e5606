"""Startup, failure and shutdown behaviour of real simulator processes."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time

STARTUP_LINES = [
    "Load weight begin.",
    "Load weight end. elapsed=",
    "KV Cache is allocated.",
    "Capture target verify CUDA graph begin.",
    "Capture target verify CUDA graph end.",
    "The server is fired up and ready to roll!",
]
PREFIX = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d( TP\d+)?\] ")


def _run_parser(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddtree_ops.sim", "--model-path", "m", *flags],
        capture_output=True, text=True, timeout=60,
    )


def test_unknown_and_removed_flags_exit_2_like_argparse() -> None:
    unknown = _run_parser("--no-such-flag")
    assert unknown.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in unknown.stderr
    removed = _run_parser("--cuda-graph-max-bs", "8")
    assert removed.returncode == 2
    assert "ambiguous option: --cuda-graph-max-bs" in removed.stderr


def test_phases_in_order_port_closed_while_loading_then_503_then_200(sim_factory) -> None:
    # Loading lasts 2 s simulated x 0.25 = 0.5 s real; warmup 4 s x 0.25 = 1 s of 503.
    # Budget 16 with CUDA graphs is fine on this profile (only b300 fails capture).
    sim = sim_factory(
        "--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", "17",
        env={"SIM_GPU": "rtx-pro-6000", "SIM_TIME_SCALE": "0.25", "SIM_LOAD_S": "2", "SIM_WARMUP_S": "4"},
    )
    seen: list[int | None] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not seen or seen[-1] != 200):
        assert sim.proc.poll() is None, sim.log()
        status = sim.health()
        if not seen or seen[-1] != status:
            seen.append(status)
            if status is None:
                # While the port is closed, the log must not claim readiness yet.
                assert "fired up" not in sim.log()
        time.sleep(0.02)
    assert seen == [None, 503, 200], seen
    log = sim.log()
    positions = [log.find(line) for line in STARTUP_LINES]
    assert all(p >= 0 for p in positions), log
    assert positions == sorted(positions), log
    for line in log.splitlines():
        if any(key in line for key in STARTUP_LINES):
            assert PREFIX.match(line), line


def test_b300_ddtree_budget_over_8_fails_in_capture_and_eager_starts(sim_factory) -> None:
    flags = ("--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", "17",
             "--speculative-eagle-topk", "4")
    failing = sim_factory(*flags, env={"SIM_GPU": "b300"})
    eager = sim_factory(*flags, "--cuda-graph-backend-decode", "disabled", env={"SIM_GPU": "b300"})
    rc = failing.wait_exit()
    assert rc == -signal.SIGKILL  # SGLang's launcher kills its own process tree
    log = failing.log()
    order = [
        log.find("Capture target verify CUDA graph begin."),
        log.find("Scheduler hit an exception:"),
        log.find("Capture cuda graph failed: CUDA error: an illegal memory access was encountered"),
        log.find("Received sigquit from a child process. It usually means the child failed."),
    ]
    assert all(p >= 0 for p in order) and order == sorted(order), log
    assert "fired up" not in log

    eager.wait_ready()
    assert "Capture target verify" not in eager.log()


def test_deprecated_disable_cuda_graph_and_tp_rank_prefixes(sim_factory) -> None:
    import httpx

    sim = sim_factory("--disable-cuda-graph", "--tp-size", "2", env={"SIM_GPU": "b300"})
    sim.wait_ready()
    log = sim.log()
    assert "'--disable-cuda-graph' is deprecated and will be removed in a future release." in log
    assert re.search(r"^\[[^\]]+ TP0\] Load weight begin\.", log, re.M), log
    assert re.search(r"^\[[^\]]+ TP1\] Load weight begin\.", log, re.M), log
    assert re.search(r"^\[[\d\- :]+\] The server is fired up", log, re.M), log
    info = httpx.get(sim.url + "/server_info").json()
    assert info["cuda_graph_backend_decode"] == "disabled"
    assert info["cuda_graph_backend_prefill"] == "disabled"
    assert "Capture" not in sim.log()


def test_port_in_use_fails_after_the_scaled_wait(sim_factory) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        # 30 s simulated x 0.02 = 0.6 s real.
        sim = sim_factory(port=port)
        rc = sim.wait_exit()
    finally:
        holder.close()
    assert rc != 0
    log = sim.log()
    assert "Port is already in use." in log
    assert "Load weight begin." not in log


def test_sigterm_drains_with_health_200_then_exits(sim_factory) -> None:
    # Drain 50 s simulated x 0.02 = 1 s real.
    sim = sim_factory(env={"SIM_SHUTDOWN_DRAIN_S": "50"})
    sim.wait_ready()
    sim.proc.send_signal(signal.SIGTERM)
    statuses: list[int | None] = []
    while sim.proc.poll() is None:
        statuses.append(sim.health())
        time.sleep(0.02)
    assert sim.proc.returncode == 0
    assert 200 in statuses, statuses
    assert statuses[-1] in (200, None)
    assert "Received SIGTERM" in sim.log()


def test_a_gpu_slot_sees_its_cuda_visible_devices_and_tp_beyond_them_dies(sim_factory) -> None:
    import httpx

    slot = sim_factory("--tp-size", "2", env={"CUDA_VISIBLE_DEVICES": "4,5"})
    too_wide = sim_factory("--tp-size", "4", env={"CUDA_VISIBLE_DEVICES": "6,7"})
    slot.wait_ready()
    gpu = httpx.get(slot.url + "/server_info").json()["simulated_gpu"]
    assert (gpu["count"], gpu["indices"], gpu["cuda_visible_devices"]) == (2, [4, 5], "4,5")

    assert too_wide.wait_exit() == -signal.SIGKILL
    log = too_wide.log()
    assert "os.environ.get('CUDA_VISIBLE_DEVICES')='6,7' get_parallel().tp_rank=2 get_parallel().tp_size=4" in log
    assert "CUDA error: invalid device ordinal" in log
    assert "Load weight begin" not in log and "fired up" not in log
