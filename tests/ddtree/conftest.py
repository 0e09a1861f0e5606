"""Shared fixtures: the bundled DDTree modules, loaded by path exactly as deployed, and
the benchmarks' host-side baseline layout that is pinned to them."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest

from ddtree_ops.ddtree_core import REPO_ROOT, load_ddtree_reference, load_ddtree_runtime, load_ddtree_utils


@pytest.fixture(scope="session")
def ref() -> ModuleType:
    """The per-request reference (``ddtree_reference.py``)."""
    return load_ddtree_reference()


@pytest.fixture(scope="session")
def du() -> ModuleType:
    """The device-resident round the server runs (``ddtree_utils.py``)."""
    return load_ddtree_utils()


@pytest.fixture(scope="session")
def rt() -> ModuleType:
    """The runtime tree states' pure part (``ddtree_runtime.py``)."""
    return load_ddtree_runtime()


@pytest.fixture(scope="session")
def layout() -> ModuleType:
    """``benchmarks/host_layout.py``: the previous host-side layout the benchmarks measure against."""
    name = "_ddtree_benchmarks_host_layout"
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "benchmarks" / "host_layout.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
