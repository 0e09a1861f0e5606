"""The pure planner: remote hashes + state record -> per-file and per-host decisions."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Any

import pytest

from ddtree_ops.patching.bundle import FileOp, synthetic_bundle
from ddtree_ops.patching.gather import AppliedRecord, RemoteState
from ddtree_ops.patching.plan import plan_deploy, plan_rollback

BASE, NEW, OTHER, ORIG_B = "b" * 64, "n" * 64, "o" * 64, "c" * 64


def _bundle(files: tuple[FileOp, ...] | None = None, versions: tuple[str, ...] = ("0.5.23",)):
    files = files or (
        FileOp("replace", "srt/a.py", b"new-a", NEW, base_sha256=BASE),
        FileOp("add", "srt/b.py", b"new-b", "d" * 64),
    )
    return synthetic_bundle(name="t", version="1", package="sglang", versions=versions, files=files)


def _rs(files: dict[str, str | None], *, version: str | None = "0.5.23", applied: dict[str, Any] | None = None,
        journal: Any = None, lock: Any = None, writable: bool = True) -> RemoteState:
    return RemoteState(
        host="h", python="py", python_version="3.11.0", prefix="/p", state_dir="/p/.ddtree-ops", package="sglang",
        package_dir="/p/sglang", version=version, writable=writable, files=MappingProxyType(files),
        applied=AppliedRecord.from_json(applied) if applied else None, journal=journal, lock=lock,
    )


def test_fresh_host_plans_replace_and_add() -> None:
    p = plan_deploy(_bundle(), _rs({"srt/a.py": BASE, "srt/b.py": None}))
    assert p.outcome == "apply"
    assert {a.path: a.kind for a in p.actions} == {"srt/a.py": "replace", "srt/b.py": "add"}
    assert p.actions[0].backup_as_original and p.actions[0].original_sha256 == BASE


def test_applied_identity_is_noop() -> None:
    b = _bundle()
    rec = {"name": "t", "identity": b.identity, "files": {
        "srt/a.py": {"original_sha256": BASE, "patched_sha256": NEW, "backup": "/p/.ddtree-ops/backups/x/srt/a.py"},
        "srt/b.py": {"original_sha256": None, "patched_sha256": "d" * 64, "backup": None}}}
    p = plan_deploy(b, _rs({"srt/a.py": NEW, "srt/b.py": "d" * 64}, applied=rec))
    assert p.outcome == "noop" and "already applied" in p.reason


@pytest.mark.parametrize(("version", "force", "outcome"), [("0.5.22", False, "unsupported"), ("0.5.22", True, "apply")])
def test_version_gate(version: str, force: bool, outcome: str) -> None:
    p = plan_deploy(_bundle(), _rs({"srt/a.py": BASE, "srt/b.py": None}, version=version), force_version=force)
    assert p.outcome == outcome
    if force:
        assert any("--force-version" in n for n in p.notes)
    else:
        assert "--force-version" in p.reason


def test_drift_refused_then_forced_with_backup() -> None:
    rs = _rs({"srt/a.py": OTHER, "srt/b.py": None})
    p = plan_deploy(_bundle(), rs)
    assert p.outcome == "conflict" and "drifted" in p.reason and "--force" in p.reason
    forced = plan_deploy(_bundle(), rs, force=True)
    a = forced.actions[0]
    assert forced.outcome == "apply" and a.kind == "replace" and a.forced and a.backup_as_original
    assert a.original_sha256 == OTHER


def test_add_over_unknown_existing_file_is_conflict() -> None:
    p = plan_deploy(_bundle(), _rs({"srt/a.py": BASE, "srt/b.py": OTHER}))
    assert p.outcome == "conflict" and "should be absent" in p.reason


def test_supersede_and_restore_for_next_bundle_version() -> None:
    rec = {"name": "t", "identity": "old", "files": {
        "srt/a.py": {"original_sha256": BASE, "patched_sha256": OTHER, "backup": "/bk/a"},
        "srt/c.py": {"original_sha256": ORIG_B, "patched_sha256": "e" * 64, "backup": "/bk/c"}}}
    p = plan_deploy(_bundle(), _rs({"srt/a.py": OTHER, "srt/b.py": None, "srt/c.py": "e" * 64}, applied=rec))
    kinds = {a.path: a.kind for a in p.actions}
    assert kinds == {"srt/a.py": "supersede", "srt/b.py": "add", "srt/c.py": "restore"}
    sup = p.actions[0]
    assert sup.original_backup == "/bk/a" and not sup.backup_as_original


def test_leftover_journal_or_lock_means_recover_first() -> None:
    assert plan_deploy(_bundle(), _rs({}, journal={"txn": "x"})).outcome == "recover"
    assert plan_rollback(_rs({}, lock={"txn": "x"})).outcome == "recover"


def test_escape_is_blocked_even_with_force() -> None:
    p = plan_deploy(_bundle(), _rs({"srt/a.py": "escape:srt/a.py resolves outside", "srt/b.py": None}), force=True)
    assert p.outcome == "conflict" and "resolves outside" in p.reason


def test_readonly_package_dir() -> None:
    p = plan_deploy(_bundle(), _rs({"srt/a.py": BASE, "srt/b.py": None}, writable=False))
    assert p.outcome == "readonly"


def test_rollback_plans() -> None:
    assert plan_rollback(_rs({})).outcome == "noop"
    rec = {"name": "t", "identity": "i", "files": {
        "srt/a.py": {"original_sha256": BASE, "patched_sha256": NEW, "backup": "/bk/a"},
        "srt/b.py": {"original_sha256": None, "patched_sha256": "d" * 64, "backup": None}}}
    p = plan_rollback(_rs({"srt/a.py": NEW, "srt/b.py": "d" * 64}, applied=rec))
    assert {a.path: a.kind for a in p.actions} == {"srt/a.py": "restore", "srt/b.py": "delete"}
    drifted = plan_rollback(_rs({"srt/a.py": OTHER, "srt/b.py": "d" * 64}, applied=rec))
    assert drifted.outcome == "conflict"
    assert plan_rollback(_rs({"srt/a.py": OTHER, "srt/b.py": "d" * 64}, applied=rec), force=True).outcome == "apply"


def test_overlay_file_replace_uses_host_content_as_base() -> None:
    b = _bundle(files=(FileOp("replace", "srt/a.py", b"x", NEW, base_sha256=None),), versions=())
    p = plan_deploy(b, _rs({"srt/a.py": OTHER}, version="9.9"))
    assert p.outcome == "apply" and p.actions[0].kind == "replace" and p.actions[0].original_sha256 == OTHER
    p2 = plan_deploy(b, _rs({"srt/a.py": None}))
    assert p2.actions[0].kind == "add"


# --- files beside the package (keys starting with '../') ---------------------------------

META = "../sglang_x-1.0.dist-info/METADATA"


def _plugin() -> Any:
    return _bundle(files=(FileOp("add", "srt/b.py", b"new-b", "d" * 64), FileOp("add", META, b"Name: sglang-x\n", NEW)))


def test_site_packages_file_is_planned_like_any_add() -> None:
    p = plan_deploy(_plugin(), _rs({"srt/b.py": None, META: None}))
    assert p.outcome == "apply" and {a.path: a.kind for a in p.actions} == {"srt/b.py": "add", META: "add"}


def test_unrecorded_existing_site_packages_file_is_blocked_even_forced() -> None:
    for force in (False, True):
        p = plan_deploy(_plugin(), _rs({"srt/b.py": None, META: OTHER}), force=force)
        assert p.outcome == "conflict" and p.actions[1].kind == "blocked"
        assert "belongs to another installation" in p.reason and "--force" not in p.reason


def test_recorded_site_packages_file_supersedes_and_drift_is_forceable() -> None:
    rec = {
        "name": "t",
        "identity": "old",
        "files": {META: {"original_sha256": None, "patched_sha256": OTHER, "backup": None}},
    }
    p = plan_deploy(_plugin(), _rs({"srt/b.py": None, META: OTHER}, applied=rec))
    assert {a.path: a.kind for a in p.actions} == {"srt/b.py": "add", META: "supersede"}
    drifted = _rs({"srt/b.py": None, META: ORIG_B}, applied=rec)
    assert plan_deploy(_plugin(), drifted).outcome == "changed-outside"
    forced = plan_deploy(_plugin(), drifted, force=True)
    a = forced.actions[1]
    assert forced.outcome == "apply" and a.kind == "replace" and a.forced
    assert a.original_sha256 is None and not a.backup_as_original  # its original stays "absent"
    back = plan_rollback(_rs({META: OTHER}, applied=rec))
    assert back.outcome == "apply" and back.actions[0].kind == "delete"


def test_readonly_names_the_site_packages_directory_when_it_is_written() -> None:
    rs = replace(_rs({"srt/b.py": None, META: None}, writable=False), site_dir="/p")
    p = plan_deploy(_plugin(), rs)
    assert (
        p.outcome == "readonly"
        and p.reason == "package directory /p/sglang or site-packages directory /p is not writable by the remote user"
    )
    assert plan_deploy(_bundle(), replace(_rs({"srt/a.py": BASE, "srt/b.py": None}, writable=False), site_dir="/p")
                       ).reason == "package directory /p/sglang is not writable by the remote user"


def test_another_bundle_applied_is_refused_unless_replace() -> None:
    rec = {"name": "other", "identity": "o" * 64, "files": {
        "srt/c.py": {"original_sha256": ORIG_B, "patched_sha256": "e" * 64, "backup": "/bk/c"}}}
    rs = _rs({"srt/a.py": BASE, "srt/b.py": None, "srt/c.py": "e" * 64}, applied=rec)
    refused = plan_deploy(_bundle(), rs, force=True)  # --force is about drift, not about another bundle
    assert refused.outcome == "other-bundle" and not refused.actions
    assert "bundle other oooooooooooo is applied, not t" in refused.reason and "--replace" in refused.reason
    replaced = plan_deploy(_bundle(), rs, replace=True)
    assert replaced.outcome == "apply" and any("--replace" in n for n in replaced.notes)
    assert {a.path: a.kind for a in replaced.actions}["srt/c.py"] == "restore"
