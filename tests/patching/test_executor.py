"""The executor on real files through LocalTransport: happy path, refusals, and every fault.

The invariant checked after every fault: each target file is all-original or all-patched
(never a mix), and after the next run the host converges to the bundle with no journal,
lock or stray temp file left. The fault tests run for a package-only bundle and for one
that also ships a dist-info beside the package (``plugin``).
"""

from __future__ import annotations

import configparser
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from minisglang import make_prefix

from ddtree_ops.errors import (
    ConnectError,
    DriftError,
    Interrupted,
    LockError,
    RemoteFileError,
    UnsupportedVersion,
    VerifyError,
)
from ddtree_ops.inventory_types import DdtreeSettings, Host
from ddtree_ops.patching.bundle import Bundle, load_bundle
from ddtree_ops.patching.executor import HostOutcome, RunOptions, deploy, rollback
from ddtree_ops.patching.remote import run_step
from ddtree_ops.patching.status import host_status
from ddtree_ops.transport.base import RoundTripCounter
from ddtree_ops.transport.local import LocalTransport
from patching.conftest import BUNDLES, PLUGIN_GROUP, MiniHost, entry_points_on_host
from patching.faults import CuttingTransport, HoldInsideGather, PausingTransport


@pytest.fixture
def basic() -> Bundle:
    return load_bundle(BUNDLES / "basic")


@pytest.fixture(params=["basic", "plugin"])
def bundle(request: pytest.FixtureRequest) -> Bundle:
    """Each fault test runs for a package-only bundle and for one with files beside the package."""
    return load_bundle(BUNDLES / request.param)


def _t(mini: MiniHost, counter: RoundTripCounter | None = None) -> LocalTransport:
    return LocalTransport(mini.host.name, counter=counter)


def _file_states(mini: MiniHost, bundle: Bundle) -> set[str]:
    st = host_status(_t(mini), mini.host, bundle=bundle)
    return {f.state for f in st.files}


def _assert_not_mixed(mini: MiniHost, bundle: Bundle) -> str:
    states = _file_states(mini, bundle)
    assert states in ({"patched"}, {"original"}), f"mixed file set: {states}"
    return states.pop()


def _assert_clean(mini: MiniHost) -> None:
    sd = mini.state_dir
    assert not (sd / "journal.json").exists()
    assert not (sd / "lock").exists()
    temps = list(mini.pkg.rglob(".ddtree-tmp-*")) + list(mini.pkg.parent.glob("*.dist-info/.ddtree-tmp-*"))
    assert temps == []


def _plugin_names(bundle: Bundle) -> set[str]:
    """The entry points the bundle's own dist-info registers in SGLang's plugin group."""
    names: set[str] = set()
    for f in bundle.files:
        if f.root == "site-packages" and f.rel.endswith("/entry_points.txt"):
            cp = configparser.ConfigParser(delimiters=("=",))
            cp.read_string(f.content.decode())
            names.update(cp[PLUGIN_GROUP] if cp.has_section(PLUGIN_GROUP) else ())
    return names


def _assert_converged(mini: MiniHost, bundle: Bundle) -> str:
    """Not mixed and clean; beside the package, the bundle's distribution is there exactly when patched.

    When original, not even its directory may be left: importlib.metadata lists an empty
    ``*.dist-info`` as a distribution too.
    """
    state = _assert_not_mixed(mini, bundle)
    _assert_clean(mini)
    dist_dirs = {mini.pkg.parent / f.rel.split("/")[0] for f in bundle.files if f.root == "site-packages"}
    if dist_dirs:
        expected = _plugin_names(bundle) if state == "patched" else set()
        assert set(entry_points_on_host(mini.host.python, load=True)) == expected
        assert all(d.is_dir() == (state == "patched") for d in dist_dirs)
    return state


