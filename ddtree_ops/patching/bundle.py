"""Patch bundles: ``patches/<name>/patch.yaml`` plus the files it ships.

A bundle is validated completely when it is loaded, so that nothing downstream (plan,
executor, CLI) has to second-guess a path or a hash: every target path stays inside its
root, every source exists inside the bundle directory, no path appears twice, and
unknown keys are errors (a typo in ``base_sha256`` must not silently turn a guarded
replace into an unguarded one).

Two roots. ``root: package`` (the default) paths are relative to the package directory
(``sglang/``). ``root: site-packages`` paths are relative to the directory that holds the
package (its parent, the purelib dir), and may only *add* files inside a
``<name>-<version>.dist-info/`` directory of another distribution than the target's own:
that is how a bundle registers itself as a plugin (``entry_points.txt``) without ever
touching a file some installer owns.

Every file is named downstream (plan, state record, journal, status, ``--json``) by one
*key*: its path relative to the package directory. Package files keep their plain path
(so state records written before site-packages files existed still mean the same); a
site-packages file is ``../<name>-<version>.dist-info/<file>``. That is unambiguous,
because a package path can never contain ``..``; and it is literally where the file is
relative to the package directory, so ``<package_dir>/<key>`` (the CLI's ``--diff``, a
person with a shell) reaches the right file, while an older remote agent that meets such
a key in a state record refuses it as an escape instead of looking somewhere else.

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
from ddtree_ops.yamlfile import safe_load_unique

MANIFEST_NAME = "patch.yaml"
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_TOP_KEYS = {"name", "version", "description", "target", "files", "verify"}
_TARGET_KEYS = {"package", "versions"}
_FILE_KEYS = {"op", "path", "source", "base_sha256", "root"}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# A wheel's metadata directory: the distribution name escaped with '_' (so it holds no
# '-'), one '-', the version. The remote agent (_remote.py) uses the same pattern.
DIST_INFO_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.]*)-([A-Za-z0-9_.!+]+)\.dist-info$")
SITE_KEY_PREFIX = "../"
# Where a site-packages file's source lives by default: beside files/, not inside it, so
# a dist-info directory can never be mistaken for a package path.
SITE_SOURCE_DIR = "site-packages"

Op = Literal["add", "replace"]
Root = Literal["package", "site-packages"]
ROOTS: tuple[Root, ...] = ("package", "site-packages")


@dataclass(frozen=True)
class FileOp:
    """One file the bundle puts on the host.

    ``path`` is the file's key (see the module docstring): package-relative, or
    ``../<dist-info>/...`` for a file beside the package; :attr:`root` and :attr:`rel`
    take it apart. ``content`` is held in memory: bundles are a handful of source files,
    and holding the bytes means the identity, the upload and the hashes all describe the
    same data even if the working copy changes while a deploy runs.
    """

    op: Op
    path: str
    content: bytes
    sha256: str
    base_sha256: str | None = None
    source: str = ""

    @property
    def root(self) -> Root:
        return key_root(self.path)

    @property
    def rel(self) -> str:
        """The path as the manifest writes it: relative to :attr:`root`."""
        return split_key(self.path)[1]


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
    """sha256 over the manifest and each file's key and content hash, in key order.

    Keys are included so that moving a file changes the identity even when its bytes do
    not, between directories or between roots (a key carries its root); the manifest is
    included so that a changed version or verify command does.
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


def split_key(key: str) -> tuple[Root, str]:
    """(root, path relative to that root) of a file key."""
    if key.startswith(SITE_KEY_PREFIX):
        return "site-packages", key[len(SITE_KEY_PREFIX):]
    return "package", key


def key_root(key: str) -> Root:
    return split_key(key)[0]


def make_key(root: Root, rel: str) -> str:
    return SITE_KEY_PREFIX + rel if root == "site-packages" else rel


def backup_relpath(key: str) -> str:
    """Where a key's backup lives under ``backups/<txn>/`` (the remote agent computes the same).

    A site-packages file goes under a reserved ``.ddtree-`` name, which no package path
    may use, so its backup can neither climb out of the transaction's directory nor
    collide with a package file's.
    """
    root, rel = split_key(key)
    return f".ddtree-site-packages/{rel}" if root == "site-packages" else rel


