"""HTTP surface and process lifecycle of the simulated server.

Routes, response shapes and status codes follow SGLang 0.5.23's
``sglang/srt/entrypoints/http_server.py`` and its OpenAI adapters for the subset the
toolkit and common clients use. Lifecycle follows ``launch_server``: wait for the port,
"load" with the port closed, log the capture, start uvicorn, run one internal warmup
request, then log ``The server is fired up and ready to roll!``. Health answers 503
until then. Everything reports itself as simulated (``version`` "0.5.23-sim").
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from ddtree_ops.sim.args import ServerArgs, SimSettings
from ddtree_ops.sim.logs import log_ranks, main_logger, scheduler_crash, scheduler_logger
from ddtree_ops.sim.params import LogprobParams, RequestError, SamplingParams
from ddtree_ops.sim.plugin import DeployedPlugin
from ddtree_ops.sim.profiles import PROFILES
from ddtree_ops.sim.states import GraphOutcome, RuntimeStates, StateGraph, SwitchRefused, TreeState
from ddtree_ops.sim.text import classify_prompt, detokenize, tokenize

if TYPE_CHECKING:  # the engine imports torch; the server loads it during "Load weight"
    from ddtree_ops.sim.engine import Engine, GenRequest

# The profiles model 8-GPU nodes (profiles.py); the simulated machine has that many
# GPUs whatever --tp-size the server was launched with, as nvidia-smi would list them.
SIMULATED_GPU_COUNT = 8

SIM_VERSION = "0.5.23-sim"
# What /server_info names as an attention backend: the simulator has none.
SIMULATED_BACKEND = "simulated"

# sglang/srt/model_executor/runner_backend_utils/__init__.py
CUDA_GRAPH_CAPTURE_FAILED_MSG = (
    "Possible solutions:\n"
    "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)\n"
    "2. set --cuda-graph-max-bs-decode to a smaller value (e.g., 16)\n"
    "3. disable decode CUDA graph by --cuda-graph-backend-decode=disabled. "
    "(Not recommended. Huge performance loss)\n"
    "Open an issue on GitHub https://github.com/sgl-project/sglang/issues/new/choose \n"
)


# SIM_DDTREE_FAULT=crash_load: what a DDTree plugin whose worker cannot initialise logs.
_CRASH_LOAD_TRACE = (
    "Traceback (most recent call last):\n"
    '  File "sglang/srt/managers/scheduler.py", line 6362, in run_scheduler_process\n'
    "    scheduler = Scheduler(server_args, port_args)\n"
    '  File "sglang/srt/speculative/ddtree_worker_v2.py", in __init__\n'
    "    self._build_verify_buffers()\n"
    "RuntimeError: DDTREE: the verify buffers do not fit the draft block (simulated plugin fault)"
)


class State:
    """Mutable process state shared by the routes (one per process)."""

    def __init__(self, args: ServerArgs, settings: SimSettings, launch_command: str) -> None:
        self.args = args
        self.settings = settings
        self.launch_command = launch_command
        self.startup_time = time.time()
        self.ready = False
        self.draining = False
        self.engine: Engine | None = None
        # Prompts /v1/tokenize rendered through the chat template -> their text's category:
        # the word hashes cannot be read back, and a chat prompt sent to /generate as those
        # ids must behave like its text (a math question stays math). Bounded.
        self.rendered: dict[tuple[int, ...], str] = {}

    def remember(self, ids: list[int], category: str) -> None:
        if len(self.rendered) >= _RENDERED_MAX:
            self.rendered.clear()
        self.rendered[tuple(ids)] = category


_RENDERED_MAX = 1 << 16
# Modelled memory of an extra DDTREE runtime state (the plugin measures it on the device): a
# verify attention workspace, plus the verify graph when it was captured (the 0.30 GB the
# simulated capture logs).
_STATE_WORKSPACE_MB = 128.0
_STATE_GRAPH_MB = 0.3 * 1024.0


# --------------------------------------------------------------------------- helpers
def _json(content: Any, status_code: int = 200) -> JSONResponse:
    return JSONResponse(content, status_code=status_code)


def _error(message: str, status_code: int = 400) -> JSONResponse:
    """SGLang's native error shape (``_create_error_response``)."""
    return _json({"error": {"message": message}}, status_code)


def _openai_error(message: str, status_code: int = 400, err_type: str = "BadRequestError") -> JSONResponse:
    """SGLang's OpenAI error shape (``OpenAIServingBase.create_error_response``)."""
    return _json(
        {"object": "error", "message": message, "type": err_type, "param": None, "code": status_code}, status_code
    )


async def _read_json(request: Request) -> Any:
    body = await request.body()
    try:
        return json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"Invalid JSON body: {exc}") from None


def _engine(request: Request) -> Engine:
    engine = request.app.state.sim.engine
    assert engine is not None
    return engine


