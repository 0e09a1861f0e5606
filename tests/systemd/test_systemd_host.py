"""The systemd manager on a host run by a real systemd 252 (tests/systemdhost.py).

The host's SGLang is the operator's enabled ``sglang.service`` (``Restart=always``; the
simulator stands in for SGLang, from the host's venv with the real SGLang 0.5.23 files).
Everything goes through the CLI over SSH, as an operator runs it: the restart writes one
drop-in and a 0600 env file and proves the unit's new MainPID; systemd's own crash restart
and a reboot keep the patched launch; rollback gives the unit its own ExecStart back; the
inventory's env never reaches a command line (every execve on the host traced) nor the
drop-in; and a unit ddtree-ops cannot drive is refused in one line with nothing changed.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_json import json_data, read_envelope
from systemdhost import (
    UNIT,
    SystemdFleet,
    SystemdHost,
    cmdline,
    main_pid,
    reset,
    serving,
    systemd_inventory,
    wait_serving,
)

pytestmark = [pytest.mark.fleet, pytest.mark.slow, pytest.mark.timeout(600)]

DDTREE4 = ("--algorithm", "DDTREE", "--budget", "4", "--topk", "4")
DROPIN = f"/etc/systemd/system/{UNIT}.d/50-ddtree-ops.conf"
ENV_FILE = f"/etc/ddtree-ops/{UNIT}.env"


def _write_inventory(fleet: SystemdFleet, path: Path, *, host_vars: dict[str, Any] | None = None,
                     **server: object) -> Path:
    doc = systemd_inventory(fleet, **server)
    hosts = doc["all"]["children"]["systemd_hosts"]["hosts"]  # type: ignore[index]
    for name, extra in (host_vars or {}).items():
        entry = hosts[name]
        for key, value in extra.items():
            if key == "ddtree":
                entry["ddtree"] = {**entry["ddtree"], **value}
            else:
                entry[key] = value
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture
def host(systemd_host: SystemdFleet, sd_env: Path, cli: Callable[..., Any]) -> Iterator[SystemdHost]:
    """The host as its operator left it: the unit on its own ExecStart, serving, no patch."""
    h = systemd_host.hosts[0]
    if h.proc is None:
        h.boot()
    done = cli("-i", str(systemd_host.inventory), "rollback", "all")
    assert done.exit_code == 0, done.stdout + done.stderr
    reset(h)
    yield h


@pytest.fixture
def deployed(systemd_host: SystemdFleet, host: SystemdHost, cli: Callable[..., Any]) -> None:
    """The host with the DDTree bundle deployed (no restart): a DDTREE launch needs it."""
    done = cli("-i", str(systemd_host.inventory), "deploy", "sd-0")
    assert done.exit_code == 0, done.stdout + done.stderr


def _text(table: str) -> str:
    """A rendered table's words in order, its box drawing dropped (cells wrap across lines)."""
    return " ".join(w for w in table.split() if not set(w) <= set("│┃┏┓┗┛┡┩└┘━─╇┳┻┯┷╋┼┠┨"))


def _sha(host: SystemdHost, path: str) -> str:
    return hashlib.sha256(host.run("cat", path).stdout.encode()).hexdigest()


@pytest.mark.usefixtures("deployed")
def test_restart_goes_through_the_unit_and_proves_the_new_main_pid(
    systemd_host: SystemdFleet, host: SystemdHost, cli: Callable[..., Any], sd_env: Path
) -> None:
    inv = _write_inventory(systemd_host, sd_env / "inv.yaml", env={"HF_TOKEN": "hf_secret_token"})
    unit_before = _sha(host, f"/etc/systemd/system/{UNIT}")
    old = main_pid(host)
    done = cli("-i", str(inv), "--json", "restart", "sd-0", *DDTREE4)
    assert done.exit_code == 0, done.stdout + done.stderr
    result = json_data(done.stdout)["hosts"][0]["result"]
    new = main_pid(host)
    # Ready means the unit's NEW main process serves: its pid, not the old one's.
    assert result["pid"] == new != old
    argv = cmdline(host, new)
    assert argv == result["argv"]
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "5"
    # One drop-in of ours with that launch; the operator's unit file untouched.
    dropin = host.run("cat", DROPIN).stdout
    assert "ExecStart=\n" in dropin and f"EnvironmentFile={ENV_FILE}" in dropin
    assert _sha(host, f"/etc/systemd/system/{UNIT}") == unit_before
    props = host.systemctl_show(UNIT, "DropInPaths", "ActiveState", "UnitFileState")
    assert props["DropInPaths"] == DROPIN and props["ActiveState"] == "active" and props["UnitFileState"] == "enabled"
    # The env reaches the server through the 0600 file only.
    assert host.run("stat", "-c", "%a %U", ENV_FILE).stdout.split() == ["600", "root"]
    assert 'HF_TOKEN="hf_secret_token"' in host.run("cat", ENV_FILE).stdout
    assert "hf_secret_token" not in dropin
    environ = host.run("cat", f"/proc/{new}/environ").stdout.split("\0")
    assert "HF_TOKEN=hf_secret_token" in environ
    # logs: the journal of the unit since the restart.
    logs = cli("-i", str(inv), "logs", "sd-0", "-n", "200")
    assert logs.exit_code == 0 and "The server is fired up and ready to roll!" in logs.stdout
    assert "DDTREE: budget=4 topk=4" in logs.stdout


