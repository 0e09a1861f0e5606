"""The systemd manager's pure parts: the drop-in, its ExecStart quoting and the env file,
and the inventory's manager/unit rules. That systemd reads them back as written is proven
on a booted systemd (tests/systemd/test_systemd_host.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ddtree_ops.errors import ConfigError, InventoryError
from ddtree_ops.inventory import load_inventory
from ddtree_ops.service.systemd import dropin_text, environment_file, exec_start_line


def test_every_argv_entry_is_one_quoted_word_with_specifiers_and_variables_escaped() -> None:
    line = exec_start_line(["/opt/py", "--x", 'a "b" \\c', "50%", "$HOME", "tab\there"])
    assert line == ('ExecStart="/opt/py" "--x" "a \\"b\\" \\\\c" "50%%" "$$HOME" "tab\\x09here"')
    with pytest.raises(ConfigError):
        exec_start_line([])


def test_the_dropin_replaces_execstart_and_names_the_env_file_never_its_values() -> None:
    text = dropin_text(["/opt/py", "-m", "sglang.launch_server"], "sglang@1.service")
    lines = text.splitlines()
    assert lines[lines.index("[Service]") + 1] == "ExecStart="
    assert "EnvironmentFile=/etc/ddtree-ops/sglang@1.service.env" in lines
    assert sum(line.startswith("ExecStart=") for line in lines) == 2


def test_the_env_file_quotes_values_and_refuses_a_name_systemd_would_drop() -> None:
    text = environment_file({"HF_TOKEN": 'a"b$c`d\\e', "CUDA_VISIBLE_DEVICES": "0,1"})
    assert 'HF_TOKEN="a\\"b\\$c\\`d\\\\e"' in text.splitlines()
    with pytest.raises(ConfigError, match="not an environment variable name"):
        environment_file({"BAD-NAME": "x"})


def _inventory(tmp_path: Path, server: dict[str, object]) -> Path:
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump({"all": {"hosts": {"gpu1": {"ddtree": {"server": server}}}}}))
    return path


@pytest.mark.parametrize(("server", "message"), [
    ({"manager": "systemd"}, "manager systemd needs ddtree.server.unit"),
    ({"manager": "process", "unit": "sglang.service"}, "only used with manager: systemd"),
    ({"manager": "systemd", "unit": "sglang@.service"}, "is a template"),
    ({"manager": "systemd", "unit": "sglang.service", "slots": {"count": 2, "gpus_per_slot": 1}},
     "give a template such as sglang@.service"),
    ({"manager": "systemd", "unit": "sglang"}, "expected a unit type after the last '.', as in sglang.service"),
    ({"manager": "upstart"}, "expected 'process'"),
])
def test_manager_and_unit_are_refused_where_they_cannot_work(
    tmp_path: Path, server: dict[str, object], message: str
) -> None:
    with pytest.raises(InventoryError, match=message):
        load_inventory([_inventory(tmp_path, server)])


def test_a_slot_runs_its_templates_instance(tmp_path: Path) -> None:
    inv = load_inventory([_inventory(tmp_path, {"manager": "systemd", "unit": "sglang@.service",
                                                "slots": {"count": 2, "gpus_per_slot": 1}})])
    slots = inv.hosts["gpu1"].slot_hosts()
    assert [s.ddtree.server.unit for s in slots] == ["sglang@0.service", "sglang@1.service"]
