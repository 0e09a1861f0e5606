"""The deploy / status / rollback commands, through the real entry point (argv in, exit code out).

In-process (importing the CLI costs seconds per subprocess on a loaded machine); one test
runs a real subprocess to prove the one-line error without traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from cli_json import json_data, read_envelope
from fleetlib import free_port
from minisglang import expose_toolkit, make_prefix, upstream_bytes

from ddtree_ops.patching import load_bundle
from patching.conftest import BUNDLES, MiniHost

REPO = Path(__file__).resolve().parents[2]


def _inventory(tmp_path: Path, prefixes: dict[str, Path]) -> Path:
    hosts = {name: {"ddtree": {"python": str(p / "bin" / "python")}} for name, p in prefixes.items()}
    inv = {"all": {"children": {"test": {"vars": {"ansible_connection": "local"}, "hosts": hosts}}}}
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(inv))
    return path


@dataclass(frozen=True)
class Res:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., Res]:
    from ddtree_ops.cli import main

    monkeypatch.setattr(main.console, "width", 250)
    monkeypatch.setattr(main.err_console, "width", 250)

    def call(inv: Path, *args: str) -> Res:
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", ["ddtree-ops", "-i", str(inv), *args])
        code = 0
        try:
            main.run()
        except SystemExit as exc:
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return Res(code, out.out, out.err)

    return call


def test_deploy_status_rollback_two_hosts(tmp_path: Path, mini: MiniHost, cli: Callable[..., Res]) -> None:
    _cli = cli
    other = make_prefix(tmp_path / "other")
    inv = _inventory(tmp_path, {"h1": mini.prefix, "h2": other})
    bundle = str(BUNDLES / "basic")

    dry = _cli(inv, "--json", "deploy", "test", bundle, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    rows = json_data(dry.stdout)
    assert [r["outcome"] for r in rows] == ["planned", "planned"]
    assert not (mini.state_dir / "state.json").exists()

    first = _cli(inv, "deploy", "test", bundle)
    assert first.returncode == 0, first.stderr
    assert "applied" in first.stdout
    again = _cli(inv, "--json", "deploy", "test", bundle)
    assert [r["outcome"] for r in json_data(again.stdout)] == ["noop", "noop"]
    assert all("already applied" in r["message"] for r in json_data(again.stdout))

    st = json_data(_cli(inv, "--json", "status", "test", "--bundle", bundle).stdout)
    assert {r["bundle"]["name"] for r in st} == {"basic"}
    assert all(f["state"] == "patched" for r in st for f in r["files"])

    # A pip reinstall on h1 brings back the upstream worker: status shows it, deploy refuses to guess.
    worker = mini.file("srt/speculative/dflash_worker_v2.py")
    worker.write_text("# something else entirely\n")
    st = {r["host"]: r for r in json_data(_cli(inv, "--json", "status", "test", "--bundle", bundle).stdout)}
    assert {f["path"]: f["state"] for f in st["h1"]["files"]}["srt/speculative/dflash_worker_v2.py"] == "drifted"
    refused = _cli(inv, "deploy", "h1", bundle)
    assert refused.returncode == 4  # the one failed host's own exit code: patch refused (README)
    assert "drifted" in refused.stdout and "--force" in refused.stdout

    back = _cli(inv, "rollback", "h2")
    assert back.returncode == 0, back.stderr
    st = {r["host"]: r for r in json_data(_cli(inv, "--json", "status", "test", "--bundle", bundle).stdout)}
    assert st["h2"]["bundle"] is None
    noop = json_data(_cli(inv, "--json", "rollback", "h2").stdout)
    assert noop[0]["outcome"] == "noop" and "nothing applied" in noop[0]["message"]


def test_exit_code_is_the_failed_hosts_shared_one(tmp_path: Path, cli: Callable[..., Res]) -> None:
    """README "Exit codes": a patch refused on every host exits 4, like on one host; a mix
    of failures (refused here, unreachable there) exits 7. The envelope's first error stays
    ``fleet`` and its ``exit_code`` is the process's."""
    old = {name: make_prefix(tmp_path / name, version="0.4.0") for name in ("h1", "h2")}
    inv = _inventory(tmp_path, old)
    bundle = str(BUNDLES / "basic")
    refused = cli(inv, "--json", "deploy", "test", bundle)
    assert refused.returncode == 4, refused.stderr
    env = read_envelope(refused.stdout)
    assert env["exit_code"] == 4
    assert [e["code"] for e in env["errors"]] == ["fleet", "unsupported_version", "unsupported_version"]
    doc = yaml.safe_load(inv.read_text())
    doc["all"]["children"]["test"]["hosts"]["down"] = {
        "ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": free_port()
    }
    inv.write_text(yaml.safe_dump(doc))
    mixed = cli(inv, "--json", "deploy", "test", bundle)
    env = read_envelope(mixed.stdout)
    assert mixed.returncode == env["exit_code"] == 7, mixed.stderr
    codes = sorted(e["code"] for e in env["errors"])
    assert codes == ["connect", "fleet", "unsupported_version", "unsupported_version"]


