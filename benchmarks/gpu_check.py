"""The one-call GPU check of what the CPU suite can only stand in for.

The real-server tests run every branch a GPU host takes, with one thing replaced: SGLang's
CUDA op ``tree_speculative_sampling_target_only`` by its pure-torch twin
(``ddtree_reference.reference_tree_speculative_sampling``). That rests on the twin matching
the op, which only a GPU can show. On a lent GPU machine (no SGLang, no network) one call
runs these phases, in this order, each written to ``--out`` as soon as it ends:

``kernel_load``
   the kernel library: the one ``prepare`` built here when it is compatible with the
   device (same wrapper source, driver at least the CUDA version it was built with, a
   compute capability of 9.0 or more, a zero-request launch that returns no CUDA error),
   else rebuilt with the device's nvcc, else the kernel phases are skipped, saying why.
``kernel_thresholds``
   the 0.5.23 kernel against the twin with ``threshold_single`` / ``threshold_acc`` below 1
   (the ``--speculative-accept-threshold-single/-acc`` flags that the bundle passes through
   to the op), and at 1 / 1 beside them.
``kernel``
   the kernel, built from the SGLang wheel's own source
   (``kernels/jit/include/sgl_kernel/speculative/sampling.cuh`` with FlashInfer 0.7.2's
   sampling headers, launched as ``kernels/jit/csrc/speculative/sampling.cuh`` launches it:
   ``benchmarks/gpu_check_kernel.cu``) against the twin on identical coins, over random
   trees (the bundle's ``build_tree_batch``), target laws (temperature, top-k, top-p,
   min-p) and batch sizes: accepted paths, accept counts and emitted tokens must be
   identical. The one tolerated difference is a bonus token whose coin lies within float32
   rounding of a CDF boundary (the kernel sums in block-reduction order), counted apart.
``kernel_past_2_32``
   the tree kernel's probability offset is ``uint32`` (``bx * num_draft_tokens * d``), so a
   batch with batch x width x vocab >= 2^32 reads other requests' probabilities. One batch
   past it (440 requests x width 65 x vocab 151,936: two fp32 [bs, N, V] tensors, ~35 GB,
   skipped where the device has less free): the kernel called as the bundle calls it
   (``ddtree_utils.sample_tree_in_row_chunks``, rows per call under 2^32) must equal the
   twin request for request, and the kernel called once on the whole batch must differ,
   and only in the requests whose offsets pass 2^32 (proof the case reaches the wrap).
   With ``--cpu-twin`` the transcribed kernel wraps its offsets at a lowered limit instead.
``candidate_head``
   the Triton candidate top-k + log-sum-exp (``lilicorr_topk_lse``,
   ``kernels/ops/speculative/lilicorr.py`` from the wheel) on CUDA against its own torch
   path: identical ids and values, log-sum-exp within 1e-4.
``verify_round``
   ``benchmarks/verify_round.py --device cuda`` at batch 32, budgets 16 and 64 (timings,
   no pass/fail).

The thresholds, as SGLang 0.5.23 applies them (the wheel's
``sglang/kernels/jit/csrc/speculative/sampling.cuh``, lines 76-77 and 109-110: both in
[0, 1], cast to float32, ``threshold_acc`` floored at 1e-9; and
``sglang/kernels/jit/include/sgl_kernel/speculative/sampling.cuh``, the walk: a child is
accepted when ``target_prob_single > 0 && (coin < prob_acc / threshold_acc ||
target_prob_single >= threshold_single)``, ``prob_acc`` the float32 running sum of the
siblings' target probabilities tried so far at that depth). :func:`transcribed_kernel` is
that walk line for line, one request at a time in float32; ``run --cpu-twin`` checks the
twin against it on this machine, thresholds below 1 included.

Usage::

    .venv/bin/python benchmarks/gpu_check.py prepare [--json]    # here: .cache/gpu_check, the carry set
    .venv/bin/python benchmarks/gpu_check.py run --cpu-twin --quick   # here: twin vs transcribed kernel
    python3 benchmarks/gpu_check.py run --out "$OUT" --budget-s 300 --trials 1   # on the GPU machine

``prepare`` extracts the sources from the cached wheels (``.cache/wheels``; the FlashInfer
wheel is downloaded there once) into ``.cache/gpu_check`` -- never into the repository --
copies cuRAND's headers there (FlashInfer's ``sampling.cuh`` includes ``curand.h``, which
this machine's toolkit lacks: they come from the real-SGLang venv's nvidia wheels), and
builds the kernel library with nvcc for sm_90 (+ compute_90 PTX) when nvcc is here. It
prints the carry set's size with the working tree that travels beside it, and with
``--json`` the carry paths and the exact device command (:func:`device_call`).

``run`` appends one JSON line per phase to ``--out``/gpu_check.jsonl as the phase ends (a
run cut short keeps what finished), then writes the whole report to
``--out``/gpu_check.json and prints it. ``--budget-s`` skips a phase whose estimated cost
does not fit in the time left (the estimate is written with it) and stops a kernel phase
between cases when its measured pace says the rest would not fit. Exit status: 0 every
phase passed, 1 a phase failed, 2 none failed but some were skipped or cut short.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / ".cache" / "wheels"
CARRY = REPO / ".cache" / "gpu_check"
LIB = CARRY / "libddtree_tree_sampling.so"
CUDA_EXTRA = CARRY / "cuda_include"  # cuRAND's headers, for a device toolkit without them
WRAPPER = Path(__file__).resolve().with_name("gpu_check_kernel.cu")
SGLANG_WHEEL = "sglang-0.5.23-*.whl"
FLASHINFER = ("flashinfer_python", "0.7.2")
# What the check reads from the SGLang wheel (path in the wheel -> path under CARRY).
SGLANG_FILES = {
    "sglang/kernels/jit/include/sgl_kernel/speculative/sampling.cuh": "include/sgl_kernel/speculative/sampling.cuh",
    "sglang/kernels/jit/csrc/speculative/sampling.cuh": "src/csrc_speculative_sampling.cuh",
    "sglang/kernels/ops/speculative/sampling.py": "src/ops_speculative_sampling.py",
    "sglang/kernels/ops/speculative/lilicorr.py": "py/sglang/kernels/ops/speculative/lilicorr.py",
    "sglang/kernels/ops/speculative/dflash.py": "py/sglang/kernels/ops/speculative/dflash.py",
}
# lilicorr.py imports only torch, triton and dflash.py (itself torch + triton): empty
# package files stand for SGLang's, whose __init__ imports the whole server.
PACKAGE_INITS = ("sglang", "sglang/kernels", "sglang/kernels/ops", "sglang/kernels/ops/speculative")
ARCH = ["-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90"]
MIN_CAPABILITY = (9, 0)  # sm_90 machine code, compute_90 PTX for newer chips
CARRY_LIMIT = 64 * 2**20  # what travels to the device: working tree + carried paths
# The one device call (README.md, "GPU check"): the budget leaves the machine's start and a
# rerun inside the session's 15 minutes of device time.
DEVICE_BUDGET_S = 300
DEVICE_TIMEOUT_S = 360
DEVICE_COMMAND = f'python3 benchmarks/gpu_check.py run --out "$OUT" --budget-s {DEVICE_BUDGET_S} --trials 1'
# (threshold_single, threshold_acc) of the threshold phase; 1 / 1 is SGLang's default.
THRESHOLDS = ((0.5, 0.3), (0.3, 1.0), (1.0, 0.5), (0.0, 1.0), (1.0, 0.0), (1.0, 1.0))
PHASES = ("kernel_load", "kernel_thresholds", "kernel", "kernel_past_2_32", "candidate_head", "verify_round")
# kernel_past_2_32: (batch, budget, vocab, offset limit) on a GPU (the kernel's own uint32
# wrap: 440 x 65 x 151,936 = 4.35e9 > 2^32) and with --cpu-twin (the transcribed kernel
# wrapping at a lowered limit: rows 3.. of 6 reach it).
WIDE_GPU = (440, 64, 151936, 2**32)
WIDE_CPU = (6, 16, 1001, 3 * 17 * 1001 + 500)


def device_call() -> dict[str, Any]:
    """The device tool's arguments for the one GPU call."""
    return {"command": DEVICE_COMMAND, "carry": [str(CARRY.relative_to(REPO))], "timeout_s": DEVICE_TIMEOUT_S}


