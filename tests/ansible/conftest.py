"""The ddtree.ops collection, built and installed once per session for the playbook tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible_runs import install_collection


@pytest.fixture(scope="session")
def ansible_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway HOME holding the collection as ``ansible-galaxy`` installs it."""
    return install_collection(tmp_path_factory.mktemp("ansible-home"))