def _meta_info(state: State, req: GenRequest, e2e: float, logprob: LogprobParams | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.prompt_ids),
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,
        "e2e_latency": e2e,
        "simulated": True,
        # Beyond SGLang, like "simulated": real seconds per simulated second. Below 1 the
        # simulator's own CPU work can outlast a step (README, "Compressed time is not a
        # clock"), so timings measured here are not the cost model's.
        "sim_time_scale": state.settings.time_scale,
        # Beyond SGLang too: the request's latency on the cost model's clock (simulated
        # seconds of the steps it took part in), which no busy machine can stretch.
        "sim_modelled_s": req.modelled_ms / 1000.0,
    }
    if logprob is not None and logprob.return_logprob:
        _add_logprobs(meta, state, req, logprob)
    args = state.args
    if args.speculating and req.verify_ct > 0:
        proposed = req.proposed_drafts
        meta["spec_accept_rate"] = req.correct_drafts / proposed if proposed else 0.0
        meta["spec_accept_length"] = len(req.output_ids) / req.verify_ct
        meta["spec_num_correct_drafts"] = req.correct_drafts
        meta["spec_num_proposed_drafts"] = proposed
        meta["spec_verify_ct"] = req.verify_ct
    if req.trace is not None and req.finish_reason is not None:
        # Once, with the finished request (the plugin's finished_payload): the rounds that
        # committed what the request returns.
        meta["ddtree_trace"] = req.trace.payload(len(req.prompt_ids) + len(req.output_ids))
    return meta


def _add_logprobs(meta: dict[str, Any], state: State, req: GenRequest, logprob: LogprobParams) -> None:
    """The log-probability fields of 0.5.23's ``meta_info`` (``TokenizerManager.
    add_logprob_to_meta_info``, ``return_text_in_logprobs`` false): ``[logprob, token_id,
    None]`` triples, the top rows only with ``top_logprobs_num`` > 0."""
    engine = state.engine
    assert engine is not None
    top_n = logprob.top_logprobs_num
    engine.fill_logprobs(req, top_n)
    start = logprob.logprob_start_len
    tokens, tops = engine.input_logprobs(req, start, top_n) if start >= 0 else ([], [])
    meta["input_token_logprobs"] = tokens
    meta["output_token_logprobs"] = [[v, t, None] for v, t in zip(req.lp_token, req.output_ids, strict=False)]
    meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
    if top_n > 0:
        meta["input_top_logprobs"] = tops
        meta["output_top_logprobs"] = [[[v, t, None] for v, t in row] for row in req.lp_top]


def _prompt_from(obj: dict[str, Any], state: State | None = None) -> tuple[list[int], str]:
    text = obj.get("text")
    ids = obj.get("input_ids")
    if text is None and ids is None:
        raise RequestError("Either text or input_ids should be provided.")
    if text is not None and ids is not None:
        raise RequestError("Either text or input_ids should be provided, not both.")
    if text is not None:
        if not isinstance(text, str):
            raise RequestError("text must be a string (batched requests are not simulated)")
        return tokenize(text), classify_prompt(text)
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise RequestError("input_ids must be a list of non-negative integers")
    return list(ids), (state.rendered.get(tuple(ids), "chat") if state is not None else "chat")


async def _run_to_end(req: GenRequest) -> None:
    while True:
        out = await req.queue.get()
        if out.finished:
            return


# --------------------------------------------------------------------------- routes
async def health(request: Request) -> Response:
    state: State = request.app.state.sim
    if state.draining:
        # The stale-answer race seen in production: the old process still says 200.
        return Response(status_code=200)
    return Response(status_code=200 if state.ready else 503)


async def server_info(request: Request) -> Response:
    state: State = request.app.state.sim
    engine = state.engine
    profile = PROFILES[state.settings.gpu]
    visible = state.settings.visible_gpus(SIMULATED_GPU_COUNT)
    internal = {
        "avg_spec_accept_length": engine.avg_spec_accept_length() if engine else 0.0,
        "num_running_reqs": engine.num_running if engine else 0,
        "num_waiting_reqs": engine.num_waiting if engine else 0,
        "last_gen_throughput": 0.0,
        "memory_usage": {"weight": 0.0, "kvcache": 0.0},
    }
    if engine is not None and engine.states is not None:
        internal["ddtree"] = engine.states.as_json()
    extra: dict[str, Any] = {}
    if state.args.ddtree is not None:
        extra["ddtree"] = ddtree_info(state.args, engine.states if engine else None)
    return _json(
        {
            **state.args.as_dict(),
            **extra,
            # SGLang 0.5.23's resolved graph settings (ServerArgs.cuda_graph_config).
            "cuda_graph_config": {
                "decode": {"backend": state.args.cuda_graph_backend_decode,
                           "max_bs": state.args.cuda_graph_max_bs_decode},
                "prefill": {"backend": state.args.cuda_graph_backend_prefill},
            },
            "launch_command": state.launch_command,
            "startup_time": state.startup_time,
            "internal_states": [internal],
            "version": SIM_VERSION,
            "frontend": "python",
            "simulated": True,
            # Not in real SGLang (its /server_info says nothing about GPUs): lets a
            # benchmark on a host without GPUs label its rows by the simulated machine
            # instead of by host, without ever passing for real hardware.
            "simulated_gpu": {
                "profile": profile.name,
                "name": f"{profile.gpu_name} (simulated)",
                "compute_cap": profile.compute_cap,
                # What CUDA_VISIBLE_DEVICES left this process: a GPU slot's share.
                "count": len(visible),
                "indices": list(visible),
                "cuda_visible_devices": state.settings.visible_devices,
            },
            "sim": {
                "time_scale": state.settings.time_scale,
                "seed": state.settings.seed,
            },
        }
    )