def test_fresh_deploy_three_round_trips_noop_one(mini: MiniHost, basic: Bundle) -> None:
    c = RoundTripCounter()
    out = deploy(_t(mini, c), mini.host, basic)
    assert out.outcome == "applied" and c.total == 3
    assert _assert_not_mixed(mini, basic) == "patched"
    assert mini.file("srt/speculative/dflash_worker_v2.py").read_text().endswith('PATCHED = "basic"\n')
    # byte-compiled with the host interpreter
    assert list((mini.pkg / "srt/speculative/__pycache__").glob("ddtree_mini.*.pyc"))
    c2 = RoundTripCounter()
    again = deploy(_t(mini, c2), mini.host, basic)
    assert again.outcome == "noop" and "already applied" in again.message and c2.total == 1
    state = json.loads((mini.state_dir / "state.json").read_text())
    assert state["identity"] == basic.identity and state["name"] == "basic"
    _assert_clean(mini)


def test_a_host_whose_python_talks_on_stdout_deploys_and_rolls_back(mini: MiniHost, basic: Bundle,
                                                                    tmp_path: Path) -> None:
    """Every step answers one framed message (transport/hostprogram.py): what a shell hook
    and a sitecustomize print on stdout is not mistaken for it."""
    from dataclasses import replace

    from fleetlib import chatty_python

    host = replace(mini.host, ddtree=replace(mini.host.ddtree, python=str(chatty_python(tmp_path / "chatty",
                                                                                        mini.host.python))))
    out = deploy(_t(mini), host, basic)
    assert out.outcome == "applied", out.message
    assert _assert_not_mixed(mini, basic) == "patched"
    assert host_status(_t(mini), host).bundle_name == "basic"
    assert rollback(_t(mini), host).outcome == "rolled-back"
    _assert_clean(mini)


def test_rollback_restores_originals_and_twice_is_noop(mini: MiniHost, basic: Bundle) -> None:
    before = {
        rel: mini.file(rel).read_bytes()
        for rel in ("srt/speculative/dflash_worker_v2.py", "srt/speculative/dflash_info.py")
    }
    deploy(_t(mini), mini.host, basic)
    out = rollback(_t(mini), mini.host)
    assert out.outcome == "rolled-back"
    for rel, data in before.items():
        assert mini.file(rel).read_bytes() == data
    assert not mini.file("srt/speculative/ddtree_mini.py").exists()
    assert not (mini.state_dir / "state.json").exists()
    assert not list((mini.state_dir).rglob("backups/*"))
    assert rollback(_t(mini), mini.host).outcome == "noop"
    _assert_clean(mini)


def test_unsupported_version_refused_and_force_version_says_so(tmp_path: Path, basic: Bundle) -> None:
    prefix = make_prefix(tmp_path / "old", version="0.5.22")
    host = Host(name="old", connection="local", ddtree=DdtreeSettings(python=str(prefix / "bin" / "python")))
    with pytest.raises(UnsupportedVersion, match="0.5.22 is not a version.*--force-version"):
        deploy(LocalTransport("old"), host, basic)
    out = deploy(LocalTransport("old"), host, basic, RunOptions(force_version=True))
    assert out.outcome == "applied"
    assert "proceeding because of --force-version" in out.message


def test_drift_refused_then_forced_with_backup_then_rollback_restores_drifted(mini: MiniHost, basic: Bundle) -> None:
    worker = mini.file("srt/speculative/dflash_worker_v2.py")
    worker.write_text("# hand-edited on the host\n")
    with pytest.raises(DriftError, match="dflash_worker_v2.py: drifted.*--force"):
        deploy(_t(mini), mini.host, basic)
    assert worker.read_text() == "# hand-edited on the host\n"  # nothing changed
    assert not mini.file("srt/speculative/ddtree_mini.py").exists()
    out = deploy(_t(mini), mini.host, basic, RunOptions(force=True))
    assert out.outcome == "applied" and "--force" in out.message
    rollback(_t(mini), mini.host)
    assert worker.read_text() == "# hand-edited on the host\n"  # the backed-up drifted content came back


def test_verify_failure_rolls_back(mini: MiniHost, tmp_path: Path) -> None:
    d = tmp_path / "b"
    subprocess.run(["cp", "-r", str(BUNDLES / "basic"), str(d)], check=True)
    text = (d / "patch.yaml").read_text().split("verify:")[0]
    (d / "patch.yaml").write_text(text + 'verify:\n  - ["-c", "import sys; sys.exit(\'smoke check says no\')"]\n')
    before = mini.file("srt/speculative/dflash_info.py").read_bytes()
    with pytest.raises(VerifyError, match="smoke check says no"):
        deploy(_t(mini), mini.host, load_bundle(d))
    assert mini.file("srt/speculative/dflash_info.py").read_bytes() == before
    assert _assert_not_mixed(mini, load_bundle(d)) == "original"
    _assert_clean(mini)


