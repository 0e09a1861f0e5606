"""Issue 54 (part c): an inventory's templates cannot take the controller's memory or CPU,
and a value read by ``lookup('env')`` — or computed from one — is never shown.

Two tables, run through the real CLI in-process, each case as ``restart`` on a local host
whose run dir is in the test's directory (so "nothing touched" is checked for real: the run
dir must not exist afterwards), the way tests/inventory/test_hostile.py runs its cases:

- :data:`BOMBS`: templates that build a gigabyte from a few characters, or loop for hours.
  Each is refused in one line naming the file and key, exit 2, in under a second of this
  process's CPU (CPU, not wall time: a busy machine stretches the second, not the first).
- :data:`SECRETS`: every kind of inventory error a value from ``lookup('env')`` can end up
  in — range and type checks, unknown keys, Jinja's KeyError/IndexError/TypeError/
  ValueError messages, the slot checks that compute ports and GPUs from it. The error
  names it by its mask; the secret, and what a template or a check computed from it,
  appears nowhere in what ``restart``, ``hosts`` (``-v``, ``--json``), ``doctor`` and
  ``status`` print.
"""

from __future__ import annotations

import json
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ddtree_ops.inventory import load_inventory
from ddtree_ops.inventory.templates import MEMORY_HEADROOM, Budget

# A local host that nothing could serve on (tests/inventory/test_hostile.py's settings).
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
# What each command prints for an inventory it cannot load: the same one line.
READERS = (("hosts",), ("-v", "hosts"), ("--json", "hosts"), ("doctor",), ("status", "all"),
           ("--json", "status", "all"))


@dataclass(frozen=True)
class Case:
    name: str
    host_vars: str  # the host's variables, a YAML flow mapping
    expect: str  # a substring of the one error line
    hosts: str = "h"  # the host's name (a range makes many)
    where: str = "all.hosts.h"  # what the line names after the file (a whole-file refusal: "")


def _yaml(text: str) -> str:
    """``text`` as a YAML double-quoted scalar (a template has both kinds of quotes)."""
    return json.dumps(text)


def _vars(flow: str, **templates: str) -> str:
    """The YAML flow mapping ``flow``, each ``$NAME`` in it the template ``NAME``."""
    for name, template in templates.items():
        flow = flow.replace(f"${name}", _yaml(template))
    return flow


def _host(template: str) -> str:
    """A host whose address is ``template``."""
    return _vars("{ansible_host: $T}", T=template)


def _write(tmp_path: Path, case: Case) -> Path:
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars/all.yml").write_text(GROUP_VARS.replace("{tmp}", str(tmp_path)))
    inventory = tmp_path / "inv.yml"
    inventory.write_text(f"all:\n  hosts:\n    {case.hosts}: {case.host_vars}\n", encoding="utf-8")
    return inventory


def _one_line(res: Any) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-3000:]
    assert "Traceback" not in res.stdout + res.stderr
    return lines[0]


# ------------------------------------------------------------------------------ bombs

# Variables that each use the next one twice, 30 levels deep.
FAN_OUT = ", ".join([f"a{i}: {_yaml(f'{{{{ a{i + 1} ~ a{i + 1} }}}}')}" for i in range(30)] + ["a30: 'xy'"])
FAN_OUT_LISTS = ", ".join([f"a{i}: {_yaml(f'{{{{ [a{i + 1}, a{i + 1}] }}}}')}" for i in range(30)] + ["a30: 'xy'"])
# YAML's own: each alias a list holding the one before twice (2**30 strings, 30 lines).
FAN_OUT_ALIASES = ", ".join(["a0: &a0 [x, x]"] + [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}]" for i in range(1, 30)])
STEPS = "takes more than 50000 steps"

