"""Pure planning: (bundle, remote state) -> what to do on one host, and why.

Nothing here touches a host; every decision is a function of the frozen
:class:`~ddtree_ops.patching.gather.RemoteState`, so the same plan is what ``--dry-run``
shows and what the executor carries out.

Per file, comparing the remote sha256 with what the bundle and the state record expect:

    patched     already the bundle's content                      -> nothing to do
    add         absent, bundle adds it                            -> upload
    replace     the upstream base the bundle was made from        -> back up, upload
    supersede   the content a previously applied bundle put there -> upload (original backup kept)
    restore     recorded by the applied bundle but not in this one -> put the original back
    conflict    anything else (drifted: sglang upgraded, hand-edited) -> refuse unless --force
    blocked     cannot be done safely even with --force: the host refuses the path, or a
                file beside the package exists that ddtree-ops did not put there

Per host, two cases come before the per-file decisions. Another bundle (by name) is
applied: deploying this one would take that one's files away (``restore``) without the
operator having asked, so the host is refused as ``other-bundle`` unless ``--replace``
(a new version of the same bundle supersedes it as usual). And the state record says a bundle
is applied, but some of its files no longer hold what was applied (``pip install
--force-reinstall`` put the upstream files back, or someone edited them). Re-applying
silently would hide that the host ran unpatched code, so the host is refused as
``changed-outside`` with what changed and what to do (``--force`` re-applies, backing up
what is there now; ``rollback`` clears the record).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ddtree_ops.patching.bundle import Bundle, key_root
from ddtree_ops.patching.gather import AppliedRecord, RemoteState

FileActionKind = Literal["patched", "add", "replace", "supersede", "restore", "delete", "conflict", "blocked"]
Outcome = Literal[
    "apply", "noop", "unsupported", "conflict", "changed-outside", "other-bundle", "missing", "recover", "readonly"
]
_CHANGING = ("add", "replace", "supersede", "restore", "delete")


@dataclass(frozen=True)
class FileAction:
    path: str
    kind: FileActionKind
    current_sha256: str | None
    new_sha256: str | None
    reason: str = ""
    # The file's content before any bundle touched it, and where a copy of it lives.
    original_sha256: str | None = None
    original_backup: str | None = None
    # True when this run must back the current content up as the original.
    backup_as_original: bool = False
    forced: bool = False

    @property
    def changes(self) -> bool:
        return self.kind in _CHANGING


@dataclass(frozen=True)
class HostPlan:
    host: str
    operation: Literal["deploy", "rollback"]
    outcome: Outcome
    actions: tuple[FileAction, ...]
    bundle_name: str | None = None
    bundle_identity: str | None = None
    package_version: str | None = None
    notes: tuple[str, ...] = ()
    reason: str = ""

    @property
    def changes(self) -> tuple[FileAction, ...]:
        return tuple(a for a in self.actions if a.changes)

    def summary(self) -> str:
        if self.outcome == "apply":
            counts: dict[str, int] = {}
            for a in self.changes:
                counts[a.kind] = counts.get(a.kind, 0) + 1
            parts = [f"{n} {k}" for k, n in sorted(counts.items())]
            if not parts:
                parts = [
                    "state record only" if self.operation == "deploy" else "record cleared, files already original"
                ]
            return ", ".join(parts)
        return self.reason or self.outcome


@dataclass(frozen=True)
class OutsideChange:
    """Recorded files that no longer hold what ddtree-ops applied: someone changed them since.

    ``reverted`` are back to their original content (a reinstall of the package does
    that); ``drifted`` hold anything else (edited, upgraded, removed).
    """

    reverted: tuple[str, ...]
    drifted: tuple[str, ...]

    def describe(self) -> str:
        parts = []
        if self.reverted:
            parts.append(f"{_files(len(self.reverted))} reverted to original")
        if self.drifted:
            parts.append(f"{_files(len(self.drifted))} drifted")
        return ", ".join(parts)


def changed_outside(rec: AppliedRecord | None, files: Mapping[str, str | None]) -> OutsideChange | None:
    """What changed behind the state record's back, or None when every recorded file is as applied."""
    if rec is None:
        return None
    reverted: list[str] = []
    drifted: list[str] = []
    for path in sorted(rec.files):
        recf = rec.files[path]
        cur = files.get(path)
        if cur == recf.patched_sha256:
            continue
        # An added file's original is "absent", so a removed added file counts as reverted.
        if cur == recf.original_sha256 and not _is_error_sha(cur):
            reverted.append(path)
        else:
            drifted.append(path)
    if not reverted and not drifted:
        return None
    return OutsideChange(tuple(reverted), tuple(drifted))


