"""The DDTREE speculative algorithm: identity, server arguments, supported setups.

DDTREE (Diffusion Draft Tree) drafts like DFLASH -- one block-diffusion forward of
the draft model over a block of ``block_size`` positions -- and turns the draft's
per-position top-k into a tree of ``budget`` nodes that the target verifies in one
``TARGET_VERIFY`` pass under an ancestor-only attention mask.

Flags (SGLang's generic speculative fields, with EAGLE's meaning):

* ``--speculative-num-draft-tokens N``: tokens verified per round, the root plus
  ``budget = N - 1`` tree nodes (default: the draft block size);
* ``--speculative-eagle-topk K``: candidates per draft position (default 4);
* the draft block is the draft model's trained ``block_size`` (``config.json``), or
  ``--speculative-dflash-block-size`` for a draft whose config has none. DFlash
  drafts attend non-causally inside the block, so the block width is part of the
  trained model: it never follows the budget.

DDTREE is a member of the DFlash family (``is_dflash_family()``: same draft model,
same target hidden-state capture, same draft KV materialisation) with its own
predicate ``is_ddtree()``; ``is_dflash()`` stays False so the chain-only DFlash paths
(mask-less verify graphs, greedy draft sampler, chain accept) never run for it.
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any, Dict, Optional

from sglang.srt.speculative.ddtree_runtime import (
    EAGER_FROM_ENV,
    RuntimeConfig,
    RuntimeConfigError,
    TreeShape,
    load_runtime_config,
)
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

DDTREE_NAME = "DDTREE"
SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)
DEFAULT_DDTREE_TOPK = 4
# Tree building costs depth x budget x top-k per request, the verify pass
# budget + 1 tokens per request; past this the tree no longer fits the default
# verify-rows bound below even at batch 16.
MAX_DDTREE_BUDGET = 256
# Rows of verify logits per round the default max_running_requests allows:
# a round holds bs * (budget + 1) rows of vocab-wide fp32 logits, and sampling adds
# target and draft probability tensors of the same size. 4096 rows of a 152k
# vocabulary are 2.3 GiB per tensor.
DEFAULT_VERIFY_ROWS_PER_ROUND = 4096
DFLASH_DEFAULT_MAX_RUNNING_REQUESTS = 48

# Target attention backends whose TARGET_VERIFY applies DDTREE's tree mask, and how.
# Everything else is refused at startup: serving a tree without its mask verifies
# the wrong tokens.
TREE_VERIFY_BACKENDS: Dict[str, str] = {
    "flashinfer": "custom mask, captured into verify CUDA graphs",
    "triton": "custom mask (tree block read), captured into verify CUDA graphs",
    "fa3": "cascade tree attention (topk > 1); causal chain when topk == 1",
}
# Draft attention backends whose TARGET_VERIFY is a plain non-causal block: FA3
# switches to its tree path whenever speculative_eagle_topk > 1, and trtllm_mha
# sizes every verify window from speculative_num_draft_tokens.
BLOCK_DRAFT_BACKENDS = {"flashinfer", "triton"}
REFUSED_VERIFY_BACKENDS: Dict[str, str] = {
    "trtllm_mha": "it never reads a custom mask (verify is causal in the window)",
    "fa4": "its verify path is untested with a tree mask",
    "torch_native": "it has no TARGET_VERIFY path and no custom mask",
    "flex_attention": "it has no custom mask for TARGET_VERIFY",
}

# FA3's kernels (sgl_kernel's flash_attn) are built for these compute-capability
# majors only (``sgl_kernel/flash_attn.py`` ``is_fa3_supported``: sm80/86/89/90a);
# SGLang's argument resolution does not check it, so fa3 on a Blackwell GPU would
# resolve and fail at its first kernel.
FA3_CAPABILITY_MAJORS = (8, 9)

REFERENCE_SAMPLER_ENV = "SGLANG_DDTREE_REFERENCE_SAMPLER"


def is_ddtree(spec_algorithm: Any) -> bool:
    """Whether an algorithm (a builtin enum member or a registered one) is DDTREE."""
    predicate = getattr(spec_algorithm, "is_ddtree", None)
    return bool(predicate()) if callable(predicate) else False


def reference_sampler_enabled() -> bool:
    """Whether sampled requests may use the pure-torch twin of the sampling kernel
    where the kernel cannot run (exact, but slow: for CPU testing)."""
    return os.environ.get(REFERENCE_SAMPLER_ENV, "") not in ("", "0", "false")


class DDTreeError(ValueError):
    """A DDTREE server configured with something it cannot serve correctly."""


class DDTreeSpecAlgo(CustomSpecAlgo):
    """DDTREE's predicates: a DFlash-family member that verifies trees."""

    def is_ddtree(self) -> bool:
        return True

    def is_dflash(self) -> bool:
        return False

    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        # The DFlash draft block runs as TARGET_VERIFY on the draft runner.
        return True

    def supports_prefill_shared_read_done(self) -> bool:
        return True

    def supports_mixed_chunk(self) -> bool:
        # Mixed rounds run DFlash's target extend and draft KV materialisation.
        return True

    def supports_grammar_overlap(self) -> bool:
        # Constrained requests are refused per request.
        return False

    def has_draft_kv(self) -> bool:
        return True

    # The scheduler calls these three on any algorithm; CustomSpecAlgo lacks them
    # in 0.5.23. They answer like DFLASH.
    def need_topk(self) -> bool:
        return False

    def carries_draft_hidden_states(self) -> bool:
        return False

    def create_future_map(
        self,
        device,
        req_to_token_pool,
        needs_cpu_seq_lens: bool = True,
        needs_confidence_relay: bool = False,
    ):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(
            device,
            self,
            req_to_token_pool,
            needs_cpu_seq_lens,
            needs_confidence_relay,
        )

    def get_num_tokens_per_req_for_target_verify(
        self, num_draft_tokens: int, is_draft_worker: bool
    ) -> int:
        # The draft runner runs the DFlash block; the target verifies the tree.
        if is_draft_worker:
            from sglang.srt.runtime_context import get_spec

            return int(get_spec().speculative_dflash_block_size)
        return num_draft_tokens

    def resolve_max_speculative_num_draft_tokens(
        self, server_args: ServerArgs
    ) -> Optional[int]:
        # A round writes the draft block and the verify window from the same
        # committed position: reserve for the wider of the two.
        from sglang.srt.arg_groups.overrides import resolving_view

        cfg = resolving_view(server_args)
        widths = [
            int(w)
            for w in (
                cfg.speculative_num_draft_tokens,
                cfg.speculative_dflash_block_size,
            )
            if w is not None
        ]
        # A runtime state may switch to a wider tree after the scheduler reserved
        # the KV of the next decode batch (runtime_context.max_speculative_num_draft_tokens).
        runtime = runtime_config_of(cfg)
        if runtime is not None:
            widths.append(runtime.max_budget + 1)
        return max(widths) if widths else None

    def handle_server_args(self, server_args: ServerArgs) -> None:
        resolve_ddtree_server_args(server_args)


