#!/usr/bin/env python3
"""Build .cache/sglang-cpu/: a venv that runs the REAL SGLang 0.5.23 server on CPU, for tests.

Usage: python3 tests/sglang_real/setup_env.py [--force]    (any python3 >= 3.10, stdlib only)

What it builds, all under <checkout>/.cache/ (gitignored):

  .cache/sglang-cpu/venv/           the venv (made with the python that runs this script)
      torch==2.14.1 + torchvision==0.29.1   first, alone (nothing else may pull another torch)
      requirements-cpu.txt (the rest)        exact pins; the file also constrains both calls
      sglang 0.5.23                          --no-deps, from .cache/wheels (downloaded if absent)
      sglang-kernel 0.4.10                   --no-deps, from .cache/wheels (downloaded if absent)
      sglang-cpu-standins                    tests/sglang_real/standins (test-only plugin)
  .cache/sglang-cpu/stub/libcuda.so.1   a stub driver library so that the CUDA-only sgl_kernel
                                        imports (built from libcuda_stub.c with the C compiler)
  .cache/sglang-cpu/stamp.json          hashes of what the build came from

Reruns are instant while the stamp matches. A change of requirements-cpu.txt, this script or
the stub source rebuilds the venv from scratch; a change of the stand-ins only reinstalls them.
Nothing outside the checkout is read or written apart from what pip itself uses (its index
configuration and cache); HOME and /tmp may be empty.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CACHE = ROOT / ".cache" / "sglang-cpu"
VENV = CACHE / "venv"
STUB_DIR = CACHE / "stub"
STAMP = CACHE / "stamp.json"
WHEELS = ROOT / ".cache" / "wheels"
PIP_CACHE = ROOT / ".cache" / "pip"
TMP = CACHE / "tmp"

REQUIREMENTS = HERE / "requirements-cpu.txt"
STUB_SOURCE = HERE / "libcuda_stub.c"
STANDINS = HERE / "standins"

SGLANG_VERSION = "0.5.23"
SGL_KERNEL_VERSION = "0.4.10"
# The first requirements lines that are installed alone, before everything else.
FIRST = ("torch", "torchvision")


def venv_python() -> Path:
    return VENV / "bin" / "python"


def _files_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p.relative_to(HERE)).encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


def standin_files() -> list[Path]:
    return [
        p
        for p in STANDINS.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p) and "build" not in p.parts
    ]


def digests() -> dict[str, str]:
    """``deps``: what the venv's packages come from; ``standins``: the plugin's sources."""
    return {
        "deps": _files_digest([REQUIREMENTS, Path(__file__).resolve(), STUB_SOURCE]),
        "standins": _files_digest(standin_files()),
        "python": sys.version.split()[0],
    }


def read_requirements() -> tuple[list[str], list[str]]:
    """(first, rest): torch/torchvision pins, then every other pin, in file order."""
    first: list[str] = []
    rest: list[str] = []
    for raw in REQUIREMENTS.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name = line.split("=", 1)[0].split("<", 1)[0].split(">", 1)[0].strip().lower()
        (first if name in FIRST else rest).append(line)
    if sorted(n.split("==")[0].lower() for n in first) != sorted(FIRST):
        raise SystemExit(f"{REQUIREMENTS}: needs exact pins for {', '.join(FIRST)}")
    return first, rest


class Steps:
    """Runs and times named steps; prints one line per step."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def step(self, name: str):
        print(f"[setup_env] {name} ...", flush=True)
        t = time.monotonic()
        yield
        dt = time.monotonic() - t
        self.times[name] = dt
        print(f"[setup_env] {name}: {dt:.1f}s", flush=True)

    def total(self) -> float:
        return time.monotonic() - self.t0


