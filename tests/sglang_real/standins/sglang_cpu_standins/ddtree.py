"""DDTREE on the CPU server: stand-ins and test probes (TEST-ONLY).

Registered only where the DDTREE plugin's modules are installed (a prefix the DDTree
bundle was deployed into). The stand-ins let DDTREE start where its own checks refuse
CPU on purpose; the probes let tests see inside a round without changing it.

Stand-ins:

* ``ddtree_device``: DDTREE's ``check_ddtree_device`` accepts only CUDA devices; on
  device cpu it passes (the device checks themselves are tested by leaving this out).
* ``ddtree_backend``: torch_native has no TARGET_VERIFY path in SGLang 0.5.23, so the
  plugin refuses it; the ``target_verify`` stand-in of this package adds one that honours
  ``custom_mask``, and this declares torch_native a tree-verify and block-draft backend
  accordingly.

Probes (off unless their environment variable names a file):

* ``DDTREE_TEST_ORACLE``: a JSON ``{"5,6,7": [continuation...]}`` of the target's own
  greedy continuation per prompt. The draft's candidates are replaced by that
  continuation -- at rank 0, or at rank 1 on every third depth so that the accepted path
  runs through nodes that are not the first chain (which is what exercises the KV
  compaction of accepted tree nodes) -- plus distinct wrong candidates.
* ``DDTREE_TEST_WIDTHS``: JSON lines ``{"runner": "draft"|"target", "tokens_per_req": n}``
  for every distinct TARGET_VERIFY width the attention stand-in serves (with
  ``DDTREE_TEST_WIDTHS_EVERY=1``: one line per verify forward, in order, for tests that
  switch the tree at runtime).
* ``DDTREE_TEST_BREAK_HOOK``: a HookRegistry target whose hooks then fail to apply, the
  way ``HookRegistry.apply_hooks`` meets a broken hook in the field (it logs the exception
  and carries on): the DDTREE worker must refuse to start.
* ``DDTREE_TEST_MASK``: JSON lines, one per distinct record, of the tree mask a target
  verify hands attention: whether it is a view of the worker's ``TreeMaskBuffer`` (the
  buffer the last ``TreeMaskBuffer.write`` filled), its cells, and what FlashInfer's
  verify planning needs before it re-allocates (``generate_attn_arg_prefill``,
  srt/speculative/dflash_info.py: ``seq_lens_sum * N + N * N * bs`` cells).

Stand-in for a GPU path (off unless its environment variable names a file):

* ``DDTREE_TEST_TRITON_REPLAY`` (with ``DDTREE_TEST_TRITON_REPLAY_MAX_BS``, the decode
  graph's max batch size): the CPU has no CUDA graphs, so the target's Triton backend
  never takes the replay metadata path. This makes it do so for every DDTREE target
  verify of at most that many requests that the worker does not run eager: the backend
  gets its graph state once (``init_cuda_graph_state``, with the GPU's FULL_MASK verify
  mask, not the CPU's QLEN_ONLY), and each such round builds its metadata as a capture
  does (``init_forward_metadata_out_graph(in_capture=True)``: the fixed buffers, the
  mask copied into ``_verify_mask.buffer`` by ``_update_target_verify_buffers``), then
  runs eagerly on it. One JSON line per such metadata build (the CPU's eager verify
  builds it twice a round: ``prepare_for_verify`` and the eager runner): ``bs``, ``n``,
  the view's cells, the buffer's cells, the cells the kernel reads
  (``N * sum(seq_lens + N)``) and the largest prefix.
"""

from __future__ import annotations

import importlib.util
import json
import os


def installed() -> bool:
    return importlib.util.find_spec("sglang.srt.speculative.ddtree_registration") is not None


def declare_torch_native() -> None:
    from sglang.srt.speculative import ddtree_registration as reg

    reg.TREE_VERIFY_BACKENDS["torch_native"] = "custom mask (CPU test stand-in TARGET_VERIFY)"
    reg.REFUSED_VERIFY_BACKENDS.pop("torch_native", None)
    reg.BLOCK_DRAFT_BACKENDS.add("torch_native")


def device_on_cpu(original, cfg):
    """AROUND ``ddtree_registration.check_ddtree_device``: let device cpu through."""
    if str(cfg.device) == "cpu":
        return None
    return original(cfg)


_ORACLE: dict[str, list[int]] | None = None


def _oracle_table() -> dict[str, list[int]]:
    global _ORACLE
    if _ORACLE is None:
        with open(os.environ["DDTREE_TEST_ORACLE"]) as f:
            _ORACLE = {k: [int(t) for t in v] for k, v in json.load(f).items()}
    return _ORACLE


def oracle_rank(depth: int) -> int:
    """Rank of the true token at draft depth ``depth`` (1-based)."""
    return 1 if depth % 3 == 2 else 0


def oracle_draft(original, self, batch, draft_input, bs):
    """AROUND ``DDTreeWorkerV2._draft``: the real draft runs (its KV writes and window
    are kept), then its candidates are replaced by the oracle's."""
    import torch

    out = original(self, batch, draft_input, bs)
    if not os.environ.get("DDTREE_TEST_ORACLE"):
        return out
    table = _oracle_table()
    ids = out.topk_ids.clone()
    _, depth, k = ids.shape
    vocab = int(self.model_runner.model_config.vocab_size)
    lps = torch.tensor(
        [-0.3 - 0.1 * r if r < 2 else -2.0 - r for r in range(k)], dtype=torch.float32
    ).expand(bs, depth, k)
    prefix = batch.seq_lens.tolist()
    for b, req in enumerate(batch.reqs):
        cont = table.get(",".join(map(str, req.origin_input_ids)))
        if cont is None:
            continue
        root = prefix[b] - len(req.origin_input_ids)  # index of the root token in cont
        for d in range(1, depth + 1):
            if root + d >= len(cont):
                break
            true = cont[root + d]
            wrong = [t for t in ((true + 7 * j + 1) % vocab for j in range(k + 1)) if t != true]
            row = wrong[:k]
            row[oracle_rank(d) if k > 1 else 0] = true
            ids[b, d - 1] = torch.tensor(row, dtype=ids.dtype)
    out.topk_ids = ids
    out.topk_logprobs = lps.to(out.topk_logprobs.device).clone()
    return out


