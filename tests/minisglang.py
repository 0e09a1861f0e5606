"""A small real SGLang 0.5.23 install for tests: a venv holding the wheel's own copies of
the files the patch engine touches plus the dist-info, so that ``find_spec`` and
``importlib.metadata`` answer on such a host exactly as on a full install (made in ~0.1 s,
no pip). ``deployed_python`` is one with the shipped DDTree bundle deployed into it by the
toolkit's own deploy: the interpreter simulator hosts launch with, since the simulator
serves DDTREE only from the plugin deployed on its host (``ddtree_ops/sim/plugin.py``).

The files are read straight out of the SGLang wheel that ``make test`` / ``.ci/run``
download into ``.cache/wheels`` (``fleetlib.find_wheel`` fetches it if it is missing).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

from fleetlib import SGLANG_VERSION, TOOLKIT_PTH, find_wheel

from ddtree_ops.inventory_types import DdtreeSettings, Host

# The real 0.5.23 files the test bundles replace, copied into every test prefix.
REAL_FILES = ("srt/speculative/dflash_worker_v2.py", "srt/speculative/dflash_info.py", "srt/speculative/spec_info.py")


@functools.cache
def upstream_bytes(rel: str) -> bytes:
    """The 0.5.23 wheel's copy of ``sglang/<rel>``, or of its ``METADATA`` for ``"METADATA"``."""
    member = f"sglang-{SGLANG_VERSION}.dist-info/METADATA" if rel == "METADATA" else f"sglang/{rel}"
    with zipfile.ZipFile(find_wheel()) as zf:
        return zf.read(member)


def purelib(prefix: Path) -> Path:
    return Path(sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)}))


def make_prefix(root: Path, version: str = "0.5.23") -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    pkg = purelib(root) / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""SGLang (test copy: only the files the patch engine touches)."""\n')
    for rel in REAL_FILES:
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_bytes(upstream_bytes(rel))
    d = purelib(root) / f"sglang-{version}.dist-info"
    d.mkdir()
    meta = upstream_bytes("METADATA").decode().replace("Version: 0.5.23", f"Version: {version}", 1)
    (d / "METADATA").write_text(meta)
    return root


def expose_toolkit(prefix: Path) -> None:
    """The prefix's interpreter finds this project's venv (ddtree_ops, torch), as the demo
    hosts' do: a host's ``python -m ddtree_ops.sim`` must import there."""
    (purelib(prefix) / "ddtree_ops_dev.pth").write_text(TOOLKIT_PTH)


def deploy_bundle(prefix: Path, name: str = "deployed") -> None:
    """The shipped bundle deployed into ``prefix`` by the toolkit (a local host)."""
    from ddtree_ops.patching.bundle import load_bundle
    from ddtree_ops.patching.executor import deploy
    from ddtree_ops.shipped import DEFAULT_BUNDLE
    from ddtree_ops.transport.local import LocalTransport

    host = Host(name=name, connection="local", ddtree=DdtreeSettings(python=str(prefix / "bin" / "python")),
                source="<test>")
    deploy(LocalTransport(name), host, load_bundle(DEFAULT_BUNDLE))


@functools.cache
def deployed_python() -> str:
    """One interpreter per test process whose SGLang has the DDTree bundle deployed (the
    toolkit's deploy, with its verify steps), shared by every simulator host that does not
    test deploying itself; removed when the process ends."""
    root = Path(tempfile.mkdtemp(prefix="ddtree-ops-deployed-"))
    atexit.register(shutil.rmtree, root, True)
    prefix = make_prefix(root / "prefix")
    expose_toolkit(prefix)
    deploy_bundle(prefix)
    return str(prefix / "bin" / "python")