def ddtree_info(args: ServerArgs, states: RuntimeStates | None = None) -> dict[str, Any]:
    """``/server_info``'s ``ddtree`` object, with the DDTree plugin's fields
    (``DDTreeWorkerV2.describe_ddtree``). The simulator has no attention backends and
    no CUDA graphs, so it names neither a backend class nor a captured graph it does not
    have: both backends are "simulated", and ``verify_cuda_graph_captured`` says whether
    the simulated capture ran (decode graphs not disabled). Sampled requests verify with
    the pure-torch twin of the kernel: ``sampler`` "reference". Static, from startup: with
    runtime states it describes the launch state (``internal_states[0].ddtree`` says which
    state is active and how each one's capture went)."""
    tree = args.ddtree
    assert tree is not None
    captured = args.decode_cuda_graph
    max_bs = args.decode_graph_max_bs
    if states is not None and tree.budget in states.graphs:
        captured = states.graph(tree.budget).served_with_graph
        max_bs = states.graph(tree.budget).cuda_graph_max_bs
    return {
        "budget": tree.budget,
        "topk": tree.topk,
        "draft_block_size": tree.draft_block_size,
        "verify_width": tree.verify_width,
        "max_depth": tree.max_depth,
        "verify_attention_backend": SIMULATED_BACKEND,
        "draft_attention_backend": SIMULATED_BACKEND,
        "decode_cuda_graph": args.cuda_graph_backend_decode,
        "verify_cuda_graph_captured": captured,
        # The plugin's graph ceiling of the state (DDTreeWorkerV2.describe_ddtree): a round of
        # more requests runs eager; None without a graph.
        "verify_cuda_graph_max_bs": max_bs if captured else None,
        "candidate_head": "draft CUDA graph" if args.decode_cuda_graph else "eager",
        # The plugin reports what its start-up checks found; the simulator has no hooks to
        # check, and says so instead of claiming them.
        "tree_mask": {"hooks_in_place": [], "capture_input": "simulated", "verify_graphs": "simulated"},
        "sampler": "reference",
        # SGLang's --speculative-accept-threshold-{single,acc} defaults: exact verification.
        "accept_thresholds": [1.0, 1.0],
    }


def _set_trace(engine: Engine, server_args: dict[str, Any]) -> Response:
    """The tree trace switch (issue 43: ``{"ddtree_trace": 1, "ddtree_trace_grid_<b>x<k>": 1,
    ..., "ddtree_trace_max_rounds": n}``, off ``{"ddtree_trace": 0}``; numbers only, as
    0.5.23 takes them), validated by the deployed bundle's own ``parse_trace_request``;
    its keys go alone. A deployed bundle without the trace refuses them as unknown keys."""
    states, mod, tree = engine.states, engine.trace_core, engine.args.ddtree
    assert states is not None and tree is not None and mod is not None
    try:
        if len(mod.trace_keys(server_args)) != len(server_args):
            raise mod.TraceRefused("DDTREE: the ddtree_trace keys go alone (pin a tree with a separate request).")
        states.trace = mod.parse_trace_request(
            server_args, budgets=list(states.budgets) if states.config is not None else None,
            topk_max=states.topk_max, block_size=tree.draft_block_size,
        )
    except mod.TraceRefused as exc:
        states.last_refusal = str(exc)
        return _json({"detail": str(exc)}, 400)
    on = states.trace.describe() if states.trace is not None else {"on": False}
    main_logger.info(f"DDTREE: tree trace {on}", extra={"prefix": ""})
    return _json([True])


async def set_internal_state(request: Request) -> Response:
    """SGLang's ``/set_internal_state`` with the DDTree plugin's handler: ``server_args``
    ``ddtree_budget`` / ``ddtree_topk`` pin a runtime state, ``ddtree_policy: 1`` follows
    the launch policy again. 200 ``[true]`` (one answer per DP rank: one here) or 400
    ``{"detail": ...}``; a refusal changes nothing. The engine reads the state at the
    start of each round, so an accepted switch lands between two rounds."""
    engine = _engine(request)
    try:
        obj = await _read_json(request)
    except RequestError as exc:
        return _json({"detail": str(exc)}, 400)
    server_args = obj.get("server_args") if isinstance(obj, dict) else None
    if not isinstance(server_args, dict):
        return _json({"detail": "set_internal_state needs {\"server_args\": {...}}"}, 400)
    if engine.states is None:
        return _json({"detail": "DDTREE: this server is not DDTREE: it has no runtime states to switch"}, 400)
    if engine.trace_core is not None and engine.trace_core.trace_keys(server_args):
        return _set_trace(engine, server_args)
    try:
        engine.states.apply(server_args)
    except SwitchRefused as exc:
        return _json({"detail": str(exc)}, 400)
    engine.restart_acceptance_stats()
    states = engine.states
    main_logger.info(
        f"DDTREE: runtime state {states.mode} budget={states.active.budget} topk={states.active.topk} "
        f"(switch {states.switches})",
        extra={"prefix": ""},
    )
    return _json([True])


async def model_info(request: Request) -> Response:
    state: State = request.app.state.sim
    return _json(
        {
            "model_path": state.args.model_path,
            "served_model_name": state.args.served_model_name,
            "tokenizer_path": state.args.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "auto",
            "model_type": "simulated",
            "architectures": ["SimulatedForCausalLM"],
        }
    )


async def v1_models(request: Request) -> Response:
    state: State = request.app.state.sim
    return _json(
        {
            "object": "list",
            "data": [
                {
                    "id": state.args.served_model_name,
                    "object": "model",
                    "created": int(state.startup_time),
                    "owned_by": "sglang",
                    "root": state.args.served_model_name,
                    "max_model_len": 32768,
                }
            ],
        }
    )


