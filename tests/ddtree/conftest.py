"""Shared fixture: the bundled DDTree module, loaded by path exactly as deployed."""

from __future__ import annotations

from types import ModuleType

import pytest

from ddtree_ops.ddtree_core import load_ddtree_utils


@pytest.fixture(scope="session")
def du() -> ModuleType:
    return load_ddtree_utils()
