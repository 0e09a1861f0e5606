"""The CLI as a user meets it: help, version, and bad input -> one clear line, an exit code, no traceback."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from cli_json import json_data
from fleetlib import Fleet, SshdServer, free_port, keygen, known_hosts_line

REPO = Path(__file__).resolve().parents[1]


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_entry_point_help_and_version() -> None:
    env = {**os.environ, "COLUMNS": "200"}
    helped = subprocess.run([sys.executable, "-m", "ddtree_ops", "--help"], capture_output=True, text=True, env=env)
    assert helped.returncode == 0
    for command in ("hosts", "doctor"):
        assert command in helped.stdout
    version = subprocess.run([sys.executable, "-m", "ddtree_ops", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("ddtree-ops ")


def test_entry_point_error_is_one_line(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "ddtree_ops", "-i", str(tmp_path / "missing.yaml"), "hosts"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2
    assert "inventory file not found" in one_error_line(res.stderr)


def test_hosts_lists_the_shipped_inventories(cli, clean_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("DDTREE_OPS_INVENTORY", raising=False)
    res = cli("--json", "hosts")  # default: the directory inventories/
    assert res.exit_code == 0, res.stderr
    names = [h["name"] for h in json_data(res.stdout)]
    # The default folder is the demo fleet's alone; the example real hosts are read with -i.
    assert sorted(names) == ["sim-b300", "sim-ct200"]
    examples = cli("--json", "-i", "examples/inventories", "hosts")
    assert examples.exit_code == 0, examples.stderr
    assert sorted(h["name"] for h in json_data(examples.stdout)) == ["b300-a", "ct200-a", "ct200-b"]
    table = cli("-i", "inventories/local.yaml", "hosts", "local")
    assert table.exit_code == 0 and "sim-ct200" in table.stdout and "ct200-a" not in table.stdout


def test_the_default_inventory_directory_reads_yml_and_ini_like_ansible(
    cli, clean_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``inventories/`` is one directory source: ``.yml`` and INI files load (the old
    ``*.yaml`` glob skipped them), a README beside them is not an inventory."""
    (tmp_path / "inventories").mkdir()
    (tmp_path / "inventories" / "rack.yml").write_text("all:\n  hosts:\n    yml-host: {ansible_host: 10.0.0.1}\n")
    (tmp_path / "inventories" / "lab").write_text("[lab]\nnode[01:02] ansible_host=10.0.1.1\n")
    (tmp_path / "inventories" / "README.md").write_text("# not an inventory: [x]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DDTREE_OPS_INVENTORY", raising=False)
    res = cli("--json", "hosts")
    assert res.exit_code == 0, res.stderr
    assert sorted(h["name"] for h in json_data(res.stdout)) == ["node01", "node02", "yml-host"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inv.yaml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("all:\n  hosts:\n    a: {ansible_host: x}\n    b: ansible_host: y\n", r"inv\.yaml:4:\d+: YAML syntax error"),
        (
            "all:\n  hosts:\n    a:\n      ansible_host: x\n      ddtree: {server: {modle_path: /m}}\n",
            r"inv\.yaml: all\.hosts\.a\.ddtree\.server\.modle_path: unknown key \(did you mean 'model_path'\?",
        ),
        (
            "all:\n  hosts:\n    a:\n      ansible_host: x\n      ddtree: {server: {port: abc}}\n",
            r"inv\.yaml: all\.hosts\.a\.ddtree\.server\.port: expected a port number .*got 'abc'",
        ),
    ],
    ids=["yaml-syntax", "unknown-key", "wrong-type"],
)
def test_bad_inventory(cli, clean_home: Path, tmp_path: Path, text: str, expected: str) -> None:
    import re

    res = cli("-i", str(write(tmp_path, text)), "doctor", "all")
    assert res.exit_code == 2
    assert re.search(expected, one_error_line(res.stderr))


