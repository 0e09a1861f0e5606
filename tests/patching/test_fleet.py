"""The patch engine over real SSH: the real bundle on every fleet host, and a real cut connection."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from fleetlib import Fleet, FleetHost, cached_prefix_template, find_wheel

from ddtree_ops.errors import TransportError
from ddtree_ops.fleet import run_on_hosts
from ddtree_ops.patching.bundle import Bundle, load_bundle
from ddtree_ops.patching.executor import RunOptions, deploy, rollback
from ddtree_ops.patching.status import host_status
from ddtree_ops.transport import open_transport
from ddtree_ops.transport.base import Command, CommandResult, RoundTripCounter
from patching.conftest import BUNDLES, LIST_ENTRY_POINTS, PLUGIN_GROUP

REAL_BUNDLE = Path(__file__).resolve().parents[2] / "patches" / "ddtree_temperature"

pytestmark = [pytest.mark.fleet, pytest.mark.slow]


def _reset(fh: FleetHost, bundle: Bundle) -> None:
    """Upstream files back and no ddtree-ops state: other tests share the session fleet."""
    template = cached_prefix_template(find_wheel())
    upstream = Path(str(fh.sglang_dir).replace(str(fh.prefix), str(template), 1))
    for f in bundle.files:
        if f.root == "site-packages":
            # The bundle's own distribution metadata: upstream has none of it.
            shutil.rmtree(fh.site_packages / f.rel.split("/")[0], ignore_errors=True)
            continue
        target = fh.sglang_dir / f.path
        if (upstream / f.path).exists():
            shutil.copy2(upstream / f.path, target)
        elif target.exists():
            target.unlink()
    shutil.rmtree(fh.prefix / ".ddtree-ops", ignore_errors=True)


def test_real_bundle_on_every_fleet_host(ssh_fleet: Fleet) -> None:
    if not (REAL_BUNDLE / "patch.yaml").exists():
        pytest.skip("patches/ddtree_temperature not present")
    bundle = load_bundle(REAL_BUNDLE)
    inv = ssh_fleet.load()
    hosts = [inv.hosts[n] for n in ssh_fleet.names]
    for fh in ssh_fleet.hosts:
        _reset(fh, bundle)
    try:
        def apply(h: Any) -> Any:
            with open_transport(h) as t:
                return deploy(t, h, bundle)

        results = run_on_hosts(hosts, apply, max_parallel=8)
        assert all(not isinstance(r, BaseException) and r.outcome == "applied" for r in results.values()), results

        def again(h: Any) -> tuple[str, int]:
            c = RoundTripCounter()
            with open_transport(h, counter=c) as t:
                return deploy(t, h, bundle).outcome, c.commands

        assert set(run_on_hosts(hosts, again, max_parallel=8).values()) == {("noop", 1)}
        for h in hosts:
            with open_transport(h) as t:
                st = host_status(t, h, bundle=bundle)
            assert st.bundle_identity == bundle.identity and st.consistent
            assert {f.state for f in st.files} == {"patched"}

        def undo(h: Any) -> str:
            with open_transport(h) as t:
                return rollback(t, h).outcome

        assert set(run_on_hosts(hosts, undo, max_parallel=8).values()) == {"rolled-back"}
        for h in hosts:
            with open_transport(h) as t:
                st = host_status(t, h, bundle=bundle)
            assert st.bundle_name is None and {f.state for f in st.files} == {"original"}
    finally:
        for fh in ssh_fleet.hosts:
            _reset(fh, bundle)


def test_plugin_bundle_over_ssh(ssh_fleet: Fleet) -> None:
    """A dist-info beside the package, over SSH: the host's interpreter lists its entry point; rollback removes it."""
    fh = ssh_fleet.hosts[0]
    bundle = load_bundle(BUNDLES / "plugin")
    host = ssh_fleet.load().hosts[fh.name]
    meta = next(f for f in bundle.files if f.root == "site-packages" and f.rel.endswith("/METADATA"))

    def entry_points(t: Any) -> dict[str, Any]:
        res = t.run([host.python, "-c", LIST_ENTRY_POINTS, PLUGIN_GROUP], timeout=60, check=True)
        return json.loads(res.stdout)

    _reset(fh, bundle)
    try:
        with open_transport(host) as t:
            assert entry_points(t) == {}
            out = deploy(t, host, bundle)
            assert out.outcome == "applied"
            assert entry_points(t) == {"ddtree_mini": ["sglang.srt.speculative.ddtree_plugin_mini:register"]}
            # The key is the file's path relative to the package directory: SFTP reads it as `--diff` does.
            assert out.state is not None and out.state.site_dir == str(fh.site_packages)
            assert t.read_bytes(f"{out.state.package_dir}/{meta.path}") == meta.content
            assert deploy(t, host, bundle).outcome == "noop"
            assert {f.state for f in host_status(t, host, bundle=bundle).files} == {"patched"}
            assert rollback(t, host).outcome == "rolled-back"
            assert entry_points(t) == {}
        assert not (fh.site_packages / meta.rel.split("/")[0]).exists()
        assert not (fh.sglang_dir / "srt/speculative/ddtree_plugin_mini.py").exists()
    finally:
        _reset(fh, bundle)