def build_env() -> dict[str, str]:
    """The environment of every build command: pip's cache and temp files stay in .cache.

    Unpacking torch needs several GB of temporary space, which must not land in a tmpfs
    /tmp; and a cache under HOME would be read from outside the checkout.
    """
    TMP.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(TMPDIR=str(TMP), PIP_CACHE_DIR=str(PIP_CACHE), PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def run(cmd: list[str | Path], **kw) -> None:
    cmd = [str(c) for c in cmd]
    kw.setdefault("env", build_env())
    subprocess.run(cmd, check=True, **kw)


def pip(*args: str | Path) -> None:
    # --no-input: never wait for a prompt.
    run([venv_python(), "-m", "pip", "--no-input", *args])


def find_or_download(pattern: str, requirement: str) -> Path:
    """A wheel in .cache/wheels matching ``pattern`` that this venv can install; else download it."""
    WHEELS.mkdir(parents=True, exist_ok=True)
    tags = subprocess.run(
        [venv_python(), "-c", "from packaging import tags; print('\\n'.join(str(t) for t in tags.sys_tags()))"],
        capture_output=True, text=True, env=build_env(), check=False,
    )
    supported = set(tags.stdout.split()) if tags.returncode == 0 else None

    def usable(whl: Path) -> bool:
        if supported is None:
            return True
        # name-version(-build)?-pytag-abitag-plattag.whl; compressed tag sets use '.'
        parts = whl.name[: -len(".whl")].split("-")
        pys, abis, plats = parts[-3].split("."), parts[-2].split("."), parts[-1].split(".")
        return any(f"{p}-{a}-{pl}" in supported for p in pys for a in abis for pl in plats)

    found = [w for w in sorted(WHEELS.glob(pattern)) if usable(w)]
    if not found:
        pip("download", "-q", "--no-deps", requirement, "-d", WHEELS)
        found = [w for w in sorted(WHEELS.glob(pattern)) if usable(w)]
    if not found:
        raise SystemExit(f"no installable {pattern} in {WHEELS} after downloading {requirement}")
    return found[-1]


def find_cc() -> str:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return cand
    raise SystemExit(
        "setup_env: no C compiler (cc/gcc/clang) to build the libcuda stub; "
        "install one, e.g. `apt-get install -y gcc`"
    )


def build_stub() -> None:
    STUB_DIR.mkdir(parents=True, exist_ok=True)
    out = STUB_DIR / "libcuda.so.1"
    tmp = STUB_DIR / "libcuda.so.1.tmp"
    run([find_cc(), "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", tmp, STUB_SOURCE])
    tmp.replace(out)
    link = STUB_DIR / "libcuda.so"
    if not link.is_symlink():
        link.unlink(missing_ok=True)
        link.symlink_to("libcuda.so.1")


def build_venv(steps: Steps) -> None:
    first, rest = read_requirements()
    if VENV.exists():
        with steps.step("remove old venv"):
            shutil.rmtree(VENV)
    with steps.step("create venv"):
        run([sys.executable, "-m", "venv", VENV])
    # The whole file doubles as the constraints of both calls: torch's own dependencies get
    # the locked versions in the first call, and nothing can move torch in the second.
    with steps.step(f"pip install {' '.join(first)}"):
        pip("install", "-q", "-c", REQUIREMENTS, *first)
    with steps.step(f"pip install -r requirements-cpu.txt ({len(rest)} more pins)"):
        pip("install", "-q", "-r", REQUIREMENTS)
    with steps.step(f"sglang {SGLANG_VERSION} (--no-deps)"):
        wheel = find_or_download(f"sglang-{SGLANG_VERSION}-*.whl", f"sglang=={SGLANG_VERSION}")
        pip("install", "-q", "--no-deps", wheel)
    with steps.step(f"sglang-kernel {SGL_KERNEL_VERSION} (--no-deps)"):
        wheel = find_or_download(f"sglang_kernel-{SGL_KERNEL_VERSION}-*.whl", f"sglang-kernel=={SGL_KERNEL_VERSION}")
        pip("install", "-q", "--no-deps", wheel)
    with steps.step("libcuda stub"):
        build_stub()


def install_standins(steps: Steps) -> None:
    with steps.step("stand-in plugin"):
        # A copy, so that the build files pip makes never land in the source tree.
        src = CACHE / "standins-src"
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(STANDINS, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
        has_setuptools = subprocess.run(
            [venv_python(), "-c", "import setuptools"], capture_output=True, env=build_env(), check=False
        ).returncode == 0
        isolation = ["--no-build-isolation"] if has_setuptools else []  # else pip fetches setuptools
        pip("install", "-q", "--no-deps", "--force-reinstall", *isolation, src)
        shutil.rmtree(src, ignore_errors=True)
        # Every interpreter of this venv (and of the prefixes that add its site-packages)
        # imports the coverage starter, a no-op unless DDTREE_COVERAGE_RC is set.
        site = subprocess.run(
            [venv_python(), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True, text=True, env=build_env(), check=True,
        ).stdout.strip()
        Path(site, "sglang_cpu_coverage.pth").write_text("import sglang_cpu_standins.coverage_startup\n")


def check(steps: Steps) -> None:
    with steps.step("import check"):
        code = (
            "import torch, sglang, sgl_kernel, importlib.metadata as md;"
            "eps = [e.name for e in md.entry_points(group='sglang.srt.plugins')];"
            "assert 'cpu_standins' in eps, eps;"
            "print('torch', torch.__version__, 'sglang', sglang.__version__, 'plugins', eps)"
        )
        from serverenv import server_env  # noqa: PLC0415  (beside this script; stdlib only)

        run([venv_python(), "-c", code], env=dict(build_env(), **server_env()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="rebuild the venv even if the stamp matches")
    args = ap.parse_args(argv)
    if sys.version_info < (3, 10):  # noqa: UP036  (run by whatever python3 the machine has)
        raise SystemExit("setup_env.py needs python3 >= 3.10")

    CACHE.mkdir(parents=True, exist_ok=True)
    steps = Steps()
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test sessions must not build at once
        want = digests()
        have = json.loads(STAMP.read_text()) if STAMP.exists() else {}
        if have == want and not args.force and venv_python().exists():
            print(f"[setup_env] {CACHE.relative_to(ROOT)} is up to date ({steps.total():.2f}s)")
            return 0
        STAMP.unlink(missing_ok=True)
        if args.force or have.get("deps") != want["deps"] or have.get("python") != want["python"] \
                or not venv_python().exists():
            build_venv(steps)
        install_standins(steps)
        check(steps)
        shutil.rmtree(TMP, ignore_errors=True)
        STAMP.write_text(json.dumps(want, indent=1) + "\n")
    print(f"[setup_env] done in {steps.total():.1f}s: {VENV.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