def test_bad_bundle_is_one_line_error(tmp_path: Path, mini: MiniHost) -> None:
    inv = _inventory(tmp_path, {"h1": mini.prefix})
    res = subprocess.run(
        [sys.executable, "-m", "ddtree_ops", "-i", str(inv), "deploy", "h1", str(BUNDLES / "bad_traversal")],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert res.returncode == 2
    assert "escapes the package directory" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupting_a_deploy_stops_it_on_every_host(tmp_path: Path, mini: MiniHost, sig: signal.Signals) -> None:
    """Ctrl-C or SIGTERM while a deploy runs: the host stops between steps and the run
    ends (exit 130, 143 for SIGTERM; one line per host) instead of carrying on after the user left. Here
    the deploy waits for another controller's lock; the lock goes away right after the
    signal, so a deploy that kept running would now patch the host."""
    starts = tmp_path / "host-program-starts"  # one line per host program run
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f'#!/bin/sh\necho >> {starts}\nexec {mini.prefix / "bin" / "python"} "$@"\n')
    wrapper.chmod(0o755)
    hosts = {"h1": {"ddtree": {"python": str(wrapper)}}}
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump(
        {"all": {"children": {"test": {"vars": {"ansible_connection": "local"}, "hosts": hosts}}}}
    ))
    lock = mini.state_dir / "lock"
    lock.mkdir(parents=True)
    (lock / "info.json").write_text(json.dumps({"txn": "other", "controller": "elsewhere", "pid": 1, "user": "x"}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddtree_ops", "-i", str(inv), "deploy", "h1", str(BUNDLES / "basic"),
         "--lock-wait", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "COLUMNS": "250"},
    )
    try:
        deadline = time.monotonic() + 60
        # The deploy waits for the lock: the check phase's look at the host is one run, and
        # each later one is the lock wait's look again, so a third run means it saw the lock
        # at least twice (an event, not a pause that a busy machine can outlast).
        while not starts.exists() or len(starts.read_text().splitlines()) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(sig)
        # The lock goes once the deploy has ended, or after 20 s: a deploy that carried on
        # would still be waiting for it then, and patch the host once it is gone. (Gone
        # after a fixed moment instead, a busy machine's deploy could read "no lock" before
        # it looked at the signal.)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            shutil.rmtree(lock)
            out, err = proc.communicate(timeout=60)
        else:
            shutil.rmtree(lock)
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 30
    assert proc.returncode == (143 if sig == signal.SIGTERM else 130), (out, err)
    assert "interrupted while waiting for the host lock; nothing was changed" in out, out
    assert err.strip().splitlines() == ["error: interrupted; each host's state is shown above"], err
    assert "Traceback" not in err
    assert not (mini.state_dir / "state.json").exists()
    assert mini.file("srt/speculative/dflash_worker_v2.py").read_bytes() == upstream_bytes(
        "srt/speculative/dflash_worker_v2.py"
    )


def test_diff_shows_remote_original_against_bundle(tmp_path: Path, mini: MiniHost, cli: Callable[..., Res]) -> None:
    _cli = cli
    inv = _inventory(tmp_path, {"h1": mini.prefix})
    res = _cli(inv, "deploy", "h1", str(BUNDLES / "basic"), "--diff")
    assert res.returncode == 0, res.stderr
    # Paths from the host's site-packages, HOST/ and bundle/ before them: a patch -p1 applies there.
    assert "--- h1/sglang/srt/speculative/dflash_worker_v2.py" in res.stdout
    assert "+++ bundle/sglang/srt/speculative/dflash_worker_v2.py" in res.stdout
    assert '+PATCHED = "basic"' in res.stdout
    assert not (mini.state_dir / "state.json").exists()


