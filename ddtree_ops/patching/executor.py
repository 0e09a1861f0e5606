"""Carrying out a plan on one host: lock, back up, upload, journal, rename, verify, record.

Round trips for a fresh deploy: gather (1), prepare (2: lock, backups, temps uploaded
and hash-checked, journal), commit (3: renames, byte-compile, verify commands, state
record, journal and lock dropped). A no-op re-deploy is the gather alone.

The guarantee, per host: whatever interrupts a run (cut connection, killed process,
failing disk), after the next run every target file is all-original or all-patched,
and the state record says which. The journal makes that deterministic: a journal whose
transaction the state record names was committed (only cleanup was missing); any other
journal is rolled back from its backups before anything else happens.

Locks: a run holds ``<prefix>/.ddtree-ops/lock`` from prepare to commit. The lock names
its holder (controller host, pid and its start time, boot id, run id:
:mod:`ddtree_ops.lockholder`, shared with the restart lock). A holder on this machine
whose process is gone, or whose run in this process has ended, is provably dead and its
lock is taken over (with its journal recovered); a holder elsewhere can only be
overridden with ``break_lock``, because we cannot see whether it still runs.

A plan is made from a gather, outside the lock; the prepare step checks under the lock
that the state record and every gathered hash are still what the plan was made from.
Where another run committed in between, nothing is changed: the run gathers and plans
again (it then finds, say, the bundle applied: noop), instead of writing its state record
over the other run's.
"""

from __future__ import annotations

import base64
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ddtree_ops.errors import (
    DdtreeOpsError,
    DriftError,
    Interrupted,
    LockError,
    PatchError,
    RemoteFileError,
    UnsupportedVersion,
    VerifyError,
)
from ddtree_ops.inventory_types import Host
from ddtree_ops.lockholder import controller_identity, holder_is_dead, run_ended, run_started
from ddtree_ops.patching.bundle import Bundle, backup_relpath
from ddtree_ops.patching.gather import RemoteState, gather
from ddtree_ops.patching.plan import FileAction, HostPlan, plan_deploy, plan_rollback
from ddtree_ops.patching.remote import RemoteRefusal, run_step
from ddtree_ops.transport.base import Transport


@dataclass(frozen=True)
class RunOptions:
    force: bool = False
    force_version: bool = False
    replace: bool = False  # deploy over another applied bundle (plan_deploy's other-bundle)
    dry_run: bool = False
    break_lock: bool = False
    lock_wait_s: float = 0.0
    verify_timeout_s: float = 300.0


class RunOutcome(StrEnum):
    """What a deploy or rollback did on one host (a ``str``, so it prints and compares
    as its value: ``"applied"``). A dry run passes the plan's own outcome through, so
    the outcomes under which the real run refuses the host appear here too."""

    APPLIED = "applied"
    ROLLED_BACK = "rolled-back"
    NOOP = "noop"
    PLANNED = "planned"
    RECOVER = "recover"
    CONFLICT = "conflict"
    CHANGED_OUTSIDE = "changed-outside"
    OTHER_BUNDLE = "other-bundle"
    UNSUPPORTED = "unsupported"
    MISSING = "missing"
    READONLY = "readonly"

    @property
    def label(self) -> str:
        return self.value

    @property
    def is_failure(self) -> bool:
        """True when the real run refuses the host (only a dry run reports these)."""
        return self in _REFUSED

    @property
    def style(self) -> str:
        """The rich style the CLI shows it in."""
        return _STYLES.get(self, "yellow")


_REFUSED = frozenset({RunOutcome.CONFLICT, RunOutcome.CHANGED_OUTSIDE, RunOutcome.OTHER_BUNDLE,
                      RunOutcome.UNSUPPORTED, RunOutcome.MISSING, RunOutcome.READONLY})
_STYLES = {RunOutcome.APPLIED: "green", RunOutcome.ROLLED_BACK: "green", RunOutcome.NOOP: "dim",
           RunOutcome.PLANNED: "cyan"}


