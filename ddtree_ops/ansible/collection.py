"""The ddtree.ops collection's files, and its tarball as ``ansible-galaxy`` builds it.

In a checkout the collection is ``ansible_collections/ddtree/ops/``; a wheel carries the same
files as ``ddtree_ops._shipped.ansible_collection`` (``pyproject.toml``), so that an installed
ddtree-ops builds the collection of its own release (``ddtree-ops ansible-collection build``),
whose plugins then call that release.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ddtree_ops import __version__
from ddtree_ops.errors import ConfigError, DdtreeOpsError
from ddtree_ops.shipped import REPO_ROOT

NAMESPACE, NAME = "ddtree", "ops"


def collection_source() -> Path:
    """The collection's directory: the installed copy when the package carries one, else the checkout's."""
    try:
        spec = importlib.util.find_spec("ddtree_ops._shipped.ansible_collection")
    except ModuleNotFoundError:  # a checkout or an editable install: no _shipped package
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return REPO_ROOT / "ansible_collections" / NAMESPACE / NAME


def ansible_galaxy() -> str:
    """``ansible-galaxy`` beside this interpreter (a venv's), else on PATH; ConfigError without one."""
    beside = Path(sys.executable).parent / "ansible-galaxy"
    found = str(beside) if beside.exists() else shutil.which("ansible-galaxy")
    if found is None:
        raise ConfigError("ansible-galaxy not found (it comes with ansible-core: pip install ansible-core)")
    return found


@dataclass(frozen=True)
class BuiltCollection:
    name: str
    version: str
    tarball: Path
    source: Path


def build_collection(directory: Path) -> BuiltCollection:
    """``ansible-galaxy collection build`` of the collection into ``directory`` (made if
    missing; a tarball of the same version there is replaced)."""
    source = collection_source()
    if not (source / "galaxy.yml").is_file():
        raise ConfigError(f"{source}: the ddtree.ops collection is not there (no galaxy.yml)")
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{directory}: not a directory")
    directory.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run([ansible_galaxy(), "collection", "build", str(source), "--output-path", str(directory),
                               "--force"], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise DdtreeOpsError("ansible-galaxy collection build did not finish within 300 s") from None
    tarball = directory / f"{NAMESPACE}-{NAME}-{__version__}.tar.gz"
    if proc.returncode != 0 or not tarball.is_file():
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise DdtreeOpsError(f"ansible-galaxy collection build failed (exit {proc.returncode}): {tail}")
    return BuiltCollection(f"{NAMESPACE}.{NAME}", __version__, tarball, source)


__all__ = ["BuiltCollection", "build_collection", "collection_source"]
