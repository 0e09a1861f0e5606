"""The stand-ins (TEST-ONLY). Line numbers refer to the sglang 0.5.23 wheel."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("sglang_cpu_standins")

_registered = False


# --- 1. DFLASH on device "cpu" ----------------------------------------------------------------


class _CpuDflashPlatform:
    """Wraps the real platform object while ``_handle_dflash`` runs on device cpu.

    ``_handle_dflash`` (srt/arg_groups/speculative_hook.py:291-301) accepts only
    cuda/npu/xpu devices for in-tree platforms, but asks an out-of-tree platform
    (``is_out_of_tree()``) through ``supports_speculative_algorithm``. This wrapper answers as
    an out-of-tree CPU platform that supports DFLASH, and for the draft attention backend
    (speculative_hook.py:894-944) accepts exactly the in-tree list (which stand-in 2 extends
    by torch_native) and defaults to torch_native. Everything else is the real platform's.
    """

    def __init__(self, real: object) -> None:
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def is_out_of_tree(self) -> bool:
        return True

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm == "DFLASH"

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES

        return backend in DRAFT_ATTENTION_BACKEND_CHOICES

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return "torch_native"


def handle_dflash_on_cpu(original, server_args, *args, **kwargs):
    """AROUND ``speculative_hook._handle_dflash``: let DFLASH through on device cpu (TEST-ONLY).

    Why: speculative_hook.py:294-301 raises "DFLASH speculative decoding is not supported by
    CpuSRTPlatform on device 'cpu'". Only for device cpu, the module's ``current_platform``
    is swapped for :class:`_CpuDflashPlatform` while the original runs (every other check
    and default of ``_handle_dflash`` still runs unchanged), then restored.
    """
    from sglang.srt.arg_groups import speculative_hook
    from sglang.srt.arg_groups.overrides import resolving_view

    if resolving_view(server_args).device != "cpu":
        return original(server_args, *args, **kwargs)
    real = speculative_hook.current_platform
    speculative_hook.current_platform = _CpuDflashPlatform(real)
    try:
        return original(server_args, *args, **kwargs)
    finally:
        speculative_hook.current_platform = real


# --- 2. torch_native as a draft attention backend ----------------------------------------------


def allow_torch_native_draft_backend() -> None:
    """Add "torch_native" to ``DRAFT_ATTENTION_BACKEND_CHOICES`` (TEST-ONLY).

    Why: the list (srt/arg_groups/choices.py:103-111) names GPU backends only. The draft worker
    builder falls back to "flashinfer" for anything else
    (srt/speculative/draft_worker_common.py:51-63, in the scheduler process), and
    ``_handle_dflash`` checks the same list (speculative_hook.py:894-901). SGLang exports
    ``add_draft_attention_backend_choices`` (choices.py:227) for exactly this; the list is
    shared by reference, so extending it in each process (plugins load in every process) is
    enough.
    """
    from sglang.srt.arg_groups.choices import (
        DRAFT_ATTENTION_BACKEND_CHOICES,
        add_draft_attention_backend_choices,
    )

    if "torch_native" not in DRAFT_ATTENTION_BACKEND_CHOICES:
        add_draft_attention_backend_choices(["torch_native"])


# --- 3. no Triton/sgl-kernel KV-copy warmup on CPU ---------------------------------------------


def skip_kv_copy_warmup_on_cpu(original, self, *args, **kwargs):
    """AROUND ``MHATokenToKVPool._init_kv_copy_and_warmup``: skip it on CPU (TEST-ONLY).

    Why: speculative decoding builds the KV pool with ``enable_kv_cache_copy``
    (srt/mem_cache/memory_pool.py:2304-2307), whose warmup (memory_pool.py:2419-2428) calls
    ``copy_all_layer_kv_cache_func`` -> ``sgl_kernel.copy_all_layer_kv_cache_cpu``
    (kernels/ops/kvcache/cache_move.py:190-196), an op the CUDA-only sglang-kernel wheel does
    not have. With ``SGLANG_NATIVE_MOVE_KV_CACHE=1`` (set by the test server) every KV move
    takes the pure-torch path (memory_pool.py:3447-3454) before the tiled config is read, so
    the warmup has nothing to prepare. ``_kv_copy_config`` stays None: should anything still
    reach the tiled copy, its assert (memory_pool.py:3460) fails loudly.
    """
    if str(self.device).startswith("cpu") and getattr(self, "use_native_move_kv_cache", False):
        self._kv_copy_config = None
        return None
    return original(self, *args, **kwargs)


# --- 4. Tensor.record_stream on CPU tensors ------------------------------------------------------


def record_stream_noop_on_cpu(original, self, *args, **kwargs):
    """AROUND ``torch.Tensor.record_stream``: a no-op for CPU tensors (TEST-ONLY).

    Why: ``DFlashWorkerV2.forward_batch_generation`` calls
    ``batch.seq_lens.record_stream(current_stream())`` unconditionally
    (srt/speculative/dflash_worker_v2.py:2479-2483); PyTorch rejects that for CPU tensors
    ("RuntimeError: unknown parameter type"). CPU execution has no streams, hence no
    cross-stream reuse hazard to guard against -- SGLang's own overlap code skips the call on
    CPU for exactly that reason (srt/managers/overlap_utils.py:124-126).
    """
    if self.device.type == "cpu":
        return None
    return original(self, *args, **kwargs)


# --- 5. input_embeds in the model's dtype ----------------------------------------------------


def input_embeds_in_model_dtype(original, self, forward_batch, *args, **kwargs):
    """AFTER-style AROUND on ``ModelRunner._extend_forward_kwargs`` (TEST-ONLY).

    Why: the extend path hands ``forward_batch.input_embeds.bfloat16()`` to the model
    (srt/model_executor/model_runner.py:1771-1772), i.e. it assumes a bf16 model. The DFlash
    draft always runs on ``input_embeds`` (the target's embedding of the block,
    dflash_worker_v2.py:2571-2580, run as TARGET_VERIFY at :2638-2688), so a float32 model
    dies in its first linear ("expected m1 and m2 to have the same dtype ... BFloat16 !=
    float"). The stand-in passes the embeddings in the runner's own dtype instead -- for a
    bf16 model (the only case SGLang serves) that is exactly what ``.bfloat16()`` gives.
    """
    result = original(self, forward_batch, *args, **kwargs)
    embeds = getattr(forward_batch, "input_embeds", None)
    model_dtype = getattr(self, "dtype", None)
    if (
        embeds is not None
        and model_dtype is not None
        and "input_embeds" in result
        and result["input_embeds"].dtype != model_dtype
    ):
        result["input_embeds"] = embeds.to(model_dtype)
    return result


# --- 6. the draft's Triton-only fused qk-norm + RoPE (bf16 models only) ---------------------------


def plain_qk_norm_rope_on_cpu(result, self, *args, **kwargs):
    """AFTER ``DFlashAttention.__init__``: on CPU, turn off the fused qk-norm+RoPE (TEST-ONLY).

    Why: for bf16 activations the DFlash draft attention calls ``table_qk_norm_rope_``
    (srt/models/dflash.py:283-289 decides, :383-397 calls;
    kernels/ops/attention/table_qk_norm_rope.py is a Triton kernel), which dies on a machine
    without a GPU ("0 active drivers"). With the flag off it takes its own plain path
    (dflash.py:398-409: ``apply_qk_norm`` then ``rotary_emb``), the same arithmetic
    unfused. float32 models (the tests' default) never take the fused path.
    """
    from sglang.srt.utils import is_cpu

    if is_cpu():
        self.use_table_qk_norm_rope = False
    return result


# --- 7. deterministic inference with torch_native ---------------------------------------------


def allow_deterministic_torch_native() -> None:
    """Add "torch_native" to ``DETERMINISTIC_ATTENTION_BACKEND_CHOICES`` (TEST-ONLY).

    Why: per-request ``sampling_seed`` takes effect only under
    ``--enable-deterministic-inference`` (``SamplingBatchInfo.from_schedule_batch``,
    srt/sampling/sampling_batch_info.py), which refuses any attention backend outside that
    list (arg_groups/choices.py, checked in ``_deterministic_attention_backend``,
    arg_groups/overrides.py) -- GPU backends whose kernels are made batch-invariant. The
    CPU server's torch_native SDPA with one intra-op thread already is. The list is shared
    by reference (server_args.py re-exports it), so extending it in place is enough.
    """
    from sglang.srt.arg_groups.choices import DETERMINISTIC_ATTENTION_BACKEND_CHOICES

    if "torch_native" not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        DETERMINISTIC_ATTENTION_BACKEND_CHOICES.append("torch_native")


def no_batch_invariant_mode_on_cpu(original, self, *args, **kwargs):
    """AROUND ``ModelRunner.maybe_enable_batch_invariant_mode``: skip it on CPU (TEST-ONLY).

    Why: under ``--enable-deterministic-inference`` the runner swaps matmul and friends for
    batch-invariant Triton kernels registered on the CUDA/XPU dispatch key
    (srt/batch_invariant_ops/batch_invariant_ops.py ``enable_batch_invariant_mode``), which
    raises "No supported accelerator (CUDA/XPU) available" on a CPU. Without it a CPU
    server still honours ``sampling_seed`` (the seeded sampler and EAGLE's seeded verify
    coins); its float sums may then depend on the batch's composition, so tests that
    compare seeded outputs send them in batches of the same shape.
    """
    if str(getattr(self, "device", "")).startswith("cpu"):
        return None
    return original(self, *args, **kwargs)


# --- fork, not spawn, for the server's own processes on CPU ---------------------------------------


def fork_subprocesses_on_cpu(original, server_args, *args, **kwargs):
    """AROUND ``engine._set_envs_and_config``: start the scheduler and detokenizer by fork on
    device cpu (TEST-ONLY; a start-up cost, not a behaviour).

    Why: ``_set_envs_and_config`` (srt/entrypoints/engine.py:1995) sets the start method to
    "spawn", which CUDA needs, so that each child re-imports SGLang, torch and transformers
    from scratch, most of a CPU server's start-up (~30 s of CPU per child on a slow 2-core
    machine, three processes per launch). A CPU server has no CUDA context to protect: forked
    children inherit the launcher's imports and run the same entry points
    (``run_scheduler_process``, ``run_detokenizer_process``) with the same arguments. Plugins
    are already loaded in the launcher (``launch_server.py`` ``load_plugins()``), so each
    child inherits them and the hooks applied.
    """
    result = original(server_args, *args, **kwargs)
    from sglang.srt.arg_groups.overrides import resolving_view

    if resolving_view(server_args).device == "cpu":
        import multiprocessing

        multiprocessing.set_start_method("fork", force=True)
    return result


# Stand-ins that change what a CPU server can serve, not only whether it starts: on only
# where a test names them in SGLANG_CPU_STANDINS_ENABLE.
OPT_IN = {"tree_sampling_kernel"}


def _standins():
    """name -> (target, hook, hook type) for HookRegistry, or a callable to run once."""
    from sglang.srt.plugins.hook_registry import HookType

    from . import attention, coverage_startup, ddtree, kernels, sampling

    table = {
        "dflash_device": (
            "sglang.srt.arg_groups.speculative_hook._handle_dflash",
            handle_dflash_on_cpu,
            HookType.AROUND,
        ),
        "draft_backend": allow_torch_native_draft_backend,
        "fork_subprocesses": (
            "sglang.srt.entrypoints.engine._set_envs_and_config",
            fork_subprocesses_on_cpu,
            HookType.AROUND,
        ),
        "kv_copy_warmup": (
            "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup",
            skip_kv_copy_warmup_on_cpu,
            HookType.AROUND,
        ),
        "record_stream": ("torch.Tensor.record_stream", record_stream_noop_on_cpu, HookType.AROUND),
        "input_embeds_dtype": (
            "sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs",
            input_embeds_in_model_dtype,
            HookType.AROUND,
        ),
        "fused_qk_norm_rope": (
            "sglang.srt.models.dflash.DFlashAttention.__init__",
            plain_qk_norm_rope_on_cpu,
            HookType.AFTER,
        ),
        "target_verify": (
            "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
            attention.forward_extend_with_target_verify,
            HookType.AROUND,
        ),
        "murmur_hash32": (
            "sglang.kernels.ops.sampling.murmur_hash.murmur_hash32",
            sampling.murmur_hash32,
            HookType.AROUND,
        ),
        "deterministic_backend": allow_deterministic_torch_native,
        "batch_invariant_mode": (
            "sglang.srt.model_executor.model_runner.ModelRunner.maybe_enable_batch_invariant_mode",
            no_batch_invariant_mode_on_cpu,
            HookType.AROUND,
        ),
    }
    if ddtree.installed():
        # The twin runs the DDTree bundle's reference of the kernel.
        table["tree_sampling_kernel"] = sampling.provide_tree_sampling_kernel
    for name, fn in kernels.REPLACEMENTS.items():
        table[f"kernel_{name}"] = (f"sgl_kernel.speculative.{name}", fn, HookType.REPLACE)
    if ddtree.installed():
        table["ddtree_device"] = (
            "sglang.srt.speculative.ddtree_registration.check_ddtree_device",
            ddtree.device_on_cpu,
            HookType.AROUND,
        )
        table["ddtree_backend"] = ddtree.declare_torch_native
    if ddtree.installed() and os.environ.get("DDTREE_COVERAGE_RC"):
        table["ddtree_coverage"] = (
            "sglang.srt.speculative.ddtree_registration.DDTreeSpecAlgo.create_worker",
            coverage_startup.around,
            HookType.AROUND,
        )
    if ddtree.installed() and os.environ.get("DDTREE_TEST_MASK"):
        table["ddtree_mask_probe"] = (
            "sglang.srt.speculative.ddtree_utils.TreeMaskBuffer.write",
            ddtree.mask_buffer_write,
            HookType.AROUND,
        )
    if ddtree.installed() and os.environ.get("DDTREE_TEST_TRITON_REPLAY"):
        table["ddtree_triton_replay"] = (
            "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.init_forward_metadata",
            ddtree.triton_verify_replay,
            HookType.AROUND,
        )
        table["ddtree_eager_verify_round"] = (
            "sglang.srt.speculative.ddtree_worker_v2.DDTreeWorkerV2._verify_graph_unless",
            ddtree.eager_verify_round,
            HookType.AROUND,
        )
    if ddtree.installed() and os.environ.get("DDTREE_TEST_ORACLE"):
        table["ddtree_oracle"] = (
            "sglang.srt.speculative.ddtree_worker_v2.DDTreeWorkerV2._draft",
            ddtree.oracle_draft,
            HookType.AROUND,
        )
    return table


def register_all() -> None:
    """Register every stand-in, except those named in ``SGLANG_CPU_STANDINS_DISABLE``.

    The variable (comma-separated names, see :func:`_standins`) exists to show that each
    stand-in is needed: leave one out and the CPU server fails where its docstring says.
    """
    global _registered
    if _registered:
        return
    _registered = True
    import os

    from sglang.srt.plugins.hook_registry import HookRegistry

    from . import ddtree

    table = _standins()

    def names(var: str) -> set[str]:
        return {x.strip() for x in os.environ.get(var, "").split(",") if x.strip()}

    disabled = names("SGLANG_CPU_STANDINS_DISABLE")
    enabled = names("SGLANG_CPU_STANDINS_ENABLE")
    # DDTREE's stand-ins exist only where the bundle is installed; naming them elsewhere
    # is not a typo.
    ddtree_only = {"ddtree_device", "ddtree_backend", "ddtree_oracle", "ddtree_mask_probe", "ddtree_coverage",
                   "tree_sampling_kernel", "ddtree_triton_replay", "ddtree_eager_verify_round"}
    unknown = (disabled | enabled) - set(table) - ddtree_only
    if unknown or not enabled <= OPT_IN:
        raise ValueError(
            f"SGLANG_CPU_STANDINS_DISABLE/ENABLE: unknown stand-ins {sorted(unknown | (enabled - OPT_IN))}; "
            f"known: {sorted(table)}, opt-in: {sorted(OPT_IN)}"
        )
    disabled |= OPT_IN - enabled
    broken = os.environ.get("DDTREE_TEST_BREAK_HOOK")
    if broken and ddtree.installed():
        ddtree.break_hook(broken)
    for name, entry in table.items():
        if name in disabled:
            if name not in OPT_IN:
                logger.warning("sglang_cpu_standins: %s disabled", name)
        elif callable(entry):
            entry()
        else:
            HookRegistry.register(*entry)
    logger.info("sglang_cpu_standins: test-only CPU stand-ins registered: %s", sorted(set(table) - disabled))
