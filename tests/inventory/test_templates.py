"""Jinja templates in the values we use: evaluated as Ansible evaluates them for the common
cases (tests/inventory/test_parity.py compares a corpus case with Ansible itself), refused
in one line naming the file and key otherwise, and a lookup('env') value never shown."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from .invfiles import error_line, load, write

SECRET = "hunter2-s3cr3t"


def host_inventory(tmp_path: Path, host_vars: str, **top_vars: str) -> Path:
    extra = "".join(f"    {k}: {v}\n" for k, v in top_vars.items())
    text = f"all:\n  vars:\n    domain: lab.example\n{extra}  hosts:\n    h1: {host_vars}\n"
    return write(tmp_path / "inv.yml", text)


def test_values_keep_their_type_and_are_checked_once_evaluated(tmp_path: Path) -> None:
    inv = host_inventory(
        tmp_path,
        "{ansible_port: '{{ 2000 + 22 }}', ddtree: {server: {port: '{{ base + 1 }}', expected_load_s: '{{ 1.5 }}',"
        " extra_args: ['--tp-size', '{{ 4 | string }}'], env: {N: '{{ 8 }}', S: '{{ inventory_hostname | upper }}'}}}}",
        base="30000",
    )
    server = load(inv).hosts["h1"].ddtree.server
    assert load(inv).hosts["h1"].port == 2022
    assert (server.port, server.expected_load_s, server.extra_args) == (30001, 1.5, ("--tp-size", "4"))
    assert dict(server.env) == {"N": "8", "S": "H1"}


@pytest.mark.parametrize(
    ("host_vars", "message"),
    [
        # Evaluated, then checked as if written so: the error names where the template is.
        ("{ddtree: {server: {port: \"{{ 'abc' }}\"}}}",
         "all.hosts.h1.ddtree.server.port: expected a port number (integer 1-65535), got 'abc'"),
        ("{ddtree: {server: {extra_args: ['{{ 8 }}']}}}",
         "all.hosts.h1.ddtree.server.extra_args: expected a list of strings (quote numbers: \"8\"), got [8]"),
        ("{ddtree: {server: {extra_args: [\"{{ '--' + 'port' }}\", '1']}}}",
         "all.hosts.h1.ddtree.server.extra_args: --port: ddtree-ops sets --port itself"),
        ("{ansible_port: \"{{ 'x' }}\"}", "all.hosts.h1.ansible_port: expected a port number"),
        # What is not evaluated: one line, naming the key and the template.
        ("{ansible_host: \"{{ inventory_hostname | regex_replace('h', 'x') }}\"}",
         "all.hosts.h1.ansible_host: \"{{ inventory_hostname | regex_replace('h', 'x') }}\": "
         "No filter named 'regex_replace'; ddtree-ops evaluates"),
        ("{ansible_host: '{{ hostvars[inventory_hostname].ip }}'}", "'hostvars' is undefined; ddtree-ops evaluates"),
        ("{ansible_host: '{{ nope }}.{{ domain }}'}", "ansible_host: '{{ nope }}.{{ domain }}': 'nope' is undefined"),
        ("{ansible_host: '{{ domain '}", "ansible_host: '{{ domain ': unexpected end of template"),
        ("{ansible_host: '{{ query(\"env\", \"A\") }}'}", "'query' is undefined"),
        ("{ansible_host: '{{ a }}', a: '{{ b }}', b: '{{ a }}'}",
         "all.hosts.h1.ansible_host: in a: in b: variables refer to each other in a loop: a -> b -> a"),
        ("{ansible_host: '{{ ansible_host }}'}", "refer to each other in a loop: ansible_host -> ansible_host"),
        ("{ansible_host: \"{{ ''.__class__.__mro__ }}\"}", "SecurityError: access to attribute '__class__'"),
        ("{ansible_host: \"{{ 'x' * 10**10 }}\"}", "'*' would build more than 1000000 characters"),
        ("{ansible_host: '{{ range(10**9) | list }}'}", "1000000000 is larger than 1000000"),
        ("{ansible_host: '{{ 1 / 0 }}'}", "cannot be evaluated: ZeroDivisionError"),
        ("{ansible_host: '{{ pw }}', pw: !vault '$ANSIBLE_VAULT;1.1;AES256'}",
         "in pw: a vault-encrypted value (!vault) cannot be used"),
    ],
)
def test_what_cannot_be_evaluated_is_refused_in_one_line(tmp_path: Path, host_vars: str, message: str) -> None:
    inv = host_inventory(tmp_path, host_vars)
    # Refused before the work is done, not after: the CPU this process spent (a busy
    # machine stretches wall time, not this; building the 10**10 characters would take
    # tens of seconds of it).
    started = time.process_time()
    line = error_line(inv)
    assert line.startswith(f"{inv}: all.hosts.h1.") and message in line, line
    assert time.process_time() - started < 1.0


def test_an_undefined_variable_inside_another_takes_the_default(tmp_path: Path) -> None:
    inv = host_inventory(tmp_path, "{ansible_host: \"{{ ip | default('10.0.0.9') }}\", ip: '{{ nope }}'}")
    assert load(inv).hosts["h1"].address == "10.0.0.9"  # as in Ansible: ip is undefined itself


def test_a_value_from_lookup_env_is_used_but_never_shown(
    tmp_path: Path, cli, clean_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("FLEET_USER", "ops-" + SECRET)
    inv = host_inventory(
        tmp_path,
        "{ansible_user: \"{{ lookup('env', 'FLEET_USER') }}\", ansible_host: 10.0.0.1, "
        "ddtree: {server: {env: {HF_TOKEN: \"{{ token }}\"}}}}",
        token="\"{{ lookup('env', 'HF_TOKEN') }}\"",
    )
    host = load(inv).hosts["h1"]
    assert host.user == "ops-" + SECRET and host.ddtree.server.env["HF_TOKEN"] == SECRET  # used as it is
    for args in (("hosts",), ("-v", "hosts"), ("--json", "hosts")):
        res = cli("-i", str(inv), *args)
        assert res.exit_code == 0, res
        assert SECRET not in res.stdout + res.stderr, args
    data = json.loads(cli("-i", str(inv), "--json", "hosts").stdout)["data"][0]
    assert data["user"] == "<value of lookup('env', 'FLEET_USER')>"
    assert data["ddtree"]["server"]["env"] == {"HF_TOKEN": "<value of lookup('env', 'HF_TOKEN')>"}


def test_an_error_never_shows_a_value_from_lookup_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSH_PORT", SECRET)
    inv = host_inventory(tmp_path, "{ansible_port: \"{{ lookup('env', 'SSH_PORT') }}\"}")
    line = error_line(inv)
    assert "ansible_port: expected a port number (integer 1-65535), got <value of lookup('env', 'SSH_PORT')>" in line
    assert SECRET not in line
    # Jinja's own message would quote it (the missing key): the key is named by its mask.
    inv = host_inventory(tmp_path, "{ansible_host: \"{{ {'a': 1}[lookup('env', 'SSH_PORT')] }}\"}")
    line = error_line(inv)
    assert "has no attribute <value of lookup('env', 'SSH_PORT')>" in line and SECRET not in line