BOMBS = [
    # The five: each step under the size cap, the result not.
    Case("a list doubled 40 times",
         _host("{% set x=[1] %}{% for i in range(40) %}{% set _=x.extend(x) %}{% endfor %}{{ x|length }}"),
         "extend() would build more than 1000000 characters or items"),
    Case("3,000 fields padded to a million", _host("{{ ('{0:>{1}}'*3000).format(1,999999) }}"),
         "format() would build more than 1000000"),
    Case("30 levels of fan-out (text)", f"{{ansible_host: '{{{{ a0 }}}}', {FAN_OUT}}}",
         "'~' would build more than 1000000"),
    Case("30 levels of fan-out (lists)", f"{{ansible_host: '{{{{ a0 }}}}', {FAN_OUT_LISTS}}}",
         "more than 1000000 characters (as text)"),
    # Refused while the file is read, before any template: its aliases alone expand too far.
    Case("30 levels of fan-out (YAML aliases)", f"{{ansible_host: '{{{{ a29 | length }}}}', {FAN_OUT_ALIASES}}}",
         "its YAML aliases expand to more than 1,000,000 values", where=""),
    Case("one format padded to a billion", _host("{{ '{0:>999999999}'.format(1) }}"),
         "a format's width or precision of more than 1000000"),
    Case("a million strings joined", _host("{{ (['y'*999]*999999)|join }}"), "join would build more than 1000000"),
    # More of each kind: printf widths, str methods, mappings, a macro that calls itself
    # twice, loops in loops, comparisons and slices repeated, nesting, numbers, slots.
    Case("3,000 printf fields", _host("{{ ('%999999s' * 3000) % ((1,) * 3000) }}"),
         "'%' would build more than 1000000"),
    Case("one printf argument used 100,000 times", _host("{{ ('%(a)s' * 100000) % {'a': 'x' * 100000} }}"),
         "'%' would build more than 1000000"),
    Case("tabs expanded", _host("{{ ('\\t' * 1000000).expandtabs(999999) }}"),
         "expandtabs() would build more than 1000000"),
    Case("str.replace", _host("{{ ('x' * 1000000).replace('x', 'y' * 1000) }}"),
         "replace() would build more than 1000000"),
    Case("str.join", _host("{{ ','.join(['y' * 999] * 999999) }}"), "join() would build more than 1000000"),
    Case("a mapping grown by update()",
         _host("{% set d = {} %}{% for i in range(99) %}"
               "{% set _ = d.update(dict.fromkeys(range(i * 99999, i * 99999 + 99999))) %}{% endfor %}"),
         "more than 1000000"),
    Case("a macro calling itself twice",
         _host("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(40) }}"), STEPS),
    Case("a loop in a loop",
         _host("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"), STEPS),
    Case("a loop that feeds itself",
         _host("{% set x = [1] %}{% for i in x %}{% set _ = x.append(i) %}{% endfor %}"), STEPS),
    Case("loop.cycle of a long string",
         _host("{% for i in range(100000) %}{{ loop.cycle('x' * 100000) }}{% endfor %}"),
         "builds more than 1000000 characters"),
    Case("a list compared 100,000 times",
         _host("{% set a = range(100000)|list %}{% set b = range(100000)|list %}"
               "{% for i in range(100000) %}{% if a == b %}{% endif %}{% endfor %}"), "more than 4000000"),
    Case("a list sliced 100,000 times",
         _host("{% set s = range(100000)|list %}{% for i in range(100000) %}{% set _ = s[:] %}{% endfor %}"),
         "more than 4000000"),
    Case("summing lists", _host("{{ ([[1] * 1000] * 1000)|sum(start=[]) }}"), "more than 4000000"),
    Case("tojson indented", _host("{{ (range(100000)|list)|tojson(indent=99999) }}"),
         "tojson would build more than 1000000"),
    Case("a list of a million references, as text",
         _host("{% set a = ['x' * 1000] * 1000 %}{{ '{}'.format([a] * 1000) }}"),
         "more than 1000000 characters (as text)"),
    Case("a list that holds itself", _host("{% set x = [] %}{% set _ = x.append(x) %}{{ x }}"),
         "holds a list or mapping that holds itself"),
    Case("a tuple nested 100,000 deep, hashed",  # CPython's hash of it recurses in C, and crashes
         _host("{% set acc = [()] %}{% for i in range(99999) %}{% set _ = acc.append((acc[-1],)) %}{% endfor %}"
               "{{ {acc[-1]: 1} }}"), "nests lists or mappings more than 100 deep"),
    Case("a number of 12,000 bits", _vars("{ansible_port: $T}", T="{% set a = 2 ** 4000 %}{{ a * a * a }}"),
         "would compute a number of more than 4096 bits"),
    Case("a billion slots", "{ddtree: {server: {slots: {count: 1000000000, gpus_per_slot: 1}}}}",
         "ddtree.server.slots: 1000000000 slots of 1 GPU(s) each: more GPUs than a host has"),
    Case("a billion GPUs in one slot", "{ddtree: {server: {slots: {count: 1, gpus_per_slot: 1000000000}}}}",
         "ddtree.server.slots: 1 slots of 1000000000 GPU(s) each"),
    # Spread over 2,000 hosts (a group's template is evaluated for each), 99 steps each.
    Case("2,000 hosts, 99 steps each", _host("{% for i in range(99) %}{% endfor %}ok"), STEPS, hosts="h[0000:1999]"),
]