@pytest.mark.usefixtures("deployed")
def test_systemd_restarts_a_killed_server_with_the_patched_flags_and_service_status_says_so(
    systemd_host: SystemdFleet, host: SystemdHost, cli: Callable[..., Any], sd_env: Path
) -> None:
    inv = str(systemd_host.inventory)
    assert cli("-i", inv, "restart", "sd-0", *DDTREE4).exit_code == 0
    killed = main_pid(host)
    restarts = int(host.systemctl_show(UNIT, "NRestarts")["NRestarts"])
    host.run("kill", "-9", str(killed))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (main_pid(host) in (0, killed) or not serving(host)):
        time.sleep(0.2)
    revived = main_pid(host)
    assert revived not in (0, killed) and serving(host)
    assert "DDTREE" in cmdline(host, revived)
    assert int(host.systemctl_show(UNIT, "NRestarts")["NRestarts"]) == restarts + 1
    status = cli("-i", inv, "--json", "service-status", "sd-0")
    assert status.exit_code == 0, status.stdout + status.stderr
    row = json_data(status.stdout)["hosts"][0]["result"]
    assert row["manager"] == "systemd" and row["running"] and row["pid"] == revived
    assert row["unit"]["restarts"] == restarts + 1 and row["unit"]["dropin_in_effect"]
    assert row["run"] == "DDTREE budget=4 topk=4" and row["health"] == 200
    table = _text(cli("-i", inv, "service-status", "sd-0").stdout)
    assert f"sglang.service active (running), {restarts + 1} restart(s) by systemd, our drop-in, enabled" in table


@pytest.mark.usefixtures("deployed")
def test_after_a_reboot_the_unit_comes_back_serving_the_patched_launch(
    systemd_host: SystemdFleet, host: SystemdHost, cli: Callable[..., Any]
) -> None:
    inv = str(systemd_host.inventory)
    assert cli("-i", inv, "restart", "sd-0", *DDTREE4).exit_code == 0
    host.shutdown()
    assert host.proc is None
    host.boot()
    wait_serving(host)
    pid = main_pid(host)
    assert "DDTREE" in cmdline(host, pid)
    status = json_data(cli("-i", inv, "--json", "service-status", "sd-0").stdout)["hosts"][0]["result"]
    assert status["pid"] == pid and status["unit"]["dropin_in_effect"] and status["health"] == 200