def test_a_dry_run_on_a_host_without_sglang_exits_as_the_deploy_would(
    tmp_path: Path, cli: Callable[..., Res]
) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"bare": {
        "ansible_connection": "local", "ddtree": {"python": sys.executable, "run_dir": str(tmp_path / "run")}}}}}))
    basic = str(BUNDLES / "basic")
    for args in ((basic, "--dry-run"), (basic,), ("--bundle", basic)):
        res = cli(inv, "deploy", "bare", *args)
        assert res.returncode == 4, (args, res.stderr)
        assert "package 'sglang' is not installed" in res.stdout and "basic 1.0" in res.stdout
    res = cli(inv, "deploy", "bare", str(BUNDLES / "basic"), "--bundle", str(BUNDLES / "plugin"))
    assert res.returncode == 2 and "two bundles" in res.stderr


def test_another_bundle_over_an_applied_one_needs_replace(
    tmp_path: Path, mini: MiniHost, cli: Callable[..., Res]
) -> None:
    """Deploying a different bundle would take the applied one's files away: refused (exit 4,
    naming both bundles) unless --replace, which restores the first bundle's files."""
    inv = _inventory(tmp_path, {"h1": mini.prefix})
    assert cli(inv, "deploy", "h1", str(BUNDLES / "basic")).returncode == 0
    worker = mini.file("srt/speculative/dflash_worker_v2.py").read_bytes()

    dry = cli(inv, "--json", "deploy", "h1", str(BUNDLES / "plugin"), "--dry-run")
    assert [r["outcome"] for r in json_data(dry.stdout)] == ["other-bundle"]
    # The dry run exits as the run would: refused, exit 4, with the run's own error.
    assert dry.returncode == 4, dry.stderr
    dry_error = [e for e in read_envelope(dry.stdout)["errors"] if e["host"] == "h1"]
    assert dry_error[0]["code"] == "patch" and "is applied, not plugin" in dry_error[0]["message"]
    refused = cli(inv, "--json", "deploy", "h1", str(BUNDLES / "plugin"))
    assert refused.returncode == 4, refused.stderr
    env = read_envelope(refused.stdout)
    host_error = [e for e in env["errors"] if e["host"] == "h1"]
    assert len(host_error) == 1 and host_error[0]["code"] == "patch"
    message = host_error[0]["message"]
    assert "bundle basic" in message and "is applied, not plugin" in message and "--replace" in message
    assert "\n" not in message
    assert mini.file("srt/speculative/dflash_worker_v2.py").read_bytes() == worker  # nothing changed

    replaced = cli(inv, "--json", "deploy", "h1", str(BUNDLES / "plugin"), "--replace")
    assert replaced.returncode == 0, replaced.stderr
    assert json_data(replaced.stdout)[0]["outcome"] == "applied"
    assert mini.file("srt/speculative/dflash_worker_v2.py").read_bytes() == upstream_bytes(
        "srt/speculative/dflash_worker_v2.py"
    )
    st = json_data(cli(inv, "--json", "status", "h1", "--bundle", str(BUNDLES / "plugin")).stdout)
    assert st[0]["bundle"]["name"] == "plugin"


