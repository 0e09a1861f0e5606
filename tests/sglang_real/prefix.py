"""Python prefixes for deploy tests against the real SGLang 0.5.23 on CPU.

A deploy writes into SGLang's site-packages, so tests must not deploy into the shared
venv that ``setup_env.py`` builds. A prefix is a small venv of its own whose
site-packages holds the real SGLang 0.5.23 package (installed from the wheel without
its dependencies, so a deploy has a real, private package directory to patch) and a
``.pth`` that appends the shared venv's site-packages: torch, SGLang's dependencies and
the test-only stand-in plugin import from there. The prefix's own site-packages comes
first on ``sys.path``, so ``import sglang`` and ``importlib.metadata`` find its copy of
SGLang (and whatever a deploy adds beside it).

The template (venv + SGLang, ~130 MB) is built once per wheel and shared venv under
``.cache/sglang-cpu/``; each test copies it.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

from fleetlib import cached_dir

from .setup_env import CACHE, VENV, WHEELS, venv_python

TEMPLATES = CACHE / "prefixes"
# Bumped when the template's contents change (2: byte-compiled).
LAYOUT = 2


def _purelib(python: Path) -> str:
    return subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()


def _wheel() -> Path:
    found = sorted(WHEELS.glob("sglang-0.5.23-*.whl"))
    if not found:
        raise RuntimeError(f"no sglang 0.5.23 wheel in {WHEELS}: run `python3 tests/sglang_real/setup_env.py`")
    return found[-1]


def template() -> Path:
    """The prefix template for the current wheel and shared venv (built on first use)."""
    wheel = _wheel()
    key = hashlib.sha256(f"{wheel.name}\0{VENV.resolve()}\0{LAYOUT}".encode()).hexdigest()[:12]
    return cached_dir(TEMPLATES, key, lambda dest: _build_template(dest, wheel))


def _build_template(dest: Path, wheel: Path) -> None:
    shared = venv_python()
    # The shared venv's interpreter makes the venv, so both share one base Python.
    subprocess.run([str(shared), "-m", "venv", "--without-pip", str(dest)], check=True)
    python = dest / "bin" / "python"
    subprocess.run(
        # Byte-compiled here, once: the servers tests launch from copies run with
        # PYTHONDONTWRITEBYTECODE where the machine sets it, and would otherwise compile
        # SGLang's sources on every start (measured: 45-49 s to launch, 31-36 s compiled).
        [str(shared), "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--disable-pip-version-check", "--no-index", str(wheel)],
        check=True,
    )
    site = Path(_purelib(python))
    (site / "sglang_cpu_shared.pth").write_text(f"import site; site.addsitedir({_purelib(shared)!r})\n")


def make_prefix(dest: Path) -> Path:
    """A fresh copy of the template at ``dest``; returns its python."""
    shutil.copytree(template(), dest, symlinks=True, ignore=shutil.ignore_patterns(".ready"))
    return dest / "bin" / "python"