# ----------------------------------------------------------------------------- prepare


def _wheel(pattern: str, requirement: str | None = None) -> Path:
    found = sorted(WHEELS.glob(pattern))
    if not found and requirement:
        WHEELS.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", requirement, "-d", str(WHEELS)],
                       check=True)
        found = sorted(WHEELS.glob(pattern))
    if not found:
        raise SystemExit(f"gpu_check: no {pattern} in {WHEELS} (run `make venv` first)")
    return found[-1]


def _toolkit_include() -> Path | None:
    nvcc = shutil.which("nvcc")
    return Path(nvcc).resolve().parent.parent / "include" if nvcc else None


def _curand_source() -> Path | None:
    """A folder with curand.h: the toolkit's, else the real-SGLang venv's nvidia wheels."""
    dirs = [d for d in [_toolkit_include()] if d is not None]
    for site in sorted((REPO / ".cache" / "sglang-cpu" / "venv" / "lib").glob("python*/site-packages")):
        dirs.extend(sorted(site.glob("nvidia/cu*/include")))
        dirs.extend(sorted(site.glob("nvidia/curand/include")))
    return next((d for d in dirs if (d / "curand.h").is_file()), None)


def nvcc_version() -> str | None:
    """``13.0`` from ``nvcc --version``, or None without nvcc."""
    if not shutil.which("nvcc"):
        return None
    proc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, check=False)
    m = re.search(r"release (\d+\.\d+)", proc.stdout)
    return m.group(1) if m else None


def _cuda_int(version: str) -> int:
    major, minor = (int(x) for x in version.split(".")[:2])
    return major * 1000 + minor * 10


