"""``--json``: every command writes exactly one envelope on stdout, errors included, with
stable error codes from the exception tree (README "JSON output")."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from cli_json import read_envelope
from fleetlib import free_port

from ddtree_ops import errors
from ddtree_ops.cli import main as cli_main
from ddtree_ops.cli.common import envelope
from ddtree_ops.errors import ConnectError, DdtreeOpsError, FleetError, Interrupted, error_code
from ddtree_ops.fleet import FleetResult
from ddtree_ops.patching.executor import RunOutcome

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / "tests" / "patching" / "bundles" / "basic"


def _error_classes() -> list[type[DdtreeOpsError]]:
    return [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, DdtreeOpsError)]


def test_every_error_class_has_its_own_code_documented_in_the_readme() -> None:
    classes = _error_classes()
    assert len(classes) >= 25
    own = {cls: cls.__dict__.get("code") for cls in classes if cls is not DdtreeOpsError}
    assert all(own.values()), [c.__name__ for c, code in own.items() if not code]
    codes = [cls.code for cls in classes]
    assert len(set(codes)) == len(codes), codes
    assert all(re.fullmatch(r"[a-z][a-z_]*", c) for c in codes)
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## JSON output"):]
    for cls in classes:
        assert f"| `{cls.code}` |" in table, f"{cls.__name__}'s code {cls.code!r} is not in the README's table"
    assert error_code(ValueError("a bug")) == "internal" and f"| `{error_code(ValueError())}` |" in table


def test_envelope_of_a_fan_out_lists_every_failed_host() -> None:
    result = FleetResult({"a": 1, "b": ConnectError("connection refused", host="b"), "c": RuntimeError("a bug")})
    exc = FleetError("deploy failed on 2 of 3 host(s): b, c", result=result)
    assert exc.result is result and list(exc.failures) == ["b", "c"]
    env = envelope("deploy", data={"x": 1}, error=exc)
    assert env == {
        "schema_version": 1,
        "command": "deploy",
        "ok": False,
        "exit_code": 7,
        "data": {"x": 1},
        "errors": [
            {"code": "fleet", "message": "deploy failed on 2 of 3 host(s): b, c", "host": None},
            {"code": "connect", "message": "connection refused", "host": "b"},
            {"code": "internal", "message": "RuntimeError: a bug", "host": "c"},
        ],
    }
    assert envelope("hosts", data=[]) == {
        "schema_version": 1, "command": "hosts", "ok": True, "exit_code": 0, "data": [], "errors": []
    }
    # Every failed host failed alike: the command exits with their code, still under "fleet".
    same = FleetError("doctor failed on 2 of 2 host(s): b, c", failures={
        "b": ConnectError("connection refused", host="b"), "c": errors.AuthError("key rejected", host="c")
    })
    env = envelope("doctor", error=same)
    assert env["exit_code"] == same.exit_code == 3
    assert [e["code"] for e in env["errors"]] == ["fleet", "connect", "auth"]
    interrupted = envelope("restart", error=Interrupted("interrupted", failures={"a": Interrupted("wait cancelled")}))
    assert interrupted["exit_code"] == 130 and [e["code"] for e in interrupted["errors"]] == ["interrupted"] * 2


def test_run_outcome_is_its_string_and_knows_its_rendering() -> None:
    assert RunOutcome.APPLIED == "applied" and f"{RunOutcome.ROLLED_BACK}" == "rolled-back"
    assert json.dumps([RunOutcome.NOOP]) == '["noop"]'
    assert RunOutcome.APPLIED.style == "green" and RunOutcome.PLANNED.style == "cyan" and RunOutcome.NOOP.style == "dim"
    assert RunOutcome.CONFLICT.is_failure and RunOutcome.CONFLICT.style == "yellow"
    assert not any(
        o.is_failure for o in (RunOutcome.APPLIED, RunOutcome.ROLLED_BACK, RunOutcome.NOOP, RunOutcome.PLANNED)
    )


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    """Two local hosts: ``here`` (this venv's Python, no SGLang, no server) and ``broken``
    (an interpreter that does not exist: every fleet command fails there, fast)."""
    doc = {
        "all": {
            "vars": {"ansible_connection": "local"},
            "hosts": {
                "here": {
                    "ddtree": {
                        "python": sys.executable,
                        "run_dir": str(tmp_path / "run-here"),
                        "server": {"port": 39517},
                    }
                },
                "broken": {
                    "ddtree": {"python": str(tmp_path / "no" / "python"), "run_dir": str(tmp_path / "run-broken")}
                },
            },
        }
    }
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(REPO / "tests" / "report"))
    from report_rows import make_row

    path = tmp_path / "l.jsonl"
    path.write_text("".join(json.dumps(make_row(algorithm=a)) + "\n" for a in ("AR", "DFLASH", "DDTREE")))
    return path


# command -> (arguments that succeed, or None where a success is too slow for this test;
#             arguments that fail, the first error's code, the exit code).
# A fan-out whose hosts all failed alike exits with their errors' own code (README "Exit
# codes"): ``broken``'s missing interpreter is command_failed (3) for the commands that run
# a remote step, a service error (5) for the service agent's; the first error stays "fleet".
def _cases(tmp_path: Path, ledger: Path) -> dict[str, tuple[list[str] | None, list[str], str, int]]:
    sweep = str(REPO / "bench_configs" / "demo.yaml")
    return {
        "hosts": (["here"], ["nosuchhost"], "target", 2),
        "doctor": (["here"], ["broken"], "fleet", 3),
        # ``here`` has no SGLang: even its dry run is refused (exit 4, as the deploy would be).
        "deploy": (None, ["here", str(BUNDLE), "--dry-run"], "fleet", 4),
        "rollback": (["here", "--dry-run"], ["broken"], "fleet", 3),
        "status": (["here", "--bundle", str(BUNDLE)], ["broken", "--bundle", str(BUNDLE)], "fleet", 3),
        "restart": (None, ["broken"], "fleet", 5),
        "stop": (["here"], ["nosuchhost"], "target", 2),
        "service-status": (["here"], ["broken"], "fleet", 5),
        "logs": (["here"], ["here", "--follow"], "config", 2),
        "bench": (
            ["here", "--sweep", sweep, "--dry-run"],  # the target is positional, as everywhere
            ["--sweep", sweep, "--target", "nosuchhost"],
            "target",
            2,
        ),
        "report": ([str(ledger), "--min-repeats", "1"], [str(tmp_path / "nope.jsonl")], "config", 2),
        "selftest": (None, ["broken"], "fleet", 3),
        # No DDTREE rows at the temperature asked for: refused before any host is touched.
        "tune": ([str(ledger), "--min-repeats", "1"], [str(ledger), "--temperature", "0.6"], "config", 2),
        # Its tarball into a folder; a file where the folder should be is refused.
        "ansible-collection": (["build", str(tmp_path / "dist")], ["build", str(ledger)], "config", 2),
    }


def test_every_command_writes_one_envelope(
    inventory: Path, tmp_path: Path, cli: Any, clean_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cli_main._register()
    commands = set(typer.main.get_command(cli_main.app).commands)  # type: ignore[attr-defined]
    cases = _cases(tmp_path, _ledger(tmp_path, monkeypatch))
    # A new command must say here how it is exercised.
    assert set(cases) == commands
    monkeypatch.chdir(tmp_path)
    for command, (good, bad, code, exit_code) in cases.items():
        if good is not None:
            res = cli("-i", str(inventory), "--json", command, *good)
            env = read_envelope(res.stdout)
            assert res.exit_code == 0 and env["ok"] and env["command"] == command, (command, res.stderr)
            assert env["data"] is not None
        res = cli("-i", str(inventory), "--json", command, *bad)
        env = read_envelope(res.stdout)
        got = (env["command"], env["ok"], env["exit_code"], res.exit_code)
        assert got == (command, False, exit_code, exit_code), res
        assert env["errors"][0]["code"] == code, env["errors"]
        assert "Traceback" not in res.stderr
        if code == "fleet":  # the failed host is named, with its own error's code
            failed = "here" if command == "deploy" else "broken"
            assert [e["host"] for e in env["errors"][1:]] == [failed] and env["errors"][1]["code"] != "fleet"
            assert env["data"] is not None  # the per-host rows, as without the failure


def test_unknown_host_is_code_target_exit_2(inventory: Path, cli: Any, clean_home: Path) -> None:
    res = cli("-i", str(inventory), "--json", "deploy", "nosuchhost", str(BUNDLE))
    assert res.exit_code == 2
    env = read_envelope(res.stdout)
    (error,) = env.pop("errors")
    assert env == {"schema_version": 1, "command": "deploy", "ok": False, "exit_code": 2, "data": None}
    assert error["code"] == "target" and error["host"] is None
    assert error["message"].startswith("unknown target 'nosuchhost'; known groups: all")
    assert res.stderr.strip().startswith("error: unknown target 'nosuchhost'")


def test_usage_error_and_report_flag(inventory: Path, cli: Any, clean_home: Path) -> None:
    res = cli("-i", str(inventory), "--json", "deploy", "here", "--no-such-flag")
    env = read_envelope(res.stdout)
    assert (
        res.exit_code == 2 and env["errors"][0]["code"] == "config" and "--no-such-flag" in env["errors"][0]["message"]
    )
    # report's own --json flag gives the same envelope, on errors too.
    res = cli("report", "/nonexistent/ledger.jsonl", "--json")
    assert res.exit_code == 2 and read_envelope(res.stdout)["errors"][0]["code"] == "config"
    # --help stays help.
    res = cli("--json", "hosts", "--help")
    assert res.exit_code == 0 and not res.stdout.lstrip().startswith("{")


def test_exit_code_is_the_failed_hosts_shared_one(inventory: Path, tmp_path: Path, cli: Any, clean_home: Path) -> None:
    """README "Exit codes": every host unreachable exits 3 (not 7); a connection failure on
    one host and a service failure on another exit 7. The envelope's exit_code is the process's."""
    doc = yaml.safe_load(inventory.read_text())
    for name in ("down1", "down2"):
        port = free_port()
        doc["all"]["hosts"][name] = {"ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": port}
    inventory.write_text(yaml.safe_dump(doc))
    res = cli("-i", str(inventory), "--json", "doctor", "down1,down2", "--connect-timeout", "5")
    env = read_envelope(res.stdout)
    assert res.exit_code == env["exit_code"] == 3, res
    assert [e["code"] for e in env["errors"]] == ["fleet", "connect", "connect"]
    assert res.stderr.startswith("error: doctor failed on 2 of 2 host(s)")
    res = cli("-i", str(inventory), "--json", "restart", "broken,down1")
    env = read_envelope(res.stdout)
    assert res.exit_code == env["exit_code"] == 7, res
    assert sorted(e["code"] for e in env["errors"]) == ["connect", "fleet", "service"]


def test_global_options_also_work_after_the_command(inventory: Path, cli: Any, clean_home: Path) -> None:
    """``deploy here -i inv.yaml --json`` works like ``-i inv.yaml --json deploy here``; a
    command's own option of the same name stays its own, a value is never taken for a
    global option, and nothing after ``--`` moves."""
    inv = str(inventory)
    res = cli("deploy", "here", str(BUNDLE), "--dry-run", "-i", inv, "--json", "--host-key-policy", "accept-new")
    env = read_envelope(res.stdout)
    # ``here`` has no SGLang: the dry run's plan is "missing" (exit 4), read from the JSON envelope.
    assert res.exit_code == 4 and env["command"] == "deploy" and env["data"][0]["host"] == "here", res
    assert env["data"][0]["outcome"] == "missing"
    # -i before and after (repeatable: both count), --max-parallel=N, -vv, --debug after the command.
    other = inventory.with_name("other.yaml")
    other.write_text(yaml.safe_dump({"all": {"hosts": {"other": {"ansible_connection": "local"}}}}))
    listed = cli("-i", inv, "hosts", "-i", str(other), "--max-parallel=2", "-vv", "--debug")
    assert listed.exit_code == 0 and "python=" in listed.stdout, listed  # -v's detail line
    assert "here" in listed.stdout and "other" in listed.stdout
    # status has its own --max-parallel: it stays status's (the global one would be fine too).
    res = cli("status", "here", "--max-parallel", "1", "--bundle", str(BUNDLE), "--json", "-i", inv)
    assert res.exit_code == 0 and read_envelope(res.stdout)["command"] == "status", res
    # A bad global value after the command is the same usage error as before it.
    res = cli("hosts", "-i", inv, "--host-key-policy", "yolo")
    assert res.exit_code == 2 and "strict" in res.stderr
    # "--json" as --extra-arg's value is restart's, not the global flag: a table, exit 5.
    res = cli("restart", "broken", "--algorithm", "AR", "--extra-arg", "--json", "-i", inv, "--no-smoke")
    assert res.exit_code == 5 and not res.stdout.lstrip().startswith("{") and "broken" in res.stdout, res
    # After "--", "--json" is the target.
    res = cli("hosts", "-i", inv, "--", "--json")
    assert res.exit_code == 2 and "unknown target '--json'" in res.stderr, res