class _KillSessionDuringStep:
    """Wraps an SSH transport; while command ``index`` runs, SIGKILLs the host's per-connection sshd."""

    def __init__(self, inner: Any, fh: FleetHost, index: int, delay_s: float) -> None:
        self.inner, self.fh, self.index, self.delay_s = inner, fh, index, delay_s
        self.host = inner.host
        self.calls = 0
        self.killed: list[int] = []

    def _kill_sessions(self) -> None:
        listener = self.fh.server.proc.pid if self.fh.server.proc else None
        if listener is None:
            return
        out = subprocess.run(["pgrep", "-P", str(listener)], capture_output=True, text=True).stdout.split()
        for pid in map(int, out):
            try:
                os.kill(pid, signal.SIGKILL)
                self.killed.append(pid)
            except ProcessLookupError:
                pass

    def run(self, command: Command, **kw: Any) -> CommandResult:
        i = self.calls
        self.calls += 1
        timer = threading.Timer(self.delay_s, self._kill_sessions) if i == self.index else None
        if timer:
            timer.start()
        try:
            return self.inner.run(command, **kw)
        finally:
            if timer:
                timer.cancel()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_sshd_session_killed_mid_upload_then_rerun_converges(ssh_fleet: Fleet, tmp_path: Path) -> None:
    fh = ssh_fleet.hosts[-1]
    d = tmp_path / "big"
    shutil.copytree(BUNDLES / "basic", d)
    # A large added file makes the upload take long enough for the kill to land during it.
    (d / "files/srt/speculative/ddtree_big.bin").write_bytes(os.urandom(16 << 20))
    text = (d / "patch.yaml").read_text().replace(
        "files:\n", "files:\n  - {op: add, path: srt/speculative/ddtree_big.bin}\n", 1)
    (d / "patch.yaml").write_text(text)
    bundle = load_bundle(d)
    host = ssh_fleet.load().hosts[fh.name]
    _reset(fh, bundle)
    try:
        cutter = _KillSessionDuringStep(open_transport(host), fh, index=1, delay_s=0.3)
        with pytest.raises(TransportError):
            deploy(cutter, host, bundle)
        cutter.close()
        assert cutter.killed, "no sshd session process was found to kill"
        with open_transport(host) as t:
            states = {f.state for f in host_status(t, host, bundle=bundle).files}
        assert states in ({"original"}, {"patched"})
        # The orphaned step may still be finishing on the host: the re-run waits for it, then converges.
        with open_transport(host) as t:
            out = deploy(t, host, bundle, RunOptions(lock_wait_s=60))
        print(f"after the kill: files {states}, re-run {out.outcome}, recovered {out.recovered}")
        assert out.outcome in ("applied", "noop")
        with open_transport(host) as t:
            st = host_status(t, host, bundle=bundle)
        assert {f.state for f in st.files} == {"patched"} and st.journal is None and st.lock is None
        assert not list(fh.sglang_dir.rglob(".ddtree-tmp-*"))
    finally:
        _reset(fh, bundle)