def build(out: Path, include: Path) -> list[str]:
    """nvcc the wrapper into ``out``; returns the command (raises CalledProcessError).
    cuRAND comes from the toolkit when it has it, else from the carried copy."""
    cmd = ["nvcc", "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static", *ARCH,
           "-I", str(include)]
    toolkit = _toolkit_include()
    if not (toolkit and (toolkit / "curand.h").is_file()) and CUDA_EXTRA.is_dir():
        cmd += ["-I", str(CUDA_EXTRA)]
    cmd += ["-o", str(out), str(WRAPPER)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return cmd


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree_bytes() -> int:
    """What travels beside the carry: tracked and untracked-not-ignored files."""
    proc = subprocess.run(["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=REPO,
                          capture_output=True, check=False)
    total = 0
    for name in proc.stdout.decode(errors="replace").split("\0"):
        p = REPO / name
        if name and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def carry_size() -> dict[str, Any]:
    carry = sum(p.stat().st_size for p in CARRY.rglob("*") if p.is_file()) if CARRY.is_dir() else 0
    tree = _tree_bytes()
    return {"carry_bytes": carry, "tree_bytes": tree, "total_bytes": carry + tree, "limit_bytes": CARRY_LIMIT,
            "fits": carry + tree < CARRY_LIMIT}


def prepare(args: argparse.Namespace) -> int:
    sglang = _wheel(SGLANG_WHEEL)
    flashinfer = _wheel(f"{FLASHINFER[0]}-{FLASHINFER[1]}-*.whl", f"{FLASHINFER[0]}=={FLASHINFER[1]}")
    shutil.rmtree(CARRY, ignore_errors=True)
    files: dict[str, str] = {}
    with zipfile.ZipFile(sglang) as z:
        for name, dest in SGLANG_FILES.items():
            target = CARRY / dest
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(name))
            files[dest] = _sha(target)
    prefix = "flashinfer/data/include/"
    with zipfile.ZipFile(flashinfer) as z:
        for name in z.namelist():
            if name.startswith(prefix) and not name.endswith("/"):
                target = CARRY / "include" / name[len(prefix):]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(name))
    for pkg in PACKAGE_INITS:
        (CARRY / "py" / pkg / "__init__.py").touch()
    curand = _curand_source()
    if curand is not None:
        CUDA_EXTRA.mkdir(parents=True, exist_ok=True)
        for h in sorted(curand.glob("curand*.h")):
            shutil.copy2(h, CUDA_EXTRA / h.name)
    version = nvcc_version()
    manifest: dict[str, Any] = {
        "sglang_wheel": sglang.name, "flashinfer_wheel": flashinfer.name, "files": files,
        "curand_headers": str(curand) if curand else None, "wrapper_sha256": _sha(WRAPPER),
        "nvcc": version, "cuda_version": _cuda_int(version) if version else None, "arch": ARCH,
        "library": None, "library_skipped": None,
    }
    if args.no_build:
        manifest["library_skipped"] = "--no-build"
    elif version is None:
        manifest["library_skipped"] = "no nvcc on this machine: run rebuilds it on the device"
    elif curand is None:
        manifest["library_skipped"] = "no curand.h here (toolkit or .cache/sglang-cpu nvidia wheels)"
    else:
        t0 = time.monotonic()
        try:
            cmd = build(LIB, CARRY / "include")
        except subprocess.CalledProcessError as exc:
            raise SystemExit(f"gpu_check: nvcc failed:\n{exc.stderr[-3000:]}") from None
        manifest["library"] = {"command": " ".join(cmd), "seconds": round(time.monotonic() - t0, 1),
                               "bytes": LIB.stat().st_size, "sha256": _sha(LIB)}
    (CARRY / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = carry_size()
    out = {**device_call(), **size, "library": manifest["library"], "library_skipped": manifest["library_skipped"],
           "nvcc": version}
    if args.json:
        print(json.dumps(out))
    else:
        mib = 2**20
        lib = manifest["library"]
        print(f"carry {out['carry'][0]}: {size['carry_bytes'] / mib:.1f} MiB; working tree "
              f"{size['tree_bytes'] / mib:.1f} MiB; together {size['total_bytes'] / mib:.1f} MiB of "
              f"{CARRY_LIMIT / mib:.0f} MiB")
        skipped = manifest["library_skipped"]
        built = f"built by nvcc {version} in {lib['seconds']} s" if lib else f"not built ({skipped})"
        print(f"kernel library: {built}")
        print(f"device call: run(command={out['command']!r}, carry={out['carry']!r}, timeout_s={out['timeout_s']})")
    if not size["fits"]:
        print(f"gpu_check: what travels is {size['total_bytes']} bytes, over {CARRY_LIMIT}", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- the kernel


def _driver_version() -> int | None:
    """The CUDA driver's version (13000 for 13.0), or None where libcuda does not load."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        out = ctypes.c_int(0)
        return out.value if lib.cuDriverGetVersion(ctypes.byref(out)) == 0 else None
    except (OSError, AttributeError):
        return None


def _bind(path: Path):
    fn = ctypes.CDLL(str(path)).ddtree_tree_sampling
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_int, *[ctypes.c_void_p] * 11, *[ctypes.c_uint32] * 4,
                   ctypes.c_float, ctypes.c_float, ctypes.c_void_p]
    return fn


def _probe(fn, torch) -> int:
    """A zero-request call: the wrapper sets the kernel's shared-memory attribute (which fails
    on a driver or chip the library cannot run on) and launches nothing."""
    rc = 0
    for vec in (1, 2, 4):
        null = [None] * 11
        rc = rc or fn(vec, 1, *null, 0, 1, 1, vec, 1.0, 1.0, torch.cuda.current_stream().cuda_stream)
    return int(rc)


def load_kernel(torch, log: list[str]) -> tuple[Any, str | None]:
    """The C entry point and None, or None and why the kernel phases are skipped: the carried
    library when it is compatible, else one rebuilt here with nvcc."""
    capability = torch.cuda.get_device_capability(0)
    if tuple(capability) < MIN_CAPABILITY:
        return None, f"compute capability {capability} is under {MIN_CAPABILITY} (the library is sm_90 / compute_90)"
    driver = _driver_version()
    log.append(f"driver CUDA version: {driver}")
    try:
        manifest = json.loads((CARRY / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = {}
    reasons = []
    if not LIB.is_file():
        reasons.append(f"no carried library at {LIB.relative_to(REPO)}"
                       + (f" ({manifest['library_skipped']})" if manifest.get("library_skipped") else ""))
    elif manifest.get("wrapper_sha256") != _sha(WRAPPER):
        reasons.append("the carried library was built from another benchmarks/gpu_check_kernel.cu")
    elif driver is not None and manifest.get("cuda_version") and driver < manifest["cuda_version"]:
        reasons.append(f"the driver supports CUDA {driver}, the library was built with {manifest['cuda_version']}")
    else:
        try:
            fn = _bind(LIB)
            rc = _probe(fn, torch)
            if rc == 0:
                log.append(f"kernel library: carried ({LIB.relative_to(REPO)}, nvcc {manifest.get('nvcc')})")
                return fn, None
            reasons.append(f"the carried library's probe launch returned CUDA error {rc}")
        except OSError as exc:
            reasons.append(f"the carried library does not load: {exc}")
    log.extend(reasons)
    version = nvcc_version()
    if version is None:
        return None, "; ".join([*reasons, "no nvcc here to rebuild it"])
    local = Path(os.environ.get("TMPDIR", "/tmp")) / f"libddtree_tree_sampling.{os.getpid()}.so"
    try:
        t0 = time.monotonic()
        build(local, CARRY / "include")
        log.append(f"kernel library: rebuilt with nvcc {version} in {time.monotonic() - t0:.1f} s ({local})")
        fn = _bind(local)
        rc = _probe(fn, torch)
    except subprocess.CalledProcessError as exc:
        return None, "; ".join([*reasons, f"the rebuild failed: {exc.stderr[-1500:]}"])
    except OSError as exc:
        return None, "; ".join([*reasons, f"the rebuilt library does not load: {exc}"])
    if rc != 0:
        return None, "; ".join([*reasons, f"the rebuilt library's probe launch returned CUDA error {rc}"])
    return fn, None


def _kernel_call(fn, torch):
    def call(*, predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
             retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs, draft_probs,
             threshold_single=1.0, threshold_acc=1.0, deterministic=True):
        bs, n = candidates.shape
        vocab = target_probs.shape[-1]
        stream = torch.cuda.current_stream().cuda_stream
        rc = fn(math.gcd(4, vocab), int(deterministic), *(t.data_ptr() for t in (
            predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
            retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs, draft_probs)),
            bs, accept_index.shape[1], n, vocab, threshold_single, threshold_acc, stream)
        if rc != 0:
            raise RuntimeError(f"tree_speculative_sampling_target_only: CUDA error {rc}")
        torch.cuda.synchronize()
    return call


def transcribed_kernel(*, predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                       retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
                       draft_probs, threshold_single=1.0, threshold_acc=1.0, deterministic=True,
                       offset_modulus: int = 2**32) -> None:
    """SGLang 0.5.23's ``TreeSpeculativeSamplingTargetOnly`` (the wheel's
    ``kernels/jit/include/sgl_kernel/speculative/sampling.cuh``) transcribed line for line,
    one request (CUDA block) at a time, in float32 -- the CPU stand-in for the kernel that
    ``run --cpu-twin`` checks the twin against. The thresholds are cast as the launcher
    (``kernels/jit/csrc/speculative/sampling.cuh``) casts them. The bonus draw scans the
    CDF sequentially where the kernel scans it by blocks, so a coin within float32 rounding
    of a CDF boundary may pick a neighbour (the harness counts that apart). The probability
    offset is the kernel's ``uint32``: it wraps at ``offset_modulus`` (2^32; lowered, the
    ``kernel_past_2_32`` phase's CPU stand-in for a batch past it)."""
    import numpy as np

    del deterministic
    f32 = np.float32
    bs, n = candidates.shape
    steps, d = accept_index.shape[1], target_probs.shape[-1]
    # static_cast<float>(threshold_single), std::max(static_cast<float>(threshold_acc), 1e-9f)
    t_single, t_acc = f32(threshold_single), max(f32(threshold_acc), f32(1e-9))
    cand, ri, nt, ns = (t.reshape(-1).numpy() for t in (candidates, retrive_index, retrive_next_token,
                                                          retrive_next_sibling))
    us, uf = uniform_samples.reshape(-1).numpy(), uniform_samples_for_final_sampling.numpy()
    tp, dp = target_probs.reshape(-1).numpy(), draft_probs.view(-1).numpy()  # dp: written in place
    pred, acc, num = predicts.numpy(), accept_index.view(-1).numpy(), accept_token_num.numpy()
    for bx in range(bs):
        prob_acc = f32(0.0)
        off = (bx * n * d) % offset_modulus  # uint32 cur_prob_offset
        coin = us[bx * n]
        last = int(ri[bx * n])
        acc[bx * steps] = last
        m = 0
        cur = 0
        for _j in range(1, steps):
            cur = int(nt[bx * n + cur])
            while cur != -1:
                draft_index = int(ri[bx * n + cur])
                tok = int(cand[bx * n + cur])
                q = tp[off + tok]
                prob_acc = f32(prob_acc + q)
                if q > f32(0) and (coin < prob_acc / t_acc or q >= t_single):
                    prob_acc = f32(0.0)
                    off = ((bx * n + cur) * d) % offset_modulus
                    coin = us[bx * n + cur]
                    pred[last] = tok
                    m += 1
                    acc[bx * steps + m] = draft_index
                    last = draft_index
                    break
                dp[off + tok] = tp[off + tok]
                cur = int(ns[bx * n + cur])
            if cur == -1:
                break
        num[bx] = m
        q_row = tp[off:off + d]
        p_row = dp[off:off + d] if m != steps - 1 else np.zeros(d, dtype=f32)
        relu = np.maximum(q_row - p_row, f32(0))
        u = f32(uf[bx] * relu.sum(dtype=f32))
        cdf = np.cumsum(relu, dtype=f32)
        hits = np.flatnonzero((cdf > u) & (relu > 0))
        valid = np.flatnonzero(relu > 0)
        pred[last] = int(hits[0]) if hits.size else (int(valid[-1]) if valid.size else d - 1)


