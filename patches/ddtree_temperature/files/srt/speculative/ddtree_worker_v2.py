"""DDTree speculative decoding worker (spec-v2) on top of the DFlash v2 worker.

One decode round:

1. draft one block with the DFlash draft model (same forward as DFLASH);
2. take the drafter's per-position top-k and build a best-first tree under the node
   budget (``build_ddtree_trees_from_topk_batch``);
3. verify the whole tree in ONE target ``TARGET_VERIFY`` pass: tokens in pop order,
   positions by depth, an ancestor-only attention mask, and -- only when a request
   samples -- the first-child / next-sibling retrieve tensors;
4. accept: the greedy walk (``follow_verified_tree``) for all-greedy batches, the
   EAGLE tree rejection-sampling kernel (``sample_tree_paths``) otherwise;
5. ONE commit path for both: accepted tokens, KV of the accepted path compacted onto
   the chain slots, target hidden states of the accepted path into the draft KV.

Prefill, idle rounds and everything the DFlash worker sets up (draft runner, CUDA
graphs, KV materialisation helpers) are inherited unchanged.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

import torch

from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
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
from sglang.srt.runtime_context import get_parallel, get_spec
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative import ddtree_utils
from sglang.srt.speculative.ddtree_info import (
    DDTreeVerifyInput,
    build_ddtree_verify_tensors,
)
from sglang.srt.speculative.ddtree_registration import (
    DEFAULT_DDTREE_BUDGET,
    DEFAULT_DDTREE_TOPK,
    ddtree_verify_width,
)
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.dflash_utils import (
    apply_dflash_verify_logits_adjustments,
    is_dense_head_weight,
    is_dflash_sampling_verify_available,
    parse_dflash_draft_config,
)
from sglang.srt.speculative.dflash_worker_v2 import (
    DFlashWorkerV2,
    _is_all_greedy,
    _resolve_dflash_embedding_module,
)
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite
from sglang.srt.speculative.spec_utils import draft_tp_context

logger = logging.getLogger(__name__)

# (accepted local node ids starting with the root 0, emitted tokens of equal length)
TreePath = Tuple[List[int], List[int]]


class DDTreeUnsupported(ValueError):
    """A DDTree server was configured with a feature the tree worker cannot serve."""


class DDTreeWorkerV2(DFlashWorkerV2):
    """DFlash drafting, tree verification."""

    def __init__(
        self,
        server_args: ServerArgs,
        gpu_id: int,
        nccl_port: int,
        target_worker: TpModelWorker,
    ):
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        spec = get_spec()
        self.ddtree_budget = int(spec.speculative_ddtree_budget or DEFAULT_DDTREE_BUDGET)
        self.ddtree_topk = int(spec.speculative_ddtree_topk or DEFAULT_DDTREE_TOPK)
        # The registration sized speculative_num_draft_tokens to the tree window, so
        # the inherited block buffers, KV reservation and verify graphs are all
        # `budget + 1` wide.
        self.tree_width = ddtree_verify_width(self.ddtree_budget)
        if int(self.block_size) != self.tree_width:
            raise DDTreeUnsupported(
                f"DDTREE expects speculative_num_draft_tokens == budget + 1 == "
                f"{self.tree_width}, got {self.block_size}; do not pass "
                "--speculative-num-draft-tokens with DDTREE."
            )
        # Tree depth is bounded by the positions the drafter was trained to fill.
        draft_config = parse_dflash_draft_config(
            draft_hf_config=self.draft_model_runner.model_config.hf_config
        )
        trained_block = draft_config.resolve_block_size(default=None)
        draft_block = int(trained_block) if trained_block else self.tree_width
        self.ddtree_depth = max(1, min(draft_block, self.tree_width) - 1)

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
        self._sampling_kernel_available = is_dflash_sampling_verify_available()
        if get_parallel().tp_rank == 0:
            logger.info(
                "DDTREE worker ready: budget=%d topk=%d depth=%d verify_width=%d "
                "sampling_kernel=%s",
                self.ddtree_budget,
                self.ddtree_topk,
                self.ddtree_depth,
                self.tree_width,
                "available" if self._sampling_kernel_available else "unavailable",
            )

    # ------------------------------------------------------------------ guards

    def _validate_phase1_sampling_support(self, batch: ScheduleBatch) -> None:
        """Non-greedy requests are served exactly by the tree sampling kernel; refuse
        them only where the kernel cannot run (silently verifying greedily would
        change the output distribution)."""
        if batch.forward_mode.is_extend() or batch.forward_mode.is_idle():
            return
        if not _is_all_greedy(batch.sampling_info) and not self._sampling_kernel_available:
            raise RuntimeError(
                "DDTREE non-greedy verification needs SGLang's "
                "tree_speculative_sampling_target_only kernel, which is unavailable on "
                "this build/device; send temperature=0 requests or serve from a CUDA "
                "build."
            )
        if batch.has_grammar:
            raise RuntimeError(
                "DDTREE does not support grammar-constrained requests; use DFLASH."
            )

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
            # Prefill materialises prompt hidden states into the draft KV exactly as
            # DFLASH does; idle rounds carry no tree.
            return super().forward_batch_generation(
                batch,
                on_publish=on_publish,
                grammar_barrier=grammar_barrier,
                pp_proxy_tensors=pp_proxy_tensors,
            )
        self._validate_phase1_sampling_support(batch)
        if batch.spec_info is None:
            batch.spec_info = DFlashDraftInputV2.create_idle_input(device=self.device)
        draft_input = batch.spec_info
        if not isinstance(draft_input, DFlashDraftInputV2):
            raise RuntimeError(
                "DDTREE expected DFlashDraftInputV2 state on the running batch."
            )
        batch.seq_lens.record_stream(
            torch.get_device_module(self.device).current_stream()
        )

        bs = len(batch.seq_lens)
        width = self.tree_width
        prefix_lens = batch.seq_lens
        lm_head, draft_hidden, positions_2d, cache_loc_2d, kv_loc_plan, seq_lens_cpu = (
            self._draft_block(batch, draft_input, bs)
        )

        # --- 2) Per-position top-k of the drafter -> one tree per request.
        topk_ids, topk_logprobs = self._draft_topk(
            draft_hidden[:, 1 : 1 + self.ddtree_depth, :], lm_head
        )
        # One device->host copy and one tolist() for the whole batch; the heap itself
        # is sequential per request.
        trees = ddtree_utils.build_ddtree_trees_from_topk_batch(
            topk_ids.cpu(),
            topk_logprobs.cpu(),
            self.ddtree_budget,
            draft_input.bonus_tokens.view(-1).cpu(),
        )
        prefix_cpu = (
            batch.seq_lens_cpu.tolist()
            if batch.seq_lens_cpu is not None
            else prefix_lens.tolist()
        )
        sampling_info = batch.sampling_info
        all_greedy = _is_all_greedy(sampling_info)
        tensors = build_ddtree_verify_tensors(
            trees,
            prefix_cpu,
            width,
            device=self.device,
            need_retrieve=not all_greedy,
        )

        # --- 3) One target verify pass over the tree.
        verify_input = DDTreeVerifyInput(
            draft_token=tensors.tokens.reshape(-1),
            positions=tensors.positions,
            draft_token_num=width,
            topk=self.ddtree_topk,
            custom_mask=tensors.custom_mask,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            kv_loc_plan=kv_loc_plan,
            retrieve_index=tensors.retrieve_index,
            retrieve_next_token=tensors.retrieve_next_token,
            retrieve_next_sibling=tensors.retrieve_next_sibling,
        )
        verify_out_cache_loc = cache_loc_2d.reshape(-1)
        batch.out_cache_loc = verify_out_cache_loc
        seq_lens_cpu_backup = batch.seq_lens_cpu
        seq_lens_sum_backup = batch.seq_lens_sum
        if seq_lens_cpu_backup is not None:
            verify_host_seq_lens = seq_lens_cpu_backup + width
            batch.seq_lens_cpu = verify_host_seq_lens
            batch.seq_lens_sum = int(verify_host_seq_lens.sum())
        elif draft_input.nxt_kv_lens_cpu is not None:
            batch.seq_lens_cpu = draft_input.nxt_kv_lens_cpu
            batch.seq_lens_sum = int(draft_input.nxt_kv_lens_sum)
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
        logits_output = target_out.logits_output
        target_lp = self._target_logits_processor
        if target_lp is not None and target_lp.is_deferred_shard(
            logits_output.next_token_logits
        ):
            logits_output.next_token_logits = target_lp.finish_deferred_gather(
                logits_output.next_token_logits
            )
        logits = logits_output.next_token_logits
        if sampling_info is not None:
            apply_dflash_verify_logits_adjustments(
                next_token_logits=logits,
                sampling_info=sampling_info,
                draft_token_num=width,
            )

        # --- 4) Accept: greedy walk or tree rejection sampling, same contract.
        paths = self._accept_tree(trees, logits.view(bs, width, -1), sampling_info)

        # --- 5) The one commit path.
        commit = self._commit_paths(paths, bs)
        # Sampled acceptance draws coins per rank; where SGLANG_SPEC_TP_SYNC enables
        # these sites, rank 0's decision is broadcast so every rank commits the same.
        site = (
            SpecTpSyncSite.DFLASH_ACCEPT_GREEDY
            if all_greedy
            else SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE
        )
        for values in (
            commit.out_tokens,
            commit.commit_lens,
            commit.accept_nodes,
            commit.bonus,
            commit.accept_index,
            commit.predict_flat,
        ):
            self._tp_sync.sync(site, values)
        if self._tp_sync.enabled(site):
            commit.commit_lens_cpu = commit.commit_lens.tolist()
        self._compact_target_kv(commit.accept_nodes, commit.commit_lens_cpu, cache_loc_2d)

        if batch.return_logprob:
            compute_spec_logprobs(
                batch,
                logits_output,
                commit.predict_flat,
                accept_index=commit.accept_index,
            )

        commit_lens = commit.commit_lens
        new_seq_lens = prefix_lens + commit_lens.to(prefix_lens.dtype)
        if on_publish is not None:
            on_publish(new_seq_lens)

        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE verify requires target hidden states, got None.")
        hidden = hidden.view(bs, width, -1)
        # Hidden states of the accepted path, in chain order: row j of request b is
        # the target state at accepted node j, which the next draft block conditions on.
        gather_idx = commit.accept_nodes.to(hidden.device)
        path_hidden = torch.gather(
            hidden, 1, gather_idx[:, :, None].expand(-1, -1, hidden.shape[-1])
        )
        cache_loc = self._draft_write_ids(kv_loc_plan)
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=path_hidden.reshape(-1, hidden.shape[-1]),
            cache_loc=cache_loc,
            cache_loc_2d=cache_loc.view(bs, width),
            positions=positions_2d.reshape(-1),
            commit_lens=commit_lens,
        )
        logits_output.hidden_states = None

        next_draft_input = self._make_next_draft_input_decode(
            bonus_tokens=commit.bonus, new_seq_lens=new_seq_lens
        )
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=commit.out_tokens.reshape(-1),
            accept_lens=commit_lens,
            can_run_cuda_graph=target_out.can_run_cuda_graph,
            next_draft_input=next_draft_input,
            speculative_num_draft_tokens=width,
            new_seq_lens=new_seq_lens,
            routed_experts_output=target_out.routed_experts_output,
            indexer_topk_output=target_out.indexer_topk_output,
        )

    # ------------------------------------------------------------------ steps

    def _draft_block(self, batch: ScheduleBatch, draft_input, bs: int):
        """The DFLASH draft forward over one block of ``tree_width`` positions
        (bonus token then mask tokens). Returns the draft hidden states and the
        block's slots, which the tree verify reuses: node i is written at slot
        ``prefix + i``."""
        device = self.device
        width = self.tree_width
        target_model = self.target_worker.model_runner.model
        embed_module = unwrap_lora_layer(
            _resolve_dflash_embedding_module(self.draft_model, target_model)
        )
        lm_head = unwrap_lora_layer(getattr(target_model, "lm_head", None))
        if lm_head is None or not is_dense_head_weight(getattr(lm_head, "weight", None)):
            raise DDTreeUnsupported(
                "DDTREE needs the target lm_head as a dense weight to rank draft "
                "candidates; quantized heads are not supported."
            )
        self._ensure_draft_block_buffers(bs)
        block_ids = self._draft_block_ids_buf[:bs]
        positions_2d = self._draft_block_positions_buf[:bs]
        cache_loc_2d = self._draft_verify_out_cache_loc_buf[:bs]
        prefix_lens = batch.seq_lens

        block_ids.fill_(int(self._mask_token_id))
        block_ids[:, 0].copy_(draft_input.bonus_tokens)
        torch.add(prefix_lens.unsqueeze(1), self._block_pos_offsets, out=positions_2d)
        cache_loc = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=self.model_runner.req_to_token_pool.req_to_token,
            start_offset=prefix_lens,
            end_offset=prefix_lens + width,
            batch_size=bs,
            draft_token_num=width,
            device=device,
        )
        cache_loc_2d.copy_(cache_loc.view(bs, width))

        if self._full_embed_gpu is not None:
            noise_embedding = torch.nn.functional.embedding(
                block_ids, self._full_embed_gpu
            )
        else:
            noise_embedding = embed_module(block_ids)
        if self._noise_embed_scale != 1.0:
            noise_embedding = noise_embedding * self._noise_embed_scale
        input_embeds = noise_embedding.view(-1, noise_embedding.shape[-1])
        positions = positions_2d.reshape(-1)

        kv_loc_plan = self.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix_lens,
            seq_lens_cpu=(
                batch.seq_lens_cpu
                if batch.seq_lens_cpu is not None
                else draft_input.nxt_kv_lens_cpu
            ),
            write_virtual=cache_loc_2d.reshape(-1),
            read_extent=width,
        )
        seq_lens_cpu = self._draft_seq_lens_cpu_buf[:bs]
        if batch.seq_lens_cpu is not None:
            seq_lens_cpu.copy_(batch.seq_lens_cpu)
            seq_lens_cpu.add_(width)
            draft_seq_lens_sum = int(seq_lens_cpu.sum())
        elif draft_input.nxt_kv_lens_cpu is not None:
            seq_lens_cpu.copy_(draft_input.nxt_kv_lens_cpu)
            draft_seq_lens_sum = int(draft_input.nxt_kv_lens_sum)
        else:
            for i, req in enumerate(batch.reqs):
                seq_lens_cpu[i] = req.kv.kv_allocated_len
            draft_seq_lens_sum = int(seq_lens_cpu.sum())

        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=block_ids.flatten(),
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix_lens,
            out_cache_loc=cache_loc_2d.reshape(-1),
            seq_lens_sum=draft_seq_lens_sum,
            seq_lens_cpu=seq_lens_cpu,
            positions=positions,
            input_embeds=input_embeds,
            spec_algorithm=SpeculativeAlgorithm.DFLASH,
            spec_info=self._draft_block_spec_info,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            num_token_non_padded=(
                torch.full((), bs * width, dtype=torch.int32, device=device)
                if enable_num_token_non_padded()
                else None
            ),
            global_num_token_non_padded_cpu=bs * width,
            can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
        )
        kv_loc_plan.bind(forward_batch, self.draft_model_runner.kv_index_translator)
        with torch.inference_mode(), draft_tp_context(self.draft_parallel_layout):
            draft_out = self.draft_model_runner.forward(forward_batch)
        draft_hidden = draft_out.logits_output.hidden_states
        if draft_hidden is None:
            raise RuntimeError("DDTREE draft model returned no hidden states.")
        return (
            lm_head,
            draft_hidden.view(bs, width, -1),
            positions_2d,
            cache_loc_2d,
            kv_loc_plan,
            seq_lens_cpu,
        )

    def _draft_topk(
        self, hidden: torch.Tensor, lm_head
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Top-k token ids and log-probabilities per draft position, ``[bs, depth, k]``,
        over the full vocabulary (vocab-parallel shards gathered across TP)."""
        bs, depth, dim = hidden.shape
        weight = lm_head.weight
        shard = getattr(lm_head, "shard_indices", None)
        if shard is not None:
            weight = weight[: int(shard.num_org_elements)]
        with draft_tp_context(self.draft_parallel_layout):
            logits = torch.matmul(hidden.reshape(-1, dim).to(weight.dtype), weight.t())
            tp_group = get_parallel().tp_group
            if int(tp_group.world_size) > 1:
                logits = tp_group.all_gather(logits, dim=-1)
        vocab = int(self.model_runner.model_config.vocab_size)
        logprobs = torch.log_softmax(logits[:, :vocab].float(), dim=-1)
        k = min(self.ddtree_topk, vocab)
        values, ids = torch.topk(logprobs, k, dim=-1)
        return ids.view(bs, depth, k), values.view(bs, depth, k)

    def _accept_tree(self, trees, logits: torch.Tensor, sampling_info) -> List[TreePath]:
        if _is_all_greedy(sampling_info):
            argmax = torch.argmax(logits, dim=-1).cpu()
            return [
                ddtree_utils.follow_verified_tree(
                    list(tree.parents), list(tree.token_ids), argmax[b].tolist()
                )
                for b, tree in enumerate(trees)
            ]
        bs = len(trees)
        return ddtree_utils.sample_tree_paths(
            trees,
            logits,
            sampling_info.temperatures.view(bs),
            sampling_info.top_ks.view(bs),
            sampling_info.top_ps.view(bs),
            use_kernel="auto" if self._sampling_kernel_available else False,
        )

    def _commit_paths(self, paths: Sequence[TreePath], bs: int) -> "_Commit":
        return _Commit.from_paths(paths, bs, self.tree_width, device=self.device)

    def _compact_target_kv(
        self,
        accept_nodes: torch.Tensor,
        commit_lens_cpu: List[int],
        cache_loc_2d: torch.Tensor,
    ) -> None:
        """Move the target KV of accepted node ``a_j`` onto chain slot ``j``.

        Nodes are in pop order, so ``a_j >= j`` and no move reads a slot an earlier
        move wrote; slots past the commit length are left for the next round.
        """
        src_cols: List[int] = []
        dst_cols: List[int] = []
        rows: List[int] = []
        nodes = accept_nodes.tolist()
        for b in range(len(commit_lens_cpu)):
            for j in range(1, commit_lens_cpu[b]):
                if nodes[b][j] != j:
                    rows.append(b)
                    src_cols.append(nodes[b][j])
                    dst_cols.append(j)
        if not rows:
            return
        row_t = torch.tensor(rows, dtype=torch.int64, device=cache_loc_2d.device)
        src = cache_loc_2d[row_t, torch.tensor(src_cols, device=cache_loc_2d.device)]
        dst = cache_loc_2d[row_t, torch.tensor(dst_cols, device=cache_loc_2d.device)]
        self.model_runner.token_to_kv_pool.move_kv_cache(dst, src)