def test_syntax_error_in_bundle_rolls_back(mini: MiniHost, tmp_path: Path) -> None:
    d = tmp_path / "b"
    subprocess.run(["cp", "-r", str(BUNDLES / "basic"), str(d)], check=True)
    (d / "files/srt/speculative/dflash_info.py").write_text("def broken(:\n")
    with pytest.raises(VerifyError, match="does not compile"):
        deploy(_t(mini), mini.host, load_bundle(d))
    assert _assert_not_mixed(mini, load_bundle(d)) == "original"


def _ro_mount(path: Path) -> bool:
    ok = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode == 0
    if ok and subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", str(path)], capture_output=True)
        return False
    return ok


def test_read_only_package_dir_changes_nothing(mini: MiniHost, basic: Bundle) -> None:
    spec = mini.pkg / "srt" / "speculative"
    before = {p.name: p.read_bytes() for p in spec.iterdir() if p.is_file()}
    if not _ro_mount(spec):
        pytest.skip("cannot make a read-only bind mount here (needs root and mount)")
    try:
        with pytest.raises(RemoteFileError, match="Read-only file system"):
            deploy(_t(mini), mini.host, basic)
    finally:
        subprocess.run(["umount", str(spec)], check=True)
    assert {p.name: p.read_bytes() for p in spec.iterdir() if p.is_file()} == before
    assert not (mini.state_dir / "state.json").exists()
    assert not list(mini.state_dir.rglob("backups/*"))
    _assert_clean(mini)


def test_disk_full_changes_nothing(mini: MiniHost, basic: Bundle) -> None:
    spec = mini.pkg / "srt" / "speculative"
    saved = {p.name: p.read_bytes() for p in spec.iterdir() if p.is_file()}
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(spec)], capture_output=True).returncode:
        pytest.skip("cannot mount a tiny tmpfs here (needs root)")
    try:
        for name, data in saved.items():
            (spec / name).write_bytes(data)
        fd = os.open(spec / "filler", os.O_WRONLY | os.O_CREAT)
        try:  # fill the quota to the last byte, in shrinking chunks
            for chunk in (1 << 16, 1 << 12, 1):
                try:
                    while True:
                        os.write(fd, b"\0" * chunk)
                except OSError:
                    pass
        finally:
            os.close(fd)
        with pytest.raises(RemoteFileError, match="No space left"):
            deploy(_t(mini), mini.host, basic)
        assert {p.name: p.read_bytes() for p in spec.iterdir() if p.is_file() and p.name != "filler"} == saved
        assert not (mini.state_dir / "state.json").exists()
        _assert_clean(mini)
    finally:
        subprocess.run(["umount", str(spec)], check=True)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("step", [0, 1, 2], ids=["gather", "prepare", "commit"])
def test_connection_cut_at_every_step_then_rerun_converges(
    mini: MiniHost, bundle: Bundle, step: int, when: str
) -> None:
    with pytest.raises(ConnectError):
        deploy(CuttingTransport(_t(mini), cut_at=step, when=when), mini.host, bundle)
    _assert_not_mixed(mini, bundle)
    out = deploy(_t(mini), mini.host, bundle)
    assert out.outcome in ("applied", "noop")
    if step == 1 and when == "after":
        assert out.recovered == "rolled-back"  # the prepared transaction was found and undone first
    assert _assert_converged(mini, bundle) == "patched"
    assert rollback(_t(mini), mini.host).outcome == "rolled-back"
    assert _assert_converged(mini, bundle) == "original"


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("step", [0, 1, 2], ids=["gather", "prepare", "commit"])
def test_rollback_cut_at_every_step_then_rerun_converges(mini: MiniHost, bundle: Bundle, step: int, when: str) -> None:
    deploy(_t(mini), mini.host, bundle)
    with pytest.raises(ConnectError):
        rollback(CuttingTransport(_t(mini), cut_at=step, when=when), mini.host)
    _assert_not_mixed(mini, bundle)
    assert rollback(_t(mini), mini.host).outcome in ("rolled-back", "noop")
    assert _assert_converged(mini, bundle) == "original"