def _files(n: int) -> str:
    return f"{n} file" if n == 1 else f"{n} files"


def _changed_outside_reason(rs: RemoteState, rec: AppliedRecord, change: OutsideChange) -> str:
    installed = f"{rs.package} {rs.version or '(unknown version)'} is installed now"
    if rec.package_version and rec.package_version != rs.version:
        installed += f", {rec.name} was applied on {rec.package_version}"
    return (
        f"{rs.host}: changed outside ddtree-ops since {rec.name} {rec.identity[:12]} was applied: "
        f"{change.describe()} ({installed}; reinstalled or edited?) — run `ddtree-ops deploy {rs.host} --force` "
        f"to re-apply over it (what is there now is backed up), or `ddtree-ops rollback {rs.host}` "
        f"to clear the record first"
    )


def _other_bundle_reason(rs: RemoteState, rec: AppliedRecord, bundle: Bundle) -> str:
    return (
        f"{rs.host}: bundle {rec.name} {rec.identity[:12]} is applied, not {bundle.name}"
        f" {bundle.identity[:12]}; pass --replace to replace it (its files {bundle.name} does not patch are"
        f" restored), or `ddtree-ops rollback {rs.host}` first"
    )


def _short(sha: str | None) -> str:
    return "absent" if sha is None else sha[:12]


def _is_error_sha(sha: str | None) -> bool:
    return sha is not None and sha.startswith(("escape:", "notfile:"))


def plan_deploy(
    bundle: Bundle,
    rs: RemoteState,
    *,
    force: bool = False,
    force_version: bool = False,
    replace: bool = False,
) -> HostPlan:
    """Decide what deploying ``bundle`` means on the host described by ``rs``.

    ``replace`` allows deploying over another bundle (by name); without it such a host
    is refused as ``other-bundle``."""
    common: dict[str, Any] = {
        "host": rs.host,
        "operation": "deploy",
        "bundle_name": bundle.name,
        "bundle_identity": bundle.identity,
        "package_version": rs.version,
    }
    if rs.journal is not None or rs.lock is not None:
        what = "an interrupted deploy's journal" if rs.journal is not None else "a deploy lock"
        return HostPlan(
            outcome="recover", actions=(), reason=f"{what} is present; it must be recovered first", **common
        )
    if rs.package_dir is None:
        return HostPlan(outcome="missing", actions=(),
                        reason=f"package {bundle.package!r} is not installed for {rs.python or 'the host interpreter'}",
                        **common)
    notes: list[str] = []
    if bundle.versions and rs.version not in bundle.versions:
        msg = (
            f"{bundle.package} {rs.version or '(unknown version)'} is not a version this bundle was made for"
            f" ({', '.join(bundle.versions)})"
        )
        if not force_version:
            return HostPlan(outcome="unsupported", actions=(), reason=msg + "; --force-version overrides", **common)
        notes.append(msg + "; proceeding because of --force-version")
    if rs.state_error:
        return HostPlan(outcome="conflict", actions=(), reason=f"state record unreadable: {rs.state_error}", **common)

    rec = rs.applied
    if rec is not None and rec.name != bundle.name:
        if not replace:
            return HostPlan(outcome="other-bundle", actions=(), notes=tuple(notes),
                            reason=_other_bundle_reason(rs, rec, bundle), **common)
        notes.append(f"--replace: {rec.name} {rec.identity[:12]} is replaced by {bundle.name}"
                     " (its files this bundle does not patch are restored)")
    change = changed_outside(rec, rs.files)
    if change is not None and rec is not None:
        if not force:
            return HostPlan(outcome="changed-outside", actions=(), notes=tuple(notes),
                            reason=_changed_outside_reason(rs, rec, change), **common)
        notes.append(f"--force: re-applying over changes made outside ddtree-ops ({change.describe()});"
                     " what was there is backed up")
    actions: list[FileAction] = []
    for f in bundle.files:
        actions.append(_plan_file(f.path, f.op, f.sha256, f.base_sha256, rs.files.get(f.path), rec, force))
    in_bundle = {f.path for f in bundle.files}
    if rec is not None:
        for path in rec.files:
            if path not in in_bundle:
                actions.append(_plan_restore(path, rs.files.get(path), rec, force))

    blocked = [a for a in actions if a.kind in ("conflict", "blocked")]
    if blocked:
        detail = "; ".join(f"{a.path}: {a.reason}" for a in blocked)
        hint = (
            " — the installed files are not the ones this bundle was made from (was sglang upgraded or edited?);"
            " reinstall the matching sglang or use --force to back the current files up and overwrite them"
        )
        if any(a.kind == "blocked" for a in blocked):
            hint = ""
        return HostPlan(outcome="conflict", actions=tuple(actions), reason=detail + hint, notes=tuple(notes), **common)
    if any(a.forced for a in actions):
        notes.append("--force: drifted files are backed up and overwritten")
    changing = [a for a in actions if a.changes]
    if not changing and rec is not None and rec.identity == bundle.identity:
        return HostPlan(outcome="noop", actions=tuple(actions), notes=tuple(notes),
                        reason=f"already applied: {bundle.name} {bundle.identity[:12]}", **common)
    if (
        changing
        and not rs.writable
        and any(a.kind in ("add", "replace", "supersede", "restore", "delete") for a in changing)
    ):
        return HostPlan(outcome="readonly", actions=tuple(actions), notes=tuple(notes),
                        reason=f"{_dirs_written(rs, changing)} not writable by the remote user", **common)
    return HostPlan(outcome="apply", actions=tuple(actions), notes=tuple(notes), **common)


