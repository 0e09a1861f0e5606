"""The inventory loader: Ansible's format, our strict `ddtree:` block, errors naming file and key."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from ddtree_ops.errors import InventoryError, TargetError
from ddtree_ops.inventory import load_inventory
from ddtree_ops.sshconfig import SshConfig
from ddtree_ops.transport.ssh import resolve_endpoint

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "inv.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load(tmp_path: Path, text: str, **kw: object):
    return load_inventory([write(tmp_path, text)], **kw)


def test_shipped_inventories_load() -> None:
    # The demo fleet (the default inventory folder) and the example real hosts beside it.
    inv = load_inventory([*sorted((REPO / "inventories").glob("*.yaml")),
                          *sorted((REPO / "examples" / "inventories").glob("*.yaml"))])
    assert {"ct200-a", "ct200-b", "b300-a", "sim-ct200", "sim-b300"} <= set(inv.hosts)
    assert [h.name for h in inv.resolve("local")] == ["sim-ct200", "sim-b300"]
    sim = inv.hosts["sim-b300"]
    assert sim.connection == "local"
    # Relative local paths are anchored at the inventory's directory, not the cwd.
    assert sim.python == str(REPO / ".cache/demo-hosts/sim-b300/bin/python")
    assert sim.ddtree.server.port == 30200 and sim.ddtree.server.env["SIM_GPU"] == "b300"
    assert inv.hosts["ct200-b"].ddtree.server.port == 30001
    assert inv.hosts["ct200-b"].ddtree.server.model_path == "/models/Qwen3-8B"


def test_precedence_all_then_group_then_child_then_host(tmp_path: Path) -> None:
    inv = load(
        tmp_path,
        """
        all:
          vars:
            ansible_user: alluser
            ddtree: {python: /all/python, server: {port: 1000, env: {A: "1"}}}
          children:
            outer:
              vars:
                ansible_user: outeruser
                ddtree: {server: {port: 2000, env: {B: 2}}}
              children:
                inner:
                  vars:
                    ddtree: {server: {model_path: /m}}
                  hosts:
                    h1:
                      ansible_host: 10.0.0.1
                      ddtree: {server: {env: {A: "host"}}}
                    h2:
                      ansible_host: 10.0.0.2
                      ansible_user: hostuser
                      ansible_port: 2222
                      ddtree: {python: /h2/python, server: {port: 3000}}
        """,
    )
    h1, h2 = inv.hosts["h1"], inv.hosts["h2"]
    assert h1.user == "outeruser" and h2.user == "hostuser" and h2.port == 2222
    assert h1.python == "/all/python" and h2.python == "/h2/python"
    assert h1.ddtree.server.port == 2000 and h2.ddtree.server.port == 3000
    assert h1.ddtree.server.model_path == "/m" == h2.ddtree.server.model_path
    assert dict(h1.ddtree.server.env) == {"A": "host", "B": "2"}
    assert h1.groups == ("outer", "inner")
    assert [h.name for h in inv.resolve("inner")] == ["h1", "h2"]


def test_unused_ansible_vars_are_ignored(tmp_path: Path) -> None:
    inv = load(
        tmp_path,
        """
        all:
          vars: {ansible_python_interpreter: /usr/bin/python3, become: true, ntp_servers: [a, b]}
          hosts:
            web1: {ansible_host: web1.example, http_port: 80}
        """,
    )
    assert inv.hosts["web1"].address == "web1.example"
    assert inv.hosts["web1"].ddtree.server.port == 30000  # default


def test_all_is_shared_across_sources_like_ansible(tmp_path: Path) -> None:
    # Ansible has one `all` group: its vars from any source apply to every host.
    a = write(tmp_path, "all:\n  vars: {ddtree: {python: /a/py}}\n  hosts: {ha: {ansible_host: 1.1.1.1}}\n", "a.yaml")
    b = write(tmp_path, "all:\n  hosts: {hb: {ansible_host: 2.2.2.2}}\n", "b.yaml")
    inv = load_inventory([a, b])
    assert inv.hosts["ha"].python == "/a/py" == inv.hosts["hb"].python


def test_host_in_two_sources_later_source_wins(tmp_path: Path) -> None:
    a = write(tmp_path, "all:\n  hosts: {h: {ansible_host: 1.1.1.1, ansible_user: x}}\n", "a.yaml")
    b = write(tmp_path, "all:\n  hosts: {h: {ansible_host: 2.2.2.2}}\n", "b.yaml")
    inv = load_inventory([a, b])
    assert list(inv.hosts) == ["h"]
    assert inv.hosts["h"].address == "2.2.2.2" and inv.hosts["h"].user == "x"
    inv = load_inventory([b, a])
    assert inv.hosts["h"].address == "1.1.1.1"


def test_resolve_targets(tmp_path: Path) -> None:
    inv = load(
        tmp_path,
        """
        all:
          children:
            g1: {hosts: {a: {ansible_host: x}, b: {ansible_host: y}}}
            g2: {hosts: {c: {ansible_host: z}}}
        """,
    )
    assert [h.name for h in inv.resolve("all")] == ["a", "b", "c"]
    assert [h.name for h in inv.resolve("c,g1")] == ["a", "b", "c"]  # inventory order, once each
    assert [h.name for h in inv.resolve("b, b")] == ["b"]
    with pytest.raises(TargetError, match=r"unknown target 'gg1' \(did you mean 'g1'\?\); known groups: all, g1, g2"):
        inv.resolve("gg1")
    with pytest.raises(TargetError, match="empty target"):
        inv.resolve(" , ")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match=r"inventory file not found: .*nope\.yaml"):
        load_inventory([tmp_path / "nope.yaml"])


def test_no_paths() -> None:
    with pytest.raises(InventoryError, match="no inventory given"):
        load_inventory([])


def test_yaml_syntax_error_has_file_and_line(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match=r"inv\.yaml:4:\d+: YAML syntax error"):
        load(tmp_path, "all:\n  hosts:\n    a: {ansible_host: x}\n    b: ansible_host: y\n    c: {}\n")


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ("ddtree: {pyhton: /x}", r"all\.hosts\.h\.ddtree\.pyhton: unknown key \(did you mean 'python'\?"),
        ("ddtree: {server: {prot: 1}}", r"all\.hosts\.h\.ddtree\.server\.prot: unknown key \(did you mean 'port'\?"),
        ("ddtree: {server: {port: abc}}", r"all\.hosts\.h\.ddtree\.server\.port: expected a port number .*got 'abc'"),
        ("ddtree: {server: {port: 70000}}", r"ddtree\.server\.port: expected a port number"),
        ("ddtree: {server: {port: yes}}", r"ddtree\.server\.port: expected a port number .*got True"),
        ("ddtree: {server: {extra_args: --tp 2}}", r"ddtree\.server\.extra_args: expected a list of strings"),
        ("ddtree: {server: {env: [A]}}", r"ddtree\.server\.env: expected a mapping of NAME"),
        ("ddtree: {server: {expected_load_s: -1}}", r"expected_load_s: expected a load time in seconds, more than 0"),
        ("ddtree: {server: 5}", r"ddtree\.server: expected a mapping, got 5"),
        ("ddtree: [python]", r"all\.hosts\.h\.ddtree: expected a mapping"),
        ("ansible_port: abc", r"all\.hosts\.h\.ansible_port: expected a port number .*got 'abc'"),
        ("ansible_connection: winrm", r"ansible_connection: 'winrm' is not supported"),
    ],
)
def test_bad_values_name_file_and_key(tmp_path: Path, snippet: str, expected: str) -> None:
    with pytest.raises(
        InventoryError, match=rf"inv\.yaml: {expected}" if expected.startswith("all") else expected
    ) as info:
        load(tmp_path, f"all:\n  hosts:\n    h:\n      ansible_host: 10.0.0.1\n      {snippet}\n")
    assert str(info.value).startswith(str(tmp_path / "inv.yaml"))
    assert "\n" not in str(info.value)


def test_group_level_error_points_at_group_vars(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match=r"all\.children\.g\.vars\.ddtree\.gpuu: unknown key \(did you mean 'gpu'"):
        load(
            tmp_path,
            "all:\n  children:\n    g:\n      vars: {ddtree: {gpuu: b300}}\n      hosts: {h: {ansible_host: x}}\n",
        )


def test_unknown_group_key(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match=r"all\.host: unknown group key \(did you mean 'hosts'"):
        load(tmp_path, "all:\n  host: {h: {ansible_host: x}}\n")


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n"])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    with pytest.raises(InventoryError, match="expected a mapping of groups at the top level"):
        load(tmp_path, text)


def test_a_host_without_an_address_is_reached_at_its_inventory_name(tmp_path: Path) -> None:
    # As Ansible: the name is the address (an ssh_config alias, else DNS); nothing refused.
    for text in (
        "all:\n  hosts:\n    gpu1.lab.example.com: {ddtree: {python: /p}}\n",
        "all:\n  hosts:\n    gpu7: {}\n",
    ):
        inv = load(tmp_path, text)
        (host,) = inv.hosts.values()
        assert host.address is None and host.connection == "ssh"
        # What the SSH transport connects to without an ssh_config entry: the name itself.
        assert resolve_endpoint(host.name, SshConfig.from_text("")).hostname == host.name


def test_hostile_strings_are_kept_verbatim(tmp_path: Path) -> None:
    hostile = "/models/my model's \"v2\" $(touch /tmp/pwned); rm -rf ~ `id`"
    doc = {"all": {"hosts": {"h": {"ansible_host": "x", "ddtree": {"server": {"model_path": hostile}}}}}}
    inv = load(tmp_path, yaml.safe_dump(doc))
    assert inv.hosts["h"].ddtree.server.model_path == hostile


def test_duplicate_yaml_key_names_file_line_and_key(tmp_path: Path) -> None:
    text = "all:\n  hosts:\n    h:\n      ansible_host: 1.1.1.1\n      ansible_host: 2.2.2.2\n"
    with pytest.raises(InventoryError, match=r"inv\.yaml:5: duplicate key 'ansible_host' \(first at line 4\)$"):
        load(tmp_path, text)


def test_yaml_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    text = """
    all:
      vars:
        base: &base {ansible_user: u, ansible_port: 22}
      hosts:
        h: {<<: *base, ansible_port: 2222, ansible_host: 1.1.1.1}
    """
    assert load(tmp_path, text).hosts["h"].port == 2222


def test_host_in_two_groups_with_the_same_vars_is_fine(tmp_path: Path) -> None:
    inv = load(
        tmp_path,
        """
        all:
          children:
            a: {hosts: {h: {ansible_host: 1.1.1.1, ddtree: {server: {port: 1}}}}}
            b: {hosts: {h: {ansible_host: 1.1.1.1, ddtree: {python: /py}}}}
        """,
    )
    host = inv.hosts["h"]
    assert host.groups == ("a", "b") and host.ddtree.server.port == 1 and host.python == "/py"


def test_host_in_two_groups_with_conflicting_vars_is_an_error(tmp_path: Path) -> None:
    text = """
    all:
      children:
        a: {hosts: {h: {ansible_host: 1.1.1.1, ddtree: {server: {port: 1}}}}}
        b: {hosts: {h: {ansible_host: 1.1.1.1, ddtree: {server: {port: 2}}}}}
    """
    with pytest.raises(
        InventoryError,
        match=r"inv\.yaml: host 'h' is defined twice with different ddtree\.server\.port: "
        r"1 at all\.children\.a\.hosts\.h, 2 at all\.children\.b\.hosts\.h$",
    ):
        load(tmp_path, text)


def test_same_host_in_two_files_that_agree_is_one_host(tmp_path: Path) -> None:
    a = write(tmp_path, "ct200:\n  hosts: {h: {ansible_host: 1.1.1.1}}\n", "a.yaml")
    b = write(tmp_path, "gpus:\n  hosts: {h: {ansible_host: 1.1.1.1}}\n", "b.yaml")
    inv = load_inventory([a, b])
    assert [h.name for h in inv.resolve("gpus")] == ["h"] and inv.hosts["h"].groups == ("ct200", "gpus")


def test_duplicate_yaml_key_in_a_sweep_file(tmp_path: Path) -> None:
    from ddtree_ops.bench.sweep import load_sweep
    from ddtree_ops.errors import SweepError

    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nrepeats: 1\nrepeats: 3\n")
    with pytest.raises(SweepError, match=r"s\.yaml:3: duplicate key 'repeats' \(first at line 2\)$"):
        load_sweep(sweep)


def test_host_defined_twice_in_one_file_cli_names_file_and_key(tmp_path: Path, cli, clean_home: Path) -> None:
    a = write(
        tmp_path,
        "[g1]\nh ansible_host=1.1.1.1 ansible_user=x\n[g2]\nh ansible_host=1.1.1.1 ansible_user=y\n",
        "a.ini",
    )
    res = cli("-i", str(a), "hosts")
    assert res.exit_code == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "a.ini: host 'h' is defined twice with different ansible_user" in lines[0]
    assert "'x' at line 2, 'y' at line 4" in lines[0]