SETTINGS = (
    {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0},
    {"temperature": 0.7, "top_k": 20, "top_p": 1.0, "min_p": 0.0},
    {"temperature": 1.0, "top_k": -1, "top_p": 0.9, "min_p": 0.0},
    {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "min_p": 0.05},
)


def _cases(quick: bool) -> Iterator[dict[str, Any]]:
    """The ``kernel`` phase's grid, at SGLang's default thresholds (1 / 1)."""
    for bs in (1, 3, 32):
        for budget in ((4, 16) if quick else (4, 16, 64)):
            for topk in ((1, 4) if quick else (1, 2, 4, 8)):
                for vocab in ((1001,) if quick else (151936, 32002, 1001)):  # VecSize 4, 2, 1
                    for setting in (SETTINGS[-1:] if quick else SETTINGS):
                        yield {"bs": bs, "budget": budget, "topk": topk, "vocab": vocab, **setting,
                               "threshold_single": 1.0, "threshold_acc": 1.0}


def _threshold_cases(quick: bool) -> Iterator[dict[str, Any]]:
    """The ``kernel_thresholds`` phase's grid: every pair of :data:`THRESHOLDS`."""
    for single, acc in THRESHOLDS:
        for bs in ((1, 3) if quick else (1, 32)):
            for budget in ((16,) if quick else (16, 64)):
                for topk in (1, 4):
                    for vocab in ((1001,) if quick else (151936, 1001)):
                        for setting in (SETTINGS[1], SETTINGS[-1]):  # top-k 20 at 0.7 puts q past 0.5
                            yield {"bs": bs, "budget": budget, "topk": topk, "vocab": vocab, **setting,
                                   "threshold_single": single, "threshold_acc": acc}