@pytest.mark.parametrize("case", BOMBS, ids=[c.name for c in BOMBS])
def test_a_template_bomb_is_refused_in_one_line(case: Case, tmp_path: Path, cli: Any, clean_home: Path) -> None:
    inventory = _write(tmp_path, case)
    # The imports the first command of a process pays (Jinja's too) are not the bomb's.
    warm = tmp_path / "warm.yml"
    warm.write_text("all:\n  hosts:\n    w: {ansible_host: '{{ inventory_hostname }}'}\n")
    assert cli("-i", str(warm), "hosts").exit_code == 0
    started = time.process_time()
    res = cli("-i", str(inventory), *RESTART)
    spent = time.process_time() - started
    assert res.exit_code == 2, res.stdout[-2000:] + res.stderr[-2000:]
    line = _one_line(res)
    assert line.startswith(f"error: {inventory}: {case.where}") and case.expect in line, line
    assert not (tmp_path / "run").exists(), "a host was touched"
    assert spent < 1.0, f"{spent:.2f} s of CPU"


# ------------------------------------------------------------------------------ secrets

ENV = {
    "DDT_PIN": "987654",
    "DDT_SECRET": "Hunter2-zx81q",
    "DDT_PORT": "23456",
    "DDT_HIGH": "65534",
    "DDT_GPUS": "4093,4091",
    "DDT_UNIT": "zq7sglang@.service",
}
# Text that must appear nowhere: the values and what templates and checks compute from them
# (upper- and lower-cased, sliced, a port plus a slot's index).
FORBIDDEN = ("987654", "Hunter2", "HUNTER2", "hunter2", "nter2-zx81q", "zx81q", "ZX81Q", "23456", "65534", "65536",
             "4093", "4091", "zq7sglang")


def _mask(name: str) -> str:
    return f"<value of lookup('env', '{name}')>"


