"""Fixtures for the patch engine: a real Python prefix per test holding a small SGLang 0.5.23.

Each test gets its own venv (made in ~0.1 s, no pip) whose site-packages holds the real
0.5.23 files the test bundles touch plus the dist-info, so that ``find_spec`` and
``importlib.metadata`` answer on the host exactly as they do on a full install, and the
state directory ``<prefix>/.ddtree-ops`` is private to the test.

The files are read straight out of the SGLang wheel that ``make test`` / ``.ci/run``
download into ``.cache/wheels`` (``fleetlib.find_wheel`` fetches it if it is missing), so
nothing outside the checkout and pytest's tmp dirs is read.
"""

from __future__ import annotations

import json
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from minisglang import expose_toolkit, make_prefix
from service.simhosts import free_port

from ddtree_ops.inventory_types import DdtreeSettings, Host

BUNDLES = Path(__file__).parent / "bundles"


# SGLang's plugin entry-point group, and a probe that prints a group's entry points as a
# host interpreter sees them ({name: [value]}; with argv[2] == "load" also what calling each
# target returns: the test prefixes' stand-in sglang imports, the fleet's real one cannot
# without its dependencies).
PLUGIN_GROUP = "sglang.srt.plugins"
LIST_ENTRY_POINTS = (
    "import json, sys\n"
    "from importlib.metadata import entry_points\n"
    "eps = entry_points(group=sys.argv[1])\n"
    "load = sys.argv[2:] == ['load']\n"
    "print(json.dumps({e.name: [e.value] + ([e.load()()] if load else []) for e in eps}))\n"
)


def entry_points_on_host(python: str, *, load: bool = False) -> dict[str, list[str]]:
    argv = [python, "-c", LIST_ENTRY_POINTS, PLUGIN_GROUP, *(["load"] if load else [])]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@dataclass(frozen=True)
class MiniHost:
    host: Host
    prefix: Path
    pkg: Path

    @property
    def state_dir(self) -> Path:
        return self.prefix / ".ddtree-ops"

    def file(self, rel: str) -> Path:
        return self.pkg / rel


@pytest.fixture
def mini(tmp_path: Path) -> MiniHost:
    prefix = make_prefix(tmp_path / "prefix")
    py = prefix / "bin" / "python"
    pkg = Path(sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)})) / "sglang"
    host = Host(name="mini", connection="local", ddtree=DdtreeSettings(python=str(py)), source="<test>")
    return MiniHost(host=host, prefix=prefix, pkg=pkg)


def sim_inventory(tmp_path: Path, mini: MiniHost, *, load_s: float = 0.2) -> Path:
    """An inventory of one local host ``b1`` whose Python is ``mini``'s prefix and whose
    server is the simulator on its B300 profile (``load_s``: its model load)."""
    # The host's interpreter must find ddtree_ops (the simulator) like the demo hosts do.
    expose_toolkit(mini.prefix)
    server = {"command": "{python} -m ddtree_ops.sim", "model_path": "sim/qwen3-8b",
              "draft_model_path": "sim/qwen3-8b-dflash", "port": free_port(), "expected_load_s": 5,
              "env": {"SIM_LOAD_S": str(load_s), "SIM_GPU": "b300", "SIM_TIME_SCALE": "0.1"}}
    hosts = {"b1": {"ddtree": {"python": str(mini.prefix / "bin" / "python"), "run_dir": str(tmp_path / "run"),
                               "gpu": "b300", "server": server}}}
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump(
        {"all": {"children": {"b": {"vars": {"ansible_connection": "local"}, "hosts": hosts}}}}
    ))
    return inv