def _dirs_written(rs: RemoteState, actions: Sequence[FileAction]) -> str:
    """What a readonly refusal names: the package directory, and the one beside it when files go there too."""
    text = f"package directory {rs.package_dir}"
    if rs.site_dir and any(key_root(a.path) == "site-packages" for a in actions):
        return f"{text} or site-packages directory {rs.site_dir} is"
    return f"{text} is"


def _plan_file(
    path: str,
    op: str,
    new: str,
    base: str | None,
    cur: str | None,
    rec: AppliedRecord | None,
    force: bool,
) -> FileAction:
    recf = rec.files.get(path) if rec is not None else None
    if _is_error_sha(cur):
        return FileAction(path, "blocked", None, new, reason=str(cur).split(":", 1)[1] or "not a regular file")
    if cur == new:
        if recf is not None:
            return FileAction(path, "patched", cur, new, original_sha256=recf.original_sha256,
                              original_backup=recf.backup)
        # Already in place but not recorded (copied by hand): adopt it; the original is the base.
        return FileAction(path, "patched", cur, new, reason="already in place (not recorded before)",
                          original_sha256=base if op == "replace" else None)
    if recf is not None and cur == recf.patched_sha256:
        return FileAction(path, "supersede", cur, new, original_sha256=recf.original_sha256,
                          original_backup=recf.backup)
    if op == "add" and cur is None:
        return FileAction(path, "add", cur, new, original_sha256=None)
    if op == "replace" and cur is not None and (base is None or cur == base):
        # base None: an overlay file, whose base is whatever the host has.
        return FileAction(path, "replace", cur, new, original_sha256=cur, backup_as_original=True)
    if op == "replace" and base is None and cur is None:
        return FileAction(path, "add", cur, new, original_sha256=None)
    if recf is None and cur is not None and key_root(path) == "site-packages":
        # Another installation's file (a pip-installed plugin, say): --force never overwrites it.
        return FileAction(path, "blocked", cur, new, reason=(
            f"exists ({_short(cur)}) and was not put there by ddtree-ops; it belongs to another installation"
            " (uninstall that distribution first)"))
    # Drifted.
    if op == "add":
        reason = f"should be absent before the bundle adds it, found {_short(cur)}"
    elif cur is None:
        reason = f"missing (expected base {_short(base)})"
    else:
        reason = f"drifted: expected base {_short(base)} or patched {_short(new)}, found {_short(cur)}"
    if not force:
        return FileAction(path, "conflict", cur, new, reason=reason)
    kind: FileActionKind = "add" if cur is None else "replace"
    if key_root(path) == "site-packages":
        # Recorded, so ours (the unrecorded case is blocked above): its original stays
        # "absent", so that a rollback still removes the whole distribution instead of
        # bringing an edited file of it back.
        return FileAction(path, kind, cur, new, reason=reason + " (forced)", original_sha256=None, forced=True)
    return FileAction(path, kind, cur, new, reason=reason + " (forced)", original_sha256=cur,
                      backup_as_original=cur is not None, forced=True)


