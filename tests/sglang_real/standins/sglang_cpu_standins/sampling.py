"""Pure-PyTorch twins of two sampling ops that have no CPU build (TEST-ONLY).

* ``tree_speculative_sampling_target_only`` -- SGLang 0.5.23's JIT CUDA op
  (``kernels/ops/speculative/sampling.py``, kernel source
  ``kernels/jit/csrc/speculative/sampling.cuh``). On CUDA,
  ``kernels/ops/speculative/verify_sampling.py`` resolves the name to that op; on CPU to
  None, so a sampled DDTREE request would take the worker's reference branch and the
  branch a GPU host runs (``build_speculative_verify_target_probs`` feeding the op)
  would never execute. :func:`provide_tree_sampling_kernel` puts the twin at both
  names, as the CUDA resolution does, so that the worker's ``"kernel"`` sampler runs
  end to end here with only the CUDA kernel replaced. The twin first checks what the
  op's ``TensorMatcher`` checks at entry (dtypes, shapes bound across tensors, one
  device, contiguous tensors, thresholds in [0, 1]) -- a call the CUDA op would reject
  fails here too -- then runs the DDTree bundle's pure-torch twin of the kernel
  (``ddtree_reference.reference_tree_speculative_sampling``), which the GPU check
  (``benchmarks/gpu_check.py``) compares with the real kernel on identical coins.
  Opt-in (``SGLANG_CPU_STANDINS_ENABLE=tree_sampling_kernel``): without it a CPU server
  keeps SGLang's own answer (no kernel), which the abort tests rely on.
* ``murmur_hash32`` on CPU tensors -- ``kernels/ops/sampling/murmur_hash.py`` sends CPU
  tensors to ``torch.ops.sgl_kernel.murmur_hash32_cpu``, which the CUDA-only
  sglang-kernel wheel lacks. Seeded sampling (``--enable-deterministic-inference``:
  ``multinomial_with_seed`` in ``srt/layers/sampler.py``, EAGLE's
  ``_seeded_verify_coins`` in ``srt/speculative/eagle_utils.py``) hashes through it.
  :func:`murmur_hash32` is the Triton kernel ``murmur_hash32_kernel`` of that file,
  step by step in 32-bit integer arithmetic (tests compare the two under
  ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

_U32 = 0xFFFFFFFF


def _check(cond: bool, what: str) -> None:
    if not cond:
        # The CUDA op raises from TensorMatcher / CHECK_HOST with a message; so does this.
        raise RuntimeError(f"tree_speculative_sampling_target_only: {what}")


def tree_speculative_sampling_target_only(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """The op's signature (``kernels/ops/speculative/sampling.py``) and entry checks
    (``sampling.cuh``), then the bundle's twin of the kernel."""
    from sglang.srt.speculative.ddtree_reference import reference_tree_speculative_sampling

    _check(candidates.dim() == 2, f"candidates must be [bs, draft_tokens], got {tuple(candidates.shape)}")
    bs, n = candidates.shape
    _check(accept_index.dim() == 2 and accept_index.shape[0] == bs, "accept_index must be [bs, spec_tokens]")
    spec = accept_index.shape[1]
    _check(target_probs.dim() == 3, "target_probs must be [bs, draft_tokens, vocab]")
    vocab = target_probs.shape[2]
    expect = {
        "candidates": (candidates, (bs, n), torch.int64),
        "retrive_index": (retrive_index, (bs, n), torch.int64),
        "retrive_next_token": (retrive_next_token, (bs, n), torch.int64),
        "retrive_next_sibling": (retrive_next_sibling, (bs, n), torch.int64),
        "accept_index": (accept_index, (bs, spec), torch.int32),
        "accept_token_num": (accept_token_num, (bs,), torch.int32),
        "predicts": (predicts, (bs * n,), torch.int32),
        "uniform_samples": (uniform_samples, (bs, n), torch.float32),
        "uniform_samples_for_final_sampling": (uniform_samples_for_final_sampling, (bs,), torch.float32),
        "target_probs": (target_probs, (bs, n, vocab), torch.float32),
        "draft_probs": (draft_probs, (bs, n, vocab), torch.float32),
    }
    device = candidates.device
    for name, (t, shape, dtype) in expect.items():
        _check(tuple(t.shape) == shape, f"{name} has shape {tuple(t.shape)}, expected {shape}")
        _check(t.dtype == dtype, f"{name} has dtype {t.dtype}, expected {dtype}")
        _check(t.device == device, f"{name} is on {t.device}, candidates on {device}")
        _check(t.is_contiguous(), f"{name} is not contiguous")
    _check(n > 0 and spec > 0 and vocab > 0, "draft_tokens, spec_tokens and vocab_size must be positive")
    _check(0.0 <= threshold_single <= 1.0, f"threshold_single {threshold_single} not in [0, 1]")
    _check(0.0 <= threshold_acc <= 1.0, f"threshold_acc {threshold_acc} not in [0, 1]")
    if bs == 0:
        return
    reference_tree_speculative_sampling(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_token_num,
        candidates=candidates,
        retrive_index=retrive_index,
        retrive_next_token=retrive_next_token,
        retrive_next_sibling=retrive_next_sibling,
        uniform_samples=uniform_samples,
        uniform_samples_for_final_sampling=uniform_samples_for_final_sampling,
        target_probs=target_probs,
        draft_probs=draft_probs,
        threshold_single=threshold_single,
        threshold_acc=threshold_acc,
        deterministic=deterministic,
    )