async def request_times(request: Request) -> Response:
    """Simulator only: every request finished since the last call, on the server's clock
    (submit time, and per step the time it committed and the tokens it emitted), then
    forgotten. What a benchmark client measured is held against this."""
    engine = _engine(request)
    out = list(engine.request_times)
    engine.request_times.clear()
    return _json({"clock": "monotonic", "now": time.monotonic(), "requests": out})


_FLUSH_POLL_S = 0.02


async def flush_cache(request: Request) -> Response:
    """SGLang 0.5.23's ``/flush_cache?timeout=S`` (``http_server.flush_cache`` and the
    scheduler's ``SchedulerFlushWrapper``): flushed at once when idle; with S > 0 the
    flush waits up to S seconds of real time for the running and waiting requests to end;
    one flush waits at a time."""
    engine = _engine(request)
    try:
        timeout = float(request.query_params.get("timeout", "0"))
    except ValueError:
        timeout = -1.0
    if not timeout >= 0:  # FastAPI's answer to a query parameter outside ``ge=0.0`` (NaN too)
        return _json({"detail": [{"type": "greater_than_equal", "loc": ["query", "timeout"]}]}, 422)
    if getattr(request.app.state, "flush_pending", False):
        return Response(content="Another flush_cache is already in progress.", status_code=400)
    flushed = engine.flush_cache()
    if not flushed and timeout > 0:
        request.app.state.flush_pending = True
        try:
            deadline = time.monotonic() + timeout
            while not flushed and time.monotonic() < deadline:
                await asyncio.sleep(_FLUSH_POLL_S)
                flushed = engine.flush_cache()
        finally:
            request.app.state.flush_pending = False
        if not flushed:
            return Response(content="Timed out waiting for idle state.", status_code=400)
    if flushed:
        return Response(
            content="Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n",
            status_code=200,
        )
    return Response(content="Flush cache failed.\n", status_code=400)


def _is_id_batch(ids: object) -> bool:
    return isinstance(ids, list) and bool(ids) and all(isinstance(x, list) for x in ids)


async def _generate_batch(request: Request, obj: dict[str, Any], arrived: float) -> Response:
    """``input_ids`` as a list of token-id lists, as SGLang takes a batch: one answer
    each, in order (``sampling_params`` one object for all, or one per prompt), every
    one created when the batch arrived."""
    state: State = request.app.state.sim
    batch = obj["input_ids"]
    raw = obj.get("sampling_params")
    try:
        if obj.get("stream", False):
            raise RequestError("batched streaming is not simulated")
        if isinstance(raw, list) and len(raw) != len(batch):
            raise RequestError(f"{len(batch)} prompts but {len(raw)} sampling_params")
        items = [(_prompt_from({"input_ids": ids}, state),
                  SamplingParams.from_json(raw[i] if isinstance(raw, list) else raw))
                 for i, ids in enumerate(batch)]
        logprobs = [LogprobParams.from_json(obj, i) for i in range(len(batch))]
        for ((prompt, _), _), lp in zip(items, logprobs, strict=True):
            refused = lp.start_error(len(prompt))
            if refused is not None:
                raise RequestError(refused)
    except RequestError as exc:
        return _error(str(exc))
    engine = _engine(request)
    start = time.monotonic()
    reqs = [engine.submit(prompt, category, params, arrived=arrived) for (prompt, category), params in items]
    try:
        await asyncio.gather(*(_run_to_end(r) for r in reqs))
    except asyncio.CancelledError:
        for r in reqs:
            engine.abort(r)
        raise
    return _json([{"text": detokenize(r.output_ids), "output_ids": list(r.output_ids),
                   "meta_info": _meta_info(state, r, time.monotonic() - start, lp)}
                  for r, lp in zip(reqs, logprobs, strict=True)])


async def generate(request: Request) -> Response:
    arrived = _arrived(request)
    state: State = request.app.state.sim
    try:
        obj = await _read_json(request)
        if not isinstance(obj, dict):
            raise RequestError("Request body must be a JSON object.")
        if _is_id_batch(obj.get("input_ids")) and obj.get("text") is None:
            return await _generate_batch(request, obj, arrived)
        prompt, category = _prompt_from(obj, state)
        params = SamplingParams.from_json(obj.get("sampling_params"))
        logprob = LogprobParams.from_json(obj)
        refused = logprob.start_error(len(prompt))
        if refused is not None:
            raise RequestError(refused)
        stream = obj.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream must be a boolean")
    except RequestError as exc:
        return _error(str(exc))
    engine = _engine(request)
    start = time.monotonic()
    req = engine.submit(prompt, category, params, rid=obj.get("rid") if isinstance(obj.get("rid"), str) else None,
                        arrived=arrived)

    def chunk() -> dict[str, Any]:
        return {
            "text": detokenize(req.output_ids),
            "output_ids": list(req.output_ids),
            "meta_info": _meta_info(state, req, time.monotonic() - start, logprob),
        }

    if not stream:
        try:
            await _run_to_end(req)
        except asyncio.CancelledError:
            engine.abort(req)
            raise
        return _json(chunk())

    async def events() -> AsyncIterator[bytes]:
        try:
            while True:
                out = await req.queue.get()
                if out.new_ids or out.finished:
                    yield b"data: " + json.dumps(chunk()).encode() + b"\n\n"
                if out.finished:
                    break
            yield b"data: [DONE]\n\n"
        finally:
            engine.abort(req)

    return StreamingResponse(events(), media_type="text/event-stream")


