"""What a host runs now: applied bundle, per-file state, leftover journal or lock.

One round trip (the gather). Other code (the benchmark runner) calls :func:`host_status`
to record which bundle, by name and identity, served a measurement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ddtree_ops.inventory_types import Host
from ddtree_ops.patching.bundle import Bundle
from ddtree_ops.patching.gather import AppliedRecord, RemoteState, gather
from ddtree_ops.patching.plan import OutsideChange, changed_outside
from ddtree_ops.transport.base import Transport

FileStateKind = Literal["patched", "original", "drifted", "missing"]


@dataclass(frozen=True)
class FileState:
    path: str
    state: FileStateKind
    sha256: str | None


@dataclass(frozen=True)
class HostPatchStatus:
    host: str
    package: str
    package_dir: str | None
    package_version: str | None
    bundle_name: str | None
    bundle_version: str | None
    bundle_identity: str | None
    applied_at: float | None
    applied_by: str | None
    files: tuple[FileState, ...]
    journal: Mapping[str, Any] | None
    lock: Mapping[str, Any] | None
    state_error: str | None = None
    # Set when the record names a bundle but some of its files no longer hold what was
    # applied (e.g. a pip reinstall put the upstream files back): deploy refuses such a host.
    outside_change: OutsideChange | None = None

    @property
    def consistent(self) -> bool:
        """True when every file is patched (bundle applied) or every file is original (nothing applied)."""
        kinds = {f.state for f in self.files}
        if self.bundle_identity:
            return kinds <= {"patched"}
        return kinds <= {"original"}

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "package": self.package,
            "package_dir": self.package_dir,
            "package_version": self.package_version,
            "bundle": None if self.bundle_name is None else {
                "name": self.bundle_name, "version": self.bundle_version, "identity": self.bundle_identity,
                "applied_at": self.applied_at, "applied_by": self.applied_by,
            },
            "files": [{"path": f.path, "state": f.state, "sha256": f.sha256} for f in self.files],
            "journal": dict(self.journal) if self.journal else None,
            "lock": dict(self.lock) if self.lock else None,
            "state_error": self.state_error,
            "changed_outside": None if self.outside_change is None else {
                "reverted": list(self.outside_change.reverted), "drifted": list(self.outside_change.drifted),
                "summary": self.outside_change.describe(),
            },
        }


def classify(rs: RemoteState, bundle: Bundle | None = None) -> tuple[FileState, ...]:
    """Per-file state from the record (if any) and the bundle (if given). Pure."""
    out: dict[str, FileState] = {}
    rec: AppliedRecord | None = rs.applied
    if rec is not None:
        for path, f in rec.files.items():
            cur = rs.files.get(path)
            out[path] = FileState(path, _kind(cur, f.patched_sha256, f.original_sha256, f.original_sha256 is None), cur)
    if bundle is not None:
        for bf in bundle.files:
            if bf.path in out:
                continue
            cur = rs.files.get(bf.path)
            out[bf.path] = FileState(bf.path, _kind(cur, bf.sha256, bf.base_sha256, bf.op == "add"), cur)
    return tuple(out[p] for p in sorted(out))


def _kind(cur: str | None, patched: str, original: str | None, original_absent: bool) -> FileStateKind:
    if cur == patched:
        return "patched"
    if cur is None:
        return "original" if original_absent else "missing"
    if original is not None and cur == original:
        return "original"
    return "drifted"


def status_from_state(rs: RemoteState, bundle: Bundle | None = None) -> HostPatchStatus:
    rec = rs.applied
    return HostPatchStatus(
        host=rs.host,
        package=rs.package,
        package_dir=rs.package_dir,
        package_version=rs.version,
        bundle_name=rec.name if rec else None,
        bundle_version=rec.version if rec else None,
        bundle_identity=rec.identity if rec else None,
        applied_at=rec.applied_at if rec else None,
        applied_by=rec.applied_by if rec else None,
        files=classify(rs, bundle),
        journal=rs.journal,
        lock=rs.lock,
        state_error=rs.state_error,
        outside_change=changed_outside(rec, rs.files),
    )


def host_status(
    transport: Transport, host: Host, *, package: str = "sglang", bundle: Bundle | None = None
) -> HostPatchStatus:
    """One round trip: the patch status of ``host`` (files of ``bundle`` included when given)."""
    paths = [f.path for f in bundle.files] if bundle is not None else []
    rs = gather(transport, host.python, bundle.package if bundle else package, paths)
    return status_from_state(rs, bundle)