SECRETS = [
    # Range and type checks on what a template computed.
    Case("ansible_port |int", _vars("{ansible_port: $T}", T="{{ lookup('env', 'DDT_PIN') | int }}"),
         f"ansible_port: expected a port number (integer 1-65535), got {_mask('DDT_PIN')}"),
    Case("ansible_port as digits", _vars("{ansible_port: $T}", T="{{ lookup('env', 'DDT_PIN') }}"),
         f"ansible_port: expected a port number (integer 1-65535), got {_mask('DDT_PIN')}"),
    Case("server.port", _vars("{ddtree: {server: {port: $T}}}", T="{{ lookup('env', 'DDT_PIN') | int }}"),
         f"ddtree.server.port: expected a port number (integer 1-65535), got {_mask('DDT_PIN')}"),
    Case("slots count negative", _vars("{ddtree: {server: {slots: {count: $T, gpus_per_slot: 1}}}}",
                                       T="{{ -(lookup('env', 'DDT_PIN') | int) }}"),
         f"ddtree.server.slots.count: expected a positive integer, got {_mask('DDT_PIN')}"),
    Case("slots count too large", _vars("{ddtree: {server: {slots: {count: $T, gpus_per_slot: 1}}}}",
                                        T="{{ lookup('env', 'DDT_PIN') | int }}"),
         f"ddtree.server.slots: {_mask('DDT_PIN')} slots of 1 GPU(s) each"),
    Case("expected_load_s", _vars("{ddtree: {server: {expected_load_s: $T}}}",
                                  T="{{ -(lookup('env', 'DDT_PIN') | float) }}"),
         "ddtree.server.expected_load_s: expected a "),
    Case("model_path a number", _vars("{ddtree: {server: {model_path: $T}}}", T="{{ lookup('env', 'DDT_PIN') | int }}"),
         f"ddtree.server.model_path: expected a non-empty string, got {_mask('DDT_PIN')}"),
    Case("ansible_user a list", _vars("{ansible_user: $T}", T="{{ [lookup('env', 'DDT_PIN') | int] }}"),
         f"ansible_user: expected a string, got [{_mask('DDT_PIN')}]"),
    Case("ansible_user a comparison", _vars("{ansible_user: $T}", T="{{ lookup('env', 'DDT_SECRET') == 'x' }}"),
         f"ansible_user: expected a string, got {_mask('DDT_SECRET')}"),
    Case("ansible_connection", _vars("{ansible_connection: $T}", T="{{ lookup('env', 'DDT_SECRET') | upper }}"),
         f"ansible_connection: {_mask('DDT_SECRET')} is not supported"),
    Case("manager", _vars("{ddtree: {server: {manager: $T}}}", T="{{ lookup('env', 'DDT_SECRET') }}"),
         "ddtree.server.manager: expected 'process'"),
    Case("an owned flag in extra_args", _vars("{ddtree: {server: {extra_args: [$T]}}}",
                                              T="{{ '--port=' ~ lookup('env', 'DDT_SECRET') }}"),
         f"ddtree.server.extra_args: {_mask('DDT_SECRET')}: ddtree-ops sets --port itself"),
    # Unknown keys: a key computed from the environment is not shown, nor how close it is.
    Case("an unknown key", _vars("{ddtree: $T}", T="{{ {lookup('env', 'DDT_SECRET'): 1} }}"),
         "unknown key (valid keys: python, gpu, run_dir, known_hosts, server)"),
    # Jinja's own messages quote the key, the index, the value.
    Case("KeyError of an upper-cased secret", _host("{{ dict()[lookup('env', 'DDT_SECRET') | upper] }}"),
         f"'dict object' has no attribute {_mask('DDT_SECRET')}"),
    Case("KeyError from dict.pop", _host("{{ {}.pop(lookup('env', 'DDT_SECRET') | lower) }}"),
         f"cannot be evaluated: KeyError (its message is not shown: it may hold {_mask('DDT_SECRET')})"),
    Case("IndexError", _host("{{ [][lookup('env', 'DDT_PIN') | int] }}"),
         f"'list object' has no element {_mask('DDT_PIN')}"),
    Case("ValueError of a slice", _host("{{ [].index(lookup('env', 'DDT_SECRET')[2:]) }}"),
         "cannot be evaluated: ValueError (its message is not shown"),
    Case("LookupError", _host("{{ 'x'.encode(lookup('env', 'DDT_SECRET')) }}"),
         "cannot be evaluated: LookupError (its message is not shown"),
    Case("TypeError", _host("{{ lookup('env', 'DDT_SECRET') ~ 'x' + 1 }}"),
         "cannot be evaluated: TypeError (its message is not shown"),
    Case("a lookup named by the environment", _host("{{ lookup(lookup('env', 'DDT_SECRET') | upper) }}"),
         "a lookup() other than lookup('env', ...) is not evaluated"),
    Case("a size computed from one", _host("{{ range((lookup('env', 'DDT_PIN') | int) * 1000) | list }}"),
         "a number larger than 1000000 where a size is expected"),
    # Through another variable; a name written in the template is still said.
    Case("through another variable", _vars("{ansible_host: $T, token: $S}", T="{{ token[3:] ~ nope }}",
                                           S="{{ lookup('env', 'DDT_SECRET') }}"), "'nope' is undefined"),
    Case("a dict key through another variable",
         _vars("{ansible_host: $T, token: $S}", T="{{ {'a': 1}[token | upper] }}",
               S="{{ lookup('env', 'DDT_SECRET') }}"), f"'dict object' has no attribute {_mask('DDT_SECRET')}"),
    # What the slot checks compute from it: ports, GPU indices, a tensor-parallel size.
    Case("--tp-size from the environment",
         _vars("{ddtree: {server: {slots: {count: 1, gpus_per_slot: 1}, extra_args: ['--tp-size', $T]}}}",
               T="{{ lookup('env', 'DDT_PIN') }}"),
         f"ddtree.server.extra_args: --tp-size {_mask('DDT_PIN')} does not match"),
    Case("two slots on one port", _vars("{ddtree: {server: {slots: [{gpus: '0', port: $P}, {gpus: '1', port: $P}]}}}",
                                        P="{{ lookup('env', 'DDT_PORT') | int }}"),
         f"ddtree.server.slots: port {_mask('DDT_PORT')} is used by slot 0 and slot 1"),
    Case("two slots on the same GPUs",
         _vars("{ddtree: {server: {slots: [{gpus: $G, port: 1000}, {gpus: $G, port: 1001}]}}}",
               G="{{ lookup('env', 'DDT_GPUS') }}"),
         f"ddtree.server.slots: GPU {_mask('DDT_GPUS')} is in slot 0 and slot 1"),
    Case("a slot's port above 65535", _vars("{ddtree: {server: {port: $T, slots: {count: 3, gpus_per_slot: 1}}}}",
                                            T="{{ lookup('env', 'DDT_HIGH') | int }}"),
         f"ddtree.server.slots: slot 2's port {_mask('DDT_HIGH')}"),
    Case("a unit template without slots", _vars("{ddtree: {server: {manager: systemd, unit: $T}}}",
                                                T="{{ lookup('env', 'DDT_UNIT') }}"),
         f"ddtree.server.unit: {_mask('DDT_UNIT')} is a template"),
]