def runtime_config_of(cfg: Any) -> Optional[RuntimeConfig]:
    """The ``ddtree`` section of ``--speculative-adaptive-config`` (the set of runtime
    tree states), checked against the launch tree; None without one."""
    path = getattr(cfg, "speculative_adaptive_config", None)
    if not path or cfg.speculative_num_draft_tokens is None:
        return None
    topk = cfg.speculative_eagle_topk
    launch = TreeShape(
        budget=int(cfg.speculative_num_draft_tokens) - 1,
        topk=DEFAULT_DDTREE_TOPK if topk is None else int(topk),
    )
    try:
        return load_runtime_config(
            path,
            launch=launch,
            max_budget=MAX_DDTREE_BUDGET,
            eager_from=os.environ.get(EAGER_FROM_ENV),
        )
    except RuntimeConfigError as e:
        raise DDTreeError(f"DDTREE: {e}") from e


def _draft_block_size(cfg: Any) -> int:
    """The draft model's trained block size, or ``--speculative-dflash-block-size``."""
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers_utils import get_config

    draft_hf_config = get_config(
        cfg.speculative_draft_model_path,
        trust_remote_code=cfg.trust_remote_code,
        revision=cfg.speculative_draft_model_revision,
        model_override_args=json.loads(cfg.json_model_override_args),
    )
    trained = parse_dflash_draft_config(
        draft_hf_config=draft_hf_config
    ).resolve_block_size(default=None)
    flag = cfg.speculative_dflash_block_size
    if trained is not None and flag is not None and int(flag) != int(trained):
        raise DDTreeError(
            f"--speculative-dflash-block-size {flag} differs from the draft model's "
            f"trained block_size {trained}; DDTREE drafts with the trained block "
            "(drop the flag)."
        )
    block = trained if trained is not None else flag
    if block is None:
        raise DDTreeError(
            "the DDTREE draft model's config has no block_size; pass "
            "--speculative-dflash-block-size with the block it was trained with."
        )
    if int(block) < 2:
        raise DDTreeError(
            f"--speculative-dflash-block-size must be >= 2 for DDTREE, got {block}."
        )
    return int(block)