def _dry_run_outcome(plan: HostPlan) -> RunOutcome:
    return RunOutcome.PLANNED if plan.outcome == "apply" else RunOutcome(plan.outcome)


@dataclass(frozen=True)
class HostOutcome:
    """What happened on one host; the CLI renders it, the tests assert on it."""

    host: str
    operation: str
    outcome: RunOutcome
    plan: HostPlan
    recovered: str | None = None
    txn: str | None = None
    files: Mapping[str, str | None] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    state: RemoteState | None = None
    # rollback: files placed beside the bundle (a tuned policy) that went with it
    placed_removed: tuple[str, ...] = ()

    @property
    def message(self) -> str:
        parts = []
        if self.recovered:
            parts.append(f"recovered interrupted run ({self.recovered})")
        if self.outcome is RunOutcome.NOOP:
            parts.append(self.plan.reason or "nothing to do")
        elif self.outcome is RunOutcome.PLANNED:
            parts.append(f"would {self.plan.operation}: {self.plan.summary()}")
        else:
            parts.append(f"{self.outcome}: {self.plan.summary()}")
        parts.extend(self.notes)
        return "; ".join(parts)

    def refusal(self) -> PatchError | RemoteFileError | None:
        """The error the real run raises on this host, for a dry run whose plan it refuses
        (so that ``deploy --dry-run`` exits as the deploy would); None otherwise."""
        if not self.outcome.is_failure:
            return None
        try:
            _raise_for_plan(self.plan, self.host)
        except (PatchError, RemoteFileError) as exc:
            return exc
        return None


def _holder(txn: str, command: str) -> dict[str, Any]:
    h = controller_identity()
    h.update({"txn": txn, "started": time.time(), "command": command})
    return h


def lock_is_stale(lock: Mapping[str, Any]) -> bool:
    """True only when the holder is provably gone: same controller machine, dead pid or ended run."""
    if lock.get("remote_alive"):
        return False  # its controller may be gone, but a step of it still runs on the host
    return holder_is_dead(lock, run_id=lock.get("txn"))


def describe_lock(lock: Mapping[str, Any]) -> str:
    if "unreadable" in lock:
        return f"a lock without holder information ({lock['unreadable']})"
    since = lock.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    who = f"{lock.get('user', '?')}@{lock.get('controller', '?')} pid {lock.get('pid', '?')}"
    return f"{who} since {when} ({lock.get('command', '?')})"


