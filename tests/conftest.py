"""Shared fixtures: the real SSH test fleet, a local host, and isolation from the user's files."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fleetlib import Fleet, build_fleet, fast_root

from ddtree_ops.inventory_types import DdtreeSettings, Host

FLEET_SIZE = int(os.environ.get("DDTREE_OPS_FLEET_SIZE", "3"))

# A shell without job control starts a background command (`make test &`, a CI runner that
# backgrounds its job) with SIGINT ignored, every child inherits that, and Python then
# installs no KeyboardInterrupt handler: the tests that press Ctrl-C on the CLI or on this
# process would see nothing happen. Restoring Python's handler here makes exec'd children
# start with SIGINT at its default again (a handler, unlike SIG_IGN, does not survive exec).
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the main lane for two busy cores (the Makefile runs it ``--dist loadgroup``).

    A module whose tests share a module-scoped fixture (a booted systemd trio, an Ansible
    host) is one xdist group: the fixture is built once, on one worker, instead of once on
    each worker that drew one of its tests. Modules with a slow test go first (whole, so a
    module fixture is never built twice in one process): with the long tests started early,
    the short ones fill the workers in at the end, instead of one worker finishing a
    five-minute module alone while the other idles (measured: the last 3% of the lane took
    over 4 of its 23 minutes). The real-server lane orders itself (tests/sglang_real/conftest.py)."""
    if any("sglang_real" in item.nodeid.split("::")[0] for item in items):
        return
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    slow = {path for path, its in modules.items() if any(i.get_closest_marker("slow") for i in its)}
    items[:] = [i for path in sorted(modules, key=lambda p: p not in slow) for i in modules[path]]
    for path, its in modules.items():
        shared = any(
            d.scope == "module" for i in its for defs in i._fixtureinfo.name2fixturedefs.values() for d in defs
        )
        if shared:
            for item in its:
                item.add_marker(pytest.mark.xdist_group(path))


@pytest.fixture(scope="session")
def ssh_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """N real sshd hosts on loopback (default 3: RTX PRO 6000, B300, no GPU).

    Session-scoped because building the Python prefixes is the slow part; tests that stop
    a host's sshd must start it again (use the ``fleet_host_restored`` pattern: try/finally).
    """
    gpus = ("rtx-pro-6000", "b300", None, *([None] * max(0, FLEET_SIZE - 3)))[:FLEET_SIZE]
    root, owned = fast_root(tmp_path_factory.mktemp("fleet"))
    try:
        fleet = build_fleet(root / "fleet", gpus)
        try:
            yield fleet
        finally:
            fleet.close()
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fleet_hosts_running(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that stopped a fleet host's sshd must not break the next test."""
    yield
    if "ssh_fleet" in request.fixturenames:
        fleet: Fleet = request.getfixturevalue("ssh_fleet")
        for host in fleet.hosts:
            if not host.server.running:
                host.server.start()


@pytest.fixture
def local_host(tmp_path: Path) -> Host:
    """A local-connection host whose run_dir is in the test's tmp dir and python is ours."""
    return Host(
        name="local-test",
        connection="local",
        ddtree=DdtreeSettings(python=sys.executable, run_dir=str(tmp_path / "run")),
        source="<test>",
    )


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads or writes the user's ddtree-ops state file."""
    monkeypatch.setenv("DDTREE_OPS_STATE", str(tmp_path / "state.json"))


@dataclass(frozen=True)
class CliResult:
    exit_code: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., CliResult]:
    """Run ``ddtree-ops ARGS`` in-process through the real entry point (error rendering and
    exit codes included), much faster than a subprocess per call."""
    from ddtree_ops.cli import main as cli_main

    def invoke(*args: str) -> CliResult:
        monkeypatch.setattr(sys, "argv", ["ddtree-ops", *args])
        capsys.readouterr()
        code = 0
        try:
            cli_main.run()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        out, err = capsys.readouterr()
        return CliResult(code, out, err)

    return invoke


@pytest.fixture
def clean_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HOME, so the machine user's ~/.ssh/config and known_hosts stay out of tests."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    return home
