"""Hostile values (issue 54a): a unit name that becomes a systemctl option, numbers in
digits that are not ASCII, gate flags out of any sensible range, load times of centuries,
group names that are two targets.

One table, :data:`CASES`, run in-process through the real entry point as
``tests/test_hostile_inputs.py`` runs its own: the files a case writes, the command, the
exit code and the line that refuses it. Every flag case aims at an SSH host nothing
listens for: a value that got past the checks reaches the connection and fails there
(exit 3), so exit 2 with the flag's line proves it was refused before any host was
touched. Beside the table: every number option of every command read through the same
check (:func:`test_every_number_option_reads_ascii_digits_only`), and the unit agent's
``systemctl`` / ``journalctl`` argv for a unit name that got past the schema
(:func:`test_the_unit_agent_never_passes_a_unit_name_as_an_option`).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from test_cli_basics import one_error_line
from test_hostile_inputs import AR, TREE, ledger, load_time, row, state, write_files
from testports import free_port

from ddtree_ops.cli import main as cli_main
from ddtree_ops.probe import PROBE_SOURCE
from ddtree_ops.service import _unit_agent

# --- the files the cases write -------------------------------------------------------


def unreachable() -> str:
    """One SSH host ``h`` on a loopback port nothing listens on (a B300)."""
    server = {"model_path": "sim/qwen3-8b", "draft_model_path": "sim/qwen3-8b-dflash", "port": 30000}
    host = {"ansible_host": "127.0.0.1", "ansible_port": free_port(), "ansible_user": "nobody",
            "ddtree": {"python": "python3", "gpu": "b300", "server": server}}
    return yaml.safe_dump({"all": {"hosts": {"h": host}}})


def local(**server: Any) -> str:
    """One local host ``h`` with ``server`` over a minimal server block (only loaded: ``hosts``)."""
    host = {"ansible_connection": "local", "ddtree": {"python": "python3", "server": {"model_path": "m", **server}}}
    return yaml.safe_dump({"all": {"hosts": {"h": host}}})


def unit(name: Any, **server: Any) -> str:
    return local(manager="systemd", unit=name, **server)


def named(pattern: str, **host_vars: Any) -> str:
    """One host written as ``pattern`` (a range, a port after ':')."""
    return yaml.safe_dump({"all": {"hosts": {pattern: {"ansible_connection": "local", **host_vars}}}})


def grouped(group: str) -> str:
    return yaml.safe_dump({"all": {"children": {group: {"hosts": {"h": {"ansible_connection": "local"}}}}}})


# --- the table -----------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    files: Mapping[str, str]  # name in the tmp dir -> text ("{tmp}" is the tmp dir)
    args: tuple[str, ...]  # "{tmp}" is the tmp dir; with "--json", stdout is checked as the envelope
    line: str  # a substring of the line that refuses it ("" with exit 0: the value is fine)
    exit_code: int = 2
    # A value the option parser refuses: click's usage block, whose "Error: Invalid value
    # for '--flag': ..." line carries ``line`` (range and type errors of every option look so).
    usage: bool = False
    # Environment variables the command sees; their values must appear nowhere in its output
    # (a unit name read by lookup('env') is masked, a character or its length included).
    env: tuple[tuple[str, str], ...] = ()


INV = ("-i", "{tmp}/inv.yaml")
FLEET = {"inv.yaml": unreachable()}
RESTART = (*INV, "restart", "h", "--algorithm", "DDTREE", "--budget", "8", "--topk", "4")
CANARY = (*RESTART, "--canary", "h")
# Measured on h: its machine type's policy launches budget 8, top-k 4.
TUNE = {"inv.yaml": unreachable(), "l.jsonl": ledger(row(algorithm="AR", host="h"), row(budget=8, topk=4, host="h"))}
ASCII_INT = "is not a whole number in ASCII digits"
ASCII_FLOAT = "is not a finite number in ASCII digits"
HOSTS = (*INV, "hosts")
UNIT = "ddtree.server.unit"
DASH = "a unit name starting with '-' would be an option to systemctl and journalctl"
CHARS = "a unit name has letters, digits and : _ . - \\ @ only, not "


def flag(name: str, value: str, line: str, *, args: tuple[str, ...] = RESTART, usage: bool = True) -> Case:
    return Case(f"{args[3]} {name} {value!r}", FLEET, (*args, name, value), line, usage=usage)


CASES: tuple[Case, ...] = (
    # --canary N / --serial N: hand-parsed, one line, before any host (issue: '²' was a traceback).
    Case("restart --canary '²'", FLEET, (*RESTART, "--canary", "²"), "--canary '²': '²' is not one of the targets"),
    Case("restart --json --canary '²': the envelope", FLEET, (*RESTART, "--json", "--canary", "²"),
         "--canary '²': '²' is not one of the targets"),
    Case("restart --canary '٣' (Arabic-Indic 3) is no count", FLEET, (*RESTART, "--canary", "٣"),
         "--canary '٣': '٣' is not one of the targets"),
    Case("tune --deploy --canary '²'", TUNE, (*INV, "tune", "{tmp}/l.jsonl", "--deploy", "h", "--canary", "²"),
         "--canary '²': '²' is not one of the targets"),
    Case("tune --json --deploy --canary '²'", TUNE,
         (*INV, "tune", "{tmp}/l.jsonl", "--json", "--deploy", "h", "--canary", "²"), "--canary '²'"),
    Case("deploy --restart --canary '²'", FLEET, (*INV, "deploy", "h", "--restart", "--canary", "²"),
         "--canary '²': '²' is not one of the targets"),
    Case("restart --canary 0", FLEET, (*RESTART, "--canary", "0"), "--canary 0: at least one host"),
    Case("restart --serial '٣' (ran a real 3-host batch)", FLEET, (*RESTART, "--serial", "٣"),
         "--serial '٣': expected a number of hosts (2) or a share of them (25%)"),
    Case("restart --serial '²'", FLEET, (*RESTART, "--serial", "²"), "--serial '²': expected a number of hosts"),
    Case("restart --serial '٥٠%'", FLEET, (*RESTART, "--serial", "٥٠%"), "--serial '٥٠%': expected a number"),
    Case("restart --serial of 5000 digits", FLEET, (*RESTART, "--serial", "9" * 5000),
         f"--serial '{'9' * 40}…': expected a number of hosts"),
    # Typed number options: ASCII digits only, a float finite (the parser's usage block).
    flag("--max-fail", "٣", f"Invalid value for '--max-fail': '٣' {ASCII_INT}"),
    flag("--max-fail", "²", f"'²' {ASCII_INT}"),
    flag("--max-fail", "1_0", f"'1_0' {ASCII_INT}"),
    flag("--max-fail", "３", f"'３' {ASCII_INT}"),
    flag("--max-fail", "1.0", f"'1.0' {ASCII_INT}"),
    flag("--budget", "٨", f"Invalid value for '--budget': '٨' {ASCII_INT}"),
    flag("--timeout", "1_0", f"Invalid value for '--timeout': '1_0' {ASCII_FLOAT}"),
    flag("--timeout", "nan", f"'nan' {ASCII_FLOAT}"),
    flag("--timeout", "1e400", f"'1e400' {ASCII_FLOAT}"),
    flag("--smoke-temperature", "١.٥", f"Invalid value for '--smoke-temperature': '١.٥' {ASCII_FLOAT}"),
    Case("--max-parallel '٣' (a global option)", FLEET, (*INV, "--max-parallel", "٣", "status", "h"),
         f"Invalid value for '--max-parallel': '٣' {ASCII_INT}", usage=True),
    Case("status --max-parallel 1_0 (after the command)", FLEET, (*INV, "status", "h", "--max-parallel", "1_0"),
         f"'1_0' {ASCII_INT}", usage=True),
    Case("restart --json --max-fail '²': the envelope", FLEET, (*RESTART, "--json", "--max-fail", "²"),
         f"'²' {ASCII_INT}", usage=True),
    Case("selftest --e2e --budgets '²'", FLEET, (*INV, "selftest", "h", "--e2e", "--budgets", "4,²"),
         "--budgets: '²' is not a tree budget"),
    Case("report --mix '٠.٥'", {"l.jsonl": ledger(AR, TREE)}, ("report", "{tmp}/l.jsonl", "--mix", "chat=٠.٥"),
         "--mix: 'chat=٠.٥' is not data_set=weight"),
    # Gate flags: finite, in their ranges, before any host (inf restarted the canary, then failed it).
    flag("--gate-temperature", "inf", f"Invalid value for '--gate-temperature': 'inf' {ASCII_FLOAT}", args=CANARY),
    flag("--gate-temperature", "1e308", "Invalid value for '--gate-temperature': Input should be less than or "
         "equal to 2", args=CANARY),
    flag("--gate-temperature", "2.5", "Input should be less than or equal to 2", args=CANARY),
    flag("--gate-temperature", "0", "Invalid value for '--gate-temperature'", args=CANARY),
    flag("--gate-accept-floor", "inf", f"'inf' {ASCII_FLOAT}", args=CANARY),
    flag("--gate-accept-floor", "1e308", "--gate-accept-floor 1e+308: must be below 9, the largest acceptance "
         "length of the tree launched (DDTREE budget 8: 8 nodes and the bonus token)", args=CANARY, usage=False),
    flag("--gate-accept-floor", "9", "--gate-accept-floor 9: must be below 9", args=CANARY, usage=False),
    flag("--gate-accept-floor", "0.5", "Input should be greater than or equal to 1", args=CANARY),
    Case("--gate-accept-floor for a DFLASH canary of 4 draft tokens", FLEET,
         (*INV, "restart", "h", "--algorithm", "DFLASH", "--budget", "4", "--canary", "h", "--gate-accept-floor", "4"),
         "--gate-accept-floor 4: must be below 4, the largest acceptance length of the tree launched (DFLASH 4 "
         "draft tokens)"),
    Case("--gate-accept-floor for an AR canary", FLEET,
         (*INV, "restart", "h", "--algorithm", "AR", "--canary", "h", "--gate-accept-floor", "1.5"),
         "--gate-accept-floor: the canary launches AR, which does not speculate: there is no acceptance to judge"),
    Case("tune --deploy --gate-accept-floor above the policy's tree", TUNE,
         (*INV, "tune", "{tmp}/l.jsonl", "--deploy", "h", "--canary", "h", "--gate-accept-floor", "9"),
         "--gate-accept-floor 9: must be below 9, the largest acceptance length of the tree launched (DDTREE budget "
         "8: 8 nodes and the bonus token)"),
    flag("--gate-tie-epsilon", "1e308", "Invalid value for '--gate-tie-epsilon': Input should be less than or "
         "equal to 1", args=CANARY),
    flag("--gate-tie-epsilon", "nan", f"'nan' {ASCII_FLOAT}", args=CANARY),
    flag("--gate-min-speed", "1e9", "Invalid value for '--gate-min-speed': Input should be less than or equal to "
         "10", args=CANARY),
    flag("--gate-min-speed", "-inf", f"'-inf' {ASCII_FLOAT}", args=CANARY),
    flag("--gate-agreement", "nan", f"'nan' {ASCII_FLOAT}", args=CANARY),
    Case("a gate option without --canary (nothing would be gated)", FLEET, (*RESTART, "--gate-temperature", "0.5"),
         "--gate-temperature sets the canary's gate: add --canary HOST (or --canary N)"),
    Case("deploy --restart --gate-accept-floor without --canary", FLEET,
         (*INV, "deploy", "h", "--restart", "--gate-accept-floor", "2"), "--gate-accept-floor sets the canary's gate"),
    # In range: refused by nothing but the host nobody answers on (the checks do not over-refuse).
    Case("--gate-accept-floor 8.9 with budget 8 reaches the host", FLEET,
         (*CANARY, "--gate-accept-floor", "8.9", "--gate-temperature", "2", "--gate-tie-epsilon", "1",
          "--gate-min-speed", "10", "--serial", "1", "--max-fail", "+0"), "restart failed on 1 of 1 host(s): h",
         exit_code=3),
    # Unit names: systemd.unit(5)'s grammar, no leading '-', where the inventory is read.
    *(Case(f"unit {name!r}", {"inv.yaml": unit(name)}, HOSTS, f"{UNIT}: {why}, got {name!r}")
      for name, why in (
          ("-Hroot@127.0.0.9.service", DASH),
          ("--user.service", DASH),
          ("-Mfoo.service", DASH),
          ("--help.service", DASH),
          ("a" * 248 + ".service", "a systemd unit name has at most 255 bytes, this one 256"),
          ("sglang.socket", "that is a socket unit: ddtree-ops drives the service that runs SGLang, as sglang.service"),
          ("sglang", "expected a unit type after the last '.', as in sglang.service"),
          ("sglang.servic", "expected a unit type after the last '.', as in sglang.service"),
          (".service", "expected a name before '@' and '.service', as in sglang.service or sglang@.service"),
          ("@0.service", "expected a name before '@' and '.service', as in sglang.service or sglang@.service"),
          ("a@b@c.service", "'@' once at most: a template is sglang@.service, its instance sglang@0.service"),
          ("sglang .service", f"{CHARS}' '"),
          ("sglang\u0430.service", f"{CHARS}'\u0430'"),
          ("sglang/x.service", f"{CHARS}'/'"),
          ("sglang%i.service", f"{CHARS}'%'"),
          ("sgl\nang.service", f"{CHARS}'\\n'"),
          (7, "expected a systemd service unit name such as sglang.service or sglang@.service"),
      )),
    Case("unit: a template whose slot instances pass 255 bytes", {"inv.yaml": unit(
        "a" * 245 + "@.service", slots={"count": 12, "gpus_per_slot": 1})}, HOSTS,
        f"{UNIT}: slot 11 runs {'a' * 245}@11.service: a systemd unit name has at most 255 bytes, this one 256"),
    Case("unit: a name made by a template", {"inv.yaml": unit("{{ '-H' ~ 'x' }}.service")}, HOSTS,
         f"{UNIT}: {DASH}, got '-Hx.service'"),
    *(Case(f"unit read by lookup('env'): {secret!r}", {"inv.yaml": unit("{{ lookup('env', 'UNIT_S') }}.service")},
           HOSTS, f"{UNIT}: {why}, got <value of lookup('env', 'UNIT_S')>", env=(("UNIT_S", secret),))
      for secret, why in (("-HS3CR3T", DASH), ("S3CR3T\u00e9", "a unit name has letters, digits and : _ . - \\ @ only"),
                          ("S3CR3T" * 50, "a systemd unit name has at most 255 bytes"))),
    *(Case(f"unit {name!r} is fine", {"inv.yaml": unit(name, **server)}, HOSTS, "", exit_code=0)
      for name, server in (("a" * 247 + ".service", {}), ("sglang@gpu-0:x_y.service", {}),
                           (r"sglang@a\x2db.service", {}),
                           ("a" * 245 + "@.service", {"slots": {"count": 10, "gpus_per_slot": 1}}))),
    # expected_load_s: a load time, (0, 86400] (the state file's bound).
    *(Case(f"expected_load_s {value!r}", {"inv.yaml": local(expected_load_s=value)}, HOSTS,
           "ddtree.server.expected_load_s: expected a load time in seconds, more than 0 and at most 86400 (a day)")
      for value in (86401, 86400.5, 1e300, float("inf"), 0, -5, "{{ 86401 }}", True, "60")),
    Case("expected_load_s 86400 is fine", {"inv.yaml": local(expected_load_s=86400)}, HOSTS, "", exit_code=0),
    # The state file's learned times: the same bound (already held: kept aligned).
    *(Case(f"state: a learned {key} of {value!r} s", {"inv.yaml": unreachable(), "state.json": state(
        load_times={"h|sim/qwen3-8b": {**load_time(30)["h|sim/qwen3-8b"], key: value}})}, RESTART,
        f"load_times['h|sim/qwen3-8b'].{key}: {value!r} is not a number of seconds in (0, 86400]")
      for key, value in (("load_s", 86401), ("load_s", 0), ("restart_s", 86400.5))),
    # Numbers written as text in an inventory: ASCII digits ('²' was a traceback, '٣' a 3).
    Case("ansible_port '²'", {"inv.yaml": named("h", ansible_port="²")}, HOSTS,
         "ansible_port: expected a port number (integer 1-65535), got '²'"),
    Case("ansible_port '٣٣'", {"inv.yaml": named("h", ansible_port="٣٣")}, HOSTS,
         "ansible_port: expected a port number (integer 1-65535), got '٣٣'"),
    Case("host range n[¹:³]", {"inv.yaml": named("n[¹:³]")}, HOSTS, "host range [¹:³] in 'n[¹:³]' is neither numeric "
         "nor alphabetic"),
    Case("host range n[٣:٥]", {"inv.yaml": named("n[٣:٥]")}, HOSTS, "is neither numeric nor alphabetic"),
    Case("host range step '٢'", {"inv.yaml": named("n[1:3:٢]")}, HOSTS, "step '٢' is not an integer"),
    Case("port after ':' '٣٣'", {"inv.yaml": named("h:٣٣")}, HOSTS, "the port after ':' is not a number"),
    Case("port after ':' of 5000 digits", {"inv.yaml": named("h:" + "9" * 5000)}, HOSTS,
         "the port after ':' is not a number"),
    Case("ansible_port ' 2222 ' and n[01:02:1] are fine", {"inv.yaml": named("n[01:02:1]", ansible_port=" 2222 ")},
         HOSTS, "", exit_code=0),
    # Group names: ',' separates targets on the command line.
    Case("group 'a,b' (YAML)", {"inv.yaml": grouped("a,b")}, HOSTS,
         "inv.yaml: all.children.a,b: group name 'a,b': ',' is not allowed in a group name: on the command line it "
         "separates targets"),
    Case("group 'a,b' (INI)", {"inv.ini": "[a,b]\nh ansible_connection=local\n"}, ("-i", "{tmp}/inv.ini", "hosts"),
         "inv.ini:1: group name 'a,b': ',' is not allowed in a group name"),
    Case("group with an escape character", {"inv.yaml": grouped("a\x1b[31mb")}, HOSTS,
         "group name 'a\\x1b[31mb': a group name has no control or invisible characters"),
    Case("group 'a-b.c_d' is fine", {"inv.yaml": grouped("a-b.c_d")}, HOSTS, "", exit_code=0),
)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_value_is_refused_in_one_line(
    case: Case, cli: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_files(tmp_path, case.files)
    args = [a.replace("{tmp}", str(tmp_path)) for a in case.args]
    for name, value in {"DDTREE_OPS_STATE": str(tmp_path / "state.json"), "COLUMNS": "200",
                        "HOME": str(tmp_path), **dict(case.env)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)  # the default results/ and inventories/ are the case's own (none)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    res = cli(*args)
    assert res.exit_code == case.exit_code, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stdout + res.stderr
    if case.usage:
        errors = [line for line in res.stderr.splitlines() if line.startswith("Error: ")]
        assert len(errors) == 1 and case.line in errors[0], res.stderr
    elif case.line:
        assert case.line in one_error_line(res.stderr)
    else:
        assert "error" not in res.stderr.lower(), res.stderr
    if "--json" in args:
        document = json.loads(res.stdout)
        assert (document["ok"], document["exit_code"]) == (False, case.exit_code)
        assert case.line.removeprefix("Invalid value for ") in document["errors"][0]["message"]
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.name in before} == before
    assert not [value for _, value in case.env if value in res.stdout + res.stderr]


# --- every number option, one check ----------------------------------------------------


def _number_options() -> list[tuple[tuple[str, ...], Any]]:
    """(command path, parameter) for every int- and float-valued parameter of every command."""
    from ddtree_ops.cli import numbers

    cli_main._register()
    found: list[tuple[tuple[str, ...], Any]] = []

    def walk(command: Any, path: tuple[str, ...]) -> None:
        found.extend((path, param) for param in command.params if numbers.number_kind(param) is not None)
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, (*path, name))

    walk(typer.main.get_command(cli_main.app), ())
    return found


def test_every_number_option_reads_ascii_digits_only() -> None:
    """Each int or float option of each command, as the entry point builds them: '1_0'
    (which Python and pydantic read as 10) and '٣' are refused naming the option; '+3'
    is read. Options that take a count (-v) are not numbers typed by hand."""
    command = cli_main.build_command()
    options = _number_options()
    assert len(options) >= 40 and {p.opts[0] for _, p in options} >= {
        "--max-parallel", "--max-fail", "--budget", "--topk", "--lines", "--min-repeats", "--show-cells",
        "--gate-temperature", "--gate-accept-floor", "--timeout", "--smoke-temperature"}
    for path, param in options:
        target = [] if not path or path[0] in ("report", "tune", "bench") else ["h"]
        for value in ("1_0", "٣"):
            args = [*path, *target, param.opts[0], value] if path else [param.opts[0], value, "hosts"]
            with pytest.raises(typer.BadParameter) as refused:
                command.main(args=args, prog_name="ddtree-ops", standalone_mode=False, obj=cli_main.AppContext())
            message = refused.value.format_message()
            assert param.opts[0] in message and f"{value!r} is not a" in message, (args, message)


@pytest.mark.parametrize(("text", "as_int", "as_float"), [
    ("0", 0, 0.0), ("+3", 3, 3.0), ("-2", -2, -2.0), ("007", 7, 7.0), ("1.5", None, 1.5), (".5", None, 0.5),
    ("2.", None, 2.0), ("1e-3", None, 0.001), ("1E3", None, 1000.0), ("٣", None, None), ("²", None, None),
    ("1_0", None, None), ("３", None, None), (" 1", None, None), ("1 ", None, None), ("", None, None),
    ("inf", None, None), ("-Infinity", None, None), ("nan", None, None), ("1e400", None, None), ("0x10", None, None),
    ("9" * 19, None, float("9" * 19)), ("9" * 18, int("9" * 18), float("9" * 18)),
])
def test_ascii_numbers(text: str, as_int: int | None, as_float: float | None) -> None:
    from ddtree_ops.numbers import parse_float, parse_int

    assert (parse_int(text), parse_float(text)) == (as_int, as_float)


# --- the unit agent's argv -----------------------------------------------------------

# A systemctl / journalctl that records its argv (words separated by \x1f) and answers like
# systemd for one unit: started by `start`, stopped by `stop` or `kill`. A shell script: it
# runs a dozen times per name.
FAKE = """#!/bin/sh
here=$(dirname "$0")
name=$(basename "$0")
{ printf '%s\\037' "$name" "$@"; printf '\\n'; } >> "$here/calls"
case "$name $1" in
  "systemctl start") : > "$here/active" ;;
  "systemctl stop" | "systemctl kill") rm -f "$here/active" ;;
  "systemctl show")
    echo LoadState=loaded
    if [ -e "$here/active" ]; then echo ActiveState=active; echo "MainPID=$FAKE_MAIN_PID"
    else echo ActiveState=inactive; echo MainPID=0; fi
    echo InvocationID=0123456789abcdef ;;
  journalctl*) echo "-- cursor: s=1" ;;
