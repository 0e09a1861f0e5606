"""The continuous-batching scheduler of the simulated server.

One asyncio task plays SGLang's scheduler: each iteration either prefills newly
admitted requests (producing their first token, as SGLang's prefill does) or runs one
decode step over every running request. What a step *produces* comes from running the
real DDTree code against the synthetic language (a served DDTREE: the copy deployed into
the host's SGLang, ``sim/plugin.py``); how long it *takes* comes from the GPU profile's cost model, slept in real
time scaled by ``SIM_TIME_SCALE``. The CPU work of a step counts towards its sleep, so
the simulator only distorts timing once that work exceeds the modelled step time
(``benchmarks/sim_capacity.py`` measures where).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from ddtree_ops.sim.args import SLOW_FAULT_FACTOR, ServerArgs, SimSettings
from ddtree_ops.sim.language import CATEGORIES, Category, SyntheticLanguage
from ddtree_ops.sim.logs import scheduler_crash
from ddtree_ops.sim.params import SamplingParams, StepOutput
from ddtree_ops.sim.profiles import PROFILES, GpuProfile
from ddtree_ops.sim.states import GraphOutcome, RuntimeStates, StateGraph, TreeState
from ddtree_ops.sim.text import EOS_TOKEN, VOCAB, hash_ints


def bundled_core() -> ModuleType:
    """The bundle's per-request reference in this checkout: what DFLASH's chain (upstream
    code on a real host) verifies with, and what offline calibration runs DDTREE with. A
    served DDTREE runs the host's deployed copy instead (``sim/plugin.py``)."""
    from ddtree_ops.ddtree_core import load_ddtree_reference

    return load_ddtree_reference()


@dataclass
class GenRequest:
    """Mutable per-request state owned by the scheduler loop."""

    rid: str
    prompt_ids: list[int]
    category: Category
    params: SamplingParams
    key: int
    generator: torch.Generator
    created: float
    output_ids: list[int] = field(default_factory=list)
    verify_ct: int = 0
    correct_drafts: int = 0
    # Tree nodes proposed over the request's rounds: the sum of each round's budget (the
    # budget may change between rounds on a server with runtime states).
    proposed_drafts: int = 0
    finish_reason: dict[str, Any] | None = None
    queue: asyncio.Queue[StepOutput] = field(default_factory=asyncio.Queue)
    aborted: bool = False
    # (monotonic time the step committed, tokens it emitted): the server's own clock, which
    # benchmarks/client_accuracy.py holds every benchmark client's timing against.
    emits: list[tuple[float, int]] = field(default_factory=list)
    # The tree trace of its traced rounds (the bundle's ddtree_trace.RequestTrace); None
    # until a round of it runs with the trace on.
    trace: Any = None
    # SIM_DDTREE_FAULT=late_token: whether this request's one wrong token was emitted.
    fault_fired: bool = False
    # Log-probabilities of the output so far (return_logprob), filled on demand by
    # Engine.fill_logprobs: the emitted token's, and the best (logprob, token) pairs.
    lp_token: list[float] = field(default_factory=list)
    lp_top: list[list[tuple[float, int]]] = field(default_factory=list)
    # The cost model's milliseconds of every step this request took part in (prefill and
    # decode): its latency on the model's own clock, whatever the machine's speed.
    modelled_ms: float = 0.0
    # The prompt's (logprob_start_len >= 0), computed once: (token rows, top rows).
    input_lp: tuple[list[list[Any]], list[Any]] | None = None

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else (self.prompt_ids[-1] if self.prompt_ids else 1)

    @property
    def position(self) -> int:
        """Absolute position of the next token to generate."""
        return len(self.prompt_ids) + len(self.output_ids)