def _verify_backend(cfg: Any) -> str:
    """The attention backend that runs the target's TARGET_VERIFY."""
    from sglang.srt.arg_groups.model_override_base import attention_backends_of

    prefill, decode = attention_backends_of(cfg)
    backend = decode if cfg.speculative_attention_mode == "decode" else prefill
    return str(backend)


def _decode_graph_mode(cfg: Any) -> str:
    graph = getattr(cfg, "cuda_graph_config", None)
    decode = getattr(graph, "decode", None)
    return str(getattr(decode, "backend", "unknown"))


def check_ddtree_device(cfg: Any) -> None:
    """DDTREE runs where its verify path is built: CUDA devices (or an out-of-tree
    platform that says it supports DDTREE)."""
    from sglang.srt.platforms import current_platform

    if current_platform.is_out_of_tree():
        supported = current_platform.supports_speculative_algorithm(DDTREE_NAME)
    else:
        supported = str(cfg.device).startswith("cuda")
    if not supported:
        raise DDTreeError(
            f"DDTREE speculative decoding is not supported on --device {cfg.device} "
            f"({type(current_platform).__name__}); it needs a CUDA device."
        )


def _device_capability() -> Optional[tuple]:
    """(major, minor) of the CUDA device SGLang resolves for, or None off CUDA."""
    from sglang.srt.runtime_context import get_platform

    if not get_platform().is_cuda:
        return None
    major, minor = get_platform().device_capability
    return None if major is None else (int(major), int(minor or 0))


def backend_problem(
    backend: str, *, topk: int, topk_max: int, capability: Optional[tuple]
) -> Optional[str]:
    """Why DDTREE cannot verify with ``backend`` here (None: it can). ``topk`` is
    the launch top-k, ``topk_max`` the largest a runtime state serves, ``capability``
    the CUDA device's (None off CUDA)."""
    if backend not in TREE_VERIFY_BACKENDS:
        return REFUSED_VERIFY_BACKENDS.get(
            backend, "its TARGET_VERIFY path has not been checked with a tree mask"
        )
    if backend == "fa3":
        if capability is not None and capability[0] not in FA3_CAPABILITY_MAJORS:
            return (
                f"its kernels run on sm_80/sm_90 only and this GPU is "
                f"sm_{capability[0]}{capability[1]}"
            )
        if topk == 1 < topk_max:
            # FA3 picks its tree path (the one that reads the mask) from the launch top-k.
            return (
                "it builds its verify path from the launch top-k (1), and a runtime "
                f"state serves top-k up to {topk_max}"
            )
    return None


def check_verify_backend(backend: str, decode_graph: str, device: str) -> str:
    """How the tree mask reaches attention for this setup; raises if it does not.

    ``decode_graph`` does not change the answer for the supported backends: the
    verify graphs are captured with the mask buffer (flashinfer, triton) or read
    the live mask at replay (fa3).
    """
    del device  # checked by check_ddtree_device
    if backend in TREE_VERIFY_BACKENDS:
        return TREE_VERIFY_BACKENDS[backend]
    reason = REFUSED_VERIFY_BACKENDS.get(
        backend, "its TARGET_VERIFY path has not been checked with a tree mask"
    )
    raise DDTreeError(
        f"DDTREE cannot verify with --attention-backend {backend} "
        f"(decode graphs: {decode_graph}): {reason}; use one of "
        f"{', '.join(sorted(TREE_VERIFY_BACKENDS))}."
    )