esac
"""


def _as_option(argv: list[str], unit: str) -> bool:
    """Whether getopt (systemctl's and journalctl's parser) may read ``unit`` as an option
    (or an option's argument) in ``argv``: it is a word of its own before any ``--``."""
    end = argv.index("--") if "--" in argv else len(argv)
    return unit in argv[:end]


@pytest.mark.parametrize("unit_name", ["-Hroot@127.0.0.9.service", "--user.service", "-Mfoo.service",
                                       "--help.service"])
def test_the_unit_agent_never_passes_a_unit_name_as_an_option(
    unit_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defence in depth, for a name that got past the schema: every systemctl call puts
    ``--`` before the unit, journalctl names it as ``--unit=``. The agent's own functions
    run here against a systemctl and a journalctl on PATH that record their argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for program in ("systemctl", "journalctl"):
        path = bin_dir / program
        path.write_text(FAKE)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MAIN_PID", str(os.getpid()))
    dirs = {key: str(tmp_path / key) for key in ("unit_dir", "env_dir", "runtime_unit_dir", "runtime_env_dir")}
    p = {"unit": unit_name, "run_dir": str(tmp_path / "run"), "probe_host": "127.0.0.1", "port": free_port(),
         "lines": 5, "grace_s": 0.0, **dirs}
    started = _unit_agent._start_unit(p, operator=True)
    assert started.get("pid") == os.getpid(), started
    assert _unit_agent.action_unit_status(p)["alive"]
    _unit_agent.action_unit_logs(p)
    _unit_agent.action_unit_logs(dict(p, offset="s=1"))
    assert _unit_agent.action_unit_stop(p)["signal"] == "SIGKILL"  # grace 0: the kill too
    # doctor's host probe asks systemctl too (its functions, without the program's last lines
    # that read a payload; "systemd runs this host" as the probe tests it: its run dir).
    probe: dict[str, Any] = {}
    exec(PROBE_SOURCE.partition("\nunits = PAYLOAD")[0], probe)
    isdir = os.path.isdir
    with monkeypatch.context() as patched:
        patched.setattr(os.path, "isdir", lambda path: path == "/run/systemd/system" or isdir(path))
        assert probe["unit_facts"](unit_name)["LoadState"] == "loaded"
    calls = [line.split("\x1f")[:-1] for line in (bin_dir / "calls").read_text().splitlines()]
    verbs = {(c[0], c[1] if c[0] == "systemctl" else "") for c in calls}
    assert verbs >= {("systemctl", v) for v in ("show", "start", "stop", "kill")} | {("journalctl", "")}
    assert all(unit_name in c or f"--unit={unit_name}" in c for c in calls if c[0] == "journalctl" and
               not any(a.startswith("_SYSTEMD_INVOCATION_ID=") for a in c)), calls
    assert not [c for c in calls if _as_option(c[1:], unit_name)], calls
