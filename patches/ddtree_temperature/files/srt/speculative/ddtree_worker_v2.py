"""DDTREE speculative decoding worker (spec-v2), built on the DFlash v2 worker.

One decode round, every step on the device in whole-batch operations:

1. DFlash's draft step over one block of ``block_size`` positions (the draft
   model's trained block: DFlash drafts attend non-causally inside it), with
   DFlash's block preparation; the draft head's top-k over the target ``lm_head``
   (``candidate_topk``: shards gathered as candidate pairs, not vocab-wide
   logits) runs once, folded into the draft CUDA graph where one is captured;
2. one best-first tree of ``budget`` nodes per request (``build_tree_batch``);
3. one ``TARGET_VERIFY`` pass over ``N = budget + 1`` tokens per request: tokens in
   pop order, positions by depth, the ancestor-only mask written into a persistent
   buffer (only the tree blocks change per round), and -- when a request samples --
   the first-child / next-sibling retrieve tensors;
4. accept: the greedy walk for all-greedy batches, the tree rejection-sampling
   kernel ``tree_speculative_sampling_target_only`` otherwise (thresholds from
   ``--speculative-accept-threshold-*``);
5. one commit path for both: the accepted nodes' target KV moved to the front of
   the verify window (``move_accept_tokens_to_target_kvcache``, as EAGLE's tree
   commit), their target hidden states written to the draft KV with DFlash's
   writer, and the accepted tokens returned chain-shaped.

Prefill, mixed and idle rounds are DFlash's.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any, Dict, Optional

import torch

from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.kernels.ops.speculative.dflash import _prepare_dflash_draft_block_unchecked
from sglang.srt.environ import envs
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.lora.layers import unwrap_lora_layer
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    enable_num_token_non_padded,
)
from sglang.srt.models.dflash import candidate_topk
from sglang.srt.runtime_context import get_context, get_exec, get_parallel, get_spec
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative import (
    ddtree_plugin,
    ddtree_reference,
    ddtree_runtime,
    ddtree_trace,
    ddtree_utils,
)
from sglang.srt.speculative.ddtree_info import (
    DDTreeDraftInputV2,
    DDTreeVerifyInput,
    make_ddtree_draft_input,
)
from sglang.srt.speculative.ddtree_registration import (
    reference_sampler_enabled,
    runtime_config_of,
)
from sglang.srt.speculative.ddtree_runtime import (
    CaptureContextPoisoned,
    CaptureDisagreement,
    StateMemory,
    StateMemoryExceeded,
    StateOutcome,
    TreeRuntime,
    TreeShape,
    build_state,
    graph_max_bs,
)
from sglang.srt.speculative.dflash_utils import (
    apply_dflash_verify_logits_adjustments,
    build_speculative_verify_target_probs,
)
from sglang.srt.speculative.dflash_worker_v2 import (
    DFlashWorkerV2,
    _is_all_greedy,
    _resolve_dflash_embedding_module,
)
from sglang.srt.speculative.draft_worker_common import (
    build_block_pos_offsets,
    make_draft_block_spec_info,
)
from sglang.srt.speculative.eagle_utils import _verify_coins
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite
from sglang.srt.speculative.spec_utils import (
    draft_tp_context,
    move_accept_tokens_to_target_kvcache,
    record_stream_each,
)

logger = logging.getLogger(__name__)


def tree_sampling_kernel():
    """SGLang's ``tree_speculative_sampling_target_only`` for this platform, or None.

    Looked up at call time in ``kernels/ops/speculative/verify_sampling.py``, which
    resolves the op once per platform (on CUDA the JIT op of
    ``kernels/ops/speculative/sampling.py``; None where the platform has none), the
    name DFlash's sampled verify uses too.
    """
    from sglang.kernels.ops.speculative import verify_sampling

    return verify_sampling.tree_speculative_sampling_target_only


def sampling_kernel_available() -> bool:
    """Whether ``tree_speculative_sampling_target_only`` can run in this process."""
    return tree_sampling_kernel() is not None


def sampling_verifier_available() -> bool:
    """Whether sampled (temperature > 0) requests can be verified exactly here."""
    return sampling_kernel_available() or reference_sampler_enabled()


class DDTreeUnsupported(ValueError):
    """A DDTREE server started with a draft or target it cannot serve."""


class _DDTreeDraftCandidates:
    """Top-k draft candidates of the block positions ``1..depth`` over the target
    ``lm_head``, with their log-probabilities under the full vocabulary.

    Called with the draft model's hidden states; as a capture tail hook it runs
    inside the draft CUDA graph and leaves its result in static buffers, so the
    head is applied once per round.
    """

    def __init__(self, *, lm_head, block_size, depth, topk, max_bs, device):
        self.lm_head = lm_head
        self.block_size = int(block_size)
        self.depth = int(depth)
        self.topk = int(topk)
        rows = int(max_bs) * self.depth
        self.ids = torch.empty((rows, self.topk), dtype=torch.int64, device=device)
        self.logprobs = torch.empty(
            (rows, self.topk), dtype=torch.float32, device=device
        )

    def compute(self, hidden_states: torch.Tensor):
        bs = hidden_states.shape[0] // self.block_size
        positions = hidden_states.view(bs, self.block_size, -1)[:, 1 : 1 + self.depth]
        ids, logits, lse = candidate_topk(
            positions.reshape(-1, hidden_states.shape[-1]),
            self.lm_head,
            self.topk,
            with_partition=True,
        )
        return ids, logits.float() - lse.unsqueeze(-1)

    def __call__(self, hidden_states, input_ids=None):
        ids, logprobs = self.compute(hidden_states)
        rows = ids.shape[0]
        self.ids[:rows].copy_(ids)
        self.logprobs[:rows].copy_(logprobs)


class _CaptureProbe:
    """What ``DecodeCudaGraphRunner.get_spec_info`` reads of its runner, for the
    start-up check that the capture hook hands a target verify the mask buffer."""

    def __init__(self, model_runner, width: int, device) -> None:
        self.model_runner = model_runner
        self.captured_req_width = int(width)
        self.buffers = SimpleNamespace(
            custom_mask=torch.ones(
                int(width) * int(width), dtype=torch.bool, device=device
            )
        )


@dataclass(frozen=True)
class _TreeState:
    """One budget's verify resources (``SpecRuntimeState``'s verify half): the
    target attention backend built for its width and its verify graph, if any."""

    attn_backend: Any
    graph_runner: Any


@dataclass
class _DraftRound:
    """The draft step's results a round keeps using."""

    topk_ids: torch.Tensor  # [bs, depth, k]
    topk_logprobs: torch.Tensor  # [bs, depth, k]
    cache_loc: torch.Tensor  # [bs, window] virtual slots from the prefix on
    kv_loc_plan: object