def provide_tree_sampling_kernel() -> None:
    """Bind the twin where CUDA's resolution binds the op (verify_sampling.py: the name
    from ``sampling.py``). Plain attribute binds, not HookRegistry: on CPU the original
    is None, and a REPLACE would rebind every module attribute that is None."""
    from sglang.kernels.ops.speculative import sampling, verify_sampling

    sampling.tree_speculative_sampling_target_only = tree_speculative_sampling_target_only
    verify_sampling.tree_speculative_sampling_target_only = tree_speculative_sampling_target_only


# --- murmur_hash32 ---------------------------------------------------------------------------


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """``a * c mod 2**32`` for ``0 <= a, c < 2**32`` in int64 without overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return ((a * lo) + (((a * hi) & 0xFFFF) << 16)) & _U32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _U32


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _mul32(k, 0xCC9E2D51)
    k = _rotl32(k, 15)
    k = _mul32(k, 0x1B873593)
    h = h ^ k
    h = _rotl32(h, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _U32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` uint32: ``murmur_hash32_kernel`` of row ``i`` (seed, position) and column ``j``.

    The seed is read as uint64 and split into two 32-bit blocks, the position and the
    column are truncated to 32 bits, as the kernel's loads do.
    """
    s = seed.to(torch.int64)  # uint64 bit pattern in int64: masks below recover both halves
    seed_lo = (s & _U32).view(-1, 1)
    seed_hi = ((s >> 32) & _U32).view(-1, 1)
    pos = (positions.to(torch.int64) & _U32).view(-1, 1)
    col = (col_indices.to(torch.int64) & _U32).view(1, -1)
    h = torch.zeros((s.numel(), 1), dtype=torch.int64, device=seed.device)
    h = _mix(h, seed_lo)
    h = _mix(h, seed_hi)
    h = _mix(h, pos)
    h = _mix(h.expand(-1, col.shape[1]), col.expand(h.shape[0], -1))
    h = _fmix32(h ^ 16)
    return h.to(torch.uint32)


def murmur_hash32(original, seed, positions, col_indices):
    """AROUND ``kernels.ops.sampling.murmur_hash.murmur_hash32``: CPU tensors get the twin."""
    if seed.device.type != "cpu":
        return original(seed, positions, col_indices)
    assert seed.shape == positions.shape and seed.dim() == 1 and col_indices.dim() == 1
    return murmur_hash32_cpu(seed, positions, col_indices)