@pytest.mark.parametrize("renamed", [0, 1, 2, 3])
def test_process_killed_mid_commit_is_recovered(mini: MiniHost, bundle: Bundle, renamed: int) -> None:
    """A journal in phase 'committing' with only some renames done (the host process died)."""
    with pytest.raises(ConnectError):
        deploy(CuttingTransport(_t(mini), cut_at=2, when="before"), mini.host, bundle)
    jpath = mini.state_dir / "journal.json"
    journal = json.loads(jpath.read_text())
    journal["phase"] = "committing"
    for e in journal["entries"][:renamed]:
        Path(e["temp"]).replace(e["target"])
    jpath.write_text(json.dumps(journal))
    if 0 < renamed < 3:
        assert _file_states(mini, bundle) == {"patched", "original"}  # the mixed state the journal must repair
    out2 = deploy(_t(mini), mini.host, bundle)
    assert out2.recovered == "rolled-back" and out2.outcome == "applied"
    assert _assert_converged(mini, bundle) == "patched"


def test_state_written_but_journal_left_is_completed_not_undone(mini: MiniHost, basic: Bundle) -> None:
    deploy(_t(mini), mini.host, basic)
    state = json.loads((mini.state_dir / "state.json").read_text())
    # As if the commit step died after writing the state record, before dropping its journal.
    (mini.state_dir / "journal.json").write_text(
        json.dumps({"txn": state["txn"], "phase": "committing", "entries": []})
    )
    (mini.state_dir / "lock").mkdir()
    (mini.state_dir / "lock" / "info.json").write_text(
        json.dumps({"txn": state["txn"], "controller": "elsewhere", "pid": 1})
    )
    with pytest.raises(LockError, match="--break-lock"):
        deploy(_t(mini), mini.host, basic)
    out = deploy(_t(mini), mini.host, basic, RunOptions(break_lock=True))
    assert out.recovered == "completed" and out.outcome == "noop"
    _assert_clean(mini)


def test_lock_of_dead_local_process_is_taken_over(mini: MiniHost, basic: Bundle) -> None:
    import socket

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (mini.state_dir / "lock").mkdir(parents=True)
    (mini.state_dir / "lock" / "info.json").write_text(
        json.dumps({"txn": "deadbeef", "controller": socket.gethostname(), "pid": int(dead.stdout), "user": "x"})
    )
    out = deploy(_t(mini), mini.host, basic)
    assert out.recovered == "lock-released" and out.outcome == "applied"


def test_concurrent_deploys_never_interleave(mini: MiniHost, basic: Bundle) -> None:
    first = PausingTransport(_t(mini), pause_at=2)  # holds the lock between prepare and commit
    results: dict[str, object] = {}
    t1 = threading.Thread(target=lambda: results.setdefault("first", deploy(first, mini.host, basic)))
    t1.start()
    assert first.reached.wait(60)
    try:
        with pytest.raises(LockError, match="locked by"):
            deploy(_t(mini), mini.host, basic)
        assert _file_states(mini, basic) == {"original"}  # the refused run touched nothing
        waiter = threading.Thread(
            target=lambda: results.setdefault("second", deploy(_t(mini), mini.host, basic, RunOptions(lock_wait_s=60)))
        )
        waiter.start()
    finally:
        first.release.set()
    t1.join(60)
    waiter.join(60)
    assert results["first"].outcome == "applied"  # type: ignore[attr-defined]
    assert results["second"].outcome == "noop"  # type: ignore[attr-defined]
    assert _assert_not_mixed(mini, basic) == "patched"