def test_plugin_bundle_diff_status_rollback(tmp_path: Path, mini: MiniHost, cli: Callable[..., Res]) -> None:
    """Files beside the package through the CLI: their key is where they are, relative to the package."""
    import shutil

    inv = _inventory(tmp_path, {"h1": mini.prefix})
    meta_key = "../sglang_ddtree_mini-0.1.0.dist-info/METADATA"
    dry = cli(inv, "--json", "deploy", "h1", str(BUNDLES / "plugin"), "--diff")
    assert dry.returncode == 0, dry.stderr
    assert {f["path"]: f["action"] for f in json_data(dry.stdout)[0]["plan"]["files"]}[meta_key] == "add"
    # Added files are shown too, against nothing, as git shows a new file.
    text = cli(inv, "deploy", "h1", str(BUNDLES / "plugin"), "--diff").stdout
    meta_path = "sglang_ddtree_mini-0.1.0.dist-info/METADATA"  # beside the package, in site-packages
    assert f"--- /dev/null\n+++ bundle/{meta_path}" in text
    assert "+++ bundle/sglang/srt/speculative/ddtree_plugin_mini.py" in text
    assert cli(inv, "deploy", "h1", str(BUNDLES / "plugin")).returncode == 0
    st = json_data(cli(inv, "--json", "status", "h1", "--bundle", str(BUNDLES / "plugin")).stdout)
    assert {f["path"]: f["state"] for f in st[0]["files"]}[meta_key] == "patched"

    # The next build of the same distribution version changes its METADATA: diffed against the host's copy.
    d = tmp_path / "next"
    shutil.copytree(BUNDLES / "plugin", d)
    meta = d / "site-packages/sglang_ddtree_mini-0.1.0.dist-info/METADATA"
    meta.write_text(meta.read_text() + "Requires-Python: >=3.8\n")
    res = cli(inv, "deploy", "h1", str(d), "--diff")
    assert res.returncode == 0, res.stderr
    assert f"--- h1/{meta_path}" in res.stdout and f"+++ bundle/{meta_path}" in res.stdout
    assert "+Requires-Python: >=3.8" in res.stdout and "supersede" in res.stdout

    back = cli(inv, "rollback", "h1")
    assert back.returncode == 0, back.stderr
    assert not (mini.pkg.parent / "sglang_ddtree_mini-0.1.0.dist-info").exists()


def test_overlay_from_to(tmp_path: Path, mini: MiniHost, cli: Callable[..., Res]) -> None:
    _cli = cli
    inv = _inventory(tmp_path, {"h1": mini.prefix})
    work = tmp_path / "work"
    work.mkdir()
    (work / "dflash_info.py").write_text("X = 1\n")
    (work / "new_mod.py").write_text("Y = 2\n")
    res = _cli(inv, "--json", "deploy", "h1", "--from", str(work), "--to", "srt/speculative")
    assert res.returncode == 0, res.stderr
    acts = {f["path"]: f["action"] for f in json_data(res.stdout)[0]["plan"]["files"]}
    assert acts == {"srt/speculative/dflash_info.py": "replace", "srt/speculative/new_mod.py": "add"}
    assert mini.file("srt/speculative/dflash_info.py").read_text() == "X = 1\n"
    # Edit and overlay again: supersedes, the recorded original stays the upstream file.
    (work / "dflash_info.py").write_text("X = 2\n")
    res = _cli(inv, "--json", "deploy", "h1", "--from", str(work), "--to", "srt/speculative")
    acts = {f["path"]: f["action"] for f in json_data(res.stdout)[0]["plan"]["files"]}
    assert acts["srt/speculative/dflash_info.py"] == "supersede"
    assert _cli(inv, "rollback", "h1").returncode == 0
    assert "class" in mini.file("srt/speculative/dflash_info.py").read_text()  # the upstream file is back
    assert not mini.file("srt/speculative/new_mod.py").exists()


@pytest.mark.slow
@pytest.mark.parametrize("slots", [0, 2])
def test_restart_after_apply_brings_the_service_up(
    tmp_path: Path, mini: MiniHost, cli: Callable[..., Res], slots: int
) -> None:
    """`--restart` hands over to the service lifecycle: the simulated server comes up serving
    DDTREE from the DDTree bundle just deployed — on a host with GPU slots, every slot's
    server (the patch is per machine)."""
    import socket

    import httpx

    from ddtree_ops.inventory import load_inventory
    from ddtree_ops.service.manager import ProcessManager
    from ddtree_ops.transport.local import LocalTransport

    # The host's interpreter must find ddtree_ops (the simulator) like the demo hosts do.
    expose_toolkit(mini.prefix)
    ports = []
    for _ in range(max(1, slots)):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    server: dict[str, object] = {"command": "{python} -m ddtree_ops.sim", "model_path": "sim/qwen3-8b",
                                 "draft_model_path": "sim/qwen3-8b-dflash", "port": ports[0], "expected_load_s": 5,
                                 "env": {"SIM_LOAD_S": "0.2", "SIM_GPU": "h200"}}
    if slots:
        server["slots"] = [{"gpus": str(i), "port": port} for i, port in enumerate(ports)]
    hosts = {"h1": {"ddtree": {"python": str(mini.prefix / "bin" / "python"), "run_dir": str(tmp_path / "run"),
                               "server": server}}}
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        yaml.safe_dump({"all": {"children": {"t": {"vars": {"ansible_connection": "local"}, "hosts": hosts}}}})
    )
    host = load_inventory([inv]).hosts["h1"]
    try:
        res = cli(inv, "deploy", "h1", "--restart", "--budget", "8", "--topk", "2")
        assert res.returncode == 0, res.stdout + res.stderr
        for i, port in enumerate(ports):
            info = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=10).json()
            assert info["speculative_algorithm"] == "DDTREE"
            assert info["simulated_gpu"]["indices"] == ([i] if slots else list(range(8)))
    finally:
        for server_host in host.slot_hosts():
            ProcessManager(LocalTransport("h1"), server_host).stop(grace_s=5)