def test_rollback_removes_the_dropin_and_the_operators_execstart_serves_again(
    systemd_host: SystemdFleet, host: SystemdHost, cli: Callable[..., Any]
) -> None:
    inv = str(systemd_host.inventory)
    operator_argv = cmdline(host, main_pid(host))
    # The operator made /etc/ddtree-ops by hand (empty): ours to use, never to remove.
    host.run("mkdir", "-m", "0700", "/etc/ddtree-ops")
    deployed = cli("-i", inv, "deploy", "sd-0", "--restart", "--budget", "4", "--topk", "4")
    assert deployed.exit_code == 0, deployed.stdout + deployed.stderr
    assert "DDTREE" in cmdline(host, main_pid(host))
    # ... and adds a drop-in of their own to the directory ddtree-ops made: it must stay.
    operator_dropin = f"/etc/systemd/system/{UNIT}.d/10-operator.conf"
    host.run("sh", "-c", f"printf '[Service]\\nEnvironment=OPERATOR_NOTE=kept\\n' > {operator_dropin} && "
                         "systemctl daemon-reload")
    try:
        done = cli("-i", inv, "--json", "rollback", "sd-0", "--restart")
        assert done.exit_code == 0, done.stdout + done.stderr
        row = json_data(done.stdout)[0]
        assert row["outcome"] == "rolled-back"
        assert "relaunched the previous server (the unit's own ExecStart" in row["servers"][0]
        assert host.run("test", "-e", DROPIN, check=False).returncode == 1
        assert host.run("test", "-e", ENV_FILE, check=False).returncode == 1
        # Ours gone; the operator's drop-in, its directory and their empty /etc/ddtree-ops kept.
        assert host.run("cat", operator_dropin).stdout == "[Service]\nEnvironment=OPERATOR_NOTE=kept\n"
        assert host.run("ls", "-A", "/etc/ddtree-ops").stdout == ""
        assert host.systemctl_show(UNIT, "DropInPaths")["DropInPaths"] == operator_dropin
    finally:
        host.run("sh", "-c", f"rm -f {operator_dropin} && systemctl daemon-reload")
    assert cmdline(host, main_pid(host)) == operator_argv and serving(host)
    status = json_data(cli("-i", inv, "--json", "service-status", "sd-0").stdout)["hosts"][0]["result"]
    assert status["run"] == "the unit's own ExecStart" and not status["unit"]["dropin_in_effect"]
    # Rolled back, the host's SGLang knows no DDTREE: a DDTREE restart is refused before the
    # unit is touched, naming the remedy, and the operator's server goes on serving.
    pid = main_pid(host)
    refused = cli("-i", inv, "--json", "restart", "sd-0", *DDTREE4)
    assert refused.exit_code == 4, refused.stdout + refused.stderr
    (error,) = [e for e in read_envelope(refused.stdout)["errors"] if e["host"] == "sd-0"]
    assert error["code"] == "not_deployed" and "`ddtree-ops deploy sd-0`" in error["message"], error
    assert main_pid(host) == pid and serving(host) and host.run("test", "-e", DROPIN, check=False).returncode == 1


def test_an_odd_argument_reaches_the_server_exactly_through_execstart(
    systemd_host: SystemdFleet, host: SystemdHost, cli: Callable[..., Any]
) -> None:
    odd = 'x "y" 50% $HOME \\z'
    done = cli("-i", str(systemd_host.inventory), "restart", "sd-0", "--algorithm", "AR",
               "--extra-arg=--served-model-name", f"--extra-arg={odd}")
    assert done.exit_code == 0, done.stdout + done.stderr
    argv = cmdline(host, main_pid(host))
    assert argv[-2:] == ["--served-model-name", odd]


@pytest.mark.usefixtures("deployed")
def test_a_capture_failure_relaunches_eager_through_the_dropin(
    systemd_host: SystemdFleet, host: SystemdHost, cli: Callable[..., Any], sd_env: Path
) -> None:
    # The B300 profile's capture crash above budget 8; SIM_GPU from the env file wins over
    # the operator's Environment= (systemd reads EnvironmentFile= after it).
    inv = _write_inventory(systemd_host, sd_env / "inv.yaml", env={"SIM_GPU": "b300"})
    done = cli("-i", str(inv), "--json", "restart", "sd-0", "--algorithm", "DDTREE", "--budget", "16", "--topk", "4")
    assert done.exit_code == 0, done.stdout + done.stderr
    result = json_data(done.stdout)["hosts"][0]["result"]
    assert result["attempts"] == 2 and result["cuda_graph"] is False
    assert "illegal memory access" in result["fallback_reason"]
    assert '"--cuda-graph-backend-decode" "disabled"' in host.run("cat", DROPIN).stdout
    assert "disabled" in cmdline(host, main_pid(host))