_SEEN_WIDTHS: set[tuple[str, int]] = set()


def record_width(runner: str, tokens_per_req: int) -> None:
    path = os.environ.get("DDTREE_TEST_WIDTHS")
    every = os.environ.get("DDTREE_TEST_WIDTHS_EVERY") == "1"
    if not path or (not every and (runner, tokens_per_req) in _SEEN_WIDTHS):
        return
    _SEEN_WIDTHS.add((runner, tokens_per_req))
    with open(path, "a") as f:
        f.write(json.dumps({"runner": runner, "tokens_per_req": tokens_per_req}) + "\n")


_MASK_BUFFER_PTR: list[int] = []
_SEEN_MASKS: set[tuple] = set()


def mask_buffer_write(original, self, *args, **kwargs):
    """AROUND ``ddtree_utils.TreeMaskBuffer.write``: note the buffer's storage."""
    out = original(self, *args, **kwargs)
    _MASK_BUFFER_PTR[:] = [self._buf.untyped_storage().data_ptr()]
    return out


def record_mask(spec_info, forward_batch, n: int, bs: int) -> None:
    path = os.environ.get("DDTREE_TEST_MASK")
    mask = getattr(spec_info, "custom_mask", None)
    if not path or mask is None or not hasattr(spec_info, "retrieve_next_sibling"):
        return  # not a DDTREE target verify
    record = {
        "view_of_buffer": bool(_MASK_BUFFER_PTR) and mask.untyped_storage().data_ptr() == _MASK_BUFFER_PTR[0],
        "mask_cells": int(mask.numel()),
        "flashinfer_needs": int(forward_batch.seq_lens_sum) * n + n * n * bs,
        "bs": bs,
        "n": n,
    }
    key = tuple(sorted(record.items()))
    if key in _SEEN_MASKS or len(_SEEN_MASKS) > 200:
        return
    _SEEN_MASKS.add(key)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def break_hook(target: str) -> None:
    """Make HookRegistry fail to apply the hooks of ``target`` (see DDTREE_TEST_BREAK_HOOK)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    real_apply = HookRegistry._apply_target.__func__

    def failing(cls, name, hooks):
        if name == target:
            raise RuntimeError(f"DDTREE_TEST_BREAK_HOOK: {name} cannot be applied")
        return real_apply(cls, name, hooks)

    HookRegistry._apply_target = classmethod(failing)


_EAGER_VERIFY = [False]
_REPLAY_READY: set[int] = set()


def eager_verify_round(original, self, eager):
    """AROUND ``DDTreeWorkerV2._verify_graph_unless``: a round the worker runs without
    its verify graph takes the eager metadata path here too."""
    import contextlib

    @contextlib.contextmanager
    def around():
        with original(self, eager):
            _EAGER_VERIFY[0] = bool(eager)
            try:
                yield
            finally:
                _EAGER_VERIFY[0] = False

    return around()


def triton_verify_replay(original, self, forward_batch):
    """AROUND ``TritonAttnBackend.init_forward_metadata``: a DDTREE target verify of at
    most ``DDTREE_TEST_TRITON_REPLAY_MAX_BS`` requests gets the graph-replay metadata."""
    import torch

    spec_info = forward_batch.spec_info
    max_bs = int(os.environ.get("DDTREE_TEST_TRITON_REPLAY_MAX_BS", "0"))
    bs = int(forward_batch.batch_size)
    if (
        _EAGER_VERIFY[0]
        or self.is_draft_runner
        or not forward_batch.forward_mode.is_target_verify()
        or getattr(spec_info, "custom_mask", None) is None
        or not hasattr(spec_info, "retrieve_next_sibling")
        or bs > max_bs
    ):
        return original(self, forward_batch)
    if id(self) not in _REPLAY_READY:
        from sglang.srt.layers.attention import verify_mask
        from sglang.srt.speculative.eagle_utils import TreeMaskMode

        cpu_mode = verify_mask.default_tree_mask_mode
        verify_mask.default_tree_mask_mode = lambda: TreeMaskMode.FULL_MASK
        try:
            self.init_cuda_graph_state(max_bs, max_bs * int(self.num_draft_tokens))
        finally:
            verify_mask.default_tree_mask_mode = cpu_mode
        _REPLAY_READY.add(id(self))
    original(self, forward_batch)  # the eager path's per-round state, then replaced
    self.init_forward_metadata_out_graph(forward_batch, in_capture=True)
    n = int(self.num_draft_tokens)
    seq_lens = forward_batch.seq_lens[:bs].to("cpu", dtype=torch.int64)
    record = {
        "bs": bs,
        "n": n,
        "max_bs": max_bs,
        "mask_cells": int(spec_info.custom_mask.numel()),
        "buffer_cells": int(self._verify_mask.buffer.numel()),
        "kernel_reads": n * int((seq_lens + n).sum()),
        "max_prefix": int(seq_lens.max()),
        "context_len": int(self.max_context_len),
    }
    with open(os.environ["DDTREE_TEST_TRITON_REPLAY"], "a") as f:
        f.write(json.dumps(record) + "\n")