@pytest.mark.parametrize("case", SECRETS, ids=[c.name for c in SECRETS])
def test_a_value_from_lookup_env_is_never_shown_in_an_error(
    case: Case, tmp_path: Path, cli: Any, clean_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    inventory = _write(tmp_path, case)
    res = cli("-i", str(inventory), *RESTART)
    assert res.exit_code == 2, res.stdout[-2000:] + res.stderr[-2000:]
    line = _one_line(res)
    assert case.expect in line, line
    assert not (tmp_path / "run").exists(), "a host was touched"
    for args in (RESTART, *READERS):
        res = cli("-i", str(inventory), *args)
        assert res.exit_code == 2, (args, res.stdout[-2000:], res.stderr[-2000:])
        shown = [text for text in FORBIDDEN if text in res.stdout + res.stderr]
        assert not shown, (args, shown, res.stdout[-2000:] + res.stderr[-2000:])


def test_only_what_a_template_computed_from_the_environment_is_masked(
    tmp_path: Path, cli: Any, clean_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keys of ``ddtree:`` beside one read from the environment are shown as written
    (they were masked with it), and a number from the environment is used as a number."""
    monkeypatch.setenv("DDT_SECRET", ENV["DDT_SECRET"])
    monkeypatch.setenv("DDT_PORT", ENV["DDT_PORT"])
    host_vars = _vars("{ansible_port: $P, ddtree: {server: {model_path: /models/qwen, port: $P, env: {HF_TOKEN: $S}}}}",
                      P="{{ lookup('env', 'DDT_PORT') | int }}", S="{{ lookup('env', 'DDT_SECRET') }}")
    inventory = _write(tmp_path, Case("", host_vars, ""))
    host = load_inventory([inventory]).hosts["h"]
    assert (host.port, host.ddtree.server.port) == (23456, 23456)
    assert type(host.port) is int and type(host.ddtree.server.port) is int  # commands get digits
    assert f"--port {host.ddtree.server.port}" == "--port 23456"
    res = cli("-i", str(inventory), "--json", "hosts")
    assert res.exit_code == 0, res.stderr
    server = json.loads(res.stdout)["data"][0]["ddtree"]["server"]
    assert server["model_path"] == "/models/qwen"
    assert server["env"] == {"HF_TOKEN": _mask("DDT_SECRET")}
    assert ENV["DDT_SECRET"] not in res.stdout


# ------------------------------------------------------------------------------ what still works


def test_templates_an_inventory_needs_still_evaluate(tmp_path: Path, clean_home: Path) -> None:
    """Loops, joins, formats, printf and macros of a sensible size are no bombs."""
    template = ("{% macro port(i) %}{{ 30000 + i }}{% endmacro %}"
                "{% set names = [] %}{% for i in range(1000) %}{% set _ = names.append('gpu%d' % i) %}{% endfor %}"
                "{{ 'yes' if (names | join(',') | length > 5000) and ('{}-{:>4}'.format('x', 7) == 'x-   7') "
                "and port(2) == '30002' and (range(100) | list | sum) == 4950 and 'gpu7' in names else 'no' }}")
    inventory = _write(tmp_path, Case("", _vars("{ddtree: {server: {env: {OK: $T}}}}", T=template), ""))
    assert load_inventory([inventory]).hosts["h"].ddtree.server.env["OK"] == "yes"


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="the process's size is read from /proc (Linux)")
def test_templates_are_evaluated_under_a_memory_limit() -> None:
    """The last bound, for a path the checks missed: while a template runs the process
    cannot grow by more than MEMORY_HEADROOM; the limit is put back after."""
    before = resource.getrlimit(resource.RLIMIT_AS)
    with Budget().spending():
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        assert soft != resource.RLIM_INFINITY
        if before[0] == resource.RLIM_INFINITY:  # else a ulimit of the machine's is the bound
            with pytest.raises(MemoryError):
                bytearray(MEMORY_HEADROOM + (256 << 20))
    assert resource.getrlimit(resource.RLIMIT_AS) == before
