"""The service commands end to end: a real inventory file, the real CLI process, the simulator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_json import json_data
from minisglang import deployed_python
from simhosts import free_port, run_cli

pytestmark = pytest.mark.timeout(180)


def cli(inventory: Path, *args: str, env_state: Path) -> subprocess.CompletedProcess[str]:
    return run_cli(inventory, *args, state=env_state)


def host_result(out: subprocess.CompletedProcess[str], name: str) -> dict:
    """The ``result`` of one host in the shared --json document of every fleet command."""
    (row,) = [r for r in json_data(out.stdout)["hosts"] if r["host"] == name]
    assert row["ok"], row["error"]
    return row["result"]


@pytest.fixture(scope="module")
def sglang_python() -> str:
    """A prefix holding the real SGLang 0.5.23 files, so the version is found as on a host,
    with the DDTree bundle deployed."""
    return deployed_python()


@pytest.fixture
def inventory(tmp_path: Path, sglang_python: str) -> Path:
    data = {
        "all": {
            "hosts": {
                "sim-a": {
                    "ansible_connection": "local",
                    "ddtree": {
                        "python": sglang_python,
                        "run_dir": str(tmp_path / "run-a"),
                        "gpu": "b300",
                        "server": {
                            "command": "{python} -m ddtree_ops.sim",
                            "model_path": "sim/qwen3-8b",
                            "draft_model_path": "sim/qwen3-8b-dflash",
                            "port": free_port(),
                            "expected_load_s": 5,
                            "env": {"SIM_GPU": "b300", "SIM_LOAD_S": "2", "SIM_TIME_SCALE": "0.1"},
                        },
                    },
                }
            }
        }
    }
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_restart_logs_status_stop(inventory: Path, tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    try:
        # b300 budget 8 is below the capture-failure threshold: graphs on, one launch.
        out = cli(inventory, "--json", "restart", "all", "--algorithm", "DDTREE", "--budget", "8", "--topk", "4",
                  env_state=state)
        assert out.returncode == 0, out.stderr
        result = host_result(out, "sim-a")
        assert result["cuda_graph"] is True and result["attempts"] == 1
        assert result["argv"][-4:] == ["--speculative-num-draft-tokens", "9", "--speculative-eagle-topk", "4"]
        assert json.loads(state.read_text())["load_times"]  # learned for the next restart

        out = cli(inventory, "logs", "sim-a", "--lines", "3", env_state=state)
        assert out.returncode == 0 and "The server is fired up and ready to roll!" in out.stdout

        out = cli(inventory, "--json", "service-status", "sim-a", env_state=state)
        status = host_result(out, "sim-a")
        assert status["running"] and status["health"] == 200 and status["serving_ours"] is True
        assert status["cuda_graph"] is True
    finally:
        out = cli(inventory, "--json", "stop", "all", "--grace", "5", env_state=state)
    stopped = host_result(out, "sim-a")
    assert stopped["was_running"] and stopped["exited"]


def test_restart_without_an_algorithm_launches_again_what_ran_last_or_refuses(inventory: Path, tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    # Nothing launched yet: nothing to repeat, refused before the host is touched.
    out = cli(inventory, "--json", "restart", "sim-a", env_state=state)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no launch of ddtree-ops recorded here to repeat: give --algorithm" in out.stdout
    # A tree without an algorithm is refused in one line, whatever ran.
    out = cli(inventory, "restart", "sim-a", "--budget", "4", env_state=state)
    assert out.returncode == 2 and out.stderr.startswith("error: --budget changes what is launched")
    try:
        first = cli(inventory, "--json", "restart", "sim-a", "--algorithm", "DDTREE", "--budget", "4", "--topk", "2",
                    "--no-smoke", env_state=state)
        assert first.returncode == 0, first.stdout + first.stderr
        again = cli(inventory, "--json", "restart", "sim-a", "--no-smoke", env_state=state)
        assert again.returncode == 0, again.stdout + again.stderr
        result = host_result(again, "sim-a")
        assert result["run"] == "DDTREE budget=4 topk=2" and result["argv"] == host_result(first, "sim-a")["argv"]
        assert result["pid"] != host_result(first, "sim-a")["pid"]
        table = cli(inventory, "restart", "sim-a", "--no-smoke", env_state=state).stdout
        assert "DDTREE b=4 k=2" in table
    finally:
        cli(inventory, "stop", "all", "--grace", "5", env_state=state)


def test_bad_input_is_one_line_and_exit_2(inventory: Path, tmp_path: Path) -> None:
    out = cli(inventory, "restart", "all", "--algorithm", "EAGLE", env_state=tmp_path / "s.json")
    assert out.returncode == 2
    assert "unknown algorithm 'EAGLE' (expected AR, DFLASH or DDTREE" in out.stderr and "Traceback" not in out.stderr
    out = cli(inventory, "restart", "nosuchhost", env_state=tmp_path / "s.json")
    assert out.returncode == 2 and "nosuchhost" in out.stderr and "Traceback" not in out.stderr


def test_ctrl_c_during_wait_reports_the_host_and_exits_130(inventory: Path, tmp_path: Path) -> None:
    import os
    import signal
    import time

    data = yaml.safe_load(inventory.read_text())
    host = data["all"]["hosts"]["sim-a"]["ddtree"]
    host["server"]["env"]["SIM_LOAD_S"] = "6000"  # never finishes loading
    inventory.write_text(yaml.safe_dump(data))
    log = Path(host["run_dir"]) / "server.log"
    env = dict(os.environ, DDTREE_OPS_STATE=str(tmp_path / "state.json"), COLUMNS="200")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddtree_ops", "-i", str(inventory), "restart", "sim-a", "--algorithm", "AR"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        for _ in range(600):
            if log.exists() and "Load weight begin." in log.read_text():
                break
            time.sleep(0.1)
            if proc.poll() is not None:
                pytest.fail(f"restart ended early: {proc.communicate()}")
        else:
            pytest.fail("server never started loading")
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130, (stdout[-2000:], stderr[-2000:])
        assert "wait cancelled during" in stdout and "server stopped (pid" in stdout
        assert "Traceback" not in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
        out = cli(inventory, "--json", "stop", "all", "--grace", "5", env_state=tmp_path / "state.json")
    assert host_result(out, "sim-a")["was_running"] is False  # the restart stopped what it started


def test_stop_and_logs_on_a_host_never_started(inventory: Path, tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    out = cli(inventory, "--json", "stop", "sim-a", env_state=state)
    assert out.returncode == 0, out.stderr
    assert host_result(out, "sim-a")["was_running"] is False
    out = cli(inventory, "logs", "sim-a", env_state=state)
    assert out.returncode == 0 and "sim-a: no server log yet" in out.stdout


def test_port_held_by_a_foreign_process_fails_within_timeout_and_says_so(inventory: Path, tmp_path: Path) -> None:
    import socket
    import threading
    import time

    port = yaml.safe_load(inventory.read_text())["all"]["hosts"]["sim-a"]["ddtree"]["server"]["port"]
    with socket.socket() as holder:  # a process we did not launch holds the server's port
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", port))
        holder.listen()

        def serve() -> None:  # answer connects, as a live server does (a full backlog would look closed)
            while True:
                try:
                    holder.accept()[0].close()
                except OSError:
                    return

        threading.Thread(target=serve, daemon=True).start()
        started = time.monotonic()
        # stdout is a pipe, not a terminal: the wait is said on stderr in plain text.
        out = cli(inventory, "restart", "sim-a", "--algorithm", "AR", "--timeout", "3", env_state=tmp_path / "s.json")
        took = time.monotonic() - started
    assert out.returncode == 5, out.stdout + out.stderr
    assert took < 60, f"the port wait ignored --timeout 3 ({took:.0f}s)"
    assert f"sim-a: port {port} busy (held by a process we did not launch); waiting up to 3s" in out.stderr
    assert f"port {port} still in use after 3s by a process we did not launch; nothing launched" in out.stdout
    assert "\x1b[" not in out.stderr  # plain text, no live board
    assert not (tmp_path / "run-a" / "launch.json").exists()


def test_restart_summary_is_one_table_naming_its_times(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import MappingProxyType

    from rich.console import Console

    from ddtree_ops.cli import main, service
    from ddtree_ops.errors import ReadinessTimeout
    from ddtree_ops.fleet import FleetResult
    from ddtree_ops.service.lifecycle import RestartResult
    from ddtree_ops.service.logphases import Phase
    from ddtree_ops.service.smoke import SmokeResult

    def result(host: str, *, capture: float | None, attempts: int = 1) -> RestartResult:
        phases = {Phase.STARTING: 0.4, Phase.LOADING_WEIGHTS: 9.0, Phase.SMOKE: 2.3}
        if capture is not None:
            phases[Phase.CAPTURING] = capture
        reason = None if capture is not None else "CUDA-graph capture failed: CUDA error: an illegal memory access"
        return RestartResult(
            host=host, pid=4242, argv=("python",), cuda_graph=capture is not None, fallback_reason=reason,
            phase_durations=MappingProxyType(phases), ready_s=15.1, load_s=12.6, deadline_s=720,
            deadline_source="learned", attempts=attempts, launch_command="python", log_path="/x/server.log",
            ready_at=0.0, ready_line_ts=None,
            smoke=SmokeResult(True, 2.3, 8, 256, 80, 3.2, detail="8 requests, accept length 3.20"),
            run="DDTREE budget=16 topk=4",
        )

    out = Console(record=True, width=200)
    monkeypatch.setattr(main, "console", out)
    results = FleetResult({"gpu-a": result("gpu-a", capture=3.1), "gpu-b": result("gpu-b", capture=None, attempts=2),
                           "gpu-c": ReadinessTimeout("not ready after 720s", host="gpu-c")})
    service._render_restart(main.AppContext(), results)
    text = out.export_text()
    header = next(line for line in text.splitlines() if "host" in line)
    for name in ("pid", "run", "mode", "load", "capture", "smoke", "total", "deadline"):
        assert name in header, header
    assert "elapsed" not in header and "ready after" not in header
    rows = [line for line in text.splitlines() if line.startswith("│")]
    (a,) = [line for line in rows if "gpu-a" in line]
    assert [cell.strip() for cell in a.split("│")[1:-1]] == [
        "gpu-a", "ok", "4242", "DDTREE b=16 k=4", "graphs", "12.6s", "3.1s", "2.3s", "15.1s", "720s (learned)"]
    (b,) = [line for line in rows if "gpu-b" in line]
    assert "15.1s (2 launches)" in b and "—" in b  # eager: no capture
    assert "gpu-c" in text and "not ready after 720s" in text
    (eager,) = [line for line in text.splitlines() if "EAGER" in line]
    assert eager.startswith("gpu-b: now serving in EAGER mode — CUDA-graph capture failed: CUDA error")
    assert eager.count("capture failed") == 1  # said once
    # The caption says what each time spans.
    assert "load: launch → the server answers (capture included)" in text and "total: launch → ready" in text
    assert "capture: the CUDA-graph capture within load" in text  # not a term added to load


def test_restart_summary_fits_80_columns_without_splitting_a_word(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 80 columns the summary drops its least useful columns (named in the caption)
    instead of folding headers and values mid-word ("captur e", "(learn ed)")."""
    from types import MappingProxyType

    from rich.console import Console

    from ddtree_ops.cli import main, service
    from ddtree_ops.fleet import FleetResult
    from ddtree_ops.service.lifecycle import RestartResult
    from ddtree_ops.service.logphases import Phase

    r = RestartResult(
        host="sim-ct200/1", pid=424242, argv=("python",), cuda_graph=True, fallback_reason=None,
        phase_durations=MappingProxyType({Phase.CAPTURING: 4.6}), ready_s=13.8, load_s=12.5, deadline_s=720,
        deadline_source="inventory", attempts=2, launch_command="python", log_path="/x/server.log",
        ready_at=0.0, ready_line_ts=None, smoke=None, run="DDTREE budget=16 topk=4",
    )
    out = Console(record=True, width=80)
    monkeypatch.setattr(main, "console", out)
    service._render_restart(main.AppContext(), FleetResult({"sim-ct200/1": r}))
    text = out.export_text()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    for word in ("sim-ct200/1", "DDTREE", "b=16", "12.5s", "13.8s", "(2", "launches)"):
        assert any(word in line.split() or f"│ {word}" in line for line in text.splitlines()), (word, text)
    # The run column takes the room of the capture time (part of load), not of a whole word.
    hidden = "Hidden to fit 80 columns: pid, capture, deadline (--wide shows every column)."
    assert f"load, then smoke. {hidden}" in " ".join(text.split())  # two sentences, not run together
    wide = Console(record=True, width=80)
    monkeypatch.setattr(main, "console", wide)
    service._render_restart(main.AppContext(), FleetResult({"sim-ct200/1": r}), wide=True)
    shown = wide.export_text()
    assert "720s (inventory)" in shown and "424242" in shown and "4.6s" in shown
