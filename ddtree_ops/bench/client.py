"""The load generator: streams requests at a live server and records what each one saw.

Two modes, because both matter: ``generate`` (SGLang's native ``POST /generate``, whose
``meta_info`` carries the server's own token counts and ``spec_verify_ct``, so accept
length is exact) and ``openai`` (``/v1/completions``, or ``/v1/chat/completions`` for
prompts given as messages; token counts from the final ``usage`` chunk, requested with
``stream_options.include_usage``; no speculation counters exist on that route).

Load shapes: closed loop (``concurrency`` requests in flight, a new one as soon as one
finishes) or, with ``request_rate``, Poisson arrivals (exponential gaps from a seeded
RNG) still capped at ``concurrency`` in flight. Warmup requests go first, at the same
concurrency, and are not part of the results.

Per request the client records TTFT (first chunk with output), per-token ITLs (a chunk
carrying n new tokens — speculation emits several per step — adds n gaps of gap/n), e2e,
token counts and the error, if any. A failure is data: it never raises out of the load
run, so a server killed mid-cell yields a cell with failed requests, not a crash.

The HTTP client ignores proxy environment variables: the benchmarked server is reached
directly (loopback, or the host's address on the fleet network).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import random
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from ddtree_ops.bench.metrics import RequestResult
from ddtree_ops.bench.prompts import Prompt

Api = Literal["generate", "openai"]


@dataclass(frozen=True)
class LoadSpec:
    """One load run: what to send and how hard."""

    prompts: tuple[Prompt, ...]
    max_new_tokens: int
    sampling: Mapping[str, float | int] = field(default_factory=dict)
    ignore_eos: bool = True
    concurrency: int = 1
    request_rate: float | None = None
    warmup: int = 0
    seed: int = 0
    api: Api = "generate"
    model: str = "default"
    timeout_s: float = 600.0


@dataclass(frozen=True)
class LoadResult:
    """Measured requests (warmup excluded) and the wall time of the measured part."""

    results: tuple[RequestResult, ...]
    duration_s: float
    warmup_failures: int = 0
    # Process CPU time spent during the measured part (what the client itself costs).
    cpu_s: float = 0.0


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, httpx.ConnectError):
        return f"connection failed: {exc}"[:300]
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return f"server closed the connection mid-response: {exc}"[:300]
    return f"{type(exc).__name__}: {exc}"[:300]


def _generate_payload(prompt: Prompt, spec: LoadSpec) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": spec.max_new_tokens, "ignore_eos": spec.ignore_eos}
    params.update(spec.sampling)
    return {"text": prompt.text, "sampling_params": params, "stream": True}


def _openai_request(prompt: Prompt, spec: LoadSpec) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": spec.model,
        "max_tokens": spec.max_new_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": spec.ignore_eos,
    }
    body.update(spec.sampling)
    if prompt.messages:
        body["messages"] = [{"role": r, "content": c} for r, c in prompt.messages]
        return "/v1/chat/completions", body
    body["prompt"] = prompt.text
    return "/v1/completions", body


class _Failed(Exception):
    """A request that ended in a server-reported failure (HTTP status or in-stream error)."""


class _Events:
    """Server-sent events of one streamed response: ``(arrival_time, object)`` pairs.

    ``done`` tells whether ``[DONE]`` arrived; a stream cut before it is a failure.
    """

    def __init__(self) -> None:
        self.done = False

    async def iterate(
        self, client: httpx.AsyncClient, route: str, body: Mapping[str, Any]
    ) -> AsyncIterator[tuple[float, dict[str, Any]]]:
        async with client.stream("POST", route, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise _Failed(f"HTTP {resp.status_code}: {text.strip()[:200]}")
            # SSE frames are split by hand on raw bytes: httpx's text line decoder costs
            # more CPU per chunk than the JSON parse itself.
            buf = b""
            async for raw in resp.aiter_bytes():
                buf += raw
                *frames, buf = buf.split(b"\n")
                now = time.perf_counter()
                for frame in frames:
                    if not frame.startswith(b"data:"):
                        continue
                    data = frame[5:].strip()
                    if data == b"[DONE]":
                        self.done = True
                        return
                    obj = json.loads(data)
                    if "error" in obj:
                        err = obj["error"]
                        msg = err.get("message", err) if isinstance(err, Mapping) else err
                        raise _Failed(f"server error: {msg}"[:300])
                    yield now, obj


async def _stream_generate(client: httpx.AsyncClient, prompt: Prompt, spec: LoadSpec) -> RequestResult:
    start = time.perf_counter()
    ttft: float | None = None
    last_t = start
    last_tokens = 0
    itls: list[float] = []
    meta: Mapping[str, Any] = {}
    chunks = 0
    events = _Events()
    try:
        async for now, obj in events.iterate(client, "/generate", _generate_payload(prompt, spec)):
            meta = obj.get("meta_info") or {}
            tokens = int(meta.get("completion_tokens", 0))
            new = tokens - last_tokens
            if new <= 0:
                continue
            chunks += 1
            if ttft is None:
                ttft = now - start
            else:
                gap = (now - last_t) / new
                itls.extend([gap] * new)
            last_t, last_tokens = now, tokens
    except _Failed as exc:
        return RequestResult(ok=False, start=start, end=time.perf_counter(), error=str(exc))
    except (httpx.HTTPError, OSError, ValueError) as exc:
        return RequestResult(ok=False, start=start, end=time.perf_counter(), error=_error_text(exc))
    end = time.perf_counter()
    if not events.done:
        return RequestResult(ok=False, start=start, end=end, error="stream ended before [DONE]")
    verify = meta.get("spec_verify_ct")
    accept = meta.get("spec_accept_length")
    server_e2e = meta.get("e2e_latency")
    return RequestResult(
        ok=True,
        start=start,
        end=end,
        ttft=ttft,
        itls=tuple(itls),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        completion_tokens=last_tokens,
        spec_verify_ct=int(verify) if verify is not None else None,
        spec_accept_length=float(accept) if accept is not None else None,
        chunks=chunks,
        server_e2e=float(server_e2e) if isinstance(server_e2e, (int, float)) else None,
    )


async def _stream_openai(client: httpx.AsyncClient, prompt: Prompt, spec: LoadSpec) -> RequestResult:
    start = time.perf_counter()
    route, body = _openai_request(prompt, spec)
    times: list[float] = []
    usage: Mapping[str, Any] = {}
    events = _Events()
    try:
        async for now, obj in events.iterate(client, route, body):
            if obj.get("usage"):
                usage = obj["usage"]
            for choice in obj.get("choices") or ():
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    times.append(now)
                    break
    except _Failed as exc:
        return RequestResult(ok=False, start=start, end=time.perf_counter(), error=str(exc))
    except (httpx.HTTPError, OSError, ValueError) as exc:
        return RequestResult(ok=False, start=start, end=time.perf_counter(), error=_error_text(exc))
    end = time.perf_counter()
    if not events.done:
        return RequestResult(ok=False, start=start, end=end, error="stream ended before [DONE]")
    tokens = int(usage.get("completion_tokens", len(times)))
    # Chunks do not say how many tokens they carry; spread the decode time evenly over the
    # tokens after the first, so that mean ITL equals TPOT as in the native mode.
    itls: tuple[float, ...] = ()
    if len(times) >= 2 and tokens > 1:
        per_chunk_tokens = (tokens - 1) / (len(times) - 1)
        itls = tuple((b - a) / per_chunk_tokens for a, b in itertools.pairwise(times))
    return RequestResult(
        ok=True,
        start=start,
        end=end,
        ttft=(times[0] - start) if times else None,
        itls=itls,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=tokens,
        chunks=len(times),
    )


async def send_request(client: httpx.AsyncClient, prompt: Prompt, spec: LoadSpec) -> RequestResult:
    """One streamed request; never raises for HTTP or server failures (they are data)."""
    if spec.api == "openai":
        return await _stream_openai(client, prompt, spec)
    return await _stream_generate(client, prompt, spec)


@functools.lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    # Loading the CA bundle costs ~70 ms of CPU; httpx would do it for every client (every
    # cell), which would dominate the client's CPU per token in short cells.
    return ssl.create_default_context()


def make_client(base_url: str, *, concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base_url,
        verify=_tls_context(),
        timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
        limits=httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4),
        trust_env=False,
    )


async def _run(
    client: httpx.AsyncClient,
    prompts: Sequence[Prompt],
    spec: LoadSpec,
    rng: random.Random | None,
    on_done: Callable[[RequestResult], None] | None,
) -> list[RequestResult]:
    sem = asyncio.Semaphore(spec.concurrency)
    results: list[RequestResult | None] = [None] * len(prompts)

    async def one(i: int, prompt: Prompt) -> None:
        async with sem:
            r = await send_request(client, prompt, spec)
        results[i] = r
        if on_done is not None:
            on_done(r)

    tasks: list[asyncio.Task[None]] = []
    for i, prompt in enumerate(prompts):
        if rng is not None and i:
            await asyncio.sleep(rng.expovariate(spec.request_rate or 1.0))
        tasks.append(asyncio.create_task(one(i, prompt)))
    await asyncio.gather(*tasks)
    return [r for r in results if r is not None]


async def run_load_async(
    base_url: str, spec: LoadSpec, *, on_done: Callable[[RequestResult], None] | None = None
) -> LoadResult:
    """Warm up, then send every prompt under the spec's load shape; failures are recorded."""
    async with make_client(base_url, concurrency=spec.concurrency, timeout_s=spec.timeout_s) as client:
        warm_failed = 0
        if spec.warmup:
            warm = [spec.prompts[i % len(spec.prompts)] for i in range(spec.warmup)]
            warm_results = await _run(client, warm, spec, None, None)
            warm_failed = sum(not r.ok for r in warm_results)
        rng = random.Random(spec.seed) if spec.request_rate else None
        t0, cpu0 = time.perf_counter(), time.process_time()
        results = await _run(client, spec.prompts, spec, rng, on_done)
        duration, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return LoadResult(results=tuple(results), duration_s=duration, warmup_failures=warm_failed, cpu_s=cpu)