def _openai_params(obj: dict[str, Any]) -> SamplingParams:
    max_tokens = obj.get("max_completion_tokens", obj.get("max_tokens"))
    raw: dict[str, Any] = {
        "temperature": obj.get("temperature", 1.0),
        "top_p": obj.get("top_p", 1.0),
        "top_k": obj.get("top_k", -1),
        "max_new_tokens": max_tokens if max_tokens is not None else 128,
        "ignore_eos": obj.get("ignore_eos", False),
        "sampling_seed": obj.get("seed"),
    }
    return SamplingParams.from_json(raw)


def chat_template_text(messages: object) -> str:
    """The simulated model's chat template: ``role: content`` lines, then ``assistant:``."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    parts = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError("each message must be an object with a role")
        content = m.get("content", "")
        if isinstance(content, list):
            content = " ".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
        if not isinstance(content, str):
            raise RequestError("message content must be a string or a list of parts")
        parts.append(f"{m['role']}: {content}")
    return "\n".join(parts) + "\nassistant:"


async def _openai(request: Request, *, chat: bool) -> Response:
    arrived = _arrived(request)
    state: State = request.app.state.sim
    try:
        obj = await _read_json(request)
        if not isinstance(obj, dict):
            raise RequestError("Request body must be a JSON object.")
        if chat:
            text = chat_template_text(obj.get("messages"))
        else:
            prompt = obj.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise RequestError("prompt must be a string")
            text = prompt
        params = _openai_params(obj)
        stream = obj.get("stream", False)
        opts = obj.get("stream_options") or {}
        if not isinstance(stream, bool) or not isinstance(opts, dict):
            raise RequestError("stream must be a boolean and stream_options an object")
        include_usage = bool(opts.get("include_usage", False))
    except RequestError as exc:
        return _openai_error(str(exc))
    engine = _engine(request)
    req = engine.submit(tokenize(text), classify_prompt(text), params, arrived=arrived)
    model = obj.get("model") or state.args.served_model_name
    created = int(time.time())
    cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    obj_name = "chat.completion" if chat else "text_completion"

    def usage() -> dict[str, Any]:
        p, c = len(req.prompt_ids), len(req.output_ids)
        return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c, "prompt_tokens_details": None}

    def finish() -> str | None:
        fr = req.finish_reason
        return None if fr is None else ("length" if fr["type"] == "length" else "stop")

    if not stream:
        try:
            await _run_to_end(req)
        except asyncio.CancelledError:
            engine.abort(req)
            raise
        text_out = detokenize(req.output_ids)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish(), "matched_stop": None}
        if chat:
            choice["message"] = {
                "role": "assistant",
                "content": text_out,
                "reasoning_content": None,
                "tool_calls": None,
            }
        else:
            choice["text"] = text_out
        return _json({"id": cid, "object": obj_name, "created": created, "model": model,
                      "choices": [choice], "usage": usage()})

    chunk_name = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list[dict[str, Any]], with_usage: dict[str, Any] | None = None) -> bytes:
        payload: dict[str, Any] = {"id": cid, "object": chunk_name, "created": created, "model": model,
                                   "choices": choices, "usage": with_usage}
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    async def events() -> AsyncIterator[bytes]:
        try:
            if chat:
                role_delta = {"role": "assistant", "content": ""}
                yield event([{"index": 0, "delta": role_delta, "logprobs": None, "finish_reason": None}])
            while True:
                out = await req.queue.get()
                if out.new_ids:
                    delta = detokenize(list(out.new_ids))
                    body = {"content": delta} if chat else None
                    ch: dict[str, Any] = {
                        "index": 0,
                        "logprobs": None,
                        "finish_reason": finish() if out.finished else None,
                    }
                    if chat:
                        ch["delta"] = body
                    else:
                        ch["text"] = delta
                    yield event([ch])
                elif out.finished:
                    ch = {"index": 0, "logprobs": None, "finish_reason": finish()}
                    if chat:
                        ch["delta"] = {}
                    else:
                        ch["text"] = ""
                    yield event([ch])
                if out.finished:
                    break
            if include_usage:
                yield event([], usage())
            yield b"data: [DONE]\n\n"
        finally:
            engine.abort(req)

    return StreamingResponse(events(), media_type="text/event-stream")


async def completions(request: Request) -> Response:
    return await _openai(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _openai(request, chat=True)


async def tokenize_route(request: Request) -> Response:
    """``/v1/tokenize`` (``serving_tokenize.py``): ``prompt`` as text, or ``messages``
    rendered as for a chat completion (the simulated model's template, chat_template_text)."""
    state: State = request.app.state.sim
    try:
        obj = await _read_json(request)
        if not isinstance(obj, dict):
            raise RequestError("Request body must be a JSON object.")
        if obj.get("messages") is not None:
            text = chat_template_text(obj["messages"])
            ids = tokenize(text)
            state.remember(ids, classify_prompt(text))
        elif isinstance(obj.get("prompt"), str):
            ids = tokenize(obj["prompt"])
        else:
            raise RequestError(f"Invalid prompt type: {type(obj.get('prompt'))}. Expected str or List[str].")
    except RequestError as exc:
        return _openai_error(str(exc))
    return _json({"tokens": ids, "count": len(ids), "max_model_len": 32768})


def build_app(state: State) -> Starlette:
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/v1/models", v1_models, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/sim/request_times", request_times, methods=["GET"]),
        Route("/set_internal_state", set_internal_state, methods=["POST"]),
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/tokenize", tokenize_route, methods=["POST"]),
        Route("/tokenize", tokenize_route, methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    app.state.sim = state
    return app


# --------------------------------------------------------------------------- lifecycle
def port_available(host: str, port: int) -> bool:
    """Whether we could bind ``port`` now (SGLang's ``is_port_available`` test)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host not in ("", "0.0.0.0") else "0.0.0.0", port))
        except OSError:
            return False
    return True


# Where the HTTP protocol leaves a request's arrival in its ASGI scope's state.
_ARRIVED = "sim_arrived"


class _StampingH11Protocol(H11Protocol):
    """uvicorn's h11 protocol that notes when a request's bytes reached the server: the
    request's creation time on the server's clock (``/sim/request_times``, TTFT, e2e).
    Stamped as its handler starts instead, a request of a burst of hundreds waited for the
    loop to parse every other one first (tens of ms at 256), which made the server's own
    clock read fast against every client's."""

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        before = getattr(self, "scope", None)
        super().data_received(data)
        scope = getattr(self, "scope", None)
        if scope is not None and scope is not before:
            scope.setdefault("state", {})[_ARRIVED] = now


def _arrived(request: Request) -> float:
    """When the request reached the server (monotonic): its bytes' arrival where the
    protocol stamped it (a pipelined request it parsed later is not), else now."""
    stamped = request.scope.get("state", {}).get(_ARRIVED)
    return stamped if isinstance(stamped, float) else time.monotonic()


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: SIGTERM drains first (see serve())."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _capture_fails(args: ServerArgs, settings: SimSettings, budget: int) -> bool:
    """Whether the profile's capture crash hits a DDTREE verify graph of ``budget``
    (B300: budget > 8, unless the fault is the candidate head and its eager switch is on)."""
    limit = PROFILES[settings.gpu].capture_fails_ddtree_budget_over
    head_avoids = settings.capture_fault == "candidate_head" and settings.eager_draft_head
    return limit is not None and args.ddtree is not None and budget > limit and not head_avoids


async def _capture(args: ServerArgs, settings: SimSettings, name: str, per_req: int, avail: float) -> float:
    """Log one graph capture's begin line and take its (simulated) time; returns the
    simulated seconds it took (the end or failure line is the caller's)."""
    log_ranks(
        args.tp_size,
        logging.INFO,
        f"Capture {name} CUDA graph begin. backend={args.cuda_graph_backend_decode}, "
        f"num_tokens_per_req={per_req}, avail mem={avail:.2f} GB",
    )
    capture_s = 2.0 + 0.01 * args.cuda_graph_max_bs_decode
    await asyncio.sleep(settings.scaled(capture_s))
    return capture_s


async def _capture_runtime_states(args: ServerArgs, settings: SimSettings, avail: float) -> RuntimeStates:
    """Capture one target-verify graph per budget of the runtime-state set, smallest first
    (``eagle_worker_v2.build_adaptive_runtime_state`` captures a runner per state). A
    failed capture does not end the launch: that state is served eager, or dropped with a
    warning (``on_capture_failure``), and the others keep their graphs. Its log line avoids
    SGLang's "Capture cuda graph failed" wording on purpose: that line means the whole
    launch failed, and the toolkit's readiness wait reads it so."""
    config = args.ddtree_adaptive
    tree = args.ddtree
    assert config is not None and tree is not None
    tp = args.tp_size
    graphs: list[StateGraph] = []
    free_at_start_mb = avail * 1024.0
    cap_mb = config.state_memory_fraction * free_at_start_mb
    used_mb = 0.0
    for budget in config.budgets:
        if not args.decode_cuda_graph:
            graph = StateGraph(budget, "disabled")
        elif budget in config.eager_budgets:
            graph = StateGraph(budget, "eager", "listed in ddtree.eager_budgets")
        elif budget != tree.budget and budget >= int(os.environ.get("SGLANG_DDTREE_EAGER_FROM_BUDGET") or 1 << 30):
            # The bundle's switch for a supervisor's relaunch (ddtree_runtime.EAGER_FROM_ENV).
            graph = StateGraph(budget, "eager", "listed in ddtree.eager_budgets by SGLANG_DDTREE_EAGER_FROM_BUDGET")
        else:
            capture_s = await _capture(args, settings, "target verify", budget + 1, avail)
            if _capture_fails(args, settings, budget):
                reason = "CUDA error: an illegal memory access was encountered"
                if settings.capture_sticky:
                    # The plugin's context probe after the failure (ddtree_runtime.capture_outcome):
                    # a poisoned context ends the start with SGLang's capture-failure marker.
                    scheduler_crash(tp, f"Capture cuda graph failed: DDTREE budget {budget}: RuntimeError: {reason} "
                                        "-- the CUDA context is unusable after it (RuntimeError: CUDA error: an "
                                        "illegal memory access was encountered); refusing to start (relaunch with "
                                        "decode CUDA graphs disabled, or with "
                                        f"{budget} in ddtree.eager_budgets)")
                outcome: GraphOutcome = "eager" if config.on_capture_failure == "eager" else "dropped"
                then = "serving it eager" if outcome == "eager" else "dropped from the runtime states"
                log_ranks(tp, logging.WARNING,
                          f"DDTREE: verify graph of budget {budget} (num_tokens_per_req={budget + 1}) did not "
                          f"capture: {reason}; {then}")
                graph = StateGraph(budget, outcome, reason)
            else:
                avail -= 0.3
                log_ranks(
                    tp,
                    logging.INFO,
                    f"Capture target verify CUDA graph end. elapsed={capture_s:.2f} s, mem usage=0.30 GB, "
                    f"avail mem={avail:.2f} GB.",
                )
                graph = StateGraph(budget, "captured", cuda_graph_max_bs=args.decode_graph_max_bs)
        if budget != tree.budget:
            # An extra state's memory, modelled (the plugin measures it): its attention workspace
            # plus, when captured, the verify graph's 0.30 GB above.
            memory_mb = _STATE_WORKSPACE_MB + (_STATE_GRAPH_MB if graph.cuda_graph == "captured" else 0.0)
            graph = dataclasses.replace(graph, memory_mb=memory_mb)
            if graph.cuda_graph != "dropped":
                used_mb += memory_mb
            log_ranks(tp, logging.INFO,
                      f"DDTREE runtime state budget {budget}: mem={memory_mb:.0f} MB (verify graph "
                      f"{graph.cuda_graph}); states {used_mb:.0f} of {cap_mb:.0f} MB allowed (simulated)")
            if used_mb > cap_mb:
                scheduler_crash(tp, f"DDTREE refuses to start: runtime state budget {budget} took "
                                    f"{memory_mb:.0f} MB, past the cap of {cap_mb:.0f} MB for all runtime states "
                                    f"(ddtree.state_memory_fraction {config.state_memory_fraction:g} of "
                                    f"{free_at_start_mb:.0f} MB free after the KV pool; the states built so far "
                                    f"took {used_mb:.0f} MB); drop budgets from ddtree.budgets or raise "
                                    "ddtree.state_memory_fraction")
        graphs.append(graph)
    states = RuntimeStates(launch=TreeState(tree.budget, tree.topk), graphs=tuple(graphs), config=config)
    states.state_memory = {"state_memory_fraction": config.state_memory_fraction,
                           "free_at_start_mb": round(free_at_start_mb, 1), "cap_mb": round(cap_mb, 1),
                           "used_mb": round(used_mb, 1), "simulated": True}
    if tree.budget not in states.budgets:
        # The launch state itself was dropped: the server starts on the smallest state left.
        if not states.budgets:
            scheduler_crash(tp, "DDTREE: every runtime state failed to capture and was dropped; "
                                "nothing left to serve (set on_capture_failure to \"eager\")")
        states.active = TreeState(states.budgets[0], tree.topk)
    main_logger.info(
        f"DDTREE: runtime states budgets={list(states.budgets)} topk_max={states.topk_max} mode={states.mode} "
        f"graphs={','.join(f'{g.budget}:{g.cuda_graph}' for g in graphs)}",
        extra={"prefix": ""},
    )
    return states


async def serve(
    args: ServerArgs, settings: SimSettings, launch_command: str, plugin: DeployedPlugin | None = None
) -> int:
    """Run the whole launch sequence; returns the process exit status. ``plugin``: the
    DDTree plugin deployed on this host, whose tree code a DDTREE server runs."""
    if settings.no_runtime_states:
        args = dataclasses.replace(args, ddtree_adaptive=None)
    profile = PROFILES[settings.gpu]
    tp = args.tp_size
    loop = asyncio.get_running_loop()

    # 1. Ports. SGLang waits up to SGLANG_WAIT_PORT_TIMEOUT (30 s) for them to free up.
    deadline = loop.time() + settings.scaled(settings.port_wait_s)
    while not port_available(args.host, args.port):
        if loop.time() >= deadline:
            main_logger.error(
                f"Port is already in use. dist_init_port={args.port + 4} port_base={args.port + 1} "
                f"detokenizer_port={args.port + 2} nccl_port={args.port + 3} scheduler_input_port={args.port + 5}",
                extra={"prefix": ""},
            )
            main_logger.error(f"ValueError: port_base at {args.port} is not available", extra={"prefix": ""})
            return 1
        await asyncio.sleep(min(0.2, max(0.01, settings.scaled(1.0))))

    # 2. Each TP rank binds GPU `rank` of those CUDA_VISIBLE_DEVICES exposes
    # (ModelRunner.__init__, model_runner.py); a rank without one dies there.
    visible = settings.visible_gpus(SIMULATED_GPU_COUNT)
    if tp > len(visible):
        rank = len(visible)
        scheduler_logger.warning(
            f"Context: self.device='cuda' get_device().gpu_id={rank} "
            f"os.environ.get('CUDA_VISIBLE_DEVICES')={settings.visible_devices!r} "
            f"get_parallel().tp_rank={rank} get_parallel().tp_size={tp}",
            extra={"prefix": f" TP{rank}" if tp > 1 else ""},
        )
        scheduler_crash(
            tp,
            "Traceback (most recent call last):\n"
            '  File "sglang/srt/model_executor/model_runner.py", line 455, in __init__\n'
            "    torch.get_device_module(self.device).set_device(get_device().gpu_id)\n"
            "torch.AcceleratorError: CUDA error: invalid device ordinal",
        )
        return 1  # not reached

    # 3. Weights, KV cache, CUDA graphs (port still closed).
    avail = profile.gpu_mem_gb - 1.5
    log_ranks(tp, logging.INFO, f"Load weight begin. avail mem={avail:.2f} GB")
    load_started = loop.time()
    # Real work (importing torch, building the synthetic model) counts as loading time.
    from ddtree_ops.sim.engine import Engine

    engine = Engine(args, settings, plugin.reference() if plugin is not None else None,
                    plugin.trace() if plugin is not None else None)
    # Shard by shard, as SGLang's loader reports it (its tqdm bar, one line a shard): the
    # progress a readiness wait follows. SIM_STALL_AT_S: the load hangs there, silent.
    shards = max(1, settings.load_shards)
    for shard in range(1, shards + 1):
        due = load_started + settings.scaled(settings.load_s) * shard / shards
        if settings.stall_at_s is not None and due - load_started > settings.scaled(settings.stall_at_s):
            await asyncio.sleep(max(0.0, load_started + settings.scaled(settings.stall_at_s) - loop.time()))
            await asyncio.Event().wait()  # hung for good: no line, no port
        await asyncio.sleep(max(0.0, due - loop.time()))
        log_ranks(tp, logging.INFO,
                  f"Loading safetensors checkpoint shards: {100 * shard / shards:3.0f}% Completed | {shard}/{shards}")
    weights_gb = avail * 0.55
    avail -= weights_gb
    log_ranks(
        tp,
        logging.INFO,
        f"Load weight end. elapsed={settings.load_s:.2f} s, type=SimulatedForCausalLM, "
        f"avail mem={avail:.2f} GB, mem usage={weights_gb:.2f} GB.",
    )
    kv_gb = max(0.5, avail * args.mem_fraction_static * 0.6)
    tokens = int(kv_gb * 1e9 / 70_000)
    log_ranks(
        tp,
        logging.INFO,
        f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {tokens}, "
        f"K size: {kv_gb / 2:.2f} GB, V size: {kv_gb / 2:.2f} GB",
    )
    avail -= kv_gb
    if settings.ddtree_fault == "crash_load" and args.speculative_algorithm == "DDTREE":
        # A deployed plugin whose worker cannot build (SIM_DDTREE_FAULT=crash_load): a scheduler
        # exception while loading, no capture involved (nothing an eager relaunch would avoid).
        scheduler_crash(tp, _CRASH_LOAD_TRACE)
        return 1  # not reached
    if args.ddtree_adaptive is not None:
        # One verify graph per runtime state; a failed capture costs only its own state.
        engine.states = await _capture_runtime_states(args, settings, avail)
    elif args.decode_cuda_graph:
        verify = args.speculating
        name = "target verify" if verify else "target decode"
        # The verify window: the block for DFLASH, root + budget for DDTREE.
        capture_s = await _capture(args, settings, name, args.speculative_num_draft_tokens or 1, avail)
        if args.ddtree is not None and _capture_fails(args, settings, args.ddtree.budget):
            error = (
                "Capture cuda graph failed: CUDA error: an illegal memory access was encountered\n"
                "CUDA kernel errors might be asynchronously reported at some other API call, so the "
                "stacktrace below might be incorrect.\n" + CUDA_GRAPH_CAPTURE_FAILED_MSG
            )
            trace = (
                "Traceback (most recent call last):\n"
                '  File "sglang/srt/managers/scheduler.py", line 6362, in run_scheduler_process\n'
                "    scheduler = Scheduler(server_args, port_args)\n"
                '  File "sglang/srt/model_executor/runner/decode_cuda_graph_runner.py", line 602, in __init__\n'
                "    raise Exception(\n"
                f"Exception: {error}"
            )
            scheduler_crash(tp, trace)
            return 1  # not reached
        log_ranks(
            tp,
            logging.INFO,
            f"Capture {name} CUDA graph end. elapsed={capture_s:.2f} s, mem usage=1.20 GB, "
            f"avail mem={avail - 1.2:.2f} GB.",
        )

    # 4. HTTP up, warmup, ready.
    state = State(args, settings, launch_command)
    state.engine = engine
    engine.start()
    app = build_app(state)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                            http=_StampingH11Protocol,
                            timeout_graceful_shutdown=1)
    server = _Server(config)
    stop = asyncio.Event()

    def on_term() -> None:
        if not state.draining:
            state.draining = True
            stop.set()

    loop.add_signal_handler(signal.SIGTERM, on_term)
    loop.add_signal_handler(signal.SIGINT, on_term)
    server_task = asyncio.create_task(server.serve())
    while not server.started:
        if server_task.done():
            await server_task
            main_logger.error(f"Port is already in use. port={args.port}", extra={"prefix": ""})
            return 1
        await asyncio.sleep(0.01)
    main_logger.info(f"Simulated SGLang {SIM_VERSION} (profile {profile.name}, {profile.gpu_name}); no GPU is used.",
                     extra={"prefix": ""})
    main_logger.info(f"Uvicorn running on http://{args.host}:{args.port} (Press CTRL+C to quit)", extra={"prefix": ""})
    async def warmup() -> None:
        # SGLang's internal warmup request (plus first-run JIT work) takes seconds, and
        # health says 503 meanwhile: a readiness check must wait through that window.
        await asyncio.sleep(settings.scaled(settings.warmup_s))
        await _run_to_end(engine.submit([1, 2, 3], "chat", SamplingParams(temperature=0.0, max_new_tokens=1)))

    warm_task = asyncio.create_task(warmup())
    done, _ = await asyncio.wait({warm_task, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    if warm_task in done:
        state.ready = True
        main_logger.info("The server is fired up and ready to roll!", extra={"prefix": ""})
        await stop.wait()
    # 5. Shutdown: keep answering (health 200) for the drain window, then close.
    main_logger.info(
        f"Received SIGTERM; draining for {settings.shutdown_drain_s:.2f} s (simulated) before exit.",
        extra={"prefix": ""},
    )
    await asyncio.sleep(settings.scaled(settings.shutdown_drain_s))
    server.should_exit = True
    await engine.stop()
    try:
        await asyncio.wait_for(server_task, timeout=5)
    except (TimeoutError, asyncio.CancelledError):
        server_task.cancel()
    return 0
