"""What cannot be honoured is refused in one line naming file and key — never used literally."""

from __future__ import annotations

import os
from pathlib import Path

from .invfiles import error_line, load, write

VAULT_VALUE = """!vault |
          $ANSIBLE_VAULT;1.1;AES256
          62313365396662343061393464336163383764373764613633653634306231386433626436623361
"""


def test_jinja_lookup_other_than_env_is_refused(tmp_path: Path) -> None:
    inv = write(tmp_path / "inv.yml", "all:\n  hosts:\n    h: {ansible_host: '{{ lookup(\"file\", \"/etc/x\") }}'}")
    message = error_line(inv)
    assert message.startswith(f"{inv}: all.hosts.h.ansible_host: lookup('file') is not evaluated; ")


def test_jinja_statement_in_ini_user_with_an_undefined_name_is_refused(tmp_path: Path) -> None:
    inv = write(tmp_path / "hosts", "[g]\nh ansible_host=1.2.3.4 'ansible_user={% if x %}a{% endif %}'\n")
    assert error_line(inv).startswith(f"{inv}:2: ansible_user: '{{% if x %}}a{{% endif %}}': 'x' is undefined; ")


def test_jinja_in_ddtree_from_group_vars_names_the_vars_file(tmp_path: Path) -> None:
    inv = write(tmp_path / "inv.yml", "gpus:\n  hosts:\n    h: {ansible_host: 1.2.3.4}\n")
    gv = write(tmp_path / "group_vars" / "gpus.yml", "ddtree:\n  server: {model_path: '/models/{{ model }}'}\n")
    message = error_line(inv)
    assert message.startswith(f"{gv}: ddtree.server.model_path: '/models/{{{{ model }}}}': 'model' is undefined")


def test_jinja_in_a_variable_we_do_not_use_is_left_alone(tmp_path: Path) -> None:
    inv = write(
        tmp_path / "inv.yml",
        "all:\n  vars: {motd: '{{ inventory_hostname }} says hi'}\n  hosts:\n    h: {ansible_host: 1.2.3.4}\n",
    )
    assert load(inv).hosts["h"].address == "1.2.3.4"


def test_unsafe_strings_are_literal_as_in_ansible(tmp_path: Path) -> None:
    inv = write(
        tmp_path / "inv.yml",
        "all:\n  hosts:\n    h: {ansible_host: 1.2.3.4, ddtree: {server: {model_path: !unsafe '/m/{{raw}}'}}}\n",
    )
    assert load(inv).hosts["h"].ddtree.server.model_path == "/m/{{raw}}"


def test_vault_value_we_use_is_refused(tmp_path: Path) -> None:
    inv = write(tmp_path / "inv.yml", f"all:\n  hosts:\n    h:\n      ansible_host: {VAULT_VALUE}")
    message = error_line(inv)
    assert message.startswith(f"{inv}: all.hosts.h.ansible_host: a vault-encrypted value (!vault)")


def test_vault_value_we_do_not_use_is_left_alone(tmp_path: Path) -> None:
    inv = write(
        tmp_path / "inv.yml",
        f"all:\n  hosts:\n    h:\n      ansible_host: 1.2.3.4\n      ansible_become_password: {VAULT_VALUE}",
    )
    assert load(inv).hosts["h"].address == "1.2.3.4"


def test_vault_in_ddtree_is_refused(tmp_path: Path) -> None:
    inv = write(
        tmp_path / "inv.yml",
        "all:\n  hosts:\n    h:\n      ansible_host: 1.2.3.4\n      ddtree:\n        server:\n"
        + "          model_path: "
        + VAULT_VALUE.replace("\n          ", "\n            "),
    )
    assert error_line(inv).startswith(f"{inv}: all.hosts.h.ddtree.server.model_path: a vault-encrypted value")


def test_vault_encrypted_vars_file_is_refused(tmp_path: Path) -> None:
    inv = write(tmp_path / "inv.yml", "all:\n  hosts:\n    h: {ansible_host: 1.2.3.4}\n")
    secret = write(tmp_path / "group_vars" / "all" / "vault.yml", "$ANSIBLE_VAULT;1.1;AES256\n6231336539\n")
    message = error_line(inv)
    assert message.startswith(f"{secret}: vault-encrypted file ($ANSIBLE_VAULT header)")


def test_vault_encrypted_inventory_is_refused(tmp_path: Path) -> None:
    inv = write(tmp_path / "inv.yml", "$ANSIBLE_VAULT;1.1;AES256\n6231336539\n")
    assert error_line(inv).startswith(f"{inv}: vault-encrypted file")


def test_dynamic_inventory_plugin_config_is_refused(tmp_path: Path) -> None:
    inv = write(tmp_path / "aws_ec2.yml", "plugin: amazon.aws.aws_ec2\nregions: [us-east-1]\n")
    message = error_line(inv)
    assert message.startswith(f"{inv}: plugin: 'amazon.aws.aws_ec2' is a dynamic inventory plugin's config")
    assert "ansible-inventory -i SOURCE --list --yaml --export" in message


def test_inventory_script_is_refused(tmp_path: Path) -> None:
    script = write(tmp_path / "inv" / "ec2.py", "#!/usr/bin/env python3\nprint('{}')\n")
    os.chmod(script, 0o755)
    message = error_line(tmp_path / "inv")
    assert message.startswith(f"{script}: an executable inventory script (dynamic inventory) is not run")


def test_toml_inventory_is_refused(tmp_path: Path) -> None:
    inv = write(tmp_path / "hosts.toml", "[web.hosts]\nweb1 = {}\n")
    assert error_line(inv).startswith(f"{inv}: TOML inventories are not supported")


def test_refusal_is_one_line_on_the_cli(tmp_path: Path, cli, clean_home: Path) -> None:
    inv = write(tmp_path / "inv.ini", "[g]\nh ansible_host='{{ ip }}'\n")
    res = cli("-i", str(inv), "hosts")
    assert res.exit_code == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"{inv}:2: ansible_host: '{{{{ ip }}}}': 'ip' is undefined" in lines[0]
    assert "Traceback" not in res.stderr


def test_what_is_not_an_inventory_file_is_one_line(tmp_path: Path) -> None:
    binary = tmp_path / "bin.yml"
    binary.write_bytes(bytes(range(128, 256)))
    assert error_line(binary) == f"{binary}: not a UTF-8 text file (byte 0): an inventory is YAML or INI"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nothing writes to it: reading it would block for ever
    assert error_line(fifo) == f"cannot read inventory {fifo}: not a regular file"
    assert error_line(Path("/dev/zero")) == "cannot read inventory /dev/zero: not a regular file"
    deep = write(tmp_path / "deep.yml", "all: " + "{a: " * 3000 + "x" + "}" * 3000 + "\n")
    assert error_line(deep) == f"{deep}: nested too deeply to be a config file"