@pytest.mark.parametrize("held", ["inside its gather", "between its gather and its prepare"])
def test_a_deploy_never_acts_on_what_it_read_before_another_deploy_committed(
    mini: MiniHost, basic: Bundle, tmp_path: Path, held: str
) -> None:
    """Two deploys of one bundle, interleaved deterministically: the second is held after
    reading the host's state record but before hashing its files (or after its whole
    gather, before its prepare), the first runs from start to end meanwhile, then the
    second goes on. What it read before the first one's commit must not be acted on: it
    finds the bundle applied (noop), and the first one's state record, with its backups
    of the originals, stands (a rollback still restores them)."""
    inside = HoldInsideGather(_t(mini), hold_at=0, tmp=tmp_path)
    paused = PausingTransport(_t(mini), pause_at=1)  # gather (0), prepare (1)
    second_t = inside if held == "inside its gather" else paused

    def reached() -> bool:
        return inside.wait_reached(60) if second_t is inside else paused.reached.wait(60)

    def release() -> None:
        inside.release() if second_t is inside else paused.release.set()

    box: dict[str, object] = {}

    def second() -> None:
        try:
            box["out"] = deploy(second_t, mini.host, basic, RunOptions(lock_wait_s=60))
        except BaseException as exc:  # noqa: BLE001 - the test reads it below
            box["exc"] = exc

    worker = threading.Thread(target=second)
    worker.start()
    try:
        assert reached()
        assert _file_states(mini, basic) == {"original"} and not (mini.state_dir / "state.json").exists()
        first = deploy(_t(mini), mini.host, basic)
        assert first.outcome == "applied"
        record = json.loads((mini.state_dir / "state.json").read_text())
    finally:
        release()
        worker.join(60)
    assert not worker.is_alive()
    assert "exc" not in box, box["exc"]
    out = box["out"]
    assert isinstance(out, HostOutcome) and out.outcome == "noop", out
    assert json.loads((mini.state_dir / "state.json").read_text()) == record
    assert all(f["backup"] for f in record["files"].values() if f["original_sha256"])
    _assert_clean(mini)
    rollback(_t(mini), mini.host)
    assert _assert_not_mixed(mini, basic) == "original"