def _trial(du, ref, torch, case, seed, device):
    """Inputs of one kernel call: a batch of best-first trees over a draft whose candidates the
    target often likes (so paths go deep), the target law per node, one coin per node."""
    g = torch.Generator(device=device).manual_seed(seed)
    bs, budget, k, vocab = case["bs"], case["budget"], case["topk"], case["vocab"]
    depth = min(15, budget)

    def randn(*shape):
        return torch.randn(shape, generator=g, device=device)

    base = randn(bs, depth + 1, vocab) * 2.5  # the "true" logits per depth
    top = torch.log_softmax(base[:, :depth] + randn(bs, depth, vocab) * 0.7, dim=-1).topk(k, dim=-1)
    roots = torch.randint(0, vocab, (bs,), generator=g, device=device)
    trees = du.build_tree_batch(top.indices, top.values, budget, roots)
    n = budget + 1
    # After a node of depth d the target favours what the draft proposed at depth d + 1.
    logits = torch.gather(base, 1, trees.depths.unsqueeze(2).expand(bs, n, vocab)) + randn(bs, n, vocab) * 0.3
    probs = ref.target_probs_from_logits(
        logits.view(bs * n, vocab), case["temperature"], case["top_k"], case["top_p"], case["min_p"]
    ).view(bs, n, vocab).contiguous()
    retrieve = du.tree_retrieve_batch(trees)
    coins = torch.rand((bs, n), generator=g, device=device)
    final = torch.rand((bs,), generator=g, device=device)
    return trees, retrieve, probs, coins, final


def _outputs(fn, trees, retrieve, probs, coins, final, torch, device, case):
    bs, n = trees.tokens.shape
    steps = trees.max_depth + 1
    out = {
        "predicts": torch.zeros((bs * n,), dtype=torch.int32, device=device),
        "accept_index": torch.full((bs, steps), -1, dtype=torch.int32, device=device),
        "accept_token_num": torch.zeros((bs,), dtype=torch.int32, device=device),
    }
    draft_probs = torch.zeros_like(probs)
    fn(predicts=out["predicts"], accept_index=out["accept_index"], accept_token_num=out["accept_token_num"],
       candidates=trees.tokens.contiguous(), retrive_index=retrieve[0].contiguous(),
       retrive_next_token=retrieve[1].contiguous(), retrive_next_sibling=retrieve[2].contiguous(),
       uniform_samples=coins, uniform_samples_for_final_sampling=final, target_probs=probs,
       draft_probs=draft_probs, threshold_single=case["threshold_single"], threshold_acc=case["threshold_acc"],
       deterministic=True)
    return {k: v.cpu() for k, v in out.items()}, draft_probs


def _bonus_on_boundary(torch, probs, draft_probs, last_row, coin, token) -> bool:
    """Whether the bonus coin lies within float32 rounding of the CDF boundary at ``token``."""
    relu = torch.clamp(probs[last_row] - draft_probs[last_row], min=0).double()
    cdf = torch.cumsum(relu, 0)
    u = float(coin) * float(cdf[-1])
    edges = [float(cdf[token - 1]) if token > 0 else 0.0, float(cdf[token])]
    return any(abs(u - e) <= 1e-5 * max(1.0, float(cdf[-1])) for e in edges)