# What SGLang 0.5.23 logs when a decode CUDA graph's replay faults (the error surfaces at
# the replay: decode_cuda_graph_runner.execute -> the graph backend's replay).
_REPLAY_CRASH_TRACE = (
    "Traceback (most recent call last):\n"
    '  File "sglang/srt/managers/scheduler.py", in event_loop_overlap\n'
    "    batch_result = self.run_batch(batch)\n"
    '  File "sglang/srt/model_executor/runner/decode_cuda_graph_runner.py", line 2011, in execute\n'
    "    output = self.backend.replay(self._replay_graph_key, forward_batch)\n"
    '  File "sglang/srt/model_executor/runner_backend/full_cuda_graph_backend.py", in replay\n'
    "    graph.replay()\n"
    "torch.AcceleratorError: CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
    "below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."
)
# A sampled request that the verify path cannot serve raising inside the forward (what
# issue-12's bundle did without the sampling kernel), graphs or not.
_SAMPLED_CRASH_TRACE = (
    "Traceback (most recent call last):\n"
    '  File "sglang/srt/managers/scheduler.py", in event_loop_overlap\n'
    "    batch_result = self.run_batch(batch)\n"
    '  File "sglang/srt/speculative/ddtree_worker_v2.py", in forward_batch_generation\n'
    "    raise RuntimeError(\n"
    "RuntimeError: DDTree sampled verify needs sgl_kernel's tree_speculative_sampling_target_only"
)

# How far behind its planned timeline the loop may fall and still catch up; beyond it
# the simulator is overloaded and restarts the timeline rather than bursting.
_CATCH_UP_S = 0.05
# SIM_DDTREE_FAULT=late_token replaces a token only where the target is this sure of it
# (its top-2 log-probability gap, nats): far above any near-tie a gate may forgive.
CONFIDENT_GAP = 1.0