class _Commit:
    """Device tensors of one round's accepted paths, chain-shaped like DFLASH's."""

    def __init__(
        self,
        *,
        out_tokens: torch.Tensor,
        commit_lens: torch.Tensor,
        commit_lens_cpu: List[int],
        bonus: torch.Tensor,
        accept_nodes: torch.Tensor,
        accept_index: torch.Tensor,
        predict_flat: torch.Tensor,
    ) -> None:
        self.out_tokens = out_tokens
        self.commit_lens = commit_lens
        self.commit_lens_cpu = commit_lens_cpu
        self.bonus = bonus
        self.accept_nodes = accept_nodes
        self.accept_index = accept_index
        self.predict_flat = predict_flat

    @classmethod
    def from_paths(
        cls, paths: Sequence[TreePath], bs: int, width: int, *, device
    ) -> "_Commit":
        out = torch.zeros((bs, width), dtype=torch.int64)
        nodes = torch.zeros((bs, width), dtype=torch.int64)
        accept_index = torch.empty((bs, width), dtype=torch.int64)
        predict = torch.zeros((bs * width,), dtype=torch.int64)
        lens: List[int] = []
        for b, (accepted, proposed) in enumerate(paths):
            n = len(accepted)
            if n != len(proposed) or n < 1 or accepted[0] != 0:
                raise RuntimeError(
                    f"DDTREE accept returned an invalid path for request {b}: "
                    f"accepted={accepted} proposed={proposed}"
                )
            lens.append(n)
            out[b, :n] = torch.as_tensor(proposed, dtype=torch.int64)
            acc = torch.as_tensor(accepted, dtype=torch.int64)
            nodes[b, :n] = acc
            # Unused rows repeat the last accepted node so gathers stay in range.
            nodes[b, n:] = acc[-1]
            accept_index[b] = b * width + nodes[b]
            predict[b * width + acc] = out[b, :n]
        commit_lens_cpu = torch.tensor(lens, dtype=torch.int32)
        bonus = out[torch.arange(bs), commit_lens_cpu.long() - 1]
        return cls(
            out_tokens=out.to(device),
            commit_lens=commit_lens_cpu.to(device),
            commit_lens_cpu=lens,
            bonus=bonus.to(device),
            accept_nodes=nodes.to(device),
            accept_index=accept_index.to(device),
            predict_flat=predict.to(device),
        )
