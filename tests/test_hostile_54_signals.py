"""Issue 54 (d): signals at any moment of the process, reads that could block, and the
last tracebacks a fuzz of every command's options found (names no file system holds).

Signals: a Ctrl-C or SIGTERM ends ``ddtree-ops`` with 130 / 143 and one line on stderr,
wherever it lands: during the second of imports, while a command runs, after a first one, as
the process exits (README "Exit codes"). Real processes get real signals, each sent once the
moment it is meant for has come, never after a fixed sleep: a line in the server's log, or a
marker file the process writes. To make a moment last until the signal comes, a
``sitecustomize`` on the process's ``PYTHONPATH`` holds it there: the import of typer (the
first heavy import; the process's own handlers must already be in place), or the
interpreter's exit (a thread still running, as a fan-out's worker that is still ending a
host: the interpreter waits for it). Each process is the console script's entry as pip's
wrapper calls it (pyproject's ``[project.scripts]``) or ``python -m ddtree_ops``.

Reads: a FIFO, a device or a directory where the toolkit reads a file on a host (the
placed policy, a file ``deploy --diff`` compares) is refused at once, over SSH as locally,
one line naming host and path; sftp-server opened a FIFO waiting for a writer (the
command, and the SSH session, hung) and read a device without end.

Names past NAME_MAX / PATH_MAX: a path option is a usage error naming the option
(``Path.exists()`` raised ENAMETOOLONG through every check of an existing file); a program
or working directory of a local host fails as the SSH transport's shell does.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_json import read_envelope
from fleetlib import Fleet
from test_hostile_inputs import SWEEP, policy, state
from testports import free_port

from ddtree_ops.errors import RemoteFileError
from ddtree_ops.inventory_types import Host
from ddtree_ops.transport import Transport, open_transport

REPO = Path(__file__).resolve().parents[1]
_SCRIPT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["ddtree-ops"]
_MODULE, _FUNCTION = _SCRIPT.split(":")
# What pip's console-script wrapper runs (its `ddtree-ops` file in the venv's bin/).
WRAPPER = f"import sys\nfrom {_MODULE} import {_FUNCTION}\nsys.argv[0] = 'ddtree-ops'\nsys.exit({_FUNCTION}())\n"
LAUNCHERS = {"script": (sys.executable, "-c", WRAPPER), "module": (sys.executable, "-m", "ddtree_ops")}

# Holds a moment of the process open until the test's signal ends it (module docstring).
SITECUSTOMIZE = '''
import os, sys, threading, time

def _mark(path):
    with open(path, "w"):
        pass

# Popped: for this process only, not the host programs and servers it starts.
_import_marker = os.environ.pop("HOLD_IMPORT_MARKER", None)
if _import_marker:
    class _HoldImport:
        def find_spec(self, name, path=None, target=None):
            if name == "typer":
                _mark(_import_marker)
                while True:  # the signal's KeyboardInterrupt ends the import here
                    time.sleep(0.05)
            return None

    sys.meta_path.insert(0, _HoldImport())

_exit_marker = os.environ.pop("HOLD_EXIT_MARKER", None)
if _exit_marker:
    def _hold_exit():
        while threading.main_thread().is_alive():  # until the interpreter begins its exit
            time.sleep(0.02)
        _mark(_exit_marker)
        while True:  # a thread the interpreter waits for: only the signal ends the process now
            time.sleep(0.05)

    threading.Thread(target=_hold_exit, name="hold-exit").start()
'''

INTERRUPTED = "error: interrupted; each host's state is shown above"


def late_line(status: int) -> str:
    return f"interrupted as ddtree-ops was exiting (the command's own exit status: {status})"


@dataclass(frozen=True)
class SignalCase:
    name: str
    launcher: str  # a key of LAUNCHERS
    args: tuple[str, ...]  # "{inv}" is the case's inventory
    signals: tuple[tuple[str, signal.Signals], ...]  # (the moment, the signal sent once it has come)
    exit_code: int
    stderr: tuple[str, ...]  # every line on stderr
    stdout: str = ""  # a substring of stdout ("": nothing asserted)


HOSTS = ("-i", "{inv}", "hosts")
RESTART = ("-i", "{inv}", "restart", "all", "--algorithm", "AR", "--serial", "1")
INT, TERM = signal.SIGINT, signal.SIGTERM

CASES: tuple[SignalCase, ...] = (
    # The first second: typer, rich, pandas and every command module import.
    SignalCase("Ctrl-C during the imports", "module", HOSTS, (("import", INT),), 130, ("interrupted",)),
    SignalCase("SIGTERM during the imports, --json", "script", ("--json", *HOSTS), (("import", TERM),), 143,
               ("interrupted",)),
    # The command has finished and written its output; the interpreter is exiting.
    SignalCase("Ctrl-C as the command exits", "script", HOSTS, (("exit", INT),), 130, (late_line(0),), "local"),
    SignalCase("SIGTERM as the command exits", "module", HOSTS, (("exit", TERM),), 143, (late_line(0),), "local"),
    # restart --serial 1: the first signal while host a loads (b not reached), the second
    # once its wind-down is over and the process exits. The first one names the status.
    SignalCase("restart --serial 1: a second Ctrl-C as it exits", "module", RESTART,
               (("loading", INT), ("exit", INT)), 130, (INTERRUPTED,), "a: no server"),
    SignalCase("restart --serial 1: Ctrl-C, then SIGTERM as it exits", "script", RESTART,
               (("loading", INT), ("exit", TERM)), 130, (INTERRUPTED,), "a: no server"),
    SignalCase("restart --serial 1 --json: SIGTERM, then Ctrl-C as it exits", "script", ("--json", *RESTART),
               (("loading", TERM), ("exit", INT)), 143, (INTERRUPTED,)),
)


@pytest.fixture(scope="module")
def holds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the ``sitecustomize`` (put first on a process's PYTHONPATH)."""
    where = tmp_path_factory.mktemp("holds")
    (where / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return where


def sim_inventory(tmp_path: Path) -> Path:
    """Hosts a and b, simulated servers that never finish loading."""
    hosts = {
        name: {"ansible_connection": "local", "ddtree": {
            "python": sys.executable, "run_dir": str(tmp_path / f"run-{name}"),
            "server": {"command": "{python} -m ddtree_ops.sim", "model_path": "sim/m", "draft_model_path": "sim/d",
                       "port": free_port(), "expected_load_s": 2,
                       "env": {"SIM_LOAD_S": "6000", "SIM_TIME_SCALE": "0.1"}}}}
        for name in ("a", "b")
    }
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    return path


def wait_for(proc: subprocess.Popen[str], moment: str, what: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 120  # the event itself decides; this only bounds a broken run
    while not what():
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate()
            pytest.fail(f"the process never reached {moment!r} (exit {proc.returncode}): {out[-1500:]}{err[-1500:]}")
        time.sleep(0.02)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_signal_at_any_moment_exits_130_or_143_with_one_line(
    case: SignalCase, holds: Path, tmp_path: Path, cli: Callable[..., Any]
) -> None:
    inv = sim_inventory(tmp_path)
    markers = {"import": tmp_path / "importing", "exit": tmp_path / "exiting"}
    path = os.pathsep.join([str(holds), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": path}
    moments = {m for m, _ in case.signals}
    env.update({f"HOLD_{m.upper()}_MARKER": str(markers[m]) for m in ("import", "exit") if m in moments})
    args = [a.replace("{inv}", str(inv)) for a in case.args]
    log = tmp_path / "run-a" / "server.log"
    reached: dict[str, Callable[[], bool]] = {
        "import": markers["import"].exists,
        "exit": markers["exit"].exists,
        "loading": lambda: log.exists() and "Load weight begin." in log.read_text(errors="replace"),
    }
    proc = subprocess.Popen([*LAUNCHERS[case.launcher], *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    try:
        for moment, sig in case.signals:
            wait_for(proc, moment, reached[moment])
            proc.send_signal(sig)
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"still running after its last signal: {out[-1500:]}{err[-1500:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
        stopped = cli("-i", str(inv), "--json", "stop", "all")  # a server left running is this test's to end
    assert proc.returncode == case.exit_code, (out[-2000:], err[-2000:])
    assert "Traceback" not in out + err
    assert [line for line in err.splitlines() if line.strip()] == list(case.stderr), err[-2000:]
    assert case.stdout in out, out[-2000:]
    if "--json" in case.args:
        envelope = read_envelope(out)
        assert envelope["exit_code"] == case.exit_code and envelope["errors"][0]["code"] == "interrupted", envelope
    if "restart" in case.args:  # the restart stopped the server it started
        rows = read_envelope(stopped.stdout)["data"]["hosts"]
        assert [(r["host"], r["result"]["was_running"]) for r in rows] == [("a", False), ("b", False)], rows


def test_the_console_script_and_python_m_share_the_entry_point() -> None:
    """Both launchers reach the one entry that owns the signals (cli/entry.py)."""
    assert _SCRIPT == "ddtree_ops.cli.entry:main"
    tree = ast.parse((REPO / "ddtree_ops" / "__main__.py").read_text())
    imported = [(n.module, [a.name for a in n.names]) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert imported == [("__future__", ["annotations"]), ("ddtree_ops.cli.entry", ["main"])]
    # Nothing heavy before the handlers: the entry module and the one with the handlers
    # import the standard library's lightest parts only, at their top.
    for name in ("entry", "interrupts"):
        tree = ast.parse((REPO / "ddtree_ops" / "cli" / f"{name}.py").read_text())
        top = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        top |= {f"{n.module}.{a.name}" for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
        assert top <= {"__future__.annotations", "atexit", "os", "signal", "sys", "ddtree_ops.cli.interrupts"}, top


def test_the_in_process_run_leaves_the_signals_as_it_found_them(cli: Callable[..., Any]) -> None:
    """run() is also the tests' in-process entry: what it installs must not outlive it in
    the pytest worker (a SIG_IGN left there was inherited by every later subprocess)."""
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    res = cli("--version")
    assert res.exit_code == 0
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


# --- reads of a file on a host that is not a regular file ---------------------------------


@dataclass(frozen=True)
class ReadCase:
    name: str
    make: Callable[[Path], Path]  # makes the thing in a scratch directory, returns the path to read
    reason: str


def _fifo(scratch: Path) -> Path:
    os.mkfifo(scratch / "policy.json")  # nothing ever writes to it
    return scratch / "policy.json"


def _link_to_fifo(scratch: Path) -> Path:
    os.mkfifo(scratch / "real")
    (scratch / "launch.json").symlink_to(scratch / "real")
    return scratch / "launch.json"


def _directory(scratch: Path) -> Path:
    (scratch / "state.json").mkdir()
    return scratch / "state.json"


READ_CASES = (
    ReadCase("a FIFO", _fifo, "not a regular file"),
    ReadCase("a link to a FIFO", _link_to_fifo, "not a regular file"),
    ReadCase("a device that never ends", lambda scratch: Path("/dev/zero"), "not a regular file"),
    ReadCase("a directory", _directory, "is a directory"),
)


@pytest.fixture(params=["local", pytest.param("ssh", marks=pytest.mark.fleet)])
def host_transport(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Host, Transport]]:
    if request.param == "local":
        host = Host("here", connection="local")
    else:
        fleet: Fleet = request.getfixturevalue("ssh_fleet")
        host = fleet.load().hosts[fleet.hosts[0].name]
    with open_transport(host) as transport:
        yield host, transport


def _read_within(transport: Transport, path: Path, seconds: float) -> BaseException | bytes | None:
    """The read's outcome, or None while it is still blocked after ``seconds`` (a hang guard,
    not a timing claim: the read is refused before any byte moves, or never ends)."""
    box: list[BaseException | bytes] = []

    def read() -> None:
        try:
            box.append(transport.read_bytes(str(path)))
        except BaseException as exc:  # noqa: BLE001 - the outcome is the test's to judge
            box.append(exc)

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    worker.join(seconds)
    return box[0] if box else None


@pytest.mark.parametrize("case", READ_CASES, ids=[c.name for c in READ_CASES])
def test_reading_a_file_that_is_not_regular_is_refused_at_once(
    case: ReadCase, host_transport: tuple[Host, Transport], tmp_path: Path
) -> None:
    host, transport = host_transport
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    path = case.make(scratch)
    outcome = _read_within(transport, path, 30)
    if outcome is None and path.is_fifo():  # blocked on the FIFO: a writer lets the read end
        with open(path, "wb"):
            pass
    assert isinstance(outcome, RemoteFileError), f"{case.name}: read gave {type(outcome).__name__}"
    assert str(outcome) == f"{host.name}: cannot read {path}: {case.reason}"
    assert outcome.host == host.name
    (scratch / "fine.json").write_text('{"ok": 1}')  # the connection is still good for the next read
    assert transport.read_bytes(str(scratch / "fine.json")) == b'{"ok": 1}'


@pytest.mark.fleet
def test_restart_with_its_placed_policy_a_fifo_on_an_ssh_host_is_one_line(
    ssh_fleet: Fleet, tmp_path: Path, cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The placed policy a DDTREE restart reads back before it launches (its hash checked):
    a FIFO there on an SSH host fails that host in one line, nothing launched."""
    doc = yaml.safe_load(ssh_fleet.inventory.read_text())
    group = doc["all"]["children"]["fleet"]
    fhost = ssh_fleet.hosts[1]  # the B300: the policy's machine type
    server = {"command": "{python} -m ddtree_ops.sim", "model_path": "sim/qwen3-8b",
              "draft_model_path": "sim/qwen3-8b-dflash", "port": free_port(), "expected_load_s": 5}
    h = {**group["hosts"][fhost.name]}
    h["ddtree"] = {**h["ddtree"], "python": sys.executable, "run_dir": str(tmp_path / "run"), "gpu": "b300",
                   "server": server}
    group["hosts"] = {"h": h}
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump(doc))
    placed = tmp_path / "placed.json"
    os.mkfifo(placed)
    (tmp_path / "state.json").write_text(state(policies=policy(str(placed))))
    monkeypatch.setenv("DDTREE_OPS_STATE", str(tmp_path / "state.json"))
    monkeypatch.setenv("COLUMNS", "200")
    res = cli("-i", str(inv), "restart", "h", "--algorithm", "DDTREE")
    assert res.exit_code == 4, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == ["error: restart failed on 1 of 1 host(s): h"]
    # Compared without whitespace: the tmp path folds where the columns end.
    assert "".join(f"cannot read {placed}: not a regular file".split()) in "".join(res.stdout.split()), res.stdout
    assert placed.is_fifo() and not (tmp_path / "run" / "launch.json").exists()


# --- path options with names no file system holds -------------------------------------------

LONG_NAME = "y" * 300  # one name past NAME_MAX (255 on Linux file systems)
LONG_PATH = "a/" * 2100  # short names, 4,200 bytes: past PATH_MAX (4,096)
NAME = "a name in the path is 300 bytes long"
PATH = "the path is 4,200 bytes long"


@dataclass(frozen=True)
class PathCase:
    args: tuple[str, ...]  # "{tmp}" is the tmp dir
    line: str  # a substring of the one "Error: Invalid value for ..." line
    # A global option's usage error comes before --json is read: no envelope (as for every
    # global option's bad value).
    global_option: bool = False


PATH_CASES = (
    PathCase(("-i", LONG_PATH, "hosts"), f"Invalid value for '-i' / '--inventory': {PATH}", global_option=True),
    PathCase(("-i", "{tmp}/inv.yaml", "deploy", "h", "--dry-run", "--bundle", LONG_NAME),
             f"Invalid value for '--bundle': {NAME}"),
    PathCase(("-i", "{tmp}/inv.yaml", "status", "h", "--bundle", LONG_PATH), f"Invalid value for '--bundle': {PATH}"),
    PathCase(("-i", "{tmp}/inv.yaml", "selftest", "h", "--out", LONG_NAME), f"Invalid value for '--out': {NAME}"),
    PathCase(("-i", "{tmp}/inv.yaml", "bench", "--sweep", "{tmp}/s.yaml", "--dry-run", "--out", f"{{tmp}}/{LONG_NAME}"),
             f"Invalid value for '--out' / '-o': {NAME}"),
    PathCase(("report", "{tmp}/l.jsonl", "--csv", LONG_NAME), f"Invalid value for '--csv': {NAME}"),
    PathCase(("report", LONG_PATH), f"Invalid value for 'LEDGERS': {PATH}"),
    PathCase(("tune", "{tmp}/l.jsonl", "--out", LONG_PATH), f"Invalid value for '--out': {PATH}"),
)


@pytest.mark.parametrize("case", PATH_CASES, ids=[" ".join(a[:28] for a in c.args[:6]) for c in PATH_CASES])
@pytest.mark.parametrize("json_output", [False, True], ids=["text", "json"])
def test_a_path_no_file_system_can_hold_is_a_usage_error(
    case: PathCase, json_output: bool, cli: Callable[..., Any], tmp_path: Path
) -> None:
    """Path.exists() raises ENAMETOOLONG on such a name: it went through as a traceback."""
    (tmp_path / "inv.yaml").write_text(yaml.safe_dump({"all": {"hosts": {"h": {"ansible_connection": "local"}}}}))
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(SWEEP))
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "l.jsonl").write_text("")
    before = sorted(p.name for p in tmp_path.iterdir())
    args = [a.replace("{tmp}", str(tmp_path)) for a in case.args]
    res = cli(*(["--json", *args] if json_output else args))
    assert res.exit_code == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stdout + res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and case.line in errors[0], res.stderr[-2000:]
    assert LONG_NAME not in res.stderr and LONG_PATH[:100] not in res.stderr  # the value is not echoed
    if json_output and not case.global_option:
        envelope = read_envelope(res.stdout)
        assert envelope["errors"][0]["code"] == "config" and case.line in envelope["errors"][0]["message"]
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize(("where", "exit_code", "says"), [("program", 127, "File name too long"), ("cwd", 1, "cd")])
def test_a_command_whose_name_no_file_system_holds_fails_as_in_a_shell(
    where: str, exit_code: int, says: str, host_transport: tuple[Host, Transport], tmp_path: Path
) -> None:
    """An inventory's ``ddtree.python`` or ``run_dir`` past NAME_MAX: the local transport let
    Popen's OSError(ENAMETOOLONG) through (``logs`` on such a host was a traceback); it
    fails as the SSH transport's shell does (sh's exec: 127; its cd: 1)."""
    _, transport = host_transport
    long = str(tmp_path / LONG_NAME)
    argv, cwd = ([long, "-c", "pass"], None) if where == "program" else (["true"], long)
    result = transport.run(argv, cwd=cwd, timeout=60)
    assert result.returncode == exit_code, result
    assert says in result.stderr and LONG_NAME in result.stderr and result.stdout == "", result