def test_hosts_named_by_dns_load_and_say_how_they_resolve(
    cli, clean_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddtree_ops.cli import main as cli_main

    monkeypatch.setattr(cli_main.console, "width", 200)  # one line per host, unwrapped
    (clean_home / ".ssh" / "config").write_text("Host b300\n  HostName 10.0.0.9\n")
    inv = write(tmp_path, "all:\n  hosts:\n    gpu1.lab.example.com: {}\n    b300: {}\n")
    res = cli("--json", "-i", str(inv), "hosts")
    assert res.exit_code == 0, res.stderr
    res = cli("-i", str(inv), "hosts")
    assert res.exit_code == 0, res.stderr
    assert "gpu1.lab.example.com (DNS)" in res.stdout and "b300 (ssh_config)" in res.stdout
    assert f"inventory: {inv}" in res.stdout  # which files these hosts come from


def test_missing_inventory_and_unknown_target(cli, clean_home: Path, tmp_path: Path) -> None:
    res = cli("-i", str(tmp_path / "nope.yaml"), "hosts")
    assert res.exit_code == 2 and "inventory file not found" in one_error_line(res.stderr)
    inv = write(tmp_path, "all:\n  children:\n    gpus: {hosts: {a: {ansible_host: x}}}\n")
    res = cli("-i", str(inv), "doctor", "gpu")
    assert res.exit_code == 2
    assert "unknown target 'gpu' (did you mean 'gpus'?); known groups: all, gpus" in one_error_line(res.stderr)


def test_refused_vs_timeout_per_host_while_others_succeed(
    ssh_fleet: Fleet, clean_home: Path, tmp_path: Path, cli
) -> None:
    silent = socket.socket()  # accepts TCP, never speaks: a hung host
    silent.bind(("127.0.0.1", 0))
    silent.listen(5)
    doc = yaml.safe_load(ssh_fleet.inventory.read_text())
    hosts = doc["all"]["children"]["fleet"]["hosts"]
    hosts["refusing"] = {"ansible_host": "127.0.0.1", "ansible_port": free_port()}
    hosts["hanging"] = {"ansible_host": "127.0.0.1", "ansible_port": silent.getsockname()[1]}
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump(doc))
    try:
        res = cli("-i", str(inv), "--json", "doctor", "all", "--connect-timeout", "2")
    finally:
        silent.close()
    assert res.exit_code == 3  # both failed hosts failed to connect: their own code (README "Exit codes")
    rows = {r["host"]: r for r in json_data(res.stdout)["hosts"]}
    assert "connection refused" in rows["refusing"]["error"]
    assert "did not complete the SSH handshake within 2s" in rows["hanging"]["error"]
    assert all(rows[n]["ok"] and rows[n]["result"]["sglang_version"] == "0.5.23" for n in ssh_fleet.names)
    assert "Traceback" not in res.stderr


def test_wrong_key_is_reported_as_auth_failure(ssh_fleet: Fleet, clean_home: Path, tmp_path: Path, cli) -> None:
    doc = yaml.safe_load(ssh_fleet.inventory.read_text())
    doc["all"]["children"]["fleet"]["vars"]["ansible_ssh_private_key_file"] = str(keygen(tmp_path / "wrong"))
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump(doc))
    res = cli("-i", str(inv), "--json", "doctor", ssh_fleet.names[0])
    assert res.exit_code == 3
    row = json_data(res.stdout)["hosts"][0]
    assert row["result"]["error_type"] == "AuthError" and "authentication failed" in row["error"]


def test_host_key_policies_via_cli(ssh_fleet: Fleet, clean_home: Path, tmp_path: Path, cli) -> None:
    fh = ssh_fleet.hosts[2]
    doc = yaml.safe_load(ssh_fleet.inventory.read_text())
    known = tmp_path / "known_hosts"
    doc["all"]["children"]["fleet"]["vars"]["ddtree"]["known_hosts"] = str(known)
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump(doc))

    res = cli("-i", str(inv), "--json", "doctor", fh.name)
    assert res.exit_code == 3
    row = json_data(res.stdout)["hosts"][0]
    assert row["result"]["error_type"] == "HostKeyError" and "unknown host key" in row["error"]

    res = cli("-i", str(inv), "--host-key-policy", "accept-new", "--json", "doctor", fh.name)
    assert res.exit_code == 0, res.stdout
    assert known.read_text() == known_hosts_line(fh.port, fh.server.host_key) + "\n"

    ssh_fleet.stop(fh.name)
    impostor = SshdServer(
        root=tmp_path / "impostor", port=fh.port, host_key=keygen(tmp_path / "other_key"),
        authorized_keys=fh.server.authorized_keys,
    )
    impostor.start()
    try:
        res = cli("-i", str(inv), "--host-key-policy", "accept-new", "--json", "doctor", fh.name)
    finally:
        impostor.stop()
        ssh_fleet.start(fh.name)
    assert res.exit_code == 3
    row = json_data(res.stdout)["hosts"][0]
    assert row["result"]["error_type"] == "HostKeyError" and "has CHANGED" in row["error"]