def default_attention_backend(cfg: Any, chosen: str, model_config: Any) -> str:
    """SGLang's default attention backend (``chosen``, from
    ``get_default_attn_backend``) for a launch that names none, unless DDTREE cannot
    verify with it there; then the one SGLang picks for a tree on the same GPU.

    Why: on sm_100/sm_103 (B200/B300) 0.5.23 defaults an MHA target at
    ``--speculative-eagle-topk 1`` to ``trtllm_mha`` (``model_override_base.py``,
    ``get_default_attn_backend`` 1.2), which never reads a custom mask, and on
    sm_90 to ``fa3``, whose tree path follows the launch top-k: a top-k 1 launch
    there would be refused (or, with runtime states up to a larger top-k, refused
    on H100 too). With top-k >= 2 SGLang picks FlashInfer on all of these GPUs
    (Triton without FlashInfer or with attention sinks, its own fallback), so a
    whole budget x top-k grid verifies on one backend. A backend the user names is
    never changed: it is checked, and refused with the flag to change."""
    if str(getattr(cfg, "speculative_algorithm", None) or "").upper() != DDTREE_NAME:
        return chosen
    topk = cfg.speculative_eagle_topk
    topk = DEFAULT_DDTREE_TOPK if topk is None else int(topk)
    try:
        runtime = runtime_config_of(cfg)
    except DDTreeError:
        runtime = None  # refused with its own line in resolve_ddtree_server_args
    topk_max = topk if runtime is None else max(topk, runtime.topk_max)
    why = backend_problem(
        chosen, topk=topk, topk_max=topk_max, capability=_device_capability()
    )
    if why is None:
        return chosen
    from sglang.srt.runtime_context import get_platform

    sinks = bool(getattr(model_config, "has_attention_sinks", False))
    replacement = (
        "flashinfer" if get_platform().has_flashinfer and not sinks else "triton"
    )
    logger.info(
        "DDTREE: SGLang's default attention backend here, %s, cannot verify a tree "
        "(%s); using %s (pass --attention-backend to choose).",
        chosen,
        why,
        replacement,
    )
    return replacement


