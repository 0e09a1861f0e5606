"""Stand-ins for kernels without a CPU build, against the kernels themselves.

* ``murmur_hash32``: the pure-torch twin (``sampling.murmur_hash32_cpu``) against SGLang's
  Triton ``murmur_hash32_kernel`` run by Triton's interpreter on CPU tensors, bit for bit.
* The tree-sampling kernel can only run on a GPU; what can be done here is done:
  ``benchmarks/gpu_check.py prepare`` extracts its sources from the wheels and builds the
  library a lent GPU loads (nvcc and the CUDA headers are on this machine; no GPU).
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest

from .serverenv import server_env

pytestmark = [pytest.mark.sglang_real, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]

_MURMUR = r"""
import json, torch
from sglang.kernels.ops.sampling import murmur_hash
from sglang_cpu_standins.sampling import murmur_hash32_cpu

gen = torch.Generator().manual_seed(0)
seeds = torch.cat([torch.tensor([0, 1, 42, 2**32 - 1, 2**32, 2**40 + 7]),
                   torch.randint(0, 2**62, (26,), generator=gen)])
positions = torch.randint(0, 2**31, (seeds.numel(),), generator=gen)
cols = torch.arange(0, 3000, 7)
n, m = seeds.numel(), cols.numel()
want = torch.empty((n, m), dtype=torch.uint32)
# The Triton kernel itself (murmur_hash32 sends CPU tensors to the missing sgl_kernel op).
murmur_hash.murmur_hash32_kernel[(n, (m + 1023) // 1024)](
    seeds.to(torch.uint64), positions, cols, want, n, m, BLOCK_SIZE=1024)
got = murmur_hash32_cpu(seeds.to(torch.uint64), positions, cols)
print(json.dumps({"equal": bool(torch.equal(got.to(torch.int64), want.to(torch.int64))),
                  "dtype": str(got.dtype), "shape": list(got.shape),
                  "distinct": int(torch.unique(want.to(torch.int64)).numel())}))
"""


def test_murmur_hash_stand_in_equals_the_triton_kernel(sglang_cpu_env: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(sglang_cpu_env), "-c", _MURMUR], capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**server_env(), "TRITON_INTERPRET": "1", "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["equal"] and got["dtype"] == "torch.uint32", got
    assert got["distinct"] > 0.99 * got["shape"][0] * got["shape"][1], got  # a hash, not a constant


def test_gpu_check_prepare_builds_the_kernel_library(sglang_cpu_env: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "prepare", "--json"],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "nvcc" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("no nvcc on this machine")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    (carried,) = report["carry"]
    carry = REPO / carried
    # The device tool carries at most 64 MiB per call: the carry and the working tree together.
    assert report["total_bytes"] < 64 * 2**20 and report["fits"], report
    manifest = json.loads((carry / "manifest.json").read_text())
    assert manifest["sglang_wheel"].startswith("sglang-0.5.23-")
    assert (carry / "include" / "sgl_kernel" / "speculative" / "sampling.cuh").is_file()
    assert (carry / "include" / "flashinfer" / "sampling.cuh").is_file()
    assert (carry / "py" / "sglang" / "kernels" / "ops" / "speculative" / "lilicorr.py").is_file()
    assert manifest["library"] is not None, "nvcc is here but built nothing"
    library = ctypes.CDLL(str(carry / "libddtree_tree_sampling.so"))
    assert hasattr(library, "ddtree_tree_sampling")