def run_load(base_url: str, spec: LoadSpec, *, on_done: Callable[[RequestResult], None] | None = None) -> LoadResult:
    """Synchronous entry for threads (each host's worker runs its own event loop)."""
    return asyncio.run(run_load_async(base_url, spec, on_done=on_done))


def flush_cache(base_url: str, *, timeout_s: float = 30.0) -> tuple[bool, str]:
    """``POST /flush_cache`` so one cell's prefix cache does not speed up the next.
    Returns (ok, detail) and never raises: a failed flush is worth a note, not a crash."""
    try:
        with httpx.Client(base_url=base_url, timeout=timeout_s, trust_env=False, verify=_tls_context()) as c:
            r = c.post("/flush_cache")
        return (r.status_code == 200, f"HTTP {r.status_code}")
    except httpx.HTTPError as exc:
        return (False, _error_text(exc))


def server_info(base_url: str, *, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """``GET /server_info`` of the server being benchmarked, or None when it cannot be read.

    Never raises: what the serving process says about itself (its version) is
    provenance, worth recording when available and never worth failing a sweep over.
    """
    try:
        with httpx.Client(base_url=base_url, timeout=timeout_s, trust_env=False, verify=_tls_context()) as c:
            r = c.get("/server_info")
        info = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return info if isinstance(info, dict) else None