class ExecveTrace:
    """Every execve on the host while the block runs: strace follows the host's systemd
    (the units it starts) and its sshd (every session the CLI opens), children included."""

    def __init__(self, host: SystemdHost, out: Path) -> None:
        self.pids = [str(host.init_pid), str(host.outer_pid(main_pid(host, "ddtree-test-sshd.service")))]
        self.out = out
        self.argv = ["strace", "-f", "-qq", "-s", "100000", "-e", "trace=execve", "-o", str(out),
                     *[a for p in self.pids for a in ("-p", p)]]
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ExecveTrace:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # Attached: strace is the tracer of both processes (a fixed second was a guess that a
        # busy machine can miss, and the execs before it would go unseen).
        deadline = time.monotonic() + 60
        while not all(self._tracer(pid) == self.proc.pid for pid in self.pids):
            assert self.proc.poll() is None, self.proc.communicate()[1]
            assert time.monotonic() < deadline, "strace did not attach within 60 s"
            time.sleep(0.05)
        return self

    @staticmethod
    def _tracer(pid: str) -> int:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("TracerPid:")))

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(timeout=30)

    @property
    def calls(self) -> list[str]:
        return [line for line in self.out.read_text(errors="replace").splitlines() if "execve(" in line]


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (apt-get install strace)")
@pytest.mark.usefixtures("deployed")
def test_the_inventory_env_never_reaches_a_command_line_nor_the_dropin(
    systemd_host: SystemdFleet, host: SystemdHost, cli: Callable[..., Any], sd_env: Path
) -> None:
    secret = f"hf_{uuid.uuid4().hex}"
    inv = _write_inventory(systemd_host, sd_env / "inv.yaml", env={"HF_TOKEN": secret})
    with ExecveTrace(host, sd_env / "execve.trace") as trace:
        done = cli("-i", str(inv), "restart", "sd-0", *DDTREE4)
        cli("-i", str(inv), "service-status", "sd-0")
    assert done.exit_code == 0, done.stdout + done.stderr
    calls = trace.calls
    # Not vacuous: the trace saw the agent, systemctl and the server itself start.
    assert any("systemctl" in c for c in calls) and any("ddtree_ops.sim" in c for c in calls), calls[:20]
    assert not [c[:300] for c in calls if secret in c]
    assert secret not in host.run("cat", DROPIN).stdout
    assert f"HF_TOKEN={secret}" in host.run("cat", f"/proc/{main_pid(host)}/environ").stdout.split("\0")


def _refusal_setup(host: SystemdHost, kind: str) -> dict[str, Any]:
    """A host whose unit ddtree-ops must refuse, and the inventory settings that point at it."""
    if kind == "not_found":
        return {"unit": "nosuch.service"}
    if kind == "masked":
        host.run("ln", "-sf", "/dev/null", "/etc/systemd/system/masked-sglang.service")
        host.run("systemctl", "daemon-reload")
        return {"unit": "masked-sglang.service"}
    if kind == "user_unit":
        host.run("mkdir", "-p", "/etc/systemd/user")
        host.run("sh", "-c", f"cp /etc/systemd/system/{UNIT} /etc/systemd/user/sglang-user.service")
        return {"unit": "sglang-user.service"}
    if kind == "not_sglang":
        host.run("sh", "-c", "printf '[Service]\\nExecStart=/bin/sleep infinity\\n' > "
                             "/etc/systemd/system/other.service && systemctl daemon-reload")
        return {"unit": "other.service"}
    if kind == "permission":
        # '*': no password, but not a locked account, which sshd would refuse to log in.
        host.run("sh", "-c", "id gpuops >/dev/null 2>&1 || useradd -m -p '*' gpuops")
        return {"user": "gpuops"}
    raise AssertionError(kind)


