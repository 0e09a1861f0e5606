"""Ansible inventories -> frozen :class:`Host` objects, resolved as ansible-core resolves them.

An inventory that already drives Ansible loads as it is, and each host gets the values
``ansible-inventory --list`` reports for it (tests compare the two on a corpus).

Supported (``sources``): YAML (``all:`` / ``children:`` / ``hosts:`` / ``vars:``) and INI
(``[group]``, ``[group:vars]``, ``[group:children]``, host lines ``name key=value``, values
typed by ``ast.literal_eval`` like ansible-core's ini plugin) inventories; host patterns
with ranges (``node[01:08]``, ``ct200-[a:h]``, ``x[1:10:2]``) and ``name:port``
(``ranges``); directories as sources (Ansible's walk and ignore rules); several sources
merged into one inventory — a host or group named twice is one, ``all`` is shared, and a
later source's value wins. ``group_vars/`` and ``host_vars/`` beside every source
(``vars``), applied with Ansible's precedence: ``all`` < groups by depth, then
``ansible_group_priority``, then name < group_vars/all < group_vars/<group> < host vars <
host_vars/<host>. Legacy connection names (``ansible_ssh_host``, ``ansible_ssh_port``,
``ansible_ssh_user``, ``ansible_ssh_private_key_file``) and quoted ports work (``build``).

Ours: the ``ddtree:`` key, strictly validated where it is written (``schema``) and merged
key by key across every layer (Ansible replaces a dict whole; we document this one
difference because a group sets ``server.port`` and a host only ``server.model_path``).

Jinja templates in the variables we use are evaluated as Ansible evaluates them, over the
host's variables, for the common cases (``templates``: other variables, inventory_hostname,
group_names, Jinja's filters, ``lookup('env')``); ``tests/inventory/test_parity.py``
compares a corpus case with what ``ansible`` evaluates.

Refused with one line naming file and key, never taken literally: a template beyond
those, and a ``!vault`` value in a variable we use; vault-encrypted files; dynamic
inventories (a YAML ``plugin:`` config, an executable ``#!`` script); TOML.

Stricter than Ansible, on purpose: a mapping key written twice in a YAML file or on an INI
host line, and a host or group given two different values for one variable within one
file, are errors (Ansible keeps whichever comes last and warns at most); a file Ansible
would skip with a warning is an error; a host name the command line could not address
(``/``, ``,``), with a control or invisible character, or with a port that is not a number
is refused. ``extra_args`` never repeat a flag ddtree-ops launches with (``schema``).
A UTF-8 byte-order mark at the start of a file is skipped.
"""

from __future__ import annotations

from ddtree_ops.inventory.build import Inventory, load_inventory
from ddtree_ops.inventory.sources import default_sources

__all__ = ["Inventory", "default_sources", "load_inventory"]
