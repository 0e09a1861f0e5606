"""INI and YAML sources, ranges, directories: what loads, and the error lines for what does not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddtree_ops.inventory import default_sources
from ddtree_ops.inventory.ranges import RangeError, expand_pattern
from ddtree_ops.inventory.sources import ini_value

from .invfiles import error_line, load, write


@pytest.mark.parametrize(
    ("pattern", "names", "port"),
    [
        ("node[01:03]", ["node01", "node02", "node03"], None),
        ("ct200-[a:c]", ["ct200-a", "ct200-b", "ct200-c"], None),
        ("x[1:10:4]", ["x1", "x5", "x9"], None),
        ("db[1:2]-[a:b]", ["db1-a", "db1-b", "db2-a", "db2-b"], None),
        ("n[8:10]:2222", ["n8", "n9", "n10"], 2222),
        ("h.example:22", ["h.example"], 22),
        ("[fe80::1]:22", ["fe80::1"], 22),
        ("fe80::1", ["fe80::1"], None),
    ],
)
def test_host_patterns(pattern: str, names: list[str], port: int | None) -> None:
    assert expand_pattern(pattern) == (names, port)


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("n[1:]", "must specify an end"),
        ("n[01:8]", "equal-length"),
        ("n[1:2:3:4]", "begin:end"),
        ("n[c:a]", "begin <= end"),
        ("node[08:01]", "begin <= end"),  # Ansible refuses it; it used to be zero hosts
        ("n[9:1]", "begin <= end"),
        ("node[1:200000]", "names more than 10000 hosts"),
        ("n[1:10000000000000]", "names more than 10000 hosts"),  # refused before a list is built
        ("a[1:200]b[1:200]", "names more than 10000 hosts"),
    ],
)
def test_bad_ranges(pattern: str, why: str) -> None:
    with pytest.raises(RangeError, match=why):
        expand_pattern(pattern)


def test_bad_range_names_file_and_line(tmp_path: Path) -> None:
    inv = write(tmp_path / "hosts.ini", "[g]\nnode[01:8]\n")
    assert error_line(inv).startswith(f"{inv}:2: node[01:8]: host range [01:8]")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2222", 2222),
        ("'2222'", "2222"),
        ("True", True),
        ("yes", "yes"),
        ("[1, 'a']", [1, "a"]),
        ("{'a': (1, 2)}", {"a": [1, 2]}),
        ("/usr/bin/python3", "/usr/bin/python3"),
        ("1.5", 1.5),
        ("None", None),
    ],
)
def test_ini_values_are_typed_like_ansible(text: str, value: object) -> None:
    assert ini_value(text) == value


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[g:vars]\na=1\n", r":1: section \[g:vars\] is for undefined group 'g'"),
        ("[p:children]\nmissing\n", r":2: \[p:children\] includes undefined group 'missing'"),
        ("[g]\nh ansible_host\n", r":2: expected key=value host variable, got 'ansible_host'"),
        ("[g:hostz]\nh\n", r":1: section \[g:hostz\] has unknown type 'hostz'"),
        ("[g x]\nh\n", r":1: invalid section '\[g x\]'"),
        ("[g:vars]\nnot a pair\n[g]\n", r":2: expected key=value in \[g:vars\]"),
        (
            "[g]\nh ansible_host=a\n[g:vars]\nansible_group_priority=high\n",
            r":4: ansible_group_priority: expected an integer",
        ),
        ("[a:children]\nb\n[b:children]\na\n", r"would contain itself"),
    ],
)
def test_ini_errors_name_file_and_line(tmp_path: Path, text: str, expected: str) -> None:
    inv = write(tmp_path / "hosts.ini", text)
    message = error_line(inv)
    assert message.startswith(str(inv))
    assert __import__("re").search(expected, message), message


def test_ini_children_may_come_before_the_group(tmp_path: Path) -> None:
    inv = write(tmp_path / "hosts.ini", "[gpus:children]\nct200\n[ct200]\nct200-a ansible_host=1.1.1.1\n")
    assert load(inv).hosts["ct200-a"].groups == ("gpus", "ct200")


def test_file_without_extension_is_yaml_or_ini(tmp_path: Path) -> None:
    yml = write(tmp_path / "a" / "hosts", "all:\n  hosts:\n    y: {ansible_host: 1.1.1.1}\n")
    ini = write(tmp_path / "b" / "hosts", "i ansible_host=2.2.2.2\n")
    inv = load(yml, ini)
    assert inv.hosts["y"].address == "1.1.1.1" and inv.hosts["i"].address == "2.2.2.2"
    assert inv.hosts["i"].groups == ("ungrouped",) and [h.name for h in inv.resolve("ungrouped")] == ["y", "i"]


def test_directory_source_loads_in_name_order_and_skips_ignored(tmp_path: Path) -> None:
    inv = tmp_path / "inv"
    write(inv / "10-b.yml", "b:\n  hosts:\n    h2: {ansible_host: 2.2.2.2}\n")
    write(inv / "02-a.ini", "[a]\nh1 ansible_host=1.1.1.1\n")
    for ignored in ("README.md", "x.txt", "y.bak", "z.retry", "w.cfg", ".hidden", "v.orig", "u~"):
        write(inv / ignored, "[broken\n")
    write(inv / "host_vars" / "h1.yml", "ansible_user: fromdir\n")
    loaded = load(inv)
    assert list(loaded.hosts) == ["h1", "h2"]
    assert loaded.hosts["h1"].user == "fromdir"


def test_broken_yaml_in_a_directory_names_the_file(tmp_path: Path) -> None:
    bad = write(tmp_path / "inv" / "bad.yml", "all:\n  hosts: [\n")
    assert error_line(tmp_path / "inv").startswith(f"{bad}:")


def test_duplicate_key_in_group_vars_file_is_an_error(tmp_path: Path) -> None:
    inv = write(tmp_path / "inv.yml", "all:\n  hosts:\n    h: {ansible_host: 1.1.1.1}\n")
    gv = write(tmp_path / "group_vars" / "all.yml", "ansible_user: a\nansible_user: b\n")
    assert error_line(inv) == f"{gv}:2: duplicate key 'ansible_user' (first at line 1)"


def test_group_vars_file_must_be_a_mapping(tmp_path: Path) -> None:
    inv = write(tmp_path / "inv.yml", "all:\n  hosts:\n    h: {ansible_host: 1.1.1.1}\n")
    gv = write(tmp_path / "group_vars" / "all.yml", "- a\n")
    assert error_line(inv) == f"{gv}: expected a mapping of variables, got a list"


def test_ddtree_typo_in_host_vars_names_the_file(tmp_path: Path) -> None:
    inv = write(tmp_path / "inv.yml", "all:\n  hosts:\n    h: {ansible_host: 1.1.1.1}\n")
    hv = write(tmp_path / "host_vars" / "h.yml", "ddtree: {sever: {port: 1}}\n")
    assert error_line(inv).startswith(f"{hv}: ddtree.sever: unknown key (did you mean 'server'?")


def test_group_var_conflict_within_one_file_is_an_error(tmp_path: Path) -> None:
    inv = write(
        tmp_path / "hosts.ini", "[g]\nh ansible_host=1.1.1.1\n[g:vars]\nansible_user=a\n[g:vars]\nansible_user=b\n"
    )
    assert (
        error_line(inv)
        == f"{inv}: group 'g' is defined twice with different ansible_user: 'a' at line 4, 'b' at line 6"
    )


def test_later_source_wins_for_group_vars_and_priority_orders_groups(tmp_path: Path) -> None:
    a = write(tmp_path / "a.yml", "g1:\n  vars: {ansible_user: a}\n  hosts:\n    h: {ansible_host: 1.1.1.1}\n")
    b = write(tmp_path / "b.ini", "[g1:vars]\nansible_user=b\n[g0]\nh\n[g0:vars]\nansible_user=zero\n")
    assert load(a, b).hosts["h"].user == "b"  # g1 sorts after g0 by name
    c = write(tmp_path / "c.ini", "[g0:vars]\nansible_group_priority=5\n")
    assert load(a, b, c).hosts["h"].user == "zero"  # priority 5 > g1's default 1


def test_quoted_port_and_bad_port(tmp_path: Path) -> None:
    inv = write(tmp_path / "inv.yml", "all:\n  hosts:\n    h: {ansible_host: x, ansible_ssh_port: '2222'}\n")
    assert load(inv).hosts["h"].port == 2222
    bad = write(tmp_path / "bad.yml", "all:\n  hosts:\n    h: {ansible_host: x, ansible_ssh_port: '22x'}\n")
    assert (
        error_line(bad) == f"{bad}: all.hosts.h.ansible_ssh_port: expected a port number (integer 1-65535), got '22x'"
    )


def test_directory_source_on_the_cli(tmp_path: Path, cli, clean_home: Path) -> None:
    write(tmp_path / "inv" / "hosts.ini", "[ct200]\nct200-[a:b] ansible_host=10.0.0.1\n")
    res = cli("-i", str(tmp_path / "inv"), "--json", "hosts")
    assert res.exit_code == 0, res.stderr
    assert "ct200-a" in res.stdout and "ct200-b" in res.stdout


def test_default_sources(tmp_path: Path) -> None:
    assert default_sources({}, tmp_path) == []
    write(tmp_path / "inventories" / "fleet.yml", "all:\n  hosts:\n    y: {ansible_host: 1.1.1.1}\n")
    write(tmp_path / "inventories" / "more.ini", "i ansible_host=2.2.2.2\n")
    write(tmp_path / "inventories" / "README.md", "# notes\n")
    assert default_sources({}, tmp_path) == [tmp_path / "inventories"]
    assert list(load(*default_sources({}, tmp_path)).hosts) == ["y", "i"]  # .yml is read, README.md skipped
    env = {"DDTREE_OPS_INVENTORY": f"a.yml{os.pathsep}{os.pathsep}b.ini"}
    assert default_sources(env, tmp_path) == [Path("a.yml"), Path("b.ini")]


def test_numbers_are_text_in_string_options_but_booleans_are_refused(tmp_path: Path) -> None:
    inv = write(tmp_path / "hosts.ini", "[g]\nh ansible_host=gpu7 ansible_user=1000\n")
    assert load(inv).hosts["h"].user == "1000"
    bad = write(tmp_path / "bad.yml", "all:\n  hosts:\n    h: {ansible_host: x, ansible_user: yes}\n")
    assert error_line(bad) == f"{bad}: all.hosts.h.ansible_user: expected a string, got True"
