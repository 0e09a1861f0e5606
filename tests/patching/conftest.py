"""Fixtures for the patch engine: a real Python prefix per test holding a small SGLang 0.5.23.

Each test gets its own venv (made in ~0.1 s, no pip) whose site-packages holds the real
0.5.23 files the test bundles touch plus the dist-info, so that ``find_spec`` and
``importlib.metadata`` answer on the host exactly as they do on a full install, and the
state directory ``<prefix>/.ddtree-ops`` is private to the test.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddtree_ops.inventory_types import DdtreeSettings, Host

SGLANG_SRC = Path("/tmp/sglang-src")
BUNDLES = Path(__file__).parent / "bundles"
# The real 0.5.23 files the test bundles replace, copied into every test prefix.
REAL_FILES = ("srt/speculative/dflash_worker_v2.py", "srt/speculative/dflash_info.py", "srt/speculative/spec_info.py")


def _sglang_source() -> tuple[Path, Path]:
    """The unpacked 0.5.23 package and its dist-info (unpacked from the cached wheel if needed)."""
    if (SGLANG_SRC / "sglang").is_dir():
        return SGLANG_SRC / "sglang", next(SGLANG_SRC.glob("sglang-0.5.23.dist-info"))
    raise RuntimeError("the SGLang 0.5.23 sources are needed at /tmp/sglang-src (unzip the wheel there)")


@dataclass(frozen=True)
class MiniHost:
    host: Host
    prefix: Path
    pkg: Path

    @property
    def state_dir(self) -> Path:
        return self.prefix / ".ddtree-ops"

    def file(self, rel: str) -> Path:
        return self.pkg / rel


def make_prefix(root: Path, version: str = "0.5.23") -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    purelib = Path(
        sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)})
    )
    src, dist = _sglang_source()
    pkg = purelib / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""SGLang (test copy: only the files the patch engine touches)."""\n')
    for rel in REAL_FILES:
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, pkg / rel)
    d = purelib / f"sglang-{version}.dist-info"
    d.mkdir()
    meta = (dist / "METADATA").read_text().replace("Version: 0.5.23", f"Version: {version}", 1)
    (d / "METADATA").write_text(meta)
    return root


@pytest.fixture
def mini(tmp_path: Path) -> MiniHost:
    prefix = make_prefix(tmp_path / "prefix")
    py = prefix / "bin" / "python"
    pkg = Path(sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)})) / "sglang"
    host = Host(name="mini", connection="local", ddtree=DdtreeSettings(python=str(py)), source="<test>")
    return MiniHost(host=host, prefix=prefix, pkg=pkg)