@pytest.mark.parametrize(("kind", "message"), [
    ("not_found", "unit nosuch.service not found"),
    ("masked", "unit masked-sglang.service is masked (systemctl unmask masked-sglang.service first)"),
    ("user_unit", "sglang-user.service is a user unit (/etc/systemd/user/sglang-user.service), run by systemd "
                  "--user"),
    ("not_sglang", "the ExecStart of other.service is not an SGLang launch (/bin/sleep infinity)"),
    ("permission", "driving sglang.service needs root on this host"),
])
def test_a_unit_that_cannot_be_driven_is_refused_in_one_line_with_nothing_changed(
    systemd_host: SystemdFleet, host: SystemdHost, cli: Callable[..., Any], sd_env: Path, kind: str, message: str
) -> None:
    settings = _refusal_setup(host, kind)
    if "user" in settings:
        inv = _write_inventory(systemd_host, sd_env / "inv.yaml", host_vars={"sd-0": {
            "ansible_user": settings["user"], "ddtree": {"run_dir": "~/.ddtree-ops"}}})
    else:
        inv = _write_inventory(systemd_host, sd_env / "inv.yaml", unit=settings["unit"])
    before = (main_pid(host), host.run("sh", "-c", "ls -R /etc/systemd/system | md5sum").stdout)
    done = cli("-i", str(inv), "--json", "restart", "sd-0", "--algorithm", "AR")
    assert done.exit_code == 5, done.stdout + done.stderr
    env = read_envelope(done.stdout)
    host_error = next(e for e in env["errors"] if e["host"] == "sd-0")
    assert host_error["code"] == "unit_refused", host_error
    assert message in host_error["message"] and host_error["message"].endswith("nothing changed")
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert (main_pid(host), host.run("sh", "-c", "ls -R /etc/systemd/system | md5sum").stdout) == before
    assert host.run("test", "-e", DROPIN, check=False).returncode == 1 and serving(host)
    # doctor names the unit's state, and fails the host where restart would refuse it.
    if kind in ("not_found", "masked"):
        doctor = cli("-i", str(inv), "doctor", "sd-0")
        assert doctor.exit_code == 5 and message.split(" (")[0] in _text(doctor.stdout)


def test_doctor_reports_the_manager_and_the_units_state(
    systemd_host: SystemdFleet, host: SystemdHost, cli: Callable[..., Any]
) -> None:
    done = cli("-i", str(systemd_host.inventory), "doctor", "sd-0")
    assert done.exit_code == 0, done.stdout + done.stderr
    assert "systemd: sglang.service active (running), enabled, its own ExecStart" in _text(done.stdout)


def test_stop_is_systemctl_stop(systemd_host: SystemdFleet, host: SystemdHost, cli: Callable[..., Any]) -> None:
    done = cli("-i", str(systemd_host.inventory), "--json", "stop", "sd-0")
    assert done.exit_code == 0, done.stdout + done.stderr
    assert json_data(done.stdout)["hosts"][0]["result"]["was_running"]
    assert host.systemctl_show(UNIT, "ActiveState")["ActiveState"] == "inactive"