def _plan_restore(path: str, cur: str | None, rec: AppliedRecord, force: bool) -> FileAction:
    """A file the applied record patched: put its original back."""
    recf = rec.files[path]
    orig = recf.original_sha256
    if _is_error_sha(cur):
        return FileAction(path, "blocked", None, orig, reason=str(cur).split(":", 1)[1] or "not a regular file")
    if cur == orig:
        return FileAction(path, "patched", cur, orig, reason="already original")
    if orig is not None and recf.backup is None:
        return FileAction(
            path,
            "blocked",
            cur,
            orig,
            reason="no backup of the original was recorded; reinstall the package to restore it",
        )
    kind: FileActionKind = "delete" if orig is None else "restore"
    if cur == recf.patched_sha256:
        return FileAction(path, kind, cur, orig, original_sha256=orig, original_backup=recf.backup)
    reason = f"drifted: expected patched {_short(recf.patched_sha256)}, found {_short(cur)}"
    if not force:
        return FileAction(path, "conflict", cur, orig, reason=reason)
    return FileAction(path, kind, cur, orig, reason=reason + " (forced)", original_sha256=orig,
                      original_backup=recf.backup, forced=True)


def plan_rollback(rs: RemoteState, *, force: bool = False) -> HostPlan:
    """Restore every file the state record lists to its original content."""
    rec = rs.applied
    common: dict[str, Any] = {
        "host": rs.host,
        "operation": "rollback",
        "package_version": rs.version,
        "bundle_name": rec.name if rec else None,
        "bundle_identity": rec.identity if rec else None,
    }
    if rs.journal is not None or rs.lock is not None:
        what = "an interrupted deploy's journal" if rs.journal is not None else "a deploy lock"
        return HostPlan(
            outcome="recover", actions=(), reason=f"{what} is present; it must be recovered first", **common
        )
    if rs.state_error:
        return HostPlan(outcome="conflict", actions=(), reason=f"state record unreadable: {rs.state_error}", **common)
    if rec is None:
        return HostPlan(outcome="noop", actions=(), reason="nothing applied", **common)
    if rs.package_dir is None:
        return HostPlan(outcome="missing", actions=(), reason=f"package {rs.package!r} is not installed", **common)
    actions = tuple(_plan_restore(p, rs.files.get(p), rec, force) for p in sorted(rec.files))
    change = changed_outside(rec, rs.files)
    outside: tuple[str, ...] = ()
    if change is not None:
        # Said on every rollback of such a host, so "rolled back" is not read as "restored every file".
        left = " (left as they are)" if change.reverted and not change.drifted else ""
        outside = (f"changed outside ddtree-ops since {rec.name} was applied: {change.describe()}{left}",)
    blocked = [a for a in actions if a.kind in ("conflict", "blocked")]
    if blocked:
        detail = "; ".join(f"{a.path}: {a.reason}" for a in blocked)
        return HostPlan(outcome="conflict", actions=actions, reason=detail + " — --force restores the originals anyway",
                        notes=outside, **common)
    if not rs.writable and any(a.changes for a in actions):
        return HostPlan(
            outcome="readonly",
            actions=actions,
            reason=f"{_dirs_written(rs, [a for a in actions if a.changes])} not writable by the remote user",
            **common,
        )
    notes: tuple[str, ...] = ()
    if any(a.forced for a in actions):
        notes = ("--force: drifted files are backed up, then the originals restored",)
    return HostPlan(outcome="apply", actions=actions, notes=outside + notes, **common)


def bundle_paths(bundle: Bundle) -> Sequence[str]:
    return [f.path for f in bundle.files]
