"""The one-call GPU check of what the CPU suite can only stand in for.

The real-server tests run every branch a GPU host takes, with one thing replaced: SGLang's
CUDA op ``tree_speculative_sampling_target_only`` by its pure-torch twin
(``ddtree_reference.reference_tree_speculative_sampling``). That rests on the twin matching
the op, which only a GPU can show. On a lent GPU machine (no SGLang, no network) one call
checks:

a. ``kernel``: the 0.5.23 kernel, built from the SGLang wheel's own source
   (``kernels/jit/include/sgl_kernel/speculative/sampling.cuh`` with FlashInfer 0.7.2's
   sampling headers, launched as ``kernels/jit/csrc/speculative/sampling.cuh`` launches
   it: ``benchmarks/gpu_check_kernel.cu``) against the twin on identical coins, over random
   trees (the bundle's ``build_tree_batch``), target laws (temperature, top-k, top-p,
   min-p) and batch sizes: accepted paths, accept counts and emitted tokens must be
   identical. The one tolerated difference is a bonus token whose coin lies within float32
   rounding of a CDF boundary (the kernel sums in block-reduction order), counted apart.
b. ``verify_round``: ``benchmarks/verify_round.py --device cuda`` at batch 32, prefix
   1k / 8k / 32k, budgets 16 and 64.
c. ``candidate_head``: the Triton candidate top-k + log-sum-exp (``lilicorr_topk_lse``,
   ``kernels/ops/speculative/lilicorr.py`` from the wheel) on CUDA against its own torch
   path: identical ids and values, log-sum-exp within 1e-4.

Usage::

    .venv/bin/python benchmarks/gpu_check.py prepare       # here: .cache/gpu_check (the carry set)
    .venv/bin/python benchmarks/gpu_check.py run --cpu-twin --quick   # here: the harness, twin vs twin
    python benchmarks/gpu_check.py run --out "$OUT"        # on the GPU machine, one call

``prepare`` extracts the sources from the cached wheels (``.cache/wheels``; the FlashInfer
wheel is downloaded there once) into ``.cache/gpu_check`` -- never into the repository --
and builds the kernel library with nvcc for sm_90 (H200) when nvcc and the CUDA headers
are here; ``run`` rebuilds it on the GPU machine if the carried one does not load. The
device command, with the carry set::

    run(command="python benchmarks/gpu_check.py run --out $OUT", carry=[".cache/gpu_check"])

``run`` prints one JSON object (also written to ``--out``/gpu_check.json) and exits 0 when
(a) and (c) pass, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / ".cache" / "wheels"
CARRY = REPO / ".cache" / "gpu_check"
LIB = CARRY / "libddtree_tree_sampling.so"
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


def _cuda_include_dirs() -> list[Path]:
    """Where curand.h and the CUDA runtime headers are: the toolkit, else the nvidia wheels."""
    dirs = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        dirs.append(Path(nvcc).resolve().parent.parent / "include")
    for site in sorted((REPO / ".cache" / "sglang-cpu" / "venv" / "lib").glob("python*/site-packages")):
        dirs.extend(sorted(site.glob("nvidia/cu*/include")))
    return [d for d in dirs if (d / "curand.h").exists()] or dirs[:1]


def build(out: Path, include: Path) -> list[str]:
    """nvcc the wrapper into ``out``; returns the command (raises CalledProcessError)."""
    cmd = ["nvcc", "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static", *ARCH,
           "-I", str(include)]
    for d in _cuda_include_dirs():
        cmd += ["-I", str(d)]
    cmd += ["-o", str(out), str(WRAPPER)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return cmd


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
            files[dest] = hashlib.sha256(target.read_bytes()).hexdigest()
    prefix = "flashinfer/data/include/"
    with zipfile.ZipFile(flashinfer) as z:
        for name in z.namelist():
            if name.startswith(prefix) and not name.endswith("/"):
                target = CARRY / "include" / name[len(prefix):]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(name))
    for pkg in PACKAGE_INITS:
        (CARRY / "py" / pkg / "__init__.py").touch()
    manifest = {"sglang_wheel": sglang.name, "flashinfer_wheel": flashinfer.name, "files": files, "library": None}
    if shutil.which("nvcc") and not args.no_build:
        t0 = time.monotonic()
        try:
            manifest["library"] = {"command": " ".join(build(LIB, CARRY / "include")),
                                   "seconds": round(time.monotonic() - t0, 1), "bytes": LIB.stat().st_size}
        except subprocess.CalledProcessError as exc:
            raise SystemExit(f"gpu_check: nvcc failed:\n{exc.stderr[-3000:]}") from None
    (CARRY / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(p.stat().st_size for p in CARRY.rglob("*") if p.is_file())
    print(json.dumps({"carry": str(CARRY.relative_to(REPO)), "bytes": size, "library": manifest["library"]}))
    return 0


# ----------------------------------------------------------------------------- run (a)


def _load_kernel(log: list[str]):
    """The C entry point, loaded from the carried library or rebuilt here."""
    for attempt in ("carried", "rebuilt"):
        if attempt == "rebuilt":
            if not shutil.which("nvcc"):
                break
            local = Path(os.environ.get("TMPDIR", "/tmp")) / "libddtree_tree_sampling.so"
            try:
                build(local, CARRY / "include")
            except subprocess.CalledProcessError as exc:
                log.append(f"rebuild failed: {exc.stderr[-2000:]}")
                break
            path = local
        else:
            path = LIB
        try:
            fn = ctypes.CDLL(str(path)).ddtree_tree_sampling
        except OSError as exc:
            log.append(f"{attempt} library {path}: {exc}")
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_int, *[ctypes.c_void_p] * 11, *[ctypes.c_uint32] * 4,
                       ctypes.c_float, ctypes.c_float, ctypes.c_void_p]
        log.append(f"kernel library: {attempt} ({path})")
        return fn
    return None


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


def _cases(quick: bool):
    settings = [
        {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0},
        {"temperature": 0.7, "top_k": 20, "top_p": 1.0, "min_p": 0.0},
        {"temperature": 1.0, "top_k": -1, "top_p": 0.9, "min_p": 0.0},
        {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "min_p": 0.05},
    ]
    for bs in (1, 3, 32):
        for budget in ((4, 16) if quick else (4, 16, 64)):
            for topk in ((1, 4) if quick else (1, 2, 4, 8)):
                for vocab in ((1001,) if quick else (151936, 32002, 1001)):  # VecSize 4, 2, 1
                    for setting in (settings[-1:] if quick else settings):
                        yield {"bs": bs, "budget": budget, "topk": topk, "vocab": vocab, **setting}


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


def _outputs(fn, trees, retrieve, probs, coins, final, torch, device):
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
       draft_probs=draft_probs, threshold_single=1.0, threshold_acc=1.0, deterministic=True)
    return {k: v.cpu() for k, v in out.items()}, draft_probs


def _bonus_on_boundary(torch, probs, draft_probs, last_row, coin, token) -> bool:
    """Whether the bonus coin lies within float32 rounding of the CDF boundary at ``token``."""
    relu = torch.clamp(probs[last_row] - draft_probs[last_row], min=0).double()
    cdf = torch.cumsum(relu, 0)
    u = float(coin) * float(cdf[-1])
    edges = [float(cdf[token - 1]) if token > 0 else 0.0, float(cdf[token])]
    return any(abs(u - e) <= 1e-5 * max(1.0, float(cdf[-1])) for e in edges)


def check_kernel(du, ref, torch, kernel, *, quick: bool, trials: int, device: str) -> dict:
    totals = {"cases": 0, "requests": 0, "accepted_drafts": 0, "paths_equal": 0, "counts_equal": 0,
              "tokens_equal": 0, "bonus_boundary_only": 0, "mismatches": 0}
    examples = []
    for ci, case in enumerate(_cases(quick)):
        totals["cases"] += 1
        for t in range(trials):
            trees, retrieve, probs, coins, final = _trial(du, ref, torch, case, 1000 * ci + t, device)
            got, got_dp = _outputs(kernel, trees, retrieve, probs, coins, final, torch, device)
            want, _ = _outputs(ref.reference_tree_speculative_sampling, trees, retrieve, probs, coins, final, torch,
                               device)
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
    return {**totals, "ok": totals["mismatches"] == 0 and totals["requests"] > 0, "examples": examples}


# ------------------------------------------------------------------------- run (b), (c)


def check_verify_round(device: str) -> dict:
    cmd = [sys.executable, str(REPO / "benchmarks" / "verify_round.py"), "--device", device, "--json",
           "--batches", "32", "--budgets", "16,64", "--topks", "4", "--repeats", "51"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
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


def run(args: argparse.Namespace) -> int:
    import torch

    sys.path.insert(0, str(REPO))
    from ddtree_ops.ddtree_core import load_ddtree_reference, load_ddtree_utils

    du, ref = load_ddtree_utils(), load_ddtree_reference()
    t0 = time.monotonic()
    report: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "log": []}
    if args.cpu_twin:
        # The harness itself, here: the twin stands for the kernel (every case must agree).
        device = "cpu"
        kernel = ref.reference_tree_speculative_sampling
        report["device"] = "cpu (twin vs twin)"
    else:
        if not torch.cuda.is_available():
            print(json.dumps({"ok": False, "error": "no CUDA device"}))
            return 1
        device = "cuda"
        report["device"] = torch.cuda.get_device_name(0)
        fn = _load_kernel(report["log"])
        if fn is None:
            report.update(ok=False, error="the kernel library neither loads nor builds")
            print(json.dumps(report))
            return 1
        kernel = _kernel_call(fn, torch)
    report["kernel"] = check_kernel(du, ref, torch, kernel, quick=args.quick, trials=args.trials, device=device)
    if not args.cpu_twin:
        report["verify_round"] = check_verify_round(device)
        try:
            report["candidate_head"] = check_candidate_head(torch)
        except Exception as exc:  # reported, the other checks still count
            report["candidate_head"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    report["ok"] = report["kernel"]["ok"] and report.get("candidate_head", {"ok": True})["ok"]
    report["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(report)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(text + "\n")
    print(text)
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="extract the sources and build the kernel library into .cache/gpu_check")
    p.add_argument("--no-build", action="store_true", help="extract only")
    r = sub.add_parser("run", help="run the checks (on the GPU machine)")
    r.add_argument("--out", help="also write gpu_check.json here")
    r.add_argument("--quick", action="store_true", help="a few cases (the CPU harness check)")
    r.add_argument("--trials", type=int, default=2, help="random batches per case")
    r.add_argument("--cpu-twin", action="store_true", help="here, without a GPU: the twin stands for the kernel")
    args = ap.parse_args(argv)
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
