"""The simulator serves DDTREE only from the DDTree plugin deployed into its host's SGLang,
as SGLang 0.5.23 does: without the plugin's entry point (or with ``SGLANG_PLUGINS`` leaving
it out) the launch fails resolving its arguments, before any port opens; with it, the tree
code that runs is the host's deployed copy, never the toolkit's."""

from __future__ import annotations

from pathlib import Path

import pytest
from minisglang import deploy_bundle, expose_toolkit, make_prefix, purelib

DDTREE = ("--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", "sim/d")
UNKNOWN = "ValueError: Unknown speculative algorithm name: DDTREE"


@pytest.fixture
def bare_python(tmp_path: Path) -> str:
    """A host interpreter with SGLang 0.5.23's files and no DDTree bundle."""
    prefix = make_prefix(tmp_path / "bare")
    expose_toolkit(prefix)
    return str(prefix / "bin" / "python")


def test_without_the_plugin_ddtree_fails_like_sglang_and_the_other_algorithms_serve(sim_factory, bare_python) -> None:
    refused = sim_factory(*DDTREE, python=bare_python)
    assert refused.wait_exit(60) == 1
    assert UNKNOWN in refused.log() and "the DDTree bundle is not deployed" in refused.log()
    assert "Load weight begin." not in refused.log()  # failed before loading: no port ever opened
    for flags in ((), ("--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "sim/d")):
        served = sim_factory(*flags, python=bare_python)
        served.wait_ready()


def test_sglang_plugins_leaving_ddtree_out_refuses_it_on_a_deployed_host(sim_factory) -> None:
    refused = sim_factory(*DDTREE, env={"SGLANG_PLUGINS": "other"})
    assert refused.wait_exit(60) == 1
    assert UNKNOWN in refused.log() and "SGLANG_PLUGINS=other leaves out the 'ddtree' plugin" in refused.log()
    allowed = sim_factory(*DDTREE, env={"SGLANG_PLUGINS": "other,ddtree"})
    allowed.wait_ready()


def test_the_tree_code_that_runs_is_the_hosts_deployed_copy(sim_factory, tmp_path: Path) -> None:
    prefix = make_prefix(tmp_path / "host")
    expose_toolkit(prefix)
    deploy_bundle(prefix)
    python = str(prefix / "bin" / "python")
    sim_factory(*DDTREE, python=python).wait_ready()
    # The host's copy changed behind the toolkit's back: the simulator runs exactly it.
    reference = purelib(prefix) / "sglang" / "srt" / "speculative" / "ddtree_reference.py"
    reference.write_text(reference.read_text() + "\nraise RuntimeError('the copy deployed on this host')\n")
    changed = sim_factory(*DDTREE, python=python)
    assert changed.wait_exit(60) != 0
    assert "RuntimeError: the copy deployed on this host" in changed.log()
