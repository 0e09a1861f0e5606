"""Hosts run by a real systemd (tests/systemdhost.py), one fleet per test module.

Skipped with the reason where this machine cannot boot one; a failure in CI (``CI=true``),
which must run them."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from fleetlib import fast_root
from systemdhost import SystemdFleet, build_systemd_fleet, systemd_unavailable


def _fleet(tmp_path_factory: pytest.TempPathFactory, count: int, **kw: object) -> Iterator[SystemdFleet]:
    reason = systemd_unavailable()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must boot systemd test hosts, but {reason}")
        pytest.skip(reason)
    root, owned = fast_root(tmp_path_factory.mktemp("systemd"))
    try:
        fleet = build_systemd_fleet(root / "fleet", count, **kw)  # type: ignore[arg-type]
        try:
            yield fleet
        finally:
            fleet.close()
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def systemd_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemdFleet]:
    """One systemd host (RTX PRO 6000 profile)."""
    yield from _fleet(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def systemd_trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemdFleet]:
    """Three systemd hosts, for rollouts."""
    yield from _fleet(tmp_path_factory, 3)


@pytest.fixture
def sd_env(clean_home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No user files, the working directory the test's own (no results/ of the checkout)."""
    monkeypatch.delenv("DDTREE_OPS_INVENTORY", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path