def resolve_ddtree_server_args(server_args: Any) -> None:
    """Validate DDTREE's flags, refuse what it cannot serve, and size its windows.

    ``server_args`` is the recording stand-in SGLang hands a registered algorithm:
    reads see the resolution so far, writes are declared as resolutions.
    """
    cfg = server_args
    _check_sglang_version()
    check_ddtree_device(cfg)

    if cfg.speculative_draft_model_path is None:
        raise DDTreeError(
            "DDTREE requires --speculative-draft-model-path (a DFlash draft model)."
        )
    block = _draft_block_size(cfg)
    topk = cfg.speculative_eagle_topk
    topk = DEFAULT_DDTREE_TOPK if topk is None else int(topk)
    if topk < 1:
        raise DDTreeError(f"--speculative-eagle-topk must be >= 1, got {topk}.")
    from sglang.srt.arg_groups.model_override_base import model_config_of

    vocab = int(model_config_of(cfg).vocab_size)
    if topk > vocab:
        raise DDTreeError(
            f"--speculative-eagle-topk {topk} exceeds the target vocabulary ({vocab})."
        )
    num_draft_tokens = cfg.speculative_num_draft_tokens
    budget = block - 1 if num_draft_tokens is None else int(num_draft_tokens) - 1
    if not 1 <= budget <= MAX_DDTREE_BUDGET:
        raise DDTreeError(
            "--speculative-num-draft-tokens is the DDTREE verify window (root + "
            f"budget nodes) and must be in 2..{MAX_DDTREE_BUDGET + 1}, got "
            f"{num_draft_tokens}."
        )
    # The verify backend first: a backend DDTREE refuses may have made SGLang change
    # other flags for it (trtllm_mha and fa4 force --page-size 64 / 128), and the
    # line must name the flag to change, not the one SGLang changed.
    backend = _verify_backend(cfg)
    graph = _decode_graph_mode(cfg)
    how = check_verify_backend(backend, graph, str(cfg.device))
    capability = _device_capability()
    if (
        backend == "fa3"
        and capability is not None
        and capability[0] not in FA3_CAPABILITY_MAJORS
    ):
        raise DDTreeError(
            f"DDTREE cannot verify with --attention-backend fa3 on this GPU "
            f"(sm_{capability[0]}{capability[1]}): FA3's kernels run on sm_80/sm_90 "
            "only; use flashinfer or triton."
        )
    if cfg.speculative_num_steps not in (None, 1):
        raise DDTreeError(
            "--speculative-num-steps does not apply to DDTREE (one draft forward "
            f"per round); got {cfg.speculative_num_steps}."
        )
    if int(cfg.page_size or 1) != 1:
        raise DDTreeError(
            f"DDTREE needs --page-size 1 (accepted tree nodes are compacted token "
            f"by token), got {cfg.page_size}."
        )
    if cfg.pp_size != 1:
        raise DDTreeError(f"DDTREE needs --pp-size 1, got {cfg.pp_size}.")
    from sglang.srt.runtime_context import attn_dp_enabled_of

    if attn_dp_enabled_of(cfg):
        raise DDTreeError("DDTREE does not support dp attention (--attn-dp-size).")
    if cfg.speculative_draft_window_size is not None:
        raise DDTreeError(
            "DDTREE does not support --speculative-draft-window-size: tree nodes "
            "are not a contiguous draft window."
        )
    if cfg.speculative_use_rejection_sampling:
        raise DDTreeError(
            "DDTREE verifies trees with tree rejection sampling; drop "
            "--speculative-use-rejection-sampling."
        )
    if getattr(cfg, "enable_watermark", False):
        raise DDTreeError(
            "DDTREE does not support --enable-watermark: the watermark biases every "
            "tree node by the committed tokens only, not by its ancestors."
        )
    if cfg.disaggregation_mode not in (None, "null"):
        raise DDTreeError(
            f"DDTREE does not support --disaggregation-mode {cfg.disaggregation_mode}."
        )
    for flag in ("accept_threshold_single", "accept_threshold_acc"):
        value = float(getattr(cfg, f"speculative_{flag}"))
        if not 0.0 < value <= 1.0:
            raise DDTreeError(
                f"--speculative-{flag.replace('_', '-')} must be in (0, 1], "
                f"got {value}."
            )

    # The launch tree is resolved; the runtime set, if any, must hold it. Checked here,
    # in the launcher, so that a bad file refuses the launch before weights load.
    server_args.speculative_eagle_topk = topk
    server_args.speculative_num_draft_tokens = budget + 1
    runtime = runtime_config_of(cfg)
    if runtime is not None and backend == "fa3" and topk == 1 < runtime.topk_max:
        # FA3 picks its tree path (the one that reads the mask) from the launch top-k.
        raise DDTreeError(
            "DDTREE: --attention-backend fa3 builds its verify path from the launch "
            f"top-k; launch with --speculative-eagle-topk > 1 when ddtree.topk_max is "
            f"{runtime.topk_max} (--speculative-adaptive-config {runtime.source})."
        )
    widest = budget if runtime is None else runtime.max_budget

    # DFlash's draft attention backend resolution, shared; then keep the draft
    # on a backend whose TARGET_VERIFY is a plain block.
    from sglang.srt.arg_groups.speculative_hook import (
        _resolve_dflash_draft_attention_backend,
    )

    _resolve_dflash_draft_attention_backend(server_args)
    draft_backend = cfg.speculative_draft_attention_backend
    if draft_backend not in BLOCK_DRAFT_BACKENDS:
        chosen = backend if backend in BLOCK_DRAFT_BACKENDS else "flashinfer"
        logger.warning(
            "DDTREE draft attention backend %s -> %s: the DFlash draft block must "
            "run as a plain non-causal block, which %s does not do under DDTREE "
            "(it takes a tree or fixed-window path).",
            draft_backend,
            chosen,
            draft_backend,
        )
        server_args.speculative_draft_attention_backend = chosen
        draft_backend = chosen

    server_args.speculative_dflash_block_size = block
    server_args.speculative_num_steps = 1
    if cfg.max_running_requests is None:
        server_args.max_running_requests = max(
            1,
            min(
                DFLASH_DEFAULT_MAX_RUNNING_REQUESTS,
                DEFAULT_VERIFY_ROWS_PER_ROUND // (widest + 1),
            ),
        )
    logger.info(
        "DDTREE: budget=%d topk=%d draft_block=%d verify_backend=%s (%s) "
        "draft_backend=%s decode_graphs=%s runtime_budgets=%s",
        budget,
        topk,
        block,
        backend,
        how,
        draft_backend,
        graph,
        "none" if runtime is None else ",".join(map(str, runtime.budgets)),
    )


def _check_sglang_version() -> None:
    from importlib import metadata

    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise DDTreeError(
            f"this DDTREE build supports SGLang {', '.join(SUPPORTED_SGLANG_VERSIONS)}"
            f", found {version}; install a DDTREE build for {version}."
        )


def _ddtree_worker_factory(server_args: ServerArgs):
    from sglang.srt.speculative.ddtree_worker_v2 import DDTreeWorkerV2

    return DDTreeWorkerV2


def register_ddtree() -> DDTreeSpecAlgo:
    """Register DDTREE once per process; later calls return the registration."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    existing = get_spec(DDTREE_NAME)
    if existing is None:
        SpeculativeAlgorithm.register(
            DDTREE_NAME, supports_overlap=True, spec_class=DDTreeSpecAlgo
        )(_ddtree_worker_factory)
        existing = get_spec(DDTREE_NAME)
    assert isinstance(existing, DDTreeSpecAlgo), existing
    return existing