@pytest.mark.parametrize("what", ["deploy", "rollback"])
def test_cancel_during_prepare_stops_before_commit_and_removes_what_was_prepared(
    mini: MiniHost, basic: Bundle, what: str
) -> None:
    """Ctrl-C while the prepare step runs on the host: that step finishes (it is all or
    nothing), the commit never starts, and the run rolls its own journal back, so the host
    is left exactly as it was and unlocked (not waiting for the next run to recover it)."""
    if what == "rollback":
        deploy(_t(mini), mini.host, basic)
    before = _assert_not_mixed(mini, basic)
    state_before = (mini.state_dir / "state.json").read_bytes() if what == "rollback" else None
    backups_before = sorted((mini.state_dir / "backups").glob("*")) if what == "rollback" else []
    cancel = threading.Event()
    paused = PausingTransport(_t(mini), pause_at=1)  # gather (0), prepare (1), commit (2)
    box: dict[str, BaseException] = {}

    def run() -> None:
        try:
            if what == "deploy":
                deploy(paused, mini.host, basic, cancel=cancel)
            else:
                rollback(paused, mini.host, cancel=cancel)
        except BaseException as exc:  # noqa: BLE001 - the test reads it below
            box["exc"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    assert paused.reached.wait(60)
    cancel.set()  # as the CLI does on Ctrl-C, while prepare is on its way to the host
    paused.release.set()
    worker.join(60)
    exc = box.get("exc")
    assert isinstance(exc, Interrupted), exc
    assert "before commit" in str(exc) and "nothing was changed" in str(exc)
    assert paused.calls == 3  # gather, prepare, then recover; never commit
    assert _assert_not_mixed(mini, basic) == before
    _assert_clean(mini)
    assert sorted((mini.state_dir / "backups").glob("*")) == backups_before  # this run's are gone
    if state_before is not None:
        assert (mini.state_dir / "state.json").read_bytes() == state_before


def test_cancel_ends_a_lock_wait_at_once(mini: MiniHost, basic: Bundle) -> None:
    """A deploy waiting for another controller's lock stops when cancelled instead of
    waiting out --lock-wait and then deploying after all."""
    (mini.state_dir / "lock").mkdir(parents=True)
    (mini.state_dir / "lock" / "info.json").write_text(
        json.dumps({"txn": "other", "controller": "elsewhere", "pid": 1, "user": "x"})
    )
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    import time

    t0 = time.monotonic()
    with pytest.raises(Interrupted, match="while waiting for the host lock; nothing was changed"):
        deploy(_t(mini), mini.host, basic, RunOptions(lock_wait_s=60), cancel=cancel)
    assert time.monotonic() - t0 < 20
    assert _assert_not_mixed(mini, basic) == "original"
    assert (mini.state_dir / "lock" / "info.json").exists()  # not ours: left alone


def test_next_bundle_version_supersedes_and_restores(mini: MiniHost, basic: Bundle) -> None:
    info_before = mini.file("srt/speculative/dflash_info.py").read_bytes()
    deploy(_t(mini), mini.host, basic)
    v2 = load_bundle(BUNDLES / "v2")
    out = deploy(_t(mini), mini.host, v2)
    assert {a.path: a.kind for a in out.plan.changes} == {
        "srt/speculative/dflash_worker_v2.py": "supersede", "srt/speculative/dflash_info.py": "restore"}
    assert mini.file("srt/speculative/dflash_info.py").read_bytes() == info_before
    rollback(_t(mini), mini.host)
    assert _assert_not_mixed(mini, basic) == "original"


def test_changed_between_plan_and_prepare_is_refused(mini: MiniHost, basic: Bundle) -> None:
    from ddtree_ops.patching.executor import controller_identity

    with pytest.raises(DriftError, match="changed since the plan"):
        run_step(_t(mini), mini.host.python, "prepare", {
            "package": "sglang", "txn": "t1", "holder": {"txn": "t1", **controller_identity()},
            "files": [{"path": "srt/speculative/dflash_info.py", "expect_sha": "0" * 64, "new_sha": "1" * 64,
                       "content_b64": ""}],
            "new_state": None,
        })
    _assert_clean(mini)


def test_orphaned_remote_step_still_running_blocks_takeover(mini: MiniHost, basic: Bundle) -> None:
    """The controller died, but its step process on the host still runs: never recover under its feet."""
    import socket

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    step = subprocess.Popen([sys.executable, "-c", "import time  # <ddtree-ops>\ntime.sleep(120)"])
    try:
        (mini.state_dir / "lock").mkdir(parents=True)
        (mini.state_dir / "lock" / "info.json").write_text(json.dumps(
            {"txn": "t0", "controller": socket.gethostname(), "pid": int(dead.stdout), "remote_pid": step.pid}))
        with pytest.raises(LockError, match="still running on the host"):
            deploy(_t(mini), mini.host, basic, RunOptions(break_lock=True))
    finally:
        step.kill()
        step.wait()
    out = deploy(_t(mini), mini.host, basic)
    assert out.recovered == "lock-released" and out.outcome == "applied"


def test_files_copied_by_hand_are_adopted_and_rollback_says_what_to_do(mini: MiniHost, basic: Bundle) -> None:
    """The old workflow (scp the files) leaves no backup: adopt the files, and be honest on rollback."""
    for f in basic.files:
        mini.file(f.path).write_bytes(f.content)
    out = deploy(_t(mini), mini.host, basic)
    assert out.outcome == "applied" and out.plan.changes == ()
    assert "state record only" in out.message
    assert host_status(_t(mini), mini.host, bundle=basic).bundle_identity == basic.identity
    with pytest.raises(DriftError, match="no backup of the original was recorded; reinstall the package"):
        rollback(_t(mini), mini.host, RunOptions(force=True))


def test_journal_without_lock_is_recovered_under_a_lock(mini: MiniHost, basic: Bundle) -> None:
    with pytest.raises(ConnectError):
        deploy(CuttingTransport(_t(mini), cut_at=1, when="after"), mini.host, basic)
    import shutil

    shutil.rmtree(mini.state_dir / "lock")  # someone removed the lock by hand; the journal remains
    out = deploy(_t(mini), mini.host, basic)
    assert out.recovered == "rolled-back" and out.outcome == "applied"
    _assert_clean(mini)