class Engine:
    """Scheduler loop + model stand-in; one per server process."""

    def __init__(
        self, args: ServerArgs, settings: SimSettings, core: ModuleType | None = None,
        trace_core: ModuleType | None = None,
    ) -> None:
        """``core``: the tree code a speculating server verifies with (None: the bundle's
        in this checkout, :func:`bundled_core`); ``trace_core``: the deployed bundle's
        ``ddtree_trace`` module (with ``core`` None: the checkout's), None where the
        deployed bundle has none (a trace switch is refused)."""
        # The simulator's tensors are tiny: extra intra-op threads only fight the other
        # processes on the machine (on a busy 2-core box the sampler ran 10x slower).
        torch.set_num_threads(1)
        self.args = args
        self.settings = settings
        self.profile: GpuProfile = PROFILES[settings.gpu]
        self.language = SyntheticLanguage(settings.seed)
        self.core: ModuleType | None = (core or bundled_core()) if args.speculating else None
        if core is None and trace_core is None and args.ddtree is not None:
            from ddtree_ops.ddtree_core import DDTREE_TRACE_PATH, load_ddtree_trace

            trace_core = load_ddtree_trace() if DDTREE_TRACE_PATH.is_file() else None
        self.trace_core = trace_core
        self._waiting: list[GenRequest] = []
        self._running: list[GenRequest] = []
        self._wakeup = asyncio.Event()
        self._counter = itertools.count()
        self._task: asyncio.Task[None] | None = None
        # End of the last step on the loop's clock; -inf: no step to continue from.
        self._planned_end = -math.inf
        self._generator = torch.Generator().manual_seed(hash_ints(settings.seed, 77))
        self.total_verify_ct = 0
        self.total_completion_tokens = 0
        self.last_step_ms = 0.0
        # Finished requests' timing on the server's clock (/sim/request_times); bounded.
        self.request_times: collections.deque[dict[str, Any]] = collections.deque(maxlen=100_000)
        # DDTREE's runtime states: one fixed state from the flags until the server's
        # startup replaces it with the captured set of --speculative-adaptive-config.
        self.states: RuntimeStates | None = fixed_states(args) if args.ddtree is not None else None
        # SIM_DDTREE_FAULT, where it applies (a DDTREE server's deployed plugin only).
        self.fault = settings.ddtree_fault if args.speculative_algorithm == "DDTREE" else None

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def flush_cache(self) -> bool:
        """SGLang refuses to flush while requests run; so do we."""
        return not self._running and not self._waiting

    def restart_acceptance_stats(self) -> None:
        """An accepted switch starts the cumulative acceptance over (the contract: a
        number averaged across two trees describes neither)."""
        self.total_verify_ct = 0
        self.total_completion_tokens = 0

    def avg_spec_accept_length(self) -> float:
        if self.total_verify_ct == 0:
            return 0.0
        return self.total_completion_tokens / self.total_verify_ct

    # ---------------------------------------------------------------- requests
    def submit(
        self, prompt_ids: Sequence[int], category: str, params: SamplingParams, rid: str | None = None,
        arrived: float | None = None,
    ) -> GenRequest:
        """Queue a request; ``arrived`` (monotonic) is when its bytes reached the server, the
        start of its time on the server's clock (``created``), else now."""
        n = next(self._counter)
        rid = rid or f"sim-{n:08x}"
        prompt = [int(t) % VOCAB for t in prompt_ids] or [1]
        key = hash_ints(self.settings.seed, *prompt[-64:], len(prompt))
        gen_seed = hash_ints(
            self.settings.seed, params.sampling_seed if params.sampling_seed is not None else 1_000_003 + n, key
        )
        req = GenRequest(
            rid=rid,
            prompt_ids=prompt,
            category=CATEGORIES[category],
            params=params,
            key=key,
            generator=torch.Generator().manual_seed(gen_seed),
            created=time.monotonic() if arrived is None else arrived,
        )
        if params.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
            req.queue.put_nowait(StepOutput((), True))
            return req
        self._waiting.append(req)
        self._wakeup.set()
        return req

    def abort(self, req: GenRequest) -> None:
        req.aborted = True

    # ---------------------------------------------------------------- loop
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._running = [r for r in self._running if not r.aborted]
            self._waiting = [r for r in self._waiting if not r.aborted]
            if not self._running and not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                # Idle time is not lateness: the step after an idle spell starts when its
                # work arrived, not at the last step's planned end (which would count the
                # idle gap as prefill already done and make TTFT read short).
                self._planned_end = -math.inf
                continue
            # Steps run on an absolute timeline: when the previous step just ended, this
            # one starts at its *planned* end, so the event loop waking a little late
            # (timer granularity, a busy machine) is paid back instead of accumulating.
            now = loop.time()
            t0 = self._planned_end if 0.0 <= now - self._planned_end < _CATCH_UP_S else now
            room = self.args.max_running_requests - len(self._running)
            if self._waiting and room > 0:
                batch = self._waiting[:room]
                del self._waiting[:room]
                outputs = self._prefill(batch)
                ms = self.profile.prefill_ms(
                    sum(len(r.prompt_ids) for r in batch),
                    cuda_graph=self.args.cuda_graph_backend_prefill != "disabled",
                )
                self._running.extend(batch)
            else:
                batch = list(self._running)
                self._crash_if_configured(batch)
                outputs, verify_tokens, graph = self._decode(batch)
                ms = self.profile.step_ms(
                    batch=len(batch),
                    verify_tokens=verify_tokens,
                    draft_positions=self.args.draft_positions,
                    cuda_graph=graph,
                )
                if self.fault == "slow":
                    ms *= SLOW_FAULT_FACTOR
            self.last_step_ms = ms
            for req in batch:
                req.modelled_ms += ms
            self._planned_end = t0 + self.settings.scaled(ms / 1000.0)
            await asyncio.sleep(max(0.0, self._planned_end - loop.time()))
            for req, new_ids in zip(batch, outputs, strict=True):
                self._commit(req, new_ids)
            self._running = [r for r in self._running if r.finish_reason is None]

    def _crash_if_configured(self, batch: Sequence[GenRequest]) -> None:
        """The failure modes of a decode step (SimSettings), with the lines SGLang logs."""
        args, settings = self.args, self.settings
        limit = settings.replay_crash_budget_over
        if limit is not None and args.speculating and args.decode_cuda_graph and self._tree_budget() > limit:
            scheduler_crash(args.tp_size, _REPLAY_CRASH_TRACE)
        sampled = any(r.params.temperature > 0 for r in batch)
        ddtree_crash = settings.ddtree_fault == "crash_sampled" and args.speculative_algorithm == "DDTREE"
        if sampled and (settings.crash_sampled or ddtree_crash):
            scheduler_crash(args.tp_size, _SAMPLED_CRASH_TRACE)

    def _tree_budget(self) -> int:
        if self.states is not None:
            return self.states.active.budget
        return max(0, (self.args.speculative_num_draft_tokens or 1) - 1)

    def _commit(self, req: GenRequest, new_ids: list[int]) -> None:
        if req.aborted or req.finish_reason is not None:
            return
        room = req.params.max_new_tokens - len(req.output_ids)
        emitted: list[int] = []
        for tok in new_ids[:room]:
            emitted.append(tok)
            if tok == EOS_TOKEN and not req.params.ignore_eos:
                req.finish_reason = {"type": "stop", "matched": EOS_TOKEN}
                break
        req.output_ids.extend(emitted)
        self.total_completion_tokens += len(emitted)
        if emitted:
            req.emits.append((time.monotonic(), len(emitted)))
        if req.finish_reason is None and len(req.output_ids) >= req.params.max_new_tokens:
            req.finish_reason = {"type": "length", "length": req.params.max_new_tokens}
        if req.finish_reason is not None:
            self.request_times.append({"rid": req.rid, "created": req.created, "emits": req.emits})
        req.queue.put_nowait(StepOutput(tuple(emitted), req.finish_reason is not None))

    # ---------------------------------------------------------------- model
    def _target(
        self, keys: Sequence[int], positions: Sequence[int], lasts: Sequence[int], cats: Sequence[Category],
        prompt_lens: Sequence[int],
    ) -> torch.Tensor:
        """The target's logits ``[M, VOCAB]`` for rows (request key, absolute position, previous
        token), with SIM_TARGET_TIE_AT's exact tie where a code prompt's output index is that:
        the second-best logit raised to the best's (the model's own tie, for every algorithm)."""
        logits = self.language.target_logits(
            torch.tensor(list(keys), dtype=torch.int64),
            torch.tensor(list(positions), dtype=torch.int64),
            torch.tensor(list(lasts), dtype=torch.int64),
            list(cats),
        )
        tie_at = self.settings.target_tie_at
        if tie_at is not None:
            rows = [i for i, (pos, n, cat) in enumerate(zip(positions, prompt_lens, cats, strict=True))
                    if pos - n == tie_at and cat.name == "code"]
            if rows:
                top = logits[rows].topk(2, dim=-1)
                logits[rows, top.indices[:, 1]] = top.values[:, 0]
        return logits

    def _root_logits(self, batch: Sequence[GenRequest]) -> torch.Tensor:
        return self._target([r.key for r in batch], [r.position for r in batch], [r.last_token for r in batch],
                            [r.category for r in batch], [len(r.prompt_ids) for r in batch])

    def fill_logprobs(self, req: GenRequest, top_n: int) -> None:
        """``req.lp_token`` / ``req.lp_top`` up to its output so far: the target's log-probability
        of each emitted token at its position, and its ``top_n`` best (logprob, token), as SGLang
        returns them (``log_softmax(logits)`` at T = 0, ``log_softmax(logits / T)`` above: the
        distribution before top-k/top-p). Recomputed from the model, not kept from the step: the
        target is deterministic, and a faulty plugin's token gets the target's opinion of it."""
        have, n = len(req.lp_token), len(req.output_ids)
        if have >= n:
            return
        plen = len(req.prompt_ids)
        index = range(have, n)
        lasts = [req.output_ids[j - 1] if j > 0 else req.prompt_ids[-1] for j in index]
        logits = self._target([req.key] * len(index), [plen + j for j in index], lasts,
                              [req.category] * len(index), [plen] * len(index))
        lp = self._logprobs(logits, req.params.temperature)
        tokens = torch.tensor(req.output_ids[have:n], dtype=torch.int64)
        req.lp_token.extend(lp.gather(1, tokens[:, None])[:, 0].tolist())
        if top_n > 0:
            values, ids = lp.topk(min(top_n, VOCAB), dim=-1)
            req.lp_top.extend(list(zip(v, i, strict=True))
                              for v, i in zip(values.tolist(), ids.tolist(), strict=True))

    def input_logprobs(self, req: GenRequest, start: int, top_n: int) -> tuple[list[list[Any]], list[Any]]:
        """The prompt's log-probabilities from token ``start`` on (``logprob_start_len``), as
        0.5.23 lays them out: ``[logprob, token, None]`` per prompt token, the first ``None``
        (nothing before it is scored), and the top rows the same way (``None`` first)."""
        if req.input_lp is None:
            ids = req.prompt_ids
            tokens: list[list[Any]] = []
            tops: list[Any] = []
            if start < len(ids):
                tokens.append([None, ids[start], None])
                tops.append(None)
                index = range(start + 1, len(ids))
                if index:
                    logits = self._target([req.key] * len(index), list(index), [ids[i - 1] for i in index],
                                          [req.category] * len(index), [len(ids)] * len(index))
                    lp = self._logprobs(logits, req.params.temperature)
                    chosen = lp.gather(1, torch.tensor([ids[i] for i in index], dtype=torch.int64)[:, None])[:, 0]
                    tokens += [[v, ids[i], None] for v, i in zip(chosen.tolist(), index, strict=True)]
                    if top_n > 0:
                        values, top_ids = lp.topk(min(top_n, VOCAB), dim=-1)
                        tops += [[[v, t, None] for v, t in zip(vr, ir, strict=True)]
                                 for vr, ir in zip(values.tolist(), top_ids.tolist(), strict=True)]
            req.input_lp = (tokens, tops)
        return req.input_lp

    @staticmethod
    def _logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
        return torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)

    def _sample_one(self, batch: Sequence[GenRequest], logits: torch.Tensor) -> list[list[int]]:
        """Autoregressive token per request, from SGLang's target distribution."""
        out: list[list[int]] = []
        greedy = logits.argmax(dim=-1).tolist()
        for i, req in enumerate(batch):
            p = req.params
            if p.temperature <= 0:
                out.append([int(greedy[i])])
                continue
            probs = _target_probs(logits[i : i + 1], p)
            gen = req.generator if p.sampling_seed is not None else self._generator
            out.append([int(torch.multinomial(probs[0], 1, generator=gen).item())])
        return out

    def _prefill(self, batch: Sequence[GenRequest]) -> list[list[int]]:
        return self._sample_one(batch, self._root_logits(batch))

    def _decode(self, batch: Sequence[GenRequest]) -> tuple[list[list[int]], int, bool]:
        """(tokens per request, tokens verified per request, whether the step replays a
        CUDA graph)."""
        algo = self.args.speculative_algorithm
        if algo is None:
            return self._sample_one(batch, self._root_logits(batch)), 1, self.args.graph_replays(len(batch))
        return self._speculate(batch)

    def _speculate(self, batch: Sequence[GenRequest]) -> tuple[list[list[int]], int, bool]:
        core = self.core
        assert core is not None
        args = self.args
        depth = args.draft_depth
        graph = args.decode_cuda_graph
        trace = self.states.trace if self.states is not None else None
        if self.states is not None:
            # Read once, at the round's start: a switch arriving mid-round applies to the next.
            state = self.states.for_round(len(batch))
            topk, budget = state.topk, state.budget
            if trace is not None:  # the grid's union, verified in the state the trace picked
                topk, budget = trace.topk, trace.state_budget
            # A batch above the state's graph ceiling runs eager, as SGLang's can_run_graph decides.
            graph = graph and self.states.graph(budget).replays_graph(len(batch))
        else:  # DFLASH verifies one chain: the drafter's rank-0 token at every position
            topk = 1
            budget = depth
            graph = args.graph_replays(len(batch))
        keys = torch.tensor([r.key for r in batch], dtype=torch.int64)
        starts = torch.tensor([r.position for r in batch], dtype=torch.int64)
        lasts = torch.tensor([r.last_token for r in batch], dtype=torch.int64)
        cats = [r.category for r in batch]
        ids, lps = self.language.draft_topk(keys, starts, lasts, cats, depth, min(topk, VOCAB))
        if trace is not None:
            assert self.trace_core is not None
            table = [(ids[b, : trace.depth].tolist(), lps[b, : trace.depth].tolist()) for b in range(len(batch))]
            trees = [self.trace_core.union_tree(i, lp, int(lasts[b]), trace, core.build_ddtree_tree_from_topk)
                     for b, (i, lp) in enumerate(table)]
        else:
            trees = [core.build_ddtree_tree_from_topk(ids[b], lps[b], budget, int(lasts[b]))
                     for b in range(len(batch))]
        n = max(len(t.parents) for t in trees)
        if self.states is not None:
            # The real worker verifies the state's full width (budget + 1, padded with
            # unreachable nodes): a top-k 1 tree capped by the draft depth costs the same.
            n = max(n, budget + 1)
        # Target logits after every node: (position of the node's child, node token).
        row_keys: list[int] = []
        row_pos: list[int] = []
        row_last: list[int] = []
        row_cats: list[Category] = []
        row_plens: list[int] = []
        for req, tree in zip(batch, trees, strict=True):
            pad = n - len(tree.parents)  # padding rows repeat the root; they are unreachable
            base = req.position
            row_keys.extend([req.key] * n)
            row_pos.extend([base + d for d in tree.depths] + [base] * pad)
            row_last.extend(tree.token_ids + [tree.token_ids[0]] * pad)
            row_cats.extend([req.category] * n)
            row_plens.extend([len(req.prompt_ids)] * n)
        logits = self._target(row_keys, row_pos, row_last, row_cats, row_plens).reshape(len(batch), n, VOCAB)
        fault = self.fault
        results: list[tuple[list[int], list[int]] | None] = [None] * len(batch)
        greedy_idx = [b for b, r in enumerate(batch) if r.params.temperature <= 0]
        if greedy_idx:
            rows = logits[greedy_idx]
            # torch.argmax keeps the first of tied maxima; the tie_flip plugin keeps the last
            # (what another kernel's reduction order may do: legal, and only at an exact tie).
            argmax = (VOCAB - 1) - rows.flip(-1).argmax(dim=-1) if fault == "tie_flip" else rows.argmax(dim=-1)
            for row, b in enumerate(greedy_idx):
                results[b] = core.follow_verified_tree(trees[b].parents, trees[b].token_ids, argmax[row])
        # Requests that carry a sampling_seed verify alone, with their own generator, so
        # their output never depends on who shares the batch (SGLang's promise for
        # sampling_seed). The rest verify in one batched call on the engine's generator
        # (seeded from SIM_SEED): far cheaper per step, deterministic for a fixed order.
        shared = [b for b, r in enumerate(batch) if results[b] is None and r.params.sampling_seed is None]
        if shared:
            ps = [batch[b].params for b in shared]
            outs = core.sample_tree_paths(
                [trees[b] for b in shared], logits[shared],
                [p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps],
                generator=self._generator, use_kernel=False,
            )
            for b, res in zip(shared, outs, strict=True):
                results[b] = res
        for b, req in enumerate(batch):
            if results[b] is not None:
                continue
            p = req.params
            results[b] = core.sample_tree_paths(
                [trees[b]], logits[b : b + 1], p.temperature, p.top_k, p.top_p,
                generator=req.generator, use_kernel=False,
            )[0]
        outputs: list[list[int]] = []
        for req, res in zip(batch, results, strict=True):
            assert res is not None
            accepted, proposed = res
            if fault == "accept_collapse":
                accepted, proposed = accepted[:1], proposed[:1]
            elif fault == "wrong_greedy" and req.params.temperature <= 0:
                proposed = [*proposed[:-1], (proposed[-1] + 1) % VOCAB]
            elif fault == "late_token" and req.params.temperature <= 0 and req.category.name == "code" \
                    and not req.fault_fired:
                accepted, proposed = self._late_token(req, accepted, proposed)
            req.verify_ct += 1
            req.correct_drafts += len(accepted) - 1
            req.proposed_drafts += budget
            self.total_verify_ct += 1
            outputs.append(list(proposed))
        if trace is not None:
            # A version-2 trace (the deployed bundle's ddtree_trace.py) commits one token per
            # recorded round, as the real worker does: rounds at consecutive positions.
            dense = getattr(self.trace_core, "VERSION", 1) >= 2
            for b, req in enumerate(batch):
                recording = dense and (req.trace is None or req.trace.recording())
                self._record_round(req, trace, table[b], trees[b], logits[b], len(outputs[b]) - 1)
                if recording:
                    req.correct_drafts -= len(outputs[b]) - 1
                    outputs[b] = outputs[b][:1]
            # The real round pads the union to the state's verify width.
            n = max(n, trace.width)
        return outputs, n, graph

    def _late_token(self, req: GenRequest, accepted: list[int], proposed: list[int]) -> tuple[list[int], list[int]]:
        """SIM_DDTREE_FAULT=late_token: the round's first token at output index SIM_FAULT_AT or
        later where the target is confident (top-2 gap >= CONFIDENT_GAP) becomes the target's
        runner-up, and the round ends there (what it verified after it assumed the right token);
        once per request."""
        start, plen = len(req.output_ids), len(req.prompt_ids)
        prev = req.last_token
        for k, token in enumerate(proposed):
            j = start + k
            if self.settings.fault_at <= j < req.params.max_new_tokens:
                row = self._target([req.key], [plen + j], [prev], [req.category], [plen])[0]
                top = torch.log_softmax(row, dim=-1).topk(2)
                if float(top.values[0] - top.values[1]) >= CONFIDENT_GAP:
                    req.fault_fired = True
                    return accepted[: k + 1], [*proposed[:k], int(top.indices[1])]
            prev = token
        return accepted, proposed

    def _record_round(
        self, req: GenRequest, trace: Any, table: tuple[list[Any], list[Any]], tree: Any, logits: torch.Tensor,
        accepted: int,
    ) -> None:
        """Append this round to ``req``'s trace, with the bundle's own record code: per
        node the target's probability of its token at its parent under the request's
        sampling (greedy: 1.0 at the argmax) and whether it is the argmax there."""
        mod = self.trace_core
        assert mod is not None
        params = req.params
        sampling = SimpleNamespace(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=0.0)
        if req.trace is None:
            req.trace = mod.RequestTrace(trace, mod.sampling_of(sampling))
        if not req.trace.wants_round():
            return
        n = len(tree.parents)
        tokens = torch.tensor([tree.token_ids], dtype=torch.int64)
        parents = torch.tensor([tree.parents], dtype=torch.int64)
        rows = logits[:n]
        probs = None if params.temperature <= 0 else _target_probs(rows, params)[None]
        p, is_argmax = mod.node_probabilities(tokens, parents, rows.argmax(dim=-1), probs)
        req.trace.rounds.append(mod.round_record(
            prefix=req.position, root=tree.token_ids[0], draft_ids=table[0], draft_logp=table[1], tree=tree,
            p=p[0].tolist(), argmax=is_argmax[0].tolist(), accepted=accepted,
        ))


def fixed_states(args: ServerArgs) -> RuntimeStates:
    """The one state of a DDTREE server without runtime states (mode "fixed")."""
    tree = args.ddtree
    assert tree is not None
    outcome: GraphOutcome = "captured" if args.decode_cuda_graph else "disabled"
    graph = StateGraph(tree.budget, outcome, cuda_graph_max_bs=args.decode_graph_max_bs)
    return RuntimeStates(launch=TreeState(tree.budget, tree.topk), graphs=(graph,), config=None)


def _target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """softmax(logits/T) then top-k then top-p, SGLang's order (same code as verification)."""
    if p.top_k == -1 and p.top_p >= 1.0:
        return torch.softmax(logits.float() / p.temperature, dim=-1)
    from ddtree_ops.ddtree_core import load_ddtree_reference

    return load_ddtree_reference().target_probs_from_logits(logits, p.temperature, p.top_k, p.top_p)
