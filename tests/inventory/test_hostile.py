"""A hostile operator's inputs (issue 41): each is refused up front, in one line naming the
file, key or host, exit 2, no traceback, within a second, and nothing on a host touched.

One table, run through the real CLI in-process. Every case runs ``restart`` (the command
that would launch a server) on a local host whose run dir is in the test's directory, so
"nothing touched" is checked for real: the run dir must not exist afterwards. The
server command is ``/bin/false``: were an input taken, the launch would fail fast
instead of waiting for a server (and the case would fail on its exit code).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# Settings every case shares (a vars file beside each inventory): a local host that
# nothing could serve on.
GROUP_VARS = """\
ansible_connection: local
ddtree:
  python: /usr/bin/python3
  run_dir: {tmp}/run
  server:
    model_path: /nonexistent/model
    command: /bin/false
    expected_load_s: 5
"""
RESTART = ("restart", "all", "--algorithm", "AR", "--no-smoke", "--timeout", "5")


@dataclass(frozen=True)
class Case:
    name: str
    files: dict[str, str | bytes]  # relative path -> content ({tmp} is the test's directory)
    args: tuple[str, ...]  # after `-i <tmp>/<first file>`
    code: int
    expect: str  # a substring of the one error line ({tmp} as above); exit 0: of --json's data


def yaml_host(host_vars: str, name: str = "h") -> dict[str, str | bytes]:
    return {"inv.yml": f"all:\n  hosts:\n    {name}: {host_vars}\n"}


CASES = [
    # --- ddtree.server.env: names a shell would not take as a variable
    Case("env name with a space", yaml_host("{ddtree: {server: {env: {'A B': '1'}}}}"), RESTART, 2,
         "{tmp}/inv.yml: all.hosts.h.ddtree.server.env: 'A B' is not an environment variable name"),
    Case("env name starting with a digit", yaml_host("{ddtree: {server: {env: {1X: '1'}}}}"), RESTART, 2,
         "all.hosts.h.ddtree.server.env: '1X' is not an environment variable name"),
    Case("env name with =", yaml_host("{ddtree: {server: {env: {'A=B': '1'}}}}"), RESTART, 2,
         "all.hosts.h.ddtree.server.env: 'A=B' is not an environment variable name"),
    # --- numbers that are not numbers
    Case("infinite expected_load_s", yaml_host("{ddtree: {server: {expected_load_s: .inf}}}"), RESTART, 2,
         "all.hosts.h.ddtree.server.expected_load_s: expected a load time in seconds, more than 0 and at most 86400 "
         "(a day), got inf"),
    Case("extra_args of numbers", yaml_host("{ddtree: {server: {extra_args: [1, 2]}}}"), RESTART, 2,
         "all.hosts.h.ddtree.server.extra_args: expected a list of strings"),
    # --- INI: one variable twice on one host line (Ansible keeps the last, silently)
    Case("ansible_port twice on an INI line", {"inv.ini": "[g]\nh ansible_port=22 ansible_port=23\n"}, RESTART, 2,
         "{tmp}/inv.ini:2: ansible_port is written twice on this host line"),
    # --- host names the CLI could not address, or the terminal would not show
    Case("host name with /", yaml_host("{}", "a/b"), RESTART, 2, "host name 'a/b'"),
    Case("host name with ,", {"inv.ini": "[g]\na,b\n"}, RESTART, 2, "{tmp}/inv.ini:2: host name 'a,b'"),
    Case("host name with a newline", yaml_host("{}", '"a\\nb"'), RESTART, 2, "host name 'a\\nb'"),
    Case("host name with NUL (YAML)", yaml_host("{}", '"a\\0b"'), RESTART, 2, "host name 'a\\x00b'"),
    Case("host name with NUL (INI)", {"inv.ini": b"[g]\na\x00b\n"}, RESTART, 2,
         "{tmp}/inv.ini:2: host name 'a\\x00b'"),
    Case("host name with an escape", {"inv.ini": b"[g]\nh\x1b]0;pwned\x07\n"}, RESTART, 2,
         "host name 'h\\x1b]0;pwned\\x07'"),
    Case("port that is not a number", {"inv.ini": "[g]\nhost:abc\n"}, RESTART, 2,
         "{tmp}/inv.ini:2: host:abc: invalid host pattern 'host:abc': the port after ':' is not a number"),
    # --- extra args that would override what ddtree-ops launches with
    Case("--extra-arg --port", yaml_host("{}"), (*RESTART, "--extra-arg", "--port", "--extra-arg", "1"), 2,
         "--extra-arg --port: ddtree-ops sets --port"),
    Case("--extra-arg --port=1", yaml_host("{}"), (*RESTART, "--extra-arg=--port=1"), 2,
         "--extra-arg --port=1: ddtree-ops sets --port"),
    Case("--extra-arg abbreviating --port", yaml_host("{}"), (*RESTART, "--extra-arg", "--por", "--extra-arg", "1"),
         2, "--extra-arg --por: SGLang reads it as --port, which ddtree-ops sets itself"),
    Case("--extra-arg --model alias", yaml_host("{}"), (*RESTART, "--extra-arg=--model=/other"), 2,
         "--extra-arg --model=/other: SGLang reads it as --model-path, which ddtree-ops sets itself"),
    Case("--extra-arg speculative flag", yaml_host("{}"),
         (*RESTART, "--extra-arg", "--speculative-algorithm", "--extra-arg", "EAGLE"), 2,
         "--extra-arg --speculative-algorithm: ddtree-ops sets --speculative-algorithm"),
    Case("--extra-arg with a newline", yaml_host("{}"), (*RESTART, "--extra-arg=--port=1\nerror: all fine"), 2,
         "--extra-arg '--port=1\\nerror: all fine': ddtree-ops sets --port itself"),
    Case("inventory extra_args --host", yaml_host("{ddtree: {server: {extra_args: [--host, 0.0.0.0]}}}"), RESTART,
         2, "{tmp}/inv.yml: all.hosts.h.ddtree.server.extra_args: --host: ddtree-ops sets --host"),
    Case("inventory extra_args top-k in group_vars",
         {"inv.ini": "[g]\nh\n", "group_vars/g.yml": "ddtree: {server: {extra_args: ['--speculative-eagle-topk=9']}}"},
         RESTART, 2, "{tmp}/group_vars/g.yml: ddtree.server.extra_args: --speculative-eagle-topk=9: ddtree-ops sets"),
    # --- a UTF-8 byte-order mark (a Windows editor's) is not part of the inventory
    Case("BOM before an INI inventory", {"inv.ini": "\ufeff[g]\nh\n"}, ("--json", "hosts"), 0, '"groups": ["g"]'),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_input(case: Case, tmp_path: Path, cli, clean_home: Path) -> None:
    files = {"group_vars/all.yml": GROUP_VARS, **case.files}
    for rel, content in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content.replace("{tmp}", str(tmp_path)), encoding="utf-8")
    inventory = tmp_path / next(iter(case.files))
    res = cli("-i", str(inventory), *case.args)
    expect = case.expect.replace("{tmp}", str(tmp_path))
    assert res.exit_code == case.code, res
    if case.code == 0:
        assert expect in json.dumps(json.loads(res.stdout)["data"]) and not res.stderr.strip(), res
    else:
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
        assert expect in lines[0], res.stderr
    assert "Traceback" not in res.stderr
    # Shown safely: no raw control character (a newline ends the line, nothing else).
    assert all(ch.isprintable() or ch == "\n" for ch in res.stdout + res.stderr), repr(res.stderr)
    assert not (tmp_path / "run").exists(), "a host was touched"
    # Up front: no connection, no wait. Timed on a second run, so that the imports the
    # first command of a process pays (over a second on a busy machine) are not counted.
    started = time.monotonic()
    assert cli("-i", str(inventory), *case.args).exit_code == case.code
    elapsed = time.monotonic() - started
    # A hang guard (a refusal that waited on a host or a connect timeout), not a speed
    # target: speed is never asserted in tests. Refusals take ~0.01 s here.
    assert elapsed < 20.0, f"took {elapsed:.2f} s"
