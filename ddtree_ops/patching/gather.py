"""Everything a plan needs from one host, in ONE remote round trip.

Package directory and installed version (found without importing the package), the
directory beside it when the bundle ships files there, the sha256 of every path the
bundle touches and of every path the state record lists (paths are file keys, see
:mod:`ddtree_ops.patching.bundle`), the state record itself, a leftover journal and the
lock holder. The result is a frozen :class:`RemoteState`, so that planning is a pure
function of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ddtree_ops.patching.remote import run_step
from ddtree_ops.transport.base import Transport


@dataclass(frozen=True)
class AppliedFile:
    """One file the state record says is patched: what it was, what it is, where the original is."""

    path: str
    original_sha256: str | None
    patched_sha256: str
    backup: str | None


@dataclass(frozen=True)
class AppliedRecord:
    """The host's state record: which bundle is applied, when, by whom, and its files."""

    name: str
    version: str
    identity: str
    txn: str
    applied_at: float | None
    applied_by: str
    package_version: str | None
    files: Mapping[str, AppliedFile]

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> AppliedRecord:
        files = {}
        for path, f in (doc.get("files") or {}).items():
            files[path] = AppliedFile(
                path=path,
                original_sha256=f.get("original_sha256"),
                patched_sha256=f.get("patched_sha256", ""),
                backup=f.get("backup"),
            )
        return cls(
            name=str(doc.get("name", "?")),
            version=str(doc.get("version", "?")),
            identity=str(doc.get("identity", "")),
            txn=str(doc.get("txn", "")),
            applied_at=doc.get("applied_at"),
            applied_by=str(doc.get("applied_by", "")),
            package_version=doc.get("package_version"),
            files=MappingProxyType(files),
        )


@dataclass(frozen=True)
class RemoteState:
    host: str
    python: str
    python_version: str
    prefix: str
    state_dir: str
    package: str
    package_dir: str | None
    version: str | None
    writable: bool
    files: Mapping[str, str | None]
    applied: AppliedRecord | None = None
    # The directory holding the package, when site-packages files were asked about and
    # the host accepts writing there (else each such file's hash says why not).
    site_dir: str | None = None
    state_error: str | None = None
    journal: Mapping[str, Any] | None = None
    lock: Mapping[str, Any] | None = None
    raw: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


def state_from_answer(host: str, package: str, ans: Mapping[str, Any]) -> RemoteState:
    state_doc = ans.get("state")
    applied = None
    state_error = None
    if isinstance(state_doc, dict):
        if "unreadable" in state_doc:
            state_error = str(state_doc["unreadable"])
        else:
            applied = AppliedRecord.from_json(state_doc)
    return RemoteState(
        host=host,
        python=str(ans.get("python", "")),
        python_version=str(ans.get("python_version", "")),
        prefix=str(ans.get("prefix", "")),
        state_dir=str(ans.get("state_dir", "")),
        package=package,
        package_dir=ans.get("package_dir"),
        site_dir=ans.get("site_dir"),
        version=ans.get("version"),
        writable=bool(ans.get("writable")),
        files=MappingProxyType(dict(ans.get("files") or {})),
        applied=applied,
        state_error=state_error,
        journal=ans.get("journal"),
        lock=ans.get("lock"),
        raw=MappingProxyType(dict(ans)),
    )


def gather(transport: Transport, python: str, package: str, paths: Sequence[str]) -> RemoteState:
    """One round trip: the remote facts for ``package`` and ``paths`` (plus recorded paths)."""
    ans = run_step(transport, python, "gather", {"package": package, "paths": list(paths)}, timeout=120.0)
    return state_from_answer(transport.host, package, ans)