def test_bad_host_key_policy_value(cli, clean_home: Path) -> None:
    res = cli("--host-key-policy", "yolo", "hosts")
    assert res.exit_code == 2 and "strict" in res.stderr and "Traceback" not in res.stderr


def test_hostile_python_path_reaches_the_host_as_data(ssh_fleet: Fleet, clean_home: Path, tmp_path: Path, cli) -> None:
    """A path with spaces, quotes, $(...) and ; is one argv entry on the host: the probe
    reports that exact interpreter missing, and nothing in it was executed."""
    canary = tmp_path / "pwned"
    hostile = f"/opt/my env/it's \"x\"/$(touch {canary}); touch {canary}; `touch {canary}`/python"
    doc = yaml.safe_load(ssh_fleet.inventory.read_text())
    doc["all"]["children"]["fleet"]["hosts"][ssh_fleet.names[0]]["ddtree"]["python"] = hostile
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump(doc))
    res = cli("-i", str(inv), "--json", "doctor", ssh_fleet.names[0])
    assert res.exit_code == 3
    row = json_data(res.stdout)["hosts"][0]
    assert "remote interpreter" in row["error"] and hostile in row["error"]
    assert not canary.exists()


def test_names_paths_and_errors_are_printed_literally_not_as_markup(
    cli, clean_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group called ``rack-[a:h]`` and a path holding ``[bold]x[/]`` reach the terminal as
    they are: rich would otherwise eat ``[a:h]`` as a style tag and ``[bold]``/``[/]`` as markup.
    (A host name cannot keep brackets: Ansible expands ``gpu-[a:h]`` into eight hosts.)"""
    from ddtree_ops.cli import main

    monkeypatch.setattr(main.console, "width", 250)
    monkeypatch.setattr(main.err_console, "width", 250)
    python = f"{tmp_path}/[bold]x[/]/python"
    doc = {"all": {"vars": {"ansible_connection": "local"}, "children": {"rack-[a:h]": {"hosts": {
        "gpu-[a:b]": {"ddtree": {"python": python, "run_dir": str(tmp_path / "[red]run")}},
    }}}}}
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump(doc))
    listed = cli("-i", str(inv), "-v", "hosts")
    assert listed.exit_code == 0, listed
    assert "gpu-a" in listed.stdout and "gpu-b" in listed.stdout and "rack-[a:h]" in listed.stdout, listed.stdout
    assert "[bold]x[/]/python" in listed.stdout
    bundle = str(REPO / "tests" / "patching" / "bundles" / "basic")
    for command in (["doctor"], ["restart"], ["status", "--bundle", bundle], ["logs"]):
        res = cli("-i", str(inv), *command[:1], "rack-[a:h]", *command[1:])
        assert res.exit_code != 0, (command, res)
        if command != ["logs"]:
            assert "│ gpu-a" in res.stdout, (command, res.stdout)
        assert "[bold]x[/]/python" in res.stdout, (command, res.stdout)
        assert one_error_line(res.stderr).endswith((": gpu-a, gpu-b", ": gpu-a", ": gpu-b")), res.stderr
        if command == ["doctor"]:
            assert "doctor: rack-[a:h]" in res.stdout, res.stdout
    unknown = cli("-i", str(inv), "doctor", "rack-[a:z]")
    assert unknown.exit_code == 2 and "rack-[a:z]" in one_error_line(unknown.stderr), unknown.stderr
    missing = cli("-i", str(tmp_path / "[bold]nope[/].yaml"), "hosts")
    assert missing.exit_code == 2 and "[bold]nope[/].yaml" in one_error_line(missing.stderr)


def test_help_shows_flags_without_a_type_placeholder(cli) -> None:
    """A flag takes no value, so ``--help`` shows none: no ``<bool>`` after ``--dry-run``,
    no ``<int>`` after ``-v`` (a count), no ``BOOLEAN``; options that take one keep it."""
    import typer

    from ddtree_ops.cli import main as cli_main

    cli_main._register()
    group = typer.main.get_command(cli_main.app)
    commands = sorted(group.commands)  # type: ignore[attr-defined]
    assert {"deploy", "restart", "report", "bench"} <= set(commands)
    for args in ([], *([c] for c in commands)):
        res = cli(*args, "--help")
        assert res.exit_code == 0 and "Usage:" in res.stdout, (args, res)
        assert "<bool>" not in res.stdout and "BOOLEAN" not in res.stdout, (args, res.stdout)
    top = cli("--help").stdout
    assert re.search(r"^\s*-v, --verbose\s+More detail", top, re.M), top
    assert re.search(r"^\s*--max-parallel N\s+Hosts", top, re.M), top
    assert re.search(r"^\s*--dry-run\s+Show the plan", cli("deploy", "--help").stdout, re.M)


def test_help_shows_readable_placeholders_not_python_types(cli) -> None:
    """Typer 0.29 labels values with annotations (``<int range>``, ``<list[Path]>``,
    ``<str>``); every command's help shows click-style placeholders instead, and every
    option that takes a value shows one."""
    import typer

    from ddtree_ops.cli import main as cli_main

    cli_main._register()
    group = typer.main.get_command(cli_main.app)
    typer_label = re.compile(r"<(?:str|int|float|path|bool|int range|float range|list\[[^\]]*\])>")
    for args in ([], *([c] for c in sorted(group.commands))):  # type: ignore[attr-defined]
        out = cli(*args, "--help").stdout
        assert not typer_label.search(out), (args, typer_label.search(out), out)
    restart = cli("restart", "--help").stdout
    assert "Usage: ddtree-ops restart [OPTIONS] {TARGET}" in restart
    assert re.search(r"^\s*--timeout SECONDS\s", restart, re.M), restart
    assert re.search(r"^\s*--budget N\s", restart, re.M), restart
    assert re.search(r"^\s*--algorithm TEXT\s", restart, re.M), restart
    assert re.search(r"^\s*TARGET\s+Host", restart, re.M), restart
    report = cli("report", "--help").stdout
    assert "[LEDGERS]..." in report and re.search(r"^\s*--csv PATH\s", report, re.M), report
    # Every value-taking option of every command got a placeholder (the walk ran on all).
    from ddtree_ops.cli import metavars

    command = typer.main.get_command(cli_main.app)
    metavars.apply(command)
    bare = [
        f"{name} {p.name}"
        for name, sub in command.commands.items()  # type: ignore[attr-defined]
        for p in sub.params
        if p.param_type_name == "option" and not p.is_flag and not p.count and p.metavar is None
        and not getattr(p.type, "choices", None)
    ]
    assert bare == []


def test_every_option_and_argument_of_every_command_has_help() -> None:
    import typer

    from ddtree_ops.cli import main as cli_main

    cli_main._register()
    group = typer.main.get_command(cli_main.app)
    missing = [
        f"{name} {param.name}"
        for name, command in group.commands.items()  # type: ignore[attr-defined]
        for param in command.params
        if not getattr(param, "help", None) and param.name != "help"
    ]
    assert missing == []


def test_an_option_every_command_shares_reads_the_same_everywhere() -> None:
    """--wide is one flag in one wording, whatever the command: an operator who read it
    in one command's help knows it in the others."""
    import typer

    from ddtree_ops.cli import main as cli_main
    from ddtree_ops.cli.common import WIDE_HELP

    cli_main._register()
    group = typer.main.get_command(cli_main.app)
    helps = {
        (name, param.name): getattr(param, "help", None)
        for name, command in group.commands.items()  # type: ignore[attr-defined]
        for param in command.params
        if param.name == "wide"
    }
    assert len(helps) >= 6 and set(helps.values()) == {WIDE_HELP}, helps


def test_a_ctrl_c_that_leaves_any_command_exits_130_and_says_so(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    # typer turns such a KeyboardInterrupt into a RETURNED exit code 130 (standalone_mode
    # off): read, it is an interrupt; unread, the command exited 0 without a word.
    from ddtree_ops.cli import hosts

    def interrupted(_obj: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(hosts, "load_inventory_for", interrupted)
    res = cli("--json", "hosts")
    assert res.exit_code == 130
    assert "interrupted" in res.stderr
    assert json.loads(res.stdout)["errors"][0]["code"] == "interrupted"


def test_a_missing_inventory_from_the_environment_names_the_variable(
    cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DDTREE_OPS_INVENTORY", str(tmp_path / "nope.yaml"))
    res = cli("hosts")
    assert res.exit_code == 2
    assert res.stderr.strip() == (f"error: $DDTREE_OPS_INVENTORY names {tmp_path / 'nope.yaml'}, which does not "
                                  f"exist (set it to inventory files or directories, :-separated, or pass -i)")
    # A command that reads no inventory is not held to it.
    assert "DDTREE_OPS_INVENTORY" not in cli("report", str(tmp_path / "none.jsonl")).stderr


@pytest.mark.parametrize("path, why", [
    ("/tmp/" + "a" * 300, "a name in the path is 300 bytes long"),
    ("/" + "d/" * 2100 + "x.yaml", "the path is 4,207 bytes long"),
])
def test_an_overlong_inventory_path_from_the_environment_is_one_line_naming_the_variable(
    cli, monkeypatch: pytest.MonkeyPatch, path: str, why: str
) -> None:
    """exists() raises ENAMETOOLONG on such a path: it is refused before, as -i's parser refuses it."""
    monkeypatch.setenv("DDTREE_OPS_INVENTORY", path)
    res = cli("hosts")
    assert res.exit_code == 2 and "Traceback" not in res.stderr
    assert res.stderr.startswith(f"error: $DDTREE_OPS_INVENTORY: {why}") and res.stderr.count("\n") == 1, res.stderr
    assert path not in res.stderr
    envelope = json.loads(cli("--json", "hosts").stdout)
    assert envelope["exit_code"] == 2 and envelope["errors"][0]["code"] == "inventory"


@pytest.mark.parametrize("args", [["--json", "--bogus", "hosts"], ["--bogus", "--json", "hosts"], ["--json", "-i"]])
def test_a_usage_error_in_the_global_options_is_the_json_envelope_under_json(cli, args: list[str]) -> None:
    """The global callback never ran (its own options are what failed to parse): --json is
    still read from the command line, as for an interruption before the parse."""
    res = cli(*args)
    assert res.exit_code == 2 and "Traceback" not in res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2 and doc["command"] is None
    assert doc["errors"][0]["code"] == "config" and doc["errors"][0]["message"], doc
    assert cli(*[a for a in args if a != "--json"]).stdout == ""  # plain text on stderr without it


def test_the_servers_env_is_listed_by_name_never_by_value(cli, tmp_path: Path) -> None:
    """An inventory's server env holds tokens for all we know: `hosts -v` and `hosts --json`
    name each variable, and no value reaches the terminal."""
    inv = tmp_path / "inv.yaml"
    inv.write_text("all:\n  hosts:\n    h1:\n      ansible_host: 10.0.0.1\n      ddtree:\n        server:\n"
                   "          env: {HF_TOKEN: hf_secret_value_123, SIM_SEED: '7'}\n")
    listed = cli("-i", str(inv), "-v", "hosts")
    assert listed.exit_code == 0 and "HF_TOKEN" in listed.stdout and "SIM_SEED" in listed.stdout
    doc = json.loads(cli("-i", str(inv), "--json", "hosts").stdout)
    assert doc["data"][0]["ddtree"]["server"]["env"] == {"HF_TOKEN": "<not shown>", "SIM_SEED": "<not shown>"}
    for out in (listed.stdout + listed.stderr, json.dumps(doc)):
        assert "hf_secret_value_123" not in out and "'7'" not in out