def check_kernel(du, ref, torch, kernel, *, quick: bool, trials: int, device: str,
                 cases: Callable[[bool], Iterator[dict[str, Any]]] = _cases,
                 deadline: float | None = None) -> dict:
    """The kernel against the twin over ``cases(quick)``; with a ``deadline`` (monotonic),
    stops between cases once the pace so far says the next would end past it."""
    totals = {"cases": 0, "requests": 0, "accepted_drafts": 0, "paths_equal": 0, "counts_equal": 0,
              "tokens_equal": 0, "bonus_boundary_only": 0, "mismatches": 0}
    planned = list(cases(quick))
    examples = []
    t0 = time.monotonic()
    for ci, case in enumerate(planned):
        if deadline is not None and ci and time.monotonic() + (time.monotonic() - t0) / ci > deadline:
            break
        totals["cases"] += 1
        for t in range(trials):
            trees, retrieve, probs, coins, final = _trial(du, ref, torch, case, 1000 * ci + t, device)
            got, got_dp = _outputs(kernel, trees, retrieve, probs, coins, final, torch, device, case)
            want, _ = _outputs(ref.reference_tree_speculative_sampling, trees, retrieve, probs, coins, final, torch,
                               device, case)
            for b in range(case["bs"]):
                totals["requests"] += 1
                m_got, m_want = int(got["accept_token_num"][b]), int(want["accept_token_num"][b])
                totals["accepted_drafts"] += m_want
                counts = m_got == m_want
                got_path = got["accept_index"][b, : m_got + 1].tolist()
                path = counts and got_path == want["accept_index"][b, : m_want + 1].tolist()
                flats = want["accept_index"][b, : m_want + 1].tolist()
                emitted_got = [int(got["predicts"][f]) for f in flats]
                emitted_want = [int(want["predicts"][f]) for f in flats]
                tokens = path and emitted_got == emitted_want
                totals["counts_equal"] += counts
                totals["paths_equal"] += path
                totals["tokens_equal"] += tokens
                if tokens:
                    continue
                n = trees.tokens.shape[1]
                last = flats[-1]
                boundary = (path and emitted_got[:-1] == emitted_want[:-1] and _bonus_on_boundary(
                    torch, probs.view(-1, probs.shape[-1]).cpu(), got_dp.view(-1, probs.shape[-1]).cpu(),
                    b * n + last % n, final[b].cpu(), emitted_want[-1]))
                totals["bonus_boundary_only" if boundary else "mismatches"] += 1
                if not boundary and len(examples) < 5:
                    examples.append({"case": case, "trial": t, "request": b,
                                     "kernel": {"accepted": m_got, "path": got["accept_index"][b].tolist(),
                                                "tokens": emitted_got},
                                     "twin": {"accepted": m_want, "path": want["accept_index"][b].tolist(),
                                              "tokens": emitted_want}})
    complete = totals["cases"] == len(planned)
    return {**totals, "planned_cases": len(planned), "complete": complete,
            "ok": totals["mismatches"] == 0 and totals["requests"] > 0, "examples": examples}


# ----------------------------------------------------------------------------- kernel_past_2_32


def wide_batch_bytes(case: tuple[int, int, int, int]) -> int:
    """Device memory of the phase's two fp32 [bs, N, V] tensors (target and draft probs)."""
    bs, budget, vocab, _ = case
    return 2 * 4 * bs * (budget + 1) * vocab


def check_past_2_32(du, ref, torch, kernel, *, device: str, case: tuple[int, int, int, int]) -> dict:
    """One batch past the kernel's offset limit: the kernel on the bundle's row chunks against
    the twin (must agree), and on the whole batch (must disagree, only where offsets pass the
    limit). Target laws are sparse (each node's mass on its children's candidates and a few
    random tokens), row-specific, so a row that reads another's probabilities shows."""
    bs, budget, vocab, limit = case
    n, depth, k = budget + 1, min(15, budget), 4
    g = torch.Generator(device=device).manual_seed(232)
    ids = torch.randint(0, vocab, (bs, depth, k), generator=g, device=device)
    lps = torch.log_softmax(torch.randn((bs, depth, k), generator=g, device=device) * 2, dim=-1)
    lps = lps.sort(dim=-1, descending=True).values
    trees = du.build_tree_batch(ids, lps, budget, torch.randint(0, vocab, (bs,), generator=g, device=device))
    favoured = torch.gather(ids, 1, trees.depths.clamp(max=depth - 1).unsqueeze(-1).expand(bs, n, k))
    support = torch.cat([favoured, torch.randint(0, vocab, (bs, n, 4), generator=g, device=device)], dim=-1)
    weights = torch.rand((bs, n, k + 4), generator=g, device=device)
    weights[..., :k] *= 4.0
    probs = torch.zeros((bs, n, vocab), dtype=torch.float32, device=device)
    probs.scatter_add_(2, support, weights / weights.sum(dim=-1, keepdim=True))
    draft = torch.zeros_like(probs)
    retrieve = du.tree_retrieve_batch(trees)
    coins = torch.rand((bs, n), generator=g, device=device)
    final = torch.rand((bs,), generator=g, device=device)
    steps = trees.max_depth + 1

    def call(fn, chunk_limit: int | None) -> tuple[dict, int]:
        draft.zero_()
        out = {"predicts": torch.zeros((bs * n,), dtype=torch.int32, device=device),
               "accept_index": torch.full((bs, steps), -1, dtype=torch.int32, device=device),
               "accept_token_num": torch.zeros((bs,), dtype=torch.int32, device=device)}
        args = dict(**out, candidates=trees.tokens.contiguous(), retrive_index=retrieve[0].contiguous(),
                    retrive_next_token=retrieve[1].contiguous(), retrive_next_sibling=retrieve[2].contiguous(),
                    uniform_samples=coins, uniform_samples_for_final_sampling=final, target_probs=probs,
                    draft_probs=draft, threshold_single=1.0, threshold_acc=1.0, deterministic=True)
        calls = 1
        if chunk_limit is None:
            fn(**args)
        else:
            calls = du.sample_tree_in_row_chunks(fn, **args, limit=chunk_limit)
        if device != "cpu":
            torch.cuda.synchronize()
        paths = [None] * bs
        num, acc, pred = (out[x].cpu() for x in ("accept_token_num", "accept_index", "predicts"))
        for b in range(bs):
            m = int(num[b])
            flats = acc[b, : m + 1].tolist()
            paths[b] = (m, flats, [int(pred[f]) for f in flats])
        return {"paths": paths, "last_row": [b * n + p[1][-1] % n for b, p in enumerate(paths)]}, calls

    want, _ = call(ref.reference_tree_speculative_sampling, None)
    chunked, chunk_calls = call(kernel, limit)
    chunked_draft_rows = {b: draft.view(-1, vocab)[chunked["last_row"][b]].cpu() for b in range(bs)}
    whole, _ = call(kernel, None)
    # Rows whose offsets (row start .. last node's row) reach the limit.
    reaching = [b for b in range(bs) if (b + 1) * n * vocab > limit]
    mismatches, boundary, examples = 0, 0, []
    for b in range(bs):
        got, exp = chunked["paths"][b], want["paths"][b]
        if got == exp:
            continue
        row = chunked["last_row"][b]
        if got[:2] == exp[:2] and got[2][:-1] == exp[2][:-1] and _bonus_on_boundary(
                torch, probs.view(-1, vocab)[row:row + 1].cpu(), chunked_draft_rows[b].view(1, vocab), 0,
                final[b].cpu(), exp[2][-1]):
            boundary += 1
            continue
        mismatches += 1
        if len(examples) < 3:
            examples.append({"request": b, "chunked": got, "twin": exp})
    whole_differs = [b for b in range(bs) if whole["paths"][b] != want["paths"][b]]
    return {"ok": mismatches == 0 and bool(whole_differs) and set(whole_differs) <= set(reaching),
            "batch": bs, "width": n, "vocab": vocab, "limit": limit, "elements": bs * n * vocab,
            "requests": bs, "chunk_calls": chunk_calls, "chunked_mismatches": mismatches,
            "chunked_bonus_boundary_only": boundary, "rows_reaching_limit": len(reaching),
            "unchunked_differs_in": whole_differs[:20], "unchunked_differs_count": len(whole_differs),
            "examples": examples, "complete": True}


