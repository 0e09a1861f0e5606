"""`ddtree-ops selftest`: the bundle's selftest.py run by real interpreters against
deployed files — locally, through the CLI, and on the SSH test fleet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_json import json_data
from fleetlib import chatty_python

from ddtree_ops.errors import CommandFailed, PatchError
from ddtree_ops.inventory_types import DdtreeSettings, Host
from ddtree_ops.patching.bundle import load_bundle
from ddtree_ops.selftest import (
    DEFAULT_BUNDLE,
    SelftestResult,
    parse_report,
    run_selftest,
    selftest_source,
)
from ddtree_ops.transport.hostprogram import MARKER
from ddtree_ops.transport.local import LocalTransport

REPO = Path(__file__).resolve().parents[2]
EXPECTED_CHECKS = {
    "golden_encoding",
    "builder_encoding_properties",
    "greedy_walk",
    "reference_sampler_exact",
    "device_round",
}


def _fake_site(root: Path, *, deployed: bool) -> Path:
    """A site dir holding a `sglang` package laid out like a deploy leaves it, and an
    interpreter wrapper that sees it (so the host's python is a real, separate process)."""
    pkg = root / "site" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    if deployed:
        for f in load_bundle(DEFAULT_BUNDLE).files:
            dest = pkg / f.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(f.content)
    wrapper = root / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={root / "site"} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def _host(python: Path, name: str = "selftest-local") -> Host:
    return Host(name=name, connection="local", ddtree=DdtreeSettings(python=str(python)), source="<test>")


@pytest.mark.parametrize("chatty", [False, True], ids=["quiet", "chatty"])
def test_selftest_passes_on_deployed_files(tmp_path: Path, chatty: bool) -> None:
    python = _fake_site(tmp_path, deployed=True)
    if chatty:  # a host whose shell hook talks on stdout first: the report is the framed message
        python = chatty_python(tmp_path / "chatty", python)
    host = _host(python)
    with LocalTransport(host.name) as t:
        result = run_selftest(t, host, source=selftest_source())
    assert result.ok, result.as_dict()
    assert set(result.checks) == EXPECTED_CHECKS
    assert result.kernel.startswith("not available")
    assert result.ddtree_utils == str(tmp_path / "site" / "sglang" / "srt" / "speculative" / "ddtree_utils.py")


def test_selftest_says_bundle_not_deployed(tmp_path: Path) -> None:
    host = _host(_fake_site(tmp_path, deployed=False))
    with LocalTransport(host.name) as t, pytest.raises(PatchError) as info:
        run_selftest(t, host, source=selftest_source())
    assert "bundle not deployed" in str(info.value)
    assert str(info.value).startswith(f"{host.name}: ")


# A deployed module that computes something else must fail the check that covers it.
BROKEN = {
    # the reference's retrieve encoding wrong: the golden worked example catches it
    "reference": (
        "ddtree_reference.py",
        "compile_ddtree_retrieve",
        "def compile_ddtree_retrieve(parents, node_logws, *, offset=0):\n"
        "    i, n, s = _orig(parents, node_logws, offset=offset)\n"
        "    return i, n, s.flip(0)\n",
        "golden_encoding",
    ),
    # the serving round's builder off by one token: only the device-vs-reference check sees it
    "device": (
        "ddtree_utils.py",
        "build_tree_batch",
        "def build_tree_batch(*args, **kwargs):\n"
        "    out = _orig(*args, **kwargs)\n"
        "    out.tokens[:, 1:] += 1\n"
        "    return out\n",
        "device_round",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_selftest_reports_a_broken_deployed_module_as_a_failed_check(tmp_path: Path, case: str) -> None:
    name, function, replacement, check = BROKEN[case]
    host = _host(_fake_site(tmp_path, deployed=True))
    module = tmp_path / "site" / "sglang" / "srt" / "speculative" / name
    module.write_text(module.read_text() + f"\n_orig = {function}\n" + replacement)
    with LocalTransport(host.name) as t:
        result = run_selftest(t, host, source=selftest_source())
    assert not result.ok
    assert check in result.failed_checks
    if case == "device":
        assert result.failed_checks == ["device_round"]


def test_parse_report_without_json_is_a_command_failure() -> None:
    with pytest.raises(CommandFailed) as info:
        # A JSON line that is not a message (no marker) is not a report either.
        parse_report("h1", 1, 'Traceback...\n{"ok": true, "deployed": true}\n', "SyntaxError: x", ["python3", "-"])
    assert "no JSON report" in str(info.value) and "h1" in str(info.value)


def test_parse_report_marks_any_failed_check() -> None:
    report = {
        "ok": True,  # a script bug claiming ok must not hide a failed check
        "deployed": True,
        "kernel": "available",
        "checks": {"golden_encoding": {"ok": True, "detail": "x"}, "kernel_vs_reference": {"ok": False, "detail": "y"}},
    }
    result = parse_report("h", 0, "banner of a chatty host\n" + MARKER + json.dumps(report) + "\n", "", ["p", "-"])
    assert isinstance(result, SelftestResult)
    assert not result.ok and result.failed_checks == ["kernel_vs_reference"]


def _inventory(path: Path, hosts: dict[str, Path]) -> Path:
    doc = {
        "all": {
            "children": {
                "lab": {
                    "vars": {"ansible_connection": "local"},
                    "hosts": {name: {"ddtree": {"python": str(py)}} for name, py in hosts.items()},
                }
            }
        }
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def test_cli_selftest_json_and_exit_code(tmp_path: Path) -> None:
    good = _fake_site(tmp_path / "good", deployed=True)
    bare = _fake_site(tmp_path / "bare", deployed=False)
    inv = _inventory(tmp_path / "inv.yaml", {"good-host": good, "bare-host": bare})
    cli = [sys.executable, "-c", "from ddtree_ops.cli.main import run; run()"]
    proc = subprocess.run(
        [*cli, "-i", str(inv), "--json", "selftest", "all"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path, env={**os.environ, "NO_COLOR": "1"},
    )
    assert proc.returncode == 4, proc.stderr  # the one failed host's own code: a PatchError (README "Exit codes")
    rows = {r["host"]: r for r in json_data(proc.stdout)}
    assert rows["good-host"]["ok"] is True
    assert set(rows["good-host"]["checks"]) == EXPECTED_CHECKS
    assert rows["bare-host"]["ok"] is False and "bundle not deployed" in rows["bare-host"]["error"]
    assert "Traceback" not in proc.stderr
    assert "bare-host" in proc.stderr.splitlines()[-1]


@pytest.mark.fleet
def test_selftest_on_the_ssh_fleet_after_deploy(ssh_fleet) -> None:  # type: ignore[no-untyped-def]
    """Deploy the bundle with the patch engine into each fleet host's real SGLang 0.5.23
    prefix over SSH (which also runs the manifest's verify commands there), selftest
    with each host's interpreter, then roll back so the shared fleet stays pristine."""
    from ddtree_ops.patching.executor import deploy, rollback
    from ddtree_ops.transport import open_transport

    inventory = ssh_fleet.load()
    bundle = load_bundle(DEFAULT_BUNDLE)
    source = selftest_source()
    for fh in ssh_fleet.hosts:
        host = inventory.hosts[fh.name]
        with open_transport(host) as t:
            with pytest.raises(PatchError, match="bundle not deployed"):
                run_selftest(t, host, source=source)
            outcome = deploy(t, host, bundle)
            try:
                assert outcome.outcome == "applied", outcome
                result = run_selftest(t, host, source=source)
            finally:
                rollback(t, host)
            assert result.ok, (host.name, result.as_dict())
            assert result.kernel.startswith("not available")
            assert result.ddtree_utils == str(fh.sglang_dir / "srt" / "speculative" / "ddtree_utils.py")
            with pytest.raises(PatchError, match="bundle not deployed"):
                run_selftest(t, host, source=source)


def test_table_rendering_names_each_host_and_its_outcome(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddtree_ops.cli.main import AppContext
    from ddtree_ops.cli.selftest import _render
    from ddtree_ops.selftest import CheckResult

    obj = AppContext(json=False)
    monkeypatch.setattr(obj.console, "width", 200)  # no cell wrapping in the assertions
    good = SelftestResult(
        host="a", ok=True, kernel="not available (no CUDA)", torch="2.13.0",
        checks={"golden_encoding": CheckResult(True, "exact")}, seconds=1.5,
    )
    bad = SelftestResult(
        host="b", ok=False, kernel="available", checks={"kernel_vs_reference": CheckResult(False, "mismatch")},
    )
    with obj.console.capture() as cap:
        failed = _render(obj, {"a": good, "b": bad, "c": PatchError("bundle not deployed: x", host="c")})
    out = cap.get()
    assert failed is True
    assert "1 checks passed" in out and "failed: kernel_vs_reference" in out
    assert "c: bundle not deployed: x" in out
    with obj.console.capture() as cap:
        assert _render(obj, {"a": good}) is False


def _sleeping_python(path: Path, pid_file: Path) -> Path:
    """A host interpreter that says its pid, then runs far longer than any test: a selftest
    program that would hold its host for minutes."""
    path.write_text(f"#!/bin/sh\necho $$ > {str(pid_file)!r}\nexec sleep 300\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("connection", ["local", pytest.param("ssh", marks=pytest.mark.fleet)])
def test_ctrl_c_ends_every_hosts_running_selftest_program_at_once(
    tmp_path: Path, connection: str, request: pytest.FixtureRequest
) -> None:
    """Ctrl-C while each host's program runs in a fan-out worker (which never sees the
    KeyboardInterrupt): the command exits 130 within seconds and ends every host's
    program, instead of waiting for each one to finish by itself."""
    import signal
    import time

    names = ("h1", "h2")
    pids = {n: tmp_path / f"{n}.pid" for n in names}
    pythons = {n: _sleeping_python(tmp_path / f"{n}-python", pids[n]) for n in names}
    if connection == "local":
        inv = _inventory(tmp_path / "inv.yaml", pythons)
    else:
        fleet = request.getfixturevalue("ssh_fleet")
        doc = yaml.safe_load(fleet.inventory.read_text())
        hosts = doc["all"]["children"]["fleet"]["hosts"]
        doc["all"]["children"]["fleet"]["hosts"] = {
            n: {**hosts[fh.name], "ddtree": {**hosts[fh.name]["ddtree"], "python": str(pythons[n])}}
            for n, fh in zip(names, fleet.hosts, strict=False)
        }
        inv = tmp_path / "inv.yaml"
        inv.write_text(yaml.safe_dump(doc))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddtree_ops", "-i", str(inv), "selftest", "all"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        while not all(p.exists() and p.read_text().strip() for p in pids.values()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        programs = [int(p.read_text()) for p in pids.values()]
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    for pid in programs:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), pid