def dist_name_key(name: str) -> str:
    """A distribution name as PEP 503 compares it: case and runs of '-', '_', '.' do not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _relative_path(raw: object, *, where: str, root_dir: str) -> str:
    """A normalized relative POSIX path without '..', absolute forms or reserved names."""
    if not isinstance(raw, str) or not raw.strip():
        raise BundleError(f"{where}: path must be a non-empty string")
    if "\\" in raw or "\0" in raw:
        raise BundleError(f"{where}: path {raw!r} contains a backslash or NUL")
    if raw.startswith("/") or re.match(r"^[A-Za-z]:", raw):
        raise BundleError(f"{where}: path {raw!r} is absolute; paths are relative to the {root_dir}")
    parts = raw.split("/")
    if any(p == ".." for p in parts):
        raise BundleError(f"{where}: path {raw!r} escapes the {root_dir} ('..')")
    norm = posixpath.normpath(raw)
    if norm in (".", "") or norm.startswith("../"):
        raise BundleError(f"{where}: path {raw!r} does not name a file inside the {root_dir}")
    if any(p.startswith(".ddtree-") for p in norm.split("/")):
        raise BundleError(f"{where}: path {raw!r} uses the reserved '.ddtree-' prefix")
    return norm


def normalize_target_path(raw: object, *, where: str) -> str:
    """A package-relative POSIX path that cannot leave the package directory."""
    return _relative_path(raw, where=where, root_dir="package directory")


def normalize_site_path(raw: object, *, package: str, where: str) -> str:
    """A path beside the package: inside one ``<name>-<version>.dist-info/`` of another distribution.

    Only metadata directories of the bundle's own distribution may be written there: a
    bundle that could put modules beside the package could shadow any installed package,
    and one that could write into the target's own dist-info would corrupt what pip
    knows about it.
    """
    norm = _relative_path(raw, where=where, root_dir="site-packages directory")
    top, sep, _rest = norm.partition("/")
    m = DIST_INFO_RE.match(top)
    if not sep or m is None:
        raise BundleError(
            f"{where}: path {raw!r} must be a file inside a '<name>-<version>.dist-info/' directory"
            " (root: site-packages only ships the bundle's own distribution metadata)"
        )
    if dist_name_key(m.group(1)) == dist_name_key(package):
        raise BundleError(
            f"{where}: path {raw!r} is inside {package}'s own metadata directory; a bundle never writes"
            " into the target package's dist-info (use a distribution name of its own)"
        )
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
        raise BundleError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(allowed))}"
        )


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
        doc = safe_load_unique(raw, source=where, error=BundleError)
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
        root = entry.get("root", "package")
        if root not in ROOTS:
            raise BundleError(f"{fwhere}: root must be 'package' or 'site-packages', got {root!r}")
        if root == "site-packages":
            if op != "add":
                raise BundleError(
                    f"{fwhere}: root: site-packages allows op 'add' only"
                    " (files of other distributions are never replaced)"
                )
            tpath = normalize_site_path(entry.get("path"), package=package, where=fwhere)
            default_source = f"{SITE_SOURCE_DIR}/{tpath}"
        else:
            tpath = normalize_target_path(entry.get("path"), where=fwhere)
            default_source = f"files/{tpath}"
        key = make_key(root, tpath)
        if key in seen:
            raise BundleError(f"{fwhere}: duplicate path {tpath!r} (also files[{seen[key]}])")
        seen[key] = i
        base = entry.get("base_sha256")
        if op == "replace":
            if not isinstance(base, str) or not _SHA_RE.match(base):
                raise BundleError(f"{fwhere}: replace needs base_sha256 (64 lowercase hex digits) of the upstream file")
        elif base is not None:
            raise BundleError(f"{fwhere}: base_sha256 is only meaningful for op 'replace'")
        source_rel = entry.get("source", default_source)
        if not isinstance(source_rel, str) or not source_rel or source_rel.startswith("/"):
            raise BundleError(f"{fwhere}: source must be a path relative to the bundle directory")
        src = _source_file(bundle_dir, source_rel, where=fwhere)
        content = src.read_bytes()
        files.append(
            FileOp(op=op, path=key, content=content, sha256=sha256_bytes(content), base_sha256=base, source=str(src))
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
        "files": [
            {"op": f.op, "path": f.path, "base_sha256": f.base_sha256} for f in sorted(files, key=lambda f: f.path)
        ],
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