@pytest.mark.usefixtures("deployed")
def test_a_sweep_holds_the_host_and_switches_trees_live_through_the_unit(
    systemd_host: SystemdFleet, host: SystemdHost, cli: Callable[..., Any], sd_env: Path
) -> None:
    inv = str(systemd_host.inventory)
    operator_argv = cmdline(host, main_pid(host))
    sweep = sd_env / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({
        "name": "sd", "targets": ["sd-0"], "baselines": ["autoregressive"],
        "grid": {"algorithm": ["ddtree"], "budget": [4, 8], "topk": [4], "temperature": [0.0], "concurrency": [2]},
        "workload": {"prompt_set": "mixed", "num_prompts": 2, "max_new_tokens": 16, "seed": 0},
        "repeats": 1, "warmup": 0, "request_timeout_s": 60,
    }))
    out = sd_env / "results" / "sd.jsonl"
    runtime_dropin = f"/run/systemd/system/{UNIT}.d/60-ddtree-ops-sweep.conf"
    # Which of our drop-ins exist while the sweep runs (looked at every 0.2 s from outside).
    seen: set[str] = set()
    swept = threading.Event()

    def watch() -> None:
        while not swept.is_set():
            look = " ".join(f"test -e {path} && echo {path};" for path in (DROPIN, runtime_dropin))
            seen.update(host.run("sh", "-c", look, check=False).stdout.split())
            swept.wait(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        done = cli("-i", inv, "--json", "bench", "--sweep", str(sweep), "--out", str(out))
    finally:
        swept.set()
        watcher.join(30)
    assert done.exit_code == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The sweep's launches ran from its runtime drop-in only: ours in /etc was never written.
    assert seen == {runtime_dropin}
    from ddtree_ops.bench import ledger

    rows = ledger.read_ledger(out).rows
    assert [(r["algorithm"], r["budget"], r["status"]) for r in rows] == [
        ("AR", None, "ok"), ("DDTREE", 4, "ok"), ("DDTREE", 8, "ok")]
    # One DDTREE launch held both trees as runtime states: the unit ran it from the sweep's
    # runtime drop-in (its runtime-state file, relative, found in its WorkingDirectory).
    ddtree = [r for r in rows if r["algorithm"] == "DDTREE"]
    assert all(r["tree_switched"] for r in ddtree) and len({r["launch_id"] for r in ddtree}) == 1
    assert "--speculative-adaptive-config" in ddtree[0]["server_argv"]
    # Left as found: the unit on its operator's own ExecStart, a new main process serving it
    # (relaunched and proven ready); no drop-in of ours in /etc, the sweep's in /run gone.
    [put] = json_data(done.stdout)["hosts"][0]["put_back"]
    assert put["action"] == "relaunched" and put["before"].startswith("the unit's own ExecStart, running"), put
    assert put["ready"] and cmdline(host, main_pid(host)) == operator_argv and serving(host)
    for gone in (DROPIN, runtime_dropin, "/var/lib/ddtree-ops/sweep-launch.json",
                 # The sweep's lease was the host's while it ran, and is given back at its end.
                 "/var/lib/ddtree-ops/sweep.lease"):
        assert host.run("test", "-e", gone, check=False).returncode == 1, gone


@pytest.mark.usefixtures("deployed")
def test_logs_follow_reads_the_journal_from_its_cursor(
    systemd_host: SystemdFleet, host: SystemdHost, cli: Callable[..., Any]
) -> None:
    from ddtree_ops.inventory import load_inventory
    from ddtree_ops.service.lifecycle import manager_for
    from ddtree_ops.transport import open_transport

    target = load_inventory([systemd_host.inventory]).hosts["sd-0"]
    with open_transport(target) as t:
        first = manager_for(t, target).read_logs(lines=5)
        assert first["offset"] and len(first["lines"]) == 5
        assert cli("-i", str(systemd_host.inventory), "restart", "sd-0", *DDTREE4).exit_code == 0
        after = manager_for(t, target).read_logs(position=first["offset"])
    assert any("DDTREE: budget=4 topk=4" in line for line in after["lines"])
    assert any("fired up and ready to roll" in line for line in after["lines"])
    assert not set(first["lines"]) & set(after["lines"][-3:])


def test_a_unit_that_exits_while_loading_is_named_with_its_result_and_stopped(
    systemd_host: SystemdFleet, host: SystemdHost, cli: Callable[..., Any]
) -> None:
    # An argument the server refuses: it exits 2 before loading, and Restart=always would
    # start it again and again with that launch.
    done = cli("-i", str(systemd_host.inventory), "--json", "restart", "sd-0", "--algorithm", "AR",
               "--extra-arg=--no-such-flag")
    assert done.exit_code == 5, done.stdout + done.stderr
    error = next(e for e in read_envelope(done.stdout)["errors"] if e["host"] == "sd-0")
    assert error["code"] == "server_crashed", error
    assert "unit sglang.service exited during" in error["message"]
    assert "(Result=exit-code, status=2" in error["message"] and "unit stopped" in error["message"]
    assert "unrecognized arguments: --no-such-flag" in error["message"]  # the journal's own line
    time.sleep(3)  # longer than the unit's RestartSec: systemd did not start it again
    assert host.systemctl_show(UNIT, "ActiveState")["ActiveState"] in ("inactive", "failed")


@pytest.mark.usefixtures("deployed")
def test_restart_without_an_algorithm_repeats_the_units_last_launch_of_ours(
    systemd_host: SystemdFleet, host: SystemdHost, cli: Callable[..., Any]
) -> None:
    inv = str(systemd_host.inventory)
    # The unit runs its own ExecStart: there is no launch of ddtree-ops to repeat.
    refused = cli("-i", inv, "restart", "sd-0")
    assert refused.exit_code == 2, refused.stdout + refused.stderr
    assert "sglang.service runs its own ExecStart, not a launch of ddtree-ops: give --algorithm" in \
        _text(refused.stdout)
    assert cli("-i", inv, "restart", "sd-0", *DDTREE4).exit_code == 0
    first = main_pid(host)
    again = cli("-i", inv, "--json", "restart", "sd-0")
    assert again.exit_code == 0, again.stdout + again.stderr
    assert json_data(again.stdout)["hosts"][0]["result"]["run"] == "DDTREE budget=4 topk=4"
    assert main_pid(host) != first and "DDTREE" in cmdline(host, main_pid(host))