class _Run:
    """One operation on one host. Registers its run id so this process knows it is alive.

    ``cancel`` (set by the CLI on Ctrl-C or SIGTERM) is looked at between round trips: a
    step already running on the host finishes (each is all-or-nothing), no later step
    starts, and files prepared but not committed are removed again before the run ends.
    """

    def __init__(self, transport: Transport, host: Host, opts: RunOptions, command: str,
                 cancel: threading.Event | None = None) -> None:
        self.t = transport
        self.host = host
        self.opts = opts
        self.txn = uuid.uuid4().hex
        self.holder = _holder(self.txn, command)
        self.cancel = cancel

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def stop_if_cancelled(self, when: str) -> None:
        if self.cancelled:
            raise Interrupted(f"interrupted {when}; nothing was changed", host=self.t.host)

    def _wait(self, delay: float) -> None:
        if self.cancel is not None:
            self.cancel.wait(delay)
        else:
            time.sleep(delay)

    def __enter__(self) -> _Run:
        run_started(self.txn)
        return self

    def __exit__(self, *exc: object) -> None:
        run_ended(self.txn)

    def step(self, name: str, payload: dict[str, Any], timeout: float | None = 600.0) -> dict[str, Any]:
        return run_step(self.t, self.host.python, name, payload, timeout=timeout)

    def gather(self, package: str, paths: list[str]) -> RemoteState:
        return gather(self.t, self.host.python, package, paths)

    def settle(self, package: str, paths: list[str]) -> tuple[RemoteState, str | None]:
        """Gather; if a journal or lock is left over, recover it (or wait / refuse) and gather again."""
        deadline = time.monotonic() + self.opts.lock_wait_s
        recovered: str | None = None
        delay = 0.2
        while True:
            rs = self.gather(package, paths)
            if rs.journal is None and rs.lock is None:
                return rs, recovered
            lock = rs.lock
            if lock is not None and not (self.opts.break_lock or lock_is_stale(lock)):
                self.stop_if_cancelled("while waiting for the host lock")
                if time.monotonic() < deadline:
                    self._wait(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                hint = "" if lock.get("controller") == socket.gethostname() else (
                    "; if no deploy is running there, re-run with --break-lock")
                raise LockError(f"locked by {describe_lock(lock)}{hint}", host=self.t.host)
            try:
                ans = self.step("recover", {"package": package, "holder": self.holder,
                                            "break_txn": lock.get("txn") if lock else None})
            except RemoteRefusal as exc:
                if exc.kind == "busy" and time.monotonic() < deadline and not self.cancelled:
                    self._wait(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                if exc.kind == "busy":
                    raise LockError(f"{exc.message}; wait for it (--lock-wait) and re-run", host=self.t.host) from exc
                if exc.kind == "locked":
                    continue  # taken by someone else between gather and recover: look again
                raise PatchError(f"recovery failed: {exc.message}", host=self.t.host) from exc
            recovered = str(ans.get("outcome"))

    def execute(self, plan: HostPlan, rs: RemoteState, payload_files: list[dict[str, Any]],
                new_state: dict[str, Any] | None, verify: list[list[str]], keep_backups: list[str],
                drop_backups: list[str]) -> dict[str, Any]:
        self.stop_if_cancelled("before the host was changed")
        try:
            self.step("prepare", {
                "package": rs.package, "txn": self.txn, "holder": self.holder, "files": payload_files,
                "new_state": new_state, "keep_backups": keep_backups, "drop_backups": drop_backups,
                # What the plan was made from, checked again under the lock.
                "expect_state": rs.raw.get("state"), "expect_files": dict(rs.files),
            })
        except RemoteRefusal as exc:
            if exc.kind == "stale":
                raise _StalePlan(exc.message, host=self.t.host) from exc
            if exc.kind == "locked":
                raise LockError(f"locked by {describe_lock(exc.extra.get('holder') or {})}", host=self.t.host) from exc
            raise PatchError(exc.message, host=self.t.host) from exc
        if self.cancelled:
            self._undo_prepared(rs.package)
        try:
            return self.step("commit", {"package": rs.package, "txn": self.txn, "verify": verify,
                                        "verify_timeout": self.opts.verify_timeout_s})
        except RemoteRefusal as exc:
            raise PatchError(exc.message, host=self.t.host) from exc


    def _undo_prepared(self, package: str) -> None:
        """Interrupted between prepare and commit: roll our own journal back (the temps and
        backups go, the lock is freed), so the host is left as it was, not locked."""
        try:
            self.step("recover", {"package": package, "holder": self.holder, "break_txn": self.txn})
        except DdtreeOpsError as exc:
            raise Interrupted(f"interrupted before commit; removing the prepared files failed ({exc.message}); "
                              "the package files are unchanged and the next run recovers the rest",
                              host=self.t.host) from exc
        raise Interrupted("interrupted before commit; the prepared files were removed, nothing was changed",
                          host=self.t.host)


class _StalePlan(DriftError):
    """The prepare step found the host no longer as gathered (another deploy or rollback
    committed between this run's gather and its lock): nothing was changed; gather and plan
    again. Raised to the caller only when that keeps happening."""


# How many times one run gathers and plans again after a stale plan.
_PLAN_ATTEMPTS = 5


def _backup_path(rs: RemoteState, txn: str, path: str) -> str:
    return "/".join([rs.state_dir, "backups", txn, backup_relpath(path)])


def _raise_for_plan(plan: HostPlan, host: str) -> None:
    if plan.outcome == "unsupported":
        raise UnsupportedVersion(plan.reason, host=host)
    if plan.outcome in ("conflict", "changed-outside"):
        raise DriftError(plan.reason, host=host)
    if plan.outcome in ("missing", "other-bundle"):
        raise PatchError(plan.reason, host=host)
    if plan.outcome == "readonly":
        raise RemoteFileError(plan.reason + "; nothing was changed", host=host)
    if plan.outcome == "recover":
        raise PatchError(plan.reason, host=host)


def deploy(transport: Transport, host: Host, bundle: Bundle | Callable[[RemoteState], Bundle],
           opts: RunOptions = RunOptions(), *, paths: list[str] | None = None,
           cancel: threading.Event | None = None) -> HostOutcome:
    """Deploy ``bundle`` to one host (or, for overlays, a bundle derived from the host's state).

    ``bundle`` may be a function of the gathered state: overlay mode decides add vs
    replace per host. Then ``paths`` lists the package paths to gather.
    """
    package = bundle.package if isinstance(bundle, Bundle) else "sglang"
    want = [f.path for f in bundle.files] if isinstance(bundle, Bundle) else list(paths or [])
    with _Run(transport, host, opts, "deploy", cancel) as run:
        recovered: str | None = None
        for attempt in range(1, _PLAN_ATTEMPTS + 1):
            rs, settled = run.settle(package, want) if not opts.dry_run else (run.gather(package, want), None)
            recovered = recovered or settled
            b = bundle if isinstance(bundle, Bundle) else bundle(rs)
            plan = plan_deploy(b, rs, force=opts.force, force_version=opts.force_version, replace=opts.replace)
            if opts.dry_run:
                return HostOutcome(host.name, "deploy", _dry_run_outcome(plan), plan,
                                   recovered=recovered, notes=plan.notes, state=rs)
            _raise_for_plan(plan, transport.host)
            if plan.outcome == "noop":
                return HostOutcome(
                    host.name, "deploy", RunOutcome.NOOP, plan, recovered=recovered, notes=plan.notes, state=rs
                )
            payload, new_state, keep, drop = _deploy_payload(b, plan, rs, run.txn, run.holder)
            try:
                result = run.execute(plan, rs, payload, new_state, [list(v) for v in b.verify], keep, drop)
            except _StalePlan:
                if attempt == _PLAN_ATTEMPTS:
                    raise
                continue
            break
        files = dict(result.get("files") or {})
        for a in plan.changes:
            if files.get(a.path) != a.new_sha256:
                raise VerifyError(f"{a.path} has sha256 {files.get(a.path)} after deploy, expected {a.new_sha256}",
                                  host=transport.host)
        return HostOutcome(host.name, "deploy", RunOutcome.APPLIED, plan, recovered=recovered, txn=run.txn, files=files,
                           notes=plan.notes, state=rs)


def _deploy_payload(bundle: Bundle, plan: HostPlan, rs: RemoteState, txn: str, holder: Mapping[str, Any]
                    ) -> tuple[list[dict[str, Any]], dict[str, Any], list[str], list[str]]:
    contents = {f.path: f for f in bundle.files}
    payload: list[dict[str, Any]] = []
    record_files: dict[str, Any] = {}
    keep: list[str] = []
    drop: list[str] = []
    for a in plan.actions:
        if a.kind in ("conflict", "blocked"):
            raise PatchError(f"{a.path}: {a.reason}")  # plan_deploy never lets these through
        if a.changes:
            item: dict[str, Any] = {"path": a.path, "expect_sha": a.current_sha256, "new_sha": a.new_sha256}
            if a.kind == "restore":
                item["from_backup"] = a.original_backup
            elif a.kind != "delete":
                item["content_b64"] = base64.b64encode(contents[a.path].content).decode()
            payload.append(item)
        if a.path not in contents:
            # A file of the previous bundle, now put back: no longer recorded.
            if a.original_backup:
                drop.append(a.original_backup)
            continue
        backup = a.original_backup
        if a.backup_as_original:
            backup = _backup_path(rs, txn, a.path)
            keep.append(backup)
        elif a.kind in ("add", "replace") and a.original_backup:
            drop.append(a.original_backup)
        record_files[a.path] = {"original_sha256": a.original_sha256, "patched_sha256": a.new_sha256, "backup": backup}
        if rs.applied is not None and a.path in rs.applied.files and backup != rs.applied.files[a.path].backup:
            old = rs.applied.files[a.path].backup
            if old and old not in drop:
                drop.append(old)
    new_state = {
        "name": bundle.name,
        "version": bundle.version,
        "identity": bundle.identity,
        "package": bundle.package,
        "package_version": rs.version,
        "applied_by": f"{holder.get('user')}@{holder.get('controller')}",
        "files": record_files,
    }
    return payload, new_state, keep, drop


def rollback(
    transport: Transport, host: Host, opts: RunOptions = RunOptions(), *, package: str = "sglang",
    cancel: threading.Event | None = None,
) -> HostOutcome:
    """Put every recorded file back to its original and clear the state record."""
    with _Run(transport, host, opts, "rollback", cancel) as run:
        recovered: str | None = None
        for attempt in range(1, _PLAN_ATTEMPTS + 1):
            rs, settled = run.settle(package, []) if not opts.dry_run else (run.gather(package, []), None)
            recovered = recovered or settled
            plan = plan_rollback(rs, force=opts.force)
            if opts.dry_run:
                return HostOutcome(host.name, "rollback", _dry_run_outcome(plan), plan,
                                   recovered=recovered, state=rs)
            _raise_for_plan(plan, transport.host)
            if plan.outcome == "noop":
                return HostOutcome(host.name, "rollback", RunOutcome.NOOP, plan, recovered=recovered, state=rs)
            payload: list[dict[str, Any]] = []
            drop: list[str] = []
            for a in plan.actions:
                if a.original_backup:
                    drop.append(a.original_backup)
                if not a.changes:
                    continue
                item: dict[str, Any] = {"path": a.path, "expect_sha": a.current_sha256, "new_sha": a.new_sha256}
                if a.kind == "restore":
                    item["from_backup"] = a.original_backup
                payload.append(item)
            keep = [_backup_path(rs, run.txn, a.path) for a in plan.actions if a.forced and a.current_sha256]
            try:
                result = run.execute(plan, rs, payload, None, [], keep, drop)
            except _StalePlan:
                if attempt == _PLAN_ATTEMPTS:
                    raise
                continue
            break
        files = dict(result.get("files") or {})
        placed = tuple(str(p) for p in result.get("placed_removed") or ())
        for a in plan.changes:
            if files.get(a.path) != a.new_sha256:
                raise VerifyError(f"{a.path} has sha256 {files.get(a.path)} after rollback, expected the original "
                                  f"{a.new_sha256}", host=transport.host)
        return HostOutcome(
            host.name,
            "rollback",
            RunOutcome.ROLLED_BACK,
            plan,
            recovered=recovered,
            txn=run.txn,
            files=files,
            notes=(*plan.notes, *(f"removed {p} (placed beside the bundle)" for p in placed)),
            state=rs,
            placed_removed=placed,
        )


def recover(
    transport: Transport, host: Host, opts: RunOptions = RunOptions(), *, package: str = "sglang"
) -> str | None:
    """Only the recovery part: settle a leftover journal/lock. Returns what was done, or None."""
    with _Run(transport, host, opts, "recover") as run:
        _rs, recovered = run.settle(package, [])
        return recovered


def file_action_rows(actions: tuple[FileAction, ...]) -> list[dict[str, Any]]:
    return [
        {"path": a.path, "action": a.kind, "current": a.current_sha256, "new": a.new_sha256, "reason": a.reason}
        for a in actions
    ]
