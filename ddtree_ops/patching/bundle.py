"""Patch bundles: ``patches/<name>/patch.yaml`` plus the files it ships.

A bundle is validated completely when it is loaded, so that nothing downstream (plan,
executor, CLI) has to second-guess a path or a hash: every target path is relative to
the package directory and stays inside it, every source exists inside the bundle
directory, no path appears twice, and unknown keys are errors (a typo in ``base_sha256``
must not silently turn a guarded replace into an unguarded one).

The bundle's *identity* is a sha256 over the manifest bytes and every shipped file; it is
what ``status`` shows and what the benchmark ledger records, so two hosts report the
same identity exactly when they run the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from ddtree_ops.errors import BundleError

MANIFEST_NAME = "patch.yaml"
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_TOP_KEYS = {"name", "version", "description", "target", "files", "verify"}
_TARGET_KEYS = {"package", "versions"}
_FILE_KEYS = {"op", "path", "source", "base_sha256"}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

Op = Literal["add", "replace"]


@dataclass(frozen=True)
class FileOp:
    """One file the bundle puts into the package directory.

    ``content`` is held in memory: bundles are a handful of source files, and holding the
    bytes means the identity, the upload and the hashes all describe the same data even
    if the working copy changes while a deploy runs.
    """

    op: Op
    path: str
    content: bytes
    sha256: str
    base_sha256: str | None = None
    source: str = ""


@dataclass(frozen=True)
class Bundle:
    name: str
    version: str
    description: str
    package: str
    versions: tuple[str, ...]
    files: tuple[FileOp, ...]
    verify: tuple[tuple[str, ...], ...]
    identity: str
    origin: str = ""

    @property
    def short_identity(self) -> str:
        return self.identity[:12]

    def file(self, path: str) -> FileOp:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def compute_identity(manifest_bytes: bytes, files: Sequence[FileOp]) -> str:
    """sha256 over the manifest and each file's path and content hash, in path order.

    Paths are included so that moving a file changes the identity even when its bytes
    do not; the manifest is included so that a changed version or verify command does.
    """
    h = hashlib.sha256()
    h.update(b"ddtree-ops-bundle-v1\0")
    h.update(sha256_bytes(manifest_bytes).encode())
    for f in sorted(files, key=lambda f: f.path):
        h.update(b"\0" + f.path.encode() + b"\0" + f.sha256.encode())
    return h.hexdigest()


def bundle_identity(bundle: Bundle | Path | str) -> str:
    """The identity of a loaded bundle or of the bundle directory at a path (what status and ledgers show)."""
    return bundle.identity if isinstance(bundle, Bundle) else load_bundle(bundle).identity


def normalize_target_path(raw: object, *, where: str) -> str:
    """A package-relative POSIX path that cannot leave the package directory."""
    if not isinstance(raw, str) or not raw.strip():
        raise BundleError(f"{where}: path must be a non-empty string")
    if "\\" in raw or "\0" in raw:
        raise BundleError(f"{where}: path {raw!r} contains a backslash or NUL")
    if raw.startswith("/") or re.match(r"^[A-Za-z]:", raw):
        raise BundleError(f"{where}: path {raw!r} is absolute; paths are relative to the package directory")
    parts = raw.split("/")
    if any(p == ".." for p in parts):
        raise BundleError(f"{where}: path {raw!r} escapes the package directory ('..')")
    norm = posixpath.normpath(raw)
    if norm in (".", "") or norm.startswith("../"):
        raise BundleError(f"{where}: path {raw!r} does not name a file inside the package directory")
    if any(p.startswith(".ddtree-") for p in norm.split("/")):
        raise BundleError(f"{where}: path {raw!r} uses the reserved '.ddtree-' prefix")
    return norm


def _source_file(bundle_dir: Path, rel: str, *, where: str) -> Path:
    """Resolve a source inside the bundle directory, refusing symlinks that lead out of it."""
    root = bundle_dir.resolve()
    candidate = bundle_dir / rel
    resolved = candidate.resolve()
    if resolved != root and root not in resolved.parents:
        raise BundleError(f"{where}: source {rel!r} resolves outside the bundle directory ({resolved})")
    if not resolved.is_file():
        raise BundleError(f"{where}: source {rel!r} not found ({candidate})")
    return resolved


def _expect_keys(obj: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise BundleError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(allowed))}")


def load_bundle(path: Path | str) -> Bundle:
    """Load and validate a bundle directory (or its ``patch.yaml``)."""
    p = Path(path)
    manifest_path = p if p.is_file() else p / MANIFEST_NAME
    bundle_dir = manifest_path.parent
    if not manifest_path.is_file():
        raise BundleError(f"{manifest_path}: no patch manifest found")
    raw = manifest_path.read_bytes()
    where = str(manifest_path)
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise BundleError(f"{where}: not valid YAML: {exc}".splitlines()[0]) from exc
    if not isinstance(doc, dict):
        raise BundleError(f"{where}: the manifest must be a mapping")
    _expect_keys(doc, _TOP_KEYS, where)
    return parse_manifest(doc, raw, bundle_dir=bundle_dir, where=where)


def parse_manifest(doc: Mapping[str, Any], raw: bytes, *, bundle_dir: Path, where: str) -> Bundle:
    for key in ("name", "version", "target", "files"):
        if key not in doc:
            raise BundleError(f"{where}: missing key '{key}'")
    name = doc["name"]
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise BundleError(f"{where}: name must be a simple identifier, got {name!r}")
    version = doc["version"]
    if not isinstance(version, (str, int, float)):
        raise BundleError(f"{where}: version must be a string")
    description = doc.get("description", "") or ""
    if not isinstance(description, str):
        raise BundleError(f"{where}: description must be a string")

    target = doc["target"]
    if not isinstance(target, dict):
        raise BundleError(f"{where}: target must be a mapping with package and versions")
    _expect_keys(target, _TARGET_KEYS, f"{where}: target")
    package = target.get("package")
    if not isinstance(package, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", package):
        raise BundleError(f"{where}: target.package must be an importable top-level package name")
    versions = target.get("versions")
    if not isinstance(versions, list) or not versions or not all(isinstance(v, (str, int, float)) for v in versions):
        raise BundleError(f"{where}: target.versions must be a non-empty list of exact versions")

    files_doc = doc["files"]
    if not isinstance(files_doc, list) or not files_doc:
        raise BundleError(f"{where}: files must be a non-empty list")
    files: list[FileOp] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(files_doc):
        fwhere = f"{where}: files[{i}]"
        if not isinstance(entry, dict):
            raise BundleError(f"{fwhere}: must be a mapping with op and path")
        _expect_keys(entry, _FILE_KEYS, fwhere)
        op = entry.get("op")
        if op not in ("add", "replace"):
            raise BundleError(f"{fwhere}: op must be 'add' or 'replace', got {op!r}")
        tpath = normalize_target_path(entry.get("path"), where=fwhere)
        if tpath in seen:
            raise BundleError(f"{fwhere}: duplicate path {tpath!r} (also files[{seen[tpath]}])")
        seen[tpath] = i
        base = entry.get("base_sha256")
        if op == "replace":
            if not isinstance(base, str) or not _SHA_RE.match(base):
                raise BundleError(f"{fwhere}: replace needs base_sha256 (64 lowercase hex digits) of the upstream file")
        elif base is not None:
            raise BundleError(f"{fwhere}: base_sha256 is only meaningful for op 'replace'")
        source_rel = entry.get("source", f"files/{tpath}")
        if not isinstance(source_rel, str) or not source_rel or source_rel.startswith("/"):
            raise BundleError(f"{fwhere}: source must be a path relative to the bundle directory")
        src = _source_file(bundle_dir, source_rel, where=fwhere)
        content = src.read_bytes()
        files.append(
            FileOp(op=op, path=tpath, content=content, sha256=sha256_bytes(content), base_sha256=base, source=str(src))
        )

    verify_doc = doc.get("verify", []) or []
    if not isinstance(verify_doc, list):
        raise BundleError(f"{where}: verify must be a list of argv lists")
    verify: list[tuple[str, ...]] = []
    for i, argv in enumerate(verify_doc):
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise BundleError(f"{where}: verify[{i}] must be a non-empty list of strings (argv after the interpreter)")
        verify.append(tuple(argv))

    return Bundle(
        name=name,
        version=str(version),
        description=description,
        package=package,
        versions=tuple(str(v) for v in versions),
        files=tuple(files),
        verify=tuple(verify),
        identity=compute_identity(raw, files),
        origin=str(bundle_dir),
    )


def synthetic_bundle(
    *,
    name: str,
    version: str,
    package: str,
    versions: Sequence[str],
    files: Sequence[FileOp],
    description: str = "",
    origin: str = "",
) -> Bundle:
    """A bundle built in memory (overlay mode); its 'manifest' is canonical JSON of its fields."""
    manifest = {
        "name": name,
        "version": version,
        "description": description,
        "target": {"package": package, "versions": list(versions)},
        "files": [{"op": f.op, "path": f.path, "base_sha256": f.base_sha256} for f in sorted(files, key=lambda f: f.path)],
    }
    raw = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return Bundle(
        name=name,
        version=version,
        description=description,
        package=package,
        versions=tuple(versions),
        files=tuple(files),
        verify=(),
        identity=compute_identity(raw, files),
        origin=origin,
    )