def test_status_has_a_service_section(tmp_path: Path, mini: MiniHost, cli: Callable[..., Res]) -> None:
    """`status` answers for the server too; a host that never ran one says so, in the same round."""
    inv = _inventory(tmp_path, {"h1": mini.prefix})
    res = cli(inv, "--json", "status", "h1")
    assert res.returncode == 0, res.stderr
    (row,) = json_data(res.stdout)
    assert row["service"]["ok"] is True
    assert row["service"]["running"] is False
    assert row["service"]["pid"] is None
    table = cli(inv, "status", "h1")
    assert table.returncode == 0, table.stderr
    assert "server" in table.stdout and "stopped" in table.stdout


def test_status_fits_a_narrow_terminal_without_breaking_a_word(
    tmp_path: Path, mini: MiniHost, cli: Callable[..., Res], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddtree_ops.cli import main

    inv = _inventory(tmp_path, {"h1": mini.prefix})
    assert cli(inv, "deploy", "h1", str(BUNDLES / "basic")).returncode == 0
    monkeypatch.setattr(main.console, "width", 60)
    res = cli(inv, "status", "h1", "--bundle", str(BUNDLES / "basic"))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert max(len(line) for line in lines) <= 60
    # Dropped columns are named; every word shown is whole (the bundle's hash, the host).
    text = " ".join(res.stdout.split())
    assert "Hidden to fit 60 columns:" in text and "--wide" in text
    identity = load_bundle(BUNDLES / "basic").short_identity
    assert any(identity in line for line in lines) and any(" h1 " in line for line in lines)
    wide = cli(inv, "status", "h1", "--bundle", str(BUNDLES / "basic"), "--wide")
    assert "Hidden to fit" not in wide.stdout and "applied" in wide.stdout


def test_the_dry_run_plan_never_cuts_a_path_at_80_columns(
    tmp_path: Path, mini: MiniHost, cli: Callable[..., Res], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddtree_ops.cli import main

    inv = _inventory(tmp_path, {"h1": mini.prefix})
    monkeypatch.setattr(main.console, "width", 80)
    res = cli(inv, "deploy", "h1", str(BUNDLES / "plugin"), "--dry-run")
    assert res.returncode == 0, res.stderr
    assert max(len(line) for line in res.stdout.splitlines()) <= 80
    # Each planned path whole, so that two files of one folder never read alike.
    for action in load_bundle(BUNDLES / "plugin").files:
        assert any(action.path in line for line in res.stdout.splitlines()), action.path


def test_a_failed_hosts_reason_is_shown_at_80_columns(
    tmp_path: Path, mini: MiniHost, cli: Callable[..., Res], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddtree_ops.cli import main

    inv = _inventory(tmp_path, {"h1": mini.prefix, "h2": tmp_path / "no-such-prefix"})
    monkeypatch.setattr(main.console, "width", 80)
    res = cli(inv, "status", "all", "--bundle", str(BUNDLES / "basic"))
    assert res.returncode != 0
    assert max(len(line) for line in res.stdout.splitlines()) <= 80
    # The column that holds the reason is dropped at this width: the reason still shows, in a line.
    assert [ln for ln in res.stdout.splitlines() if ln.startswith("h2 (")]
    # Without the whitespace: a long tmp path folds wherever the 80 columns end.
    assert "bin/python:commandnotfound" in "".join(res.stdout.split())