# ------------------------------------------------------------------- candidate_head, verify_round


def check_verify_round(device: str, timeout: float) -> dict:
    cmd = [sys.executable, str(REPO / "benchmarks" / "verify_round.py"), "--device", device, "--json",
           "--batches", "32", "--budgets", "16,64", "--topks", "4", "--repeats", "21"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        return {"ok": True, "complete": False, "error": f"timed out after {timeout:.0f} s (the budget's time left)"}
    if proc.returncode != 0:
        return {"ok": False, "error": proc.stderr[-2000:]}
    return {"ok": True, "rows": json.loads(proc.stdout)}


def check_candidate_head(torch) -> dict:
    sys.path.insert(0, str(CARRY / "py"))
    from sglang.kernels.ops.speculative import lilicorr

    g = torch.Generator().manual_seed(0)
    cases = []
    for n, vocab, k in ((3, 5000, 4), (8, 2048, 8), (48, 151936, 4), (5, 1000, 1), (17, 151936, 16)):
        logits = (torch.randn((n, vocab), generator=g) * 4).cuda()
        vals, ids, lse = lilicorr.lilicorr_topk_lse(logits, k)
        rv, ri, rl = lilicorr._topk_lse_torch(logits, k)
        torch.cuda.synchronize()
        cases.append({"shape": [n, vocab, k], "ids_equal": bool(torch.equal(ids, ri)),
                      "vals_max_abs": float((vals - rv).abs().max()), "lse_max_abs": float((lse - rl).abs().max())})
    ok = all(c["ids_equal"] and c["vals_max_abs"] == 0.0 and c["lse_max_abs"] < 1e-4 for c in cases)
    return {"ok": ok, "cases": cases}


# ----------------------------------------------------------------------------- run


def _trial_cost(case: dict[str, Any], device: str) -> float:
    """Seconds one trial (random batch, kernel call, twin call, comparison) is expected to take:
    a per-call overhead (the twin's walk syncs once per depth) plus a cost per probability."""
    elems = case["bs"] * (case["budget"] + 1) * case["vocab"]
    if device == "cpu":
        return 0.05 + 0.005 * case["bs"] + elems * 1e-7
    return 0.03 + 0.002 * min(15, case["budget"]) + elems * 3e-9


def estimate(phase: str, *, quick: bool, trials: int, device: str, carried: bool) -> float:
    """A phase's expected cost in seconds (rough; the kernel phases also watch their own pace)."""
    if phase == "kernel_load":
        return 1.0 if device == "cpu" else (5.0 if carried else 60.0)
    if phase in ("kernel", "kernel_thresholds"):
        grid = _cases(quick) if phase == "kernel" else _threshold_cases(quick)
        return sum(trials * _trial_cost(c, device) for c in grid)
    if phase == "kernel_past_2_32":
        # Twin + three kernel calls + two 17 GB memsets on a GPU; the CPU case is tiny.
        return 2.0 if device == "cpu" else 45.0
    return {"candidate_head": 30.0, "verify_round": 90.0}[phase]


class Results:
    """Each phase's record, appended to ``out``/gpu_check.jsonl (flushed and synced) as it ends."""

    def __init__(self, out: str | None) -> None:
        self.path = None
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            self.path = Path(out) / "gpu_check.jsonl"
            self.path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


def run(args: argparse.Namespace) -> int:
    import torch

    sys.path.insert(0, str(REPO))
    from ddtree_ops.ddtree_core import load_ddtree_reference, load_ddtree_utils

    t0 = time.monotonic()
    deadline = t0 + args.budget_s if args.budget_s else None
    results = Results(args.out)
    report: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "budget_s": args.budget_s,
                              "log": [], "phases": {}}
    device = "cpu" if args.cpu_twin else "cuda"
    if args.cpu_twin:
        report["device"] = "cpu (twin vs the transcribed kernel)"
        phases = ["kernel_load", "kernel_thresholds", "kernel", "kernel_past_2_32"]
    elif not torch.cuda.is_available():
        report.update(ok=False, status="failed", error="no CUDA device (use --cpu-twin without one)")
        results.write({"phase": "start", **report})
        print(json.dumps(report))
        return 1
    else:
        report["device"] = torch.cuda.get_device_name(0)
        phases = list(PHASES)
    if args.only:
        phases = [p for p in phases if p in args.only.split(",")]
    carried = LIB.is_file()
    plan = {p: round(estimate(p, quick=args.quick, trials=args.trials, device=device, carried=carried), 1)
            for p in phases}
    results.write({"phase": "start", "device": report["device"], "torch": report["torch"], "cuda": report["cuda"],
                   "budget_s": args.budget_s, "estimates_s": plan})
    du, ref = load_ddtree_utils(), load_ddtree_reference()
    kernel: Any = None
    skip_kernel: str | None = None
    for phase in phases:
        if args.stall_before == phase:  # the tests' stand-in for a run cut short here
            time.sleep(3600)
        left = None if deadline is None else deadline - time.monotonic()
        record: dict[str, Any] = {"phase": phase, "estimate_s": plan[phase]}
        started = time.monotonic()
        wide = WIDE_CPU if args.cpu_twin else WIDE_GPU
        free = torch.cuda.mem_get_info()[0] if phase == "kernel_past_2_32" and not args.cpu_twin else None
        if phase in ("kernel", "kernel_thresholds", "kernel_past_2_32") and kernel is None:
            record.update(status="skipped", reason=skip_kernel or "kernel_load did not run (--only)")
        elif free is not None and free < wide_batch_bytes(wide) + 2**32:
            record.update(status="skipped", reason=f"needs {wide_batch_bytes(wide) / 1e9:.1f} GB of device memory "
                                                   f"and 4 GB spare, {free / 1e9:.1f} GB free")
        elif left is not None and plan[phase] > left:
            record.update(status="skipped", reason=f"estimated {plan[phase]:.0f} s, {max(0.0, left):.0f} s left "
                                                   f"of --budget-s {args.budget_s:g}")
        else:
            try:
                if phase == "kernel_load":
                    if args.cpu_twin:
                        kernel = transcribed_kernel
                        result: dict[str, Any] = {"ok": True, "kernel": "transcribed_kernel (cpu)"}
                    else:
                        fn, skip_kernel = load_kernel(torch, report["log"])
                        kernel = _kernel_call(fn, torch) if fn is not None else None
                        result = {"ok": True, "log": list(report["log"])}
                        if skip_kernel:
                            result.update(skipped_kernel_phases=skip_kernel)
                elif phase in ("kernel", "kernel_thresholds"):
                    result = check_kernel(du, ref, torch, kernel, quick=args.quick, trials=args.trials,
                                          device=device, deadline=deadline,
                                          cases=_cases if phase == "kernel" else _threshold_cases)
                elif phase == "kernel_past_2_32":
                    fn = functools.partial(transcribed_kernel, offset_modulus=wide[3]) if args.cpu_twin else kernel
                    result = check_past_2_32(du, ref, torch, fn, device=device, case=wide)
                elif phase == "candidate_head":
                    result = check_candidate_head(torch)
                else:
                    result = check_verify_round(device, 600.0 if left is None else left)
            except Exception as exc:  # reported; the other phases still run
                result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            status = "passed" if result["ok"] else "failed"
            if result["ok"] and result.get("complete") is False:
                status = "cut_short"
            record.update(status=status, **result)
        record["seconds"] = round(time.monotonic() - started, 2)
        results.write(record)
        report["phases"][phase] = record
        report[phase] = record
        if phase == "kernel_load" and skip_kernel:
            report["log"].append(f"kernel phases skipped: {skip_kernel}")
    statuses = [r["status"] for r in report["phases"].values()]
    report["skipped"] = {p: r.get("reason", "cut short by --budget-s") for p, r in report["phases"].items()
                         if r["status"] in ("skipped", "cut_short")}
    report["status"] = ("failed" if "failed" in statuses else "incomplete" if report["skipped"] else "passed")
    report["ok"] = report["status"] != "failed"
    report["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(report)
    results.write({"phase": "end", "status": report["status"], "skipped": report["skipped"],
                   "seconds": report["seconds"]})
    if args.out:
        (Path(args.out) / "gpu_check.json").write_text(text + "\n")
    print(text)
    return {"passed": 0, "failed": 1}.get(report["status"], 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="extract the sources and build the kernel library into .cache/gpu_check")
    p.add_argument("--no-build", action="store_true", help="extract only")
    p.add_argument("--json", action="store_true", help="print the carry paths, the device command and the sizes")
    r = sub.add_parser("run", help="run the checks (on the GPU machine)")
    r.add_argument("--out", help="write gpu_check.jsonl (one line per phase, as it ends) and gpu_check.json here")
    r.add_argument("--quick", action="store_true", help="a few cases (the CPU harness check)")
    r.add_argument("--trials", type=int, default=2, help="random batches per case")
    r.add_argument("--budget-s", type=float, default=None,
                   help="skip the phases whose estimated cost does not fit in the time left")
    r.add_argument("--only", help="comma-separated phases to run (of " + ", ".join(PHASES) + ")")
    r.add_argument("--cpu-twin", action="store_true",
                   help="here, without a GPU: the kernel transcribed to Python stands for the CUDA kernel")
    r.add_argument("--stall-before", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