@contextlib.contextmanager
def _without_dflash_block_warning():
    """DFlashWorkerV2 warns when speculative_num_draft_tokens differs from the draft
    block size; under DDTREE they differ by design (verify window vs draft block)."""
    from sglang.srt.speculative import dflash_worker_v2

    class _Filter(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "block size mismatch" not in record.getMessage()

    f = _Filter()
    dflash_worker_v2.logger.addFilter(f)
    try:
        yield
    finally:
        dflash_worker_v2.logger.removeFilter(f)


class DDTreeWorkerV2(DFlashWorkerV2):
    """DFlash drafting, tree verification."""

    def __init__(
        self,
        server_args: ServerArgs,
        gpu_id: int,
        nccl_port: int,
        target_worker: TpModelWorker,
    ):
        with _without_dflash_block_warning():
            super().__init__(server_args, gpu_id, nccl_port, target_worker)
        spec = get_spec()
        self.verify_width = int(spec.speculative_num_draft_tokens)
        self.ddtree_budget = self.verify_width - 1
        self.ddtree_topk = int(spec.speculative_eagle_topk)
        self._adopt_block_size(int(spec.speculative_dflash_block_size))
        # The runtime tree states (--speculative-adaptive-config): the window, the
        # candidate buffers and the context-end bound are sized for the widest tree
        # and the largest top-k of the set, so a switch changes no buffer.
        self.ddtree_runtime = TreeRuntime(
            launch=TreeShape(self.ddtree_budget, self.ddtree_topk),
            config=runtime_config_of(spec),
        )
        self._tree_states: Dict[int, _TreeState] = {}
        # The tree trace (ddtree_trace.py): None = off, the round never looks further.
        self._trace: Optional[ddtree_trace.TraceConfig] = None
        widest = max(self.ddtree_runtime.budgets)
        self.ddtree_topk_max = self.ddtree_runtime.topk_max
        # Draft positions 1..block-1 propose tokens; a tree never goes deeper than
        # its budget.
        self.ddtree_depth = min(self.block_size - 1, self.ddtree_budget)
        self.ddtree_max_depth = min(self.block_size - 1, widest)
        self.window = max(self.block_size, widest + 1)
        self._mask_buffer = ddtree_utils.TreeMaskBuffer(self.device)
        self._logged_eager_mask_round = False
        self._window_ids: Optional[torch.Tensor] = None
        self._window_positions: Optional[torch.Tensor] = None
        self._window_cache_loc: Optional[torch.Tensor] = None
        self._window_seq_lens_cpu: Optional[torch.Tensor] = None
        self._window_offsets = build_block_pos_offsets(
            length=self.window, device=self.device
        )
        self._refuse_unsupported()
        self._eager_candidate_head: Optional[_DDTreeDraftCandidates] = None
        # Filled by init_cuda_graphs, the scheduler's last start-up step.
        self._startup_checks: Optional[dict] = None
        if sampling_kernel_available():
            self._sampler = "kernel"
        elif reference_sampler_enabled():
            self._sampler = "reference"
        else:
            self._sampler = "none"
        if get_parallel().tp_rank == 0:
            logger.info(
                "DDTREE worker ready: budget=%d topk=%d draft_block=%d depth=%d "
                "verify_width=%d sampler=%s",
                self.ddtree_budget,
                self.ddtree_topk,
                self.block_size,
                self.ddtree_depth,
                self.verify_width,
                self._sampler,
            )

    # ------------------------------------------------------------------ setup

    def _adopt_block_size(self, block_size: int) -> None:
        """Re-size what DFlashWorkerV2 sized from speculative_num_draft_tokens (the
        verify window under DDTREE) to the draft block."""
        self.block_size = block_size
        self.draft_model.set_block_size(block_size)
        self.speculative_num_draft_tokens = self.verify_width
        self._block_pos_offsets = build_block_pos_offsets(
            length=block_size, device=self.device
        )
        self._draft_block_spec_info = make_draft_block_spec_info(
            draft_token_num=block_size, device=self.device
        )

    def _refuse_unsupported(self) -> None:
        unsupported = []
        if self.selector is not None:
            unsupported.append("candidate-selector drafts")
        if self.lilicorr is not None:
            unsupported.append("LiLiCorr drafts")
        if self._is_domino:
            unsupported.append("Domino drafts")
        if self.use_compact_draft_cache:
            unsupported.append("--speculative-draft-window-size")
        if self._need_mamba_verify_commit:
            unsupported.append("hybrid (mamba) target models")
        if get_parallel().attn_dp_enabled:
            unsupported.append("dp attention")
        if unsupported:
            raise DDTreeUnsupported(
                "DDTREE does not support " + ", ".join(unsupported) + "; use DFLASH."
            )

    def init_cuda_graphs(self):
        """DFlash's draft graphs; then, with the target's verify graphs already
        captured (``Scheduler.init_all_cuda_graphs`` runs the target first) and the
        KV pools sized, the start-up checks and the context-end bound."""
        super().init_cuda_graphs()
        self._build_tree_states()
        self._startup_checks = self._check_tree_mask_path()
        ddtree_plugin.set_round_shape(
            ddtree_plugin.RoundShape(
                context_len=int(self.model_runner.model_config.context_len),
                row_len=int(self.model_runner.req_to_token_pool.req_to_token.shape[1]),
                window=self.window,
                max_depth=self.ddtree_max_depth,
            )
        )

    # ------------------------------------------------------- runtime states

    def _build_tree_states(self) -> None:
        """One verify state per budget of the set, as
        ``eagle_worker_v2.build_adaptive_runtime_state`` builds one per step count:
        the launch budget keeps what SGLang built; every other budget gets a target
        attention backend and a verify graph built with its width in the config,
        each measured (free device memory before and after, as that function logs
        ``mem=``) and the lot capped by ``ddtree.state_memory_fraction``."""
        runner = self.model_runner
        runtime = self.ddtree_runtime
        launch = runtime.launch.budget
        graphs = runner.decode_cuda_graph_runner is not None
        self._tree_states[launch] = _TreeState(
            runner.attn_backend, runner.decode_cuda_graph_runner
        )
        outcomes = [
            StateOutcome(
                launch,
                "captured" if graphs else "disabled",
                cuda_graph_max_bs=graph_max_bs(runner.decode_cuda_graph_runner),
            )
        ]
        config = runtime.config
        rank0 = get_parallel().tp_rank == 0
        agree = self._tp_capture_agreement() if graphs else None
        memory = None
        if config is not None and len(config.budgets) > 1:
            memory = StateMemory(self._free_memory_mb, config.state_memory_fraction)
            runtime.memory = memory
        for budget in () if config is None else config.budgets:
            if budget == launch:
                continue
            assert memory is not None
            with self._verify_width_config(budget + 1):
                try:
                    backend, graph, outcome = build_state(
                        budget,
                        lambda b: self._new_target_attn_backend(),
                        lambda backend, b: self._capture_verify_graph(backend, b + 1),
                        graphs_enabled=graphs,
                        config=config,
                        memory=memory,
                        probe=ddtree_runtime.cuda_context_probe,
                        agree=agree,
                        log=logger.info,
                    )
                except (
                    CaptureContextPoisoned,
                    CaptureDisagreement,
                    StateMemoryExceeded,
                ) as e:
                    # one line before the scheduler's traceback: what the toolkit's
                    # log reader reports (and, for a poisoned context, relaunches
                    # eager on: the line carries "Capture cuda graph failed:")
                    logger.error("%s", e)
                    raise
            outcomes.append(outcome)
            if rank0:
                logger.info(
                    "DDTREE runtime state budget %d: mem=%.0f MB (verify graph %s); "
                    "states %.0f of %.0f MB allowed, avail mem=%.0f MB",
                    budget,
                    outcome.memory_mb or 0.0,
                    outcome.cuda_graph,
                    memory.used_mb,
                    memory.cap_mb,
                    memory.free_at_start_mb - memory.used_mb,
                )
            if outcome.reason is not None:
                logger.warning(
                    "DDTREE budget %d: verify graph not captured (%s); %s.",
                    budget,
                    outcome.reason,
                    "dropped from the runtime states"
                    if outcome.cuda_graph == "dropped"
                    else "served eager, the other budgets keep their graphs",
                )
            if outcome.cuda_graph != "dropped":
                self._tree_states[budget] = _TreeState(backend, graph)
        runtime.outcomes = sorted(outcomes, key=lambda o: o.budget)
        if config is not None and rank0:
            logger.info(
                "DDTREE runtime states: %s; top-k 1..%d; mode %s",
                ", ".join(f"{o.budget} ({o.cuda_graph})" for o in runtime.outcomes),
                runtime.topk_max,
                runtime.mode,
            )

    @staticmethod
    def _tp_capture_agreement():
        """Under TP > 1, every rank's capture status gathered over the TP CPU group
        (``ddtree_runtime.tp_capture_agreement``); None with one rank."""
        from sglang.srt.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        if group.world_size <= 1:
            return None
        return ddtree_runtime.tp_capture_agreement(group.cpu_group, group.world_size)

    def _free_memory_mb(self) -> float:
        """Free device memory in MB, read as SGLang reads it around every capture
        (``get_available_gpu_memory``, GB; it empties the allocator's cache first)."""
        from sglang.srt.utils.common import get_available_gpu_memory

        return float(get_available_gpu_memory(self.device, self.gpu_id)) * 1024.0

    @contextlib.contextmanager
    def _verify_width_config(self, width: int):
        """The config a verify backend and graph of ``width`` tokens are built
        under (capture shapes read ``speculative_num_draft_tokens``; restored after,
        as ``eagle_worker_v2._override_worker_state`` does)."""
        launch = self.ddtree_runtime.launch.budget + 1
        get_context().override(
            "ddtree.capture_override", speculative_num_draft_tokens=int(width)
        )
        try:
            yield
        finally:
            get_context().override(
                "ddtree.capture_restore", speculative_num_draft_tokens=launch
            )

    def _new_target_attn_backend(self):
        runner = self.model_runner
        backup = runner.init_new_workspace
        try:
            return runner._get_attention_backend(init_new_workspace=True)
        finally:
            runner.init_new_workspace = backup

    def _capture_verify_graph(self, attn_backend, width: int):
        # CUDA graphs exist only on a GPU (see the bundle README).
        runner = self.model_runner
        return runner._decode_cuda_graph_runner_cls()(
            runner,
            attn_backend=attn_backend,
            speculative_num_steps=1,
            speculative_num_draft_tokens=int(width),
        )

    def _use_tree(self, shape: TreeShape) -> None:
        """Make ``shape`` the tree of the round about to run: called at the start of a
        decode round, so a switch never lands inside one. Every buffer is sized for
        the widest tree; only the verify width, its backend and graph change."""
        if shape.budget != self.ddtree_budget:
            state = self._tree_states[shape.budget]
            self.ddtree_budget = shape.budget
            self.verify_width = shape.budget + 1
            self.speculative_num_draft_tokens = self.verify_width
            self.ddtree_depth = min(self.block_size - 1, shape.budget)
            self.model_runner.attn_backend = state.attn_backend
            self.model_runner.decode_cuda_graph_runner = state.graph_runner
        self.ddtree_topk = shape.topk

    def request_tree_switch(self, request: Dict[str, Any]):
        """Validate a ``/set_internal_state`` switch; returns what to commit (raises
        ``TreeSwitchRefused``). Committed by :meth:`commit_tree_switch` once every
        key of the request passed."""
        if ddtree_trace.trace_keys(request):
            return ("trace", self._plan_trace(request))
        return self.ddtree_runtime.plan(request)

    def _plan_trace(self, request: Dict[str, Any]):
        """A ``ddtree_trace`` switch (it goes alone), validated: the trace config or
        None (off)."""
        runtime = self.ddtree_runtime
        try:
            if len(ddtree_trace.trace_keys(request)) != len(request):
                raise ddtree_trace.TraceRefused(
                    "DDTREE: the ddtree_trace keys go alone (pin a tree with a "
                    "separate request)."
                )
            return ddtree_trace.parse_trace_request(
                request,
                budgets=None if runtime.config is None else runtime.budgets,
                topk_max=runtime.topk_max,
                block_size=self.block_size,
            )
        except ddtree_trace.TraceRefused as e:
            runtime.last_refusal = str(e)
            raise ddtree_runtime.TreeSwitchRefused(str(e)) from e

    def describe_trace(self) -> dict:
        """What ``internal_states[i].ddtree.trace`` reports."""
        if self._trace is None:
            return dict(ddtree_trace.OFF_DESCRIPTION)
        return self._trace.describe()

    def commit_tree_switch(self, planned) -> None:
        if planned[0] == "trace":
            self._trace = planned[1]
            self.ddtree_runtime.last_refusal = None
            return
        self.ddtree_runtime.commit(planned)
        if self.ddtree_runtime.mode == "pinned":
            self._use_tree(self.ddtree_runtime.active)

    def _check_tree_mask_path(self) -> dict:
        """Refuse to start unless the tree mask reaches the target's verify: every
        plugin hook is in place, the capture hook hands the runner's mask buffer to a
        target-verify capture, and graphs already captured got it. What
        ``/server_info`` reports under ``ddtree.tree_mask``."""
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import (
            DecodeCudaGraphRunner,
        )

        hooks = ddtree_plugin.verify_hooks()
        probe = _CaptureProbe(self.model_runner, self.verify_width, self.device)
        try:
            info = DecodeCudaGraphRunner.get_spec_info(probe, self.verify_width)
        finally:
            ddtree_plugin.CAPTURED_WITH_MASK.pop(id(probe), None)
        if not (
            isinstance(info, DDTreeVerifyInput)
            and info.custom_mask is probe.buffers.custom_mask
        ):
            raise DDTreeUnsupported(
                "DDTREE refuses to start: a target-verify graph capture would get "
                f"{type(info).__name__} without the tree mask buffer."
            )
        # Every runtime state's verify graphs, the launch state's first.
        graph_runners = [
            state.graph_runner
            for state in self._tree_states.values()
            if state.graph_runner is not None
        ]
        if not graph_runners:
            graphs = "none captured"
        else:
            captures = 0
            for graph_runner in graph_runners:
                held = ddtree_plugin.CAPTURED_WITH_MASK.get(id(graph_runner), [])
                if not held or not all(held):
                    raise DDTreeUnsupported(
                        "DDTREE refuses to start: the target's verify CUDA graphs were "
                        f"captured without the tree mask buffer ({sum(held)} of "
                        f"{len(held)} captures held it)."
                    )
                captures += len(held)
            graphs = f"{captures} captured with the tree mask buffer"
        return {
            "hooks_in_place": hooks,
            "capture_input": "DDTreeVerifyInput with the runner's mask buffer",
            "verify_graphs": graphs,
        }

    def _candidate_head(self) -> Optional[_DDTreeDraftCandidates]:
        target_model = self._target_worker.model_runner.model
        lm_head = unwrap_lora_layer(getattr(target_model, "lm_head", None))
        if lm_head is None:
            return None
        return _DDTreeDraftCandidates(
            lm_head=lm_head,
            block_size=self.block_size,
            depth=self.ddtree_max_depth,
            topk=self.ddtree_topk_max,
            max_bs=max(get_exec().graph.cuda_graph_config.decode.bs),
            device=self.device,
        )

    def _maybe_build_draft_sampler(self):
        """Fold the candidate top-k into the draft CUDA graph (DFlash folds its
        greedy argmax there, which DDTREE has no use for), unless DFlash's switch
        ``SGLANG_DFLASH_EAGER_DRAFT_SAMPLER=1`` keeps it eager: the head
        (``candidate_topk`` -> Triton ``lilicorr_topk_lse``) is the only code a
        DDTREE draft graph captures that DFlash's does not, so the switch tells a
        capture failure of the head from one of the draft forward."""
        if envs.SGLANG_DFLASH_EAGER_DRAFT_SAMPLER.get():
            logger.info(
                "DDTREE candidate head kept eager (SGLANG_DFLASH_EAGER_DRAFT_SAMPLER=1)."
            )
            return None
        return self._candidate_head()

    def prewarm_sampling(self):
        # DFlash rehearses its sampling verify with block_size-wide rows; DDTREE's
        # sampled verify has verify_width rows per request, the same [rows, V] fp32
        # tensors. Every runtime state verifies at its own width: rehearse the widest
        # (with _prewarm_batch_size's batch), not the launch width, so the KV sizing
        # leaves the widest state's peak free.
        block_size = self.block_size
        self.block_size = max(self.ddtree_runtime.budgets) + 1
        try:
            return super().prewarm_sampling()
        finally:
            self.block_size = block_size

    def _prewarm_batch_size(self, block_size: int) -> int:
        # Any state, captured or eager, runs a batch above its graph ceiling eagerly
        # (can_run_graph), up to max_running_requests: that round's rows are the peak,
        # not the graph's (DFlash's bound, max_decode_logits_rows // width).
        running = self.model_runner.max_running_requests
        if running is None:
            return super()._prewarm_batch_size(block_size)
        return max(1, int(running))

    def _validate_phase1_sampling_support(self, batch: ScheduleBatch) -> None:
        # Requests DDTREE cannot serve exactly are aborted at admission
        # (validate_dflash_request); nothing reaches a round unverifiable.
        return

    def _make_next_draft_input_prefill(self, *, bonus_tokens, seq_lens):
        return make_ddtree_draft_input(bonus_tokens=bonus_tokens, new_seq_lens=seq_lens)

    def _make_next_draft_input_decode(self, *, bonus_tokens, new_seq_lens):
        return make_ddtree_draft_input(
            bonus_tokens=bonus_tokens, new_seq_lens=new_seq_lens
        )

    def describe_ddtree(self) -> dict:
        """What ``/server_info`` reports under ``ddtree``."""
        runner = self.model_runner
        return {
            "budget": self.ddtree_budget,
            "topk": self.ddtree_topk,
            "draft_block_size": self.block_size,
            "verify_width": self.verify_width,
            "max_depth": self.ddtree_depth,
            "verify_attention_backend": type(runner.attn_backend).__name__,
            "draft_attention_backend": type(
                self.draft_model_runner.attn_backend
            ).__name__,
            "decode_cuda_graph": str(get_exec().graph.cuda_graph_config.decode.backend),
            "verify_cuda_graph_captured": runner.decode_cuda_graph_runner is not None,
            # above it a round runs eager (the active state's runner: see graph_max_bs)
            "verify_cuda_graph_max_bs": graph_max_bs(runner.decode_cuda_graph_runner),
            "candidate_head": (
                "draft CUDA graph" if self._draft_sampler is not None else "eager"
            ),
            "tree_mask": dict(self._startup_checks or {}),
            "sampler": self._sampler,
            "accept_thresholds": [
                float(get_spec().speculative_accept_threshold_single),
                float(get_spec().speculative_accept_threshold_acc),
            ],
        }

    # ------------------------------------------------------------------ round

    def forward_batch_generation(
        self,
        batch: ScheduleBatch,
        on_publish=None,
        grammar_barrier=None,
        pp_proxy_tensors=None,
    ) -> GenerationBatchResult:
        if (
            batch.forward_mode.is_extend()
            or batch.is_extend_in_batch
            or batch.forward_mode.is_idle()
        ):
            return super().forward_batch_generation(
                batch,
                on_publish=on_publish,
                grammar_barrier=grammar_barrier,
                pp_proxy_tensors=pp_proxy_tensors,
            )
        if batch.spec_info is None:
            batch.spec_info = DDTreeDraftInputV2.create_idle_input(device=self.device)
        draft_input = batch.spec_info
        if not isinstance(draft_input, DDTreeDraftInputV2):
            raise RuntimeError(
                "DDTREE expected DDTreeDraftInputV2 state on the running batch, got "
                f"{type(draft_input).__name__}."
            )
        # `seq_lens` may come from the previous overlap iteration's stream.
        record_stream_each(
            (batch.seq_lens,), torch.get_device_module(self.device).current_stream()
        )
        bs = len(batch.seq_lens)
        if self._trace is not None:
            return self._traced_round(batch, draft_input, bs, on_publish, self._trace)
        self._use_tree(self.ddtree_runtime.for_round(bs))
        width = self.verify_width
        prefix_lens = batch.seq_lens

        draft = self._draft(batch, draft_input, bs)
        trees = ddtree_utils.build_tree_batch(
            draft.topk_ids,
            draft.topk_logprobs,
            self.ddtree_budget,
            draft_input.bonus_tokens.view(-1),
        )
        all_greedy, retrieve, logits_output, target_out, target_predict = (
            self._verify_round(batch, draft_input, draft, trees)
        )
        if target_predict is not None:
            paths = ddtree_utils.follow_verified_tree_batch(
                trees, target_predict.view(bs, width)
            )
        else:
            paths = self._sample(
                trees, retrieve, logits_output.next_token_logits, batch, draft_input
            )

        self._sync_paths(paths, all_greedy)
        return self._commit(
            batch, draft, paths, logits_output, target_out, prefix_lens, on_publish
        )

    def _verify_round(self, batch, draft_input, draft: _DraftRound, trees):
        """Verify ``trees``; returns whether the batch is all greedy, the retrieve
        tensors (None then) and what :meth:`_verify` returns."""
        all_greedy = _is_all_greedy(batch.sampling_info) or (
            self._only_aborted_rows_sample(batch)
        )
        # The first-child / next-sibling encoding only when a request samples.
        retrieve = None if all_greedy else ddtree_utils.tree_retrieve_batch(trees)
        return (
            all_greedy,
            retrieve,
            *self._verify(batch, draft_input, draft, trees, retrieve),
        )

    def _sync_paths(self, paths, all_greedy: bool) -> None:
        site = (
            SpecTpSyncSite.DFLASH_ACCEPT_GREEDY
            if all_greedy
            else SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE
        )
        for values in (paths.nodes, paths.tokens, paths.commit_lens):
            self._tp_sync.sync(site, values)

    def _traced_round(
        self, batch, draft_input, bs: int, on_publish, trace
    ) -> GenerationBatchResult:
        """A round while the trace is on: the union of the grid's trees, built on the
        host with the reference builder and padded to the runtime state the trace
        picked, verified and committed as any round; then each request's round is
        appended to its trace. Host syncs are fine here: a trace run measures
        acceptance, not speed (ddtree_trace.py)."""
        self._use_tree(TreeShape(trace.state_budget, trace.topk))
        width = self.verify_width
        prefix_lens = batch.seq_lens
        draft = self._draft(batch, draft_input, bs)
        rows = trace.depth
        ids = draft.topk_ids[:, :rows, : trace.topk].tolist()
        logps = draft.topk_logprobs[:, :rows, : trace.topk].float().tolist()
        roots = draft_input.bonus_tokens.view(-1).tolist()
        union = [
            ddtree_trace.union_tree(
                ids[b],
                logps[b],
                roots[b],
                trace,
                ddtree_reference.build_ddtree_tree_from_topk,
            )
            for b in range(bs)
        ]
        trees = ddtree_trace.to_device(
            ddtree_utils.tree_batch_from_trees(union, width), self.device
        )
        all_greedy, retrieve, logits_output, target_out, target_predict = (
            self._verify_round(batch, draft_input, draft, trees)
        )
        if target_predict is not None:
            argmax, probs = target_predict, None
            paths = ddtree_utils.follow_verified_tree_batch(
                trees, target_predict.view(bs, width)
            )
        else:
            logits = logits_output.next_token_logits
            argmax = logits.argmax(dim=-1)
            probs = self._target_probs(
                logits, batch.sampling_info, draft_input, bs, width
            )
            paths = self._sample(trees, retrieve, logits, batch, draft_input)
        # What the union accepted is recorded; a recorded request commits only the
        # first token, so its next round starts one position on (ddtree_trace.py).
        accepted = (paths.commit_lens - 1).tolist()
        paths = ddtree_trace.commit_first_only(
            paths, ddtree_trace.recording_rows(batch.reqs)
        )
        self._sync_paths(paths, all_greedy)
        p, is_argmax = ddtree_trace.node_probabilities(
            trees.tokens, trees.parents, argmax, probs
        )
        ddtree_trace.record_rounds(
            batch.reqs,
            trace,
            prefix_lens=prefix_lens.tolist(),
            roots=roots,
            draft_ids=ids,
            draft_logp=logps,
            trees=union,
            p=p.tolist(),
            argmax=is_argmax.tolist(),
            accepted=accepted,
        )
        return self._commit(
            batch, draft, paths, logits_output, target_out, prefix_lens, on_publish
        )

    # ------------------------------------------------------------------ steps

    def _ensure_window_buffers(self, bs: int) -> None:
        cap = 0 if self._window_ids is None else int(self._window_ids.shape[0])
        if cap >= bs:
            return
        cap = max(bs, 2 * cap)
        shape = (cap, self.window)
        self._window_ids = torch.empty(shape, dtype=torch.long, device=self.device)
        self._window_positions = torch.empty(
            shape, dtype=torch.int64, device=self.device
        )
        self._window_cache_loc = torch.empty(
            shape, dtype=torch.int64, device=self.device
        )
        self._window_seq_lens_cpu = torch.empty((cap,), dtype=torch.int32)

    def _draft(self, batch: ScheduleBatch, draft_input, bs: int) -> _DraftRound:
        """DFlash's draft step over the trained block, with the round's KV window
        (``max(block, verify width)`` slots from the prefix on) planned once."""
        block = self.block_size
        window = self.window
        device = self.device
        self._ensure_window_buffers(bs)
        ids = self._window_ids[:bs]
        positions = self._window_positions[:bs]
        cache_loc = self._window_cache_loc[:bs]
        prefix_lens = batch.seq_lens
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        prepared = False
        if self._use_triton_prepare_block:
            try:
                _prepare_dflash_draft_block_unchecked(
                    bonus_tokens=draft_input.bonus_tokens.view(-1),
                    prefix_lens=prefix_lens.view(-1),
                    req_pool_indices=batch.req_pool_indices.view(-1),
                    req_to_token=req_to_token,
                    block_ids_out=ids,
                    positions_out=positions,
                    cache_loc_out=cache_loc,
                    mask_token_id=int(self._mask_token_id),
                )
                prepared = True
            except Exception as e:
                self._use_triton_prepare_block = False
                logger.warning(
                    "DDTREE Triton prepare_block failed; using the eager path: %s", e
                )
        if not prepared:
            ids.fill_(int(self._mask_token_id))
            ids[:, 0].copy_(draft_input.bonus_tokens)
            torch.add(prefix_lens.unsqueeze(1), self._window_offsets, out=positions)
            cache_loc.copy_(
                assign_extend_cache_locs_func(
                    req_pool_indices=batch.req_pool_indices,
                    req_to_token=req_to_token,
                    start_offset=prefix_lens,
                    end_offset=prefix_lens + window,
                    batch_size=bs,
                    draft_token_num=window,
                    device=device,
                ).view(bs, window)
            )

        block_ids = ids[:, :block]
        if self._full_embed_gpu is not None:
            noise_embedding = torch.nn.functional.embedding(
                block_ids, self._full_embed_gpu
            )
        else:
            target_model = self.target_worker.model_runner.model
            embed_module = unwrap_lora_layer(
                _resolve_dflash_embedding_module(self.draft_model, target_model)
            )
            noise_embedding = embed_module(block_ids)
        if self._noise_embed_scale != 1.0:
            noise_embedding = noise_embedding * self._noise_embed_scale

        kv_loc_plan = self.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix_lens,
            seq_lens_cpu=(
                batch.seq_lens_cpu
                if batch.seq_lens_cpu is not None
                else draft_input.nxt_kv_lens_cpu
            ),
            write_virtual=cache_loc.reshape(-1),
            read_extent=window,
        )
        seq_lens_cpu, seq_lens_sum = self._host_seq_lens(batch, draft_input, block)
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=block_ids.reshape(-1),
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix_lens,
            out_cache_loc=cache_loc[:, :block].reshape(-1),
            seq_lens_sum=seq_lens_sum,
            seq_lens_cpu=seq_lens_cpu,
            positions=positions[:, :block].reshape(-1),
            input_embeds=noise_embedding.view(-1, noise_embedding.shape[-1]),
            spec_algorithm=SpeculativeAlgorithm.DFLASH,
            spec_info=self._draft_block_spec_info,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            num_token_non_padded=(
                torch.full((), bs * block, dtype=torch.int32, device=device)
                if enable_num_token_non_padded()
                else None
            ),
            global_num_token_non_padded_cpu=bs * block,
            can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
        )
        kv_loc_plan.bind(
            forward_batch,
            self.draft_model_runner.kv_index_translator,
            cols=self._cols(block),
        )
        with torch.inference_mode(), draft_tp_context(self.draft_parallel_layout):
            draft_out = self.draft_model_runner.forward(forward_batch)
        # The head ranks the candidates of every position a tree of the set may
        # reach, for the set's largest top-k (sorted: a smaller top-k is a prefix).
        rows, cols = self.ddtree_max_depth, self.ddtree_topk_max
        if self._draft_sampler is not None and draft_out.can_run_graph:
            # The captured head filled its static buffers inside the draft graph.
            topk_ids = self._draft_sampler.ids[: bs * rows]
            topk_logprobs = self._draft_sampler.logprobs[: bs * rows]
        else:
            hidden = draft_out.logits_output.hidden_states
            if hidden is None:
                raise RuntimeError("DDTREE draft model returned no hidden states.")
            # Its own instance: the captured head's buffers are the graph's and
            # are filled only by a replay.
            if self._eager_candidate_head is None:
                self._eager_candidate_head = self._candidate_head()
            head = self._eager_candidate_head
            if head is None:
                raise DDTreeUnsupported("DDTREE needs the target model's lm_head.")
            with draft_tp_context(self.draft_parallel_layout):
                topk_ids, topk_logprobs = head.compute(hidden)
        topk_ids = topk_ids.view(bs, rows, cols)
        topk_logprobs = topk_logprobs.view(bs, rows, cols)
        depth, k = self.ddtree_depth, self.ddtree_topk
        if (depth, k) != (rows, cols):
            topk_ids = topk_ids[:, :depth, :k].contiguous()
            topk_logprobs = topk_logprobs[:, :depth, :k].contiguous()
        return _DraftRound(
            topk_ids=topk_ids,
            topk_logprobs=topk_logprobs,
            cache_loc=cache_loc,
            kv_loc_plan=kv_loc_plan,
        )

    def _cols(self, width: int):
        """The columns of the round's window a forward of ``width`` tokens writes."""
        return None if width == self.window else slice(0, width)

    def _host_seq_lens(self, batch: ScheduleBatch, draft_input, width: int):
        """Host upper bounds of the KV length each request reads in a forward of
        ``width`` tokens (the committed prefix plus the forward's own tokens)."""
        bs = len(batch.seq_lens)
        out = self._window_seq_lens_cpu[:bs]
        if batch.seq_lens_cpu is not None:
            out.copy_(batch.seq_lens_cpu)
            out.add_(width)
        elif draft_input.nxt_kv_lens_cpu is not None:
            out.copy_(draft_input.nxt_kv_lens_cpu)
        else:
            for i, req in enumerate(batch.reqs):
                out[i] = req.kv.kv_allocated_len
        return out, int(out.sum())

    def _fixed_verify_mask_cells(self, bs: int) -> Optional[int]:
        """Cells of the target backend's fixed verify-mask buffer, where a graph
        replay of this batch copies the mask into one; else None.

        ``init_cuda_graph_state`` gives a backend a ``VerifyMask``
        (``srt/layers/attention/verify_mask.py``) of ``max_bs * N * (context_len +
        N)`` cells, exposed as its ``verify_mask`` (None on the base backend). Triton
        copies ``spec_info.custom_mask`` into it at replay
        (``TritonAttnBackend._update_target_verify_buffers``): a longer view raises
        there and kills the scheduler. A FULL_MASK buffer spans the context per
        request; a batch above its ``max_bs`` runs eager and reads the view itself.
        Read per round: each runtime budget has its own backend (``_use_tree``)."""
        from sglang.srt.speculative.eagle_utils import TreeMaskMode

        mask = getattr(self.model_runner.attn_backend, "verify_mask", None)
        if mask is None or mask.mode != TreeMaskMode.FULL_MASK or not mask.fits(bs):
            return None
        return int(mask.buffer.numel())

    @contextlib.contextmanager
    def _verify_graph_unless(self, eager: bool):
        """Run the verify of this round eager when ``eager``: its tree mask is
        larger than the graph's mask buffer (:meth:`_fixed_verify_mask_cells`), which
        happens only at a full batch near the context end (the round the overlap
        scheduler runs after a request finished starts past its last length). The
        eager Triton path reads the view itself (``init_forward_metadata``)."""
        runner = self.model_runner
        graph_runner = runner.decode_cuda_graph_runner
        if eager:
            if not self._logged_eager_mask_round:
                self._logged_eager_mask_round = True
                logger.info(
                    "DDTREE: a verify round's tree mask exceeds the verify graph's "
                    "mask buffer (full batch near the context end); such rounds "
                    "run eager."
                )
            runner.decode_cuda_graph_runner = None
        try:
            yield
        finally:
            runner.decode_cuda_graph_runner = graph_runner

    def _verify(self, batch, draft_input, draft: _DraftRound, trees, retrieve):
        """The tree's one target pass. Returns the logits output, the target
        result and, for an all-greedy batch (``retrieve`` None), the target's argmax
        per node."""
        width = self.verify_width
        prefix_lens = batch.seq_lens
        all_greedy = retrieve is None
        bs = len(prefix_lens)
        _, verify_kv_sum = self._host_seq_lens(batch, draft_input, width)
        fixed_cells = self._fixed_verify_mask_cells(bs)
        cells = ddtree_utils.verify_mask_cells(
            width, verify_kv_sum, bs, fixed_cells=fixed_cells
        )
        custom_mask = self._mask_buffer.write(
            ddtree_utils.tree_ancestor_masks(trees), prefix_lens, cells
        )
        retrieve = retrieve or (None, None, None)
        verify_input = DDTreeVerifyInput(
            draft_token=trees.tokens.reshape(-1),
            positions=(prefix_lens.unsqueeze(1) + trees.depths).reshape(-1),
            draft_token_num=width,
            topk=self.ddtree_topk,
            custom_mask=custom_mask,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            kv_loc_plan=draft.kv_loc_plan,
            kv_loc_cols=self._cols(width),
            retrieve_index=retrieve[0],
            retrieve_next_token=retrieve[1],
            retrieve_next_sibling=retrieve[2],
        )
        batch.out_cache_loc = draft.cache_loc[:, :width].reshape(-1)
        seq_lens_cpu_backup = batch.seq_lens_cpu
        seq_lens_sum_backup = batch.seq_lens_sum
        if seq_lens_cpu_backup is not None:
            host_lens = seq_lens_cpu_backup + width
            batch.seq_lens_cpu = host_lens
            batch.seq_lens_sum = int(host_lens.sum())
        elif draft_input.nxt_kv_lens_cpu is not None:
            batch.seq_lens_cpu = draft_input.nxt_kv_lens_cpu
            batch.seq_lens_sum = int(draft_input.nxt_kv_lens_sum)
        with self._verify_graph_unless(fixed_cells is not None and cells > fixed_cells):
            verify_forward_batch, _ = verify_input.prepare_for_verify(
                batch, self.target_worker, defer_metadata_init=False
            )
            batch.seq_lens_cpu = seq_lens_cpu_backup
            batch.seq_lens_sum = seq_lens_sum_backup
            target_out = self.target_worker.forward_batch_generation(
                batch=None,
                forward_batch=verify_forward_batch,
                is_verify=True,
                skip_attn_backend_init=True,
            )
        # Queued after the pass that read the mask: the buffer is all True again.
        self._mask_buffer.restore()

        logits_output = target_out.logits_output
        sampling_info = batch.sampling_info
        target_predict = None
        target_lp = self._target_logits_processor
        if target_lp is not None and target_lp.is_deferred_shard(
            logits_output.next_token_logits
        ):
            if all_greedy and self._can_skip_verify_logits(batch, sampling_info):
                target_predict = target_lp.deferred_argmax(
                    logits_output.next_token_logits
                )
                logits_output.next_token_logits = None
            else:
                logits_output.next_token_logits = target_lp.finish_deferred_gather(
                    logits_output.next_token_logits
                )
        if target_predict is None:
            if sampling_info is not None:
                apply_dflash_verify_logits_adjustments(
                    next_token_logits=logits_output.next_token_logits,
                    sampling_info=sampling_info,
                    draft_token_num=width,
                )
            if all_greedy:
                target_predict = torch.argmax(logits_output.next_token_logits, dim=-1)
        return logits_output, target_out, target_predict

    def _only_aborted_rows_sample(self, batch: ScheduleBatch) -> bool:
        """Without a sampling verifier, admission aborts every sampled request
        (``validate_dflash_request``); such a request may still ride one round before
        its abort is processed. Its tokens are discarded, so the round can verify
        greedily. A sampled request that was somehow not aborted is aborted here
        rather than verified greedily (lossy) or raised on (fatal to the server)."""
        if self._sampler != "none":
            return False
        from sglang.srt.managers.schedule_batch import FINISH_ABORT
        from sglang.srt.speculative.ddtree_plugin import ddtree_request_error

        for req in batch.reqs:
            if req.to_finish is None and req.finished_reason is None:
                message = ddtree_request_error(req)
                if message is not None:
                    req.to_finish = FINISH_ABORT(
                        message, HTTPStatus.BAD_REQUEST, "BadRequestError"
                    )
        return True

    def _sample(
        self,
        trees,
        retrieve,
        logits: torch.Tensor,
        batch: ScheduleBatch,
        draft_input: DDTreeDraftInputV2,
    ):
        """Tree rejection sampling against the target distribution.

        ``draft_input`` is the round's draft state (``prepare_for_decode`` put the
        batch's top-k summary there), not ``batch.spec_info``: ``prepare_for_verify``
        (``dflash_info.py``) has made that the verify input, which has no such fields.
        Coins are EAGLE's (``eagle_utils._verify_coins``): hashed from the request's
        ``sampling_seed`` and length under ``--enable-deterministic-inference``,
        ``torch.rand`` otherwise.
        """
        bs, width = trees.tokens.shape
        device = logits.device
        sampling_info = batch.sampling_info
        spec = get_spec()
        steps = trees.max_depth + 1
        retrieve_index, next_token, next_sibling = retrieve
        predicts = torch.zeros((bs * width,), dtype=torch.int32, device=device)
        accept_index = torch.full((bs, steps), -1, dtype=torch.int32, device=device)
        accept_num = torch.zeros((bs,), dtype=torch.int32, device=device)
        coins, final_coins = _verify_coins(
            sampling_info=sampling_info,
            seq_lens=batch.seq_lens,
            draft_token_num=width,
            candidates=trees.tokens,
            device=device,
        )
        if self._sampler == "kernel":
            verify = tree_sampling_kernel()
        else:
            verify = ddtree_reference.reference_tree_speculative_sampling
        target_probs = self._target_probs(logits, sampling_info, draft_input, bs, width)
        # Row chunks under the kernel's uint32 probability offset (one call where the
        # batch fits, which is every batch below bs * width * vocab = 2**32).
        ddtree_utils.sample_tree_in_row_chunks(
            verify,
            predicts=predicts,
            accept_index=accept_index,
            accept_token_num=accept_num,
            candidates=trees.tokens,
            retrive_index=retrieve_index,
            retrive_next_token=next_token,
            retrive_next_sibling=next_sibling,
            uniform_samples=coins,
            uniform_samples_for_final_sampling=final_coins,
            target_probs=target_probs,
            draft_probs=torch.zeros_like(target_probs),
            threshold_single=float(spec.speculative_accept_threshold_single),
            threshold_acc=float(spec.speculative_accept_threshold_acc),
            deterministic=True,
        )
        return ddtree_utils.accepted_paths_from_kernel(
            accept_index, accept_num, predicts, width
        )

    def _target_probs(self, logits, sampling_info, draft_input, bs: int, width: int):
        """``[bs, width, V]``: the distribution the sampled verify accepts against (the
        kernel branch's as a GPU host computes it, else the reference's)."""
        if self._sampler == "kernel":
            target_probs = build_speculative_verify_target_probs(
                next_token_logits=logits,
                sampling_info=sampling_info,
                draft_token_num=width,
                bs=bs,
                max_top_k=draft_input.max_top_k,
                uniform_top_k_value=draft_input.uniform_top_k_value,
            )
            if sampling_info.need_min_p_sampling:
                target_probs = ddtree_reference.min_p_renorm_probs(
                    target_probs, sampling_info.min_ps.view(bs, 1)
                )
            return target_probs
        return ddtree_reference.target_probs_from_logits(
            logits,
            sampling_info.temperatures.view(-1).repeat_interleave(width),
            sampling_info.top_ks.view(-1).repeat_interleave(width),
            sampling_info.top_ps.view(-1).repeat_interleave(width),
            sampling_info.min_ps.view(-1).repeat_interleave(width),
        ).view(bs, width, -1)

    def _commit(
        self,
        batch,
        draft: _DraftRound,
        paths,
        logits_output,
        target_out,
        prefix_lens,
        on_publish,
    ) -> GenerationBatchResult:
        """The one commit path of greedy and sampled rounds."""
        bs, steps = paths.nodes.shape
        width = self.verify_width
        device = paths.nodes.device
        lens = paths.commit_lens
        cols = torch.arange(steps, device=device).expand(bs, steps)
        flat = paths.nodes + (torch.arange(bs, device=device) * width).unsqueeze(1)
        accept_index = torch.where(
            cols < lens.unsqueeze(1), flat, torch.full_like(flat, -1)
        ).to(torch.int32)
        # Target KV of accepted node a_j -> verify slot j (batch.out_cache_loc is
        # the verify window), the chain the next round attends to.
        move_accept_tokens_to_target_kvcache(
            batch,
            accept_index,
            lens - 1,
            self.model_runner.token_to_kv_pool_allocator,
        )

        if batch.return_logprob:
            predict = torch.zeros((bs * width,), dtype=torch.int64, device=device)
            predict.scatter_(0, flat.reshape(-1), paths.tokens.reshape(-1))
            compute_spec_logprobs(batch, logits_output, predict, accept_index=flat)

        commit_lens = lens.to(torch.int32)
        new_seq_lens = prefix_lens + lens.to(prefix_lens.dtype)
        if on_publish is not None:
            on_publish(new_seq_lens)

        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE verify requires target hidden states, got None.")
        hidden = hidden[: bs * width].view(bs, width, -1)
        path_hidden = torch.gather(
            hidden, 1, paths.nodes.unsqueeze(2).expand(-1, -1, hidden.shape[-1])
        )
        chain_loc = self._draft_write_ids(draft.kv_loc_plan).view(bs, -1)[:, :steps]
        chain_positions = prefix_lens.unsqueeze(1).to(torch.int64) + cols
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=path_hidden.reshape(-1, hidden.shape[-1]),
            cache_loc=chain_loc.reshape(-1),
            cache_loc_2d=chain_loc,
            positions=chain_positions.reshape(-1),
            commit_lens=commit_lens,
        )
        logits_output.hidden_states = None

        bonus = torch.gather(paths.tokens, 1, (lens - 1).unsqueeze(1)).view(-1)
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=paths.tokens.reshape(-1),
            accept_lens=commit_lens,
            can_run_cuda_graph=target_out.can_run_cuda_graph,
            next_draft_input=make_ddtree_draft_input(
                bonus_tokens=bonus, new_seq_lens=new_seq_lens
            ),
            speculative_num_draft_tokens=width,
            speculative_output_stride=steps,
            new_seq_lens=new_seq_lens,
            routed_experts_output=target_out.routed_experts_output,
            indexer_topk_output=target_out.indexer_topk_output,
        )
