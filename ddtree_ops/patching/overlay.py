"""Overlay mode: copy a local working directory over a package subdirectory.

``ddtree-ops deploy HOSTS --from ./my_sglang/speculative --to srt/speculative`` is what
people do by hand with scp; here it becomes an ad-hoc bundle with the same guarantees.
Whether a file is an ``add`` or a ``replace`` depends on the host, so the bundle is
derived per host from the gathered state: a ``replace`` whose base is "whatever the host
has now" (``base_sha256`` None), recorded as the original on first apply. Later overlays
supersede earlier ones; ``rollback`` restores the originals.

The identity covers paths and contents only, so every host reports the same identity for
the same working files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ddtree_ops.errors import BundleError
from ddtree_ops.patching.bundle import Bundle, FileOp, normalize_target_path, sha256_bytes, synthetic_bundle
from ddtree_ops.patching.gather import RemoteState

# Build products and editor litter are never part of an overlay.
_SKIP_DIRS = {"__pycache__", ".git", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo", ".swp", "~")


@dataclass(frozen=True)
class Overlay:
    source_dir: Path
    target_dir: str
    files: tuple[FileOp, ...]
    package: str = "sglang"

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.files]

    def bundle_for(self, rs: RemoteState) -> Bundle:
        """The ad-hoc bundle for one host; its identity does not depend on the host."""
        return synthetic_bundle(
            name=f"overlay:{self.target_dir}",
            version="0",
            package=self.package,
            versions=(),
            files=self.files,
            description=f"overlay of {self.source_dir} onto {self.package}/{self.target_dir}",
            origin=str(self.source_dir),
        )

    @property
    def factory(self) -> Callable[[RemoteState], Bundle]:
        return self.bundle_for


def load_overlay(source: Path | str, target: str, *, package: str = "sglang") -> Overlay:
    """Collect the files under ``source`` as package paths under ``target``."""
    src = Path(source)
    if not src.is_dir():
        raise BundleError(f"--from {src}: not a directory")
    tdir = normalize_target_path(target, where="--to")
    root = src.resolve()
    files: list[FileOp] = []
    for p in sorted(src.rglob("*")):
        rel_parts = p.relative_to(src).parts
        if any(part in _SKIP_DIRS or part.startswith(".") for part in rel_parts) or p.name.endswith(_SKIP_SUFFIXES):
            continue
        if p.is_dir():
            continue
        resolved = p.resolve()
        if root not in resolved.parents:
            raise BundleError(f"--from {src}: {p} is a symlink leading outside the directory ({resolved})")
        rel = "/".join(rel_parts)
        path = normalize_target_path(f"{tdir}/{rel}", where=f"--from {src}")
        content = resolved.read_bytes()
        files.append(FileOp(op="replace", path=path, content=content, sha256=sha256_bytes(content), base_sha256=None,
                            source=str(p)))
    if not files:
        raise BundleError(f"--from {src}: no files to deploy")
    return Overlay(source_dir=src, target_dir=tdir, files=tuple(files), package=package)
