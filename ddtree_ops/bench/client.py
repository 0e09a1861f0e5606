"""The load generator: streams requests at a live server and records what each one saw.

Two modes, because both matter: ``generate`` (SGLang's native ``POST /generate``, whose
``meta_info`` carries the server's own token counts and ``spec_verify_ct``, so accept
length is exact) and ``openai`` (``/v1/completions``, or ``/v1/chat/completions`` for
prompts given as messages; token counts from the final ``usage`` chunk, requested with
``stream_options.include_usage``; no speculation counters exist on that route).
Chat prompts reach ``/generate`` as the token ids the server's own ``/v1/tokenize``
renders their messages to (the served model's chat template, :func:`render_chat`, once
per launch), never as a hand-made transcript.

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

import dataclasses
import functools
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ddtree_ops.bench import _hostclient as hc
from ddtree_ops.bench.metrics import RequestResult
from ddtree_ops.workload.prompt import Prompt, chat_messages

if TYPE_CHECKING:
    pass

# httpx is imported where a request is made, not here: every CLI command imports this
# module through the bench package, and most (hosts, restart, a refused sweep) never send
# load, so its import time (~50 ms) would only delay their answer.

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
    import httpx

    if isinstance(exc, httpx.ConnectError):
        return f"connection failed: {exc}"[:300]
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return f"server closed the connection mid-response: {exc}"[:300]
    return f"{type(exc).__name__}: {exc}"[:300]


class UnrenderedChat(ValueError):
    """A chat prompt about to reach ``/generate`` without the served model's rendering."""


def _generate_payload(prompt: Prompt, spec: LoadSpec) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": spec.max_new_tokens, "ignore_eos": spec.ignore_eos}
    params.update(spec.sampling)
    if prompt.chat:
        # Never the transcript: the drafter was trained on the model's chat template.
        if not prompt.input_ids:
            raise UnrenderedChat(f"chat prompt {prompt.id or prompt.text[:40]!r} was not rendered by the server")
        return {"input_ids": list(prompt.input_ids), "sampling_params": params, "stream": True}
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
        body["messages"] = chat_messages(prompt.messages)
        return "/v1/chat/completions", body
    body["prompt"] = prompt.text
    return "/v1/completions", body


def request_for(prompt: Prompt, spec: LoadSpec) -> tuple[str, dict[str, Any]]:
    """Route and JSON body of one prompt's request: the one builder both client modes send."""
    if spec.api == "openai":
        return _openai_request(prompt, spec)
    return "/generate", _generate_payload(prompt, spec)


def as_request_result(fields: Mapping[str, Any]) -> RequestResult:
    """A RequestResult from the field dict :mod:`._hostclient` builds (locally or on a host)."""
    known = {k: v for k, v in fields.items() if k in _RESULT_FIELDS}
    known["itls"] = tuple(known.get("itls") or ())
    return RequestResult(**known)


_RESULT_FIELDS = frozenset(f.name for f in dataclasses.fields(RequestResult))


@functools.lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    # Loading the CA bundle costs ~70 ms of CPU; httpx would do it for every client (every
    # cell), which would dominate the client's CPU per token in short cells.
    return ssl.create_default_context()


def sent_prompts(prompts: Sequence[Prompt]) -> tuple[Prompt, ...]:
    """The prompt behind each result of a load run, in result order: every prompt's first
    turn, then the follow-up turns of multi-turn questions, prompt by prompt (each keeps its
    question's id, data set and category)."""
    later = tuple(dataclasses.replace(p, text=q, messages=(("user", q),), followups=(), input_ids=())
                  for p in prompts if p.chat for q in p.followups)
    return tuple(prompts) + later


def _sessions(prompts: Sequence[Prompt]) -> dict[str, dict[str, Any]]:
    """Request index -> what its later turns need (:class:`._hostclient._Turns`)."""
    out: dict[str, dict[str, Any]] = {}
    first = len(prompts)
    for i, p in enumerate(prompts):
        if p.chat and p.followups:
            out[str(i)] = {"messages": chat_messages(p.messages), "followups": list(p.followups), "first": first}
            first += len(p.followups)
    return out


def load_payload(spec: LoadSpec) -> dict[str, Any]:
    """What :func:`._hostclient.run_load` runs: requests already built, so that both client
    modes send the same bytes (one builder, :func:`request_for`). The warmup sends first
    turns only."""
    warm = [spec.prompts[i % len(spec.prompts)] for i in range(spec.warmup)]
    return {
        "api": spec.api,
        "requests": [request_for(p, spec) for p in spec.prompts],
        "sessions": _sessions(spec.prompts),
        "warmup": [request_for(p, spec) for p in warm],
        "concurrency": spec.concurrency,
        "request_rate": spec.request_rate,
        "seed": spec.seed,
        "timeout_s": spec.timeout_s,
    }


@dataclass
class LoadReport:
    """A load run's messages as they come (``request`` per finished request, ``summary``
    at the end), in either mode; :meth:`result` makes the LoadResult."""

    on_done: Callable[[RequestResult], None] | None = None
    # Request index -> its record; records arrive as requests finish, not in order.
    results: dict[int, RequestResult] = field(default_factory=dict)
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)

    def message(self, obj: Mapping[str, Any]) -> None:
        if obj.get("kind") == "request" and isinstance(obj.get("result"), dict):
            result = as_request_result(obj["result"])
            self.results[int(obj.get("index", len(self.results)))] = result
            if self.on_done is not None:
                self.on_done(result)
        elif isinstance(obj.get("kind"), str):
            self.answers[str(obj["kind"])] = dict(obj)

    def result(self, spec: LoadSpec, problem: str | None) -> LoadResult:
        """Failures are data: a request nobody reported is a failed request carrying the
        reason (``problem``), so the row says why instead of the sweep crashing."""
        summary = self.answers.get(hc.SUMMARY)
        got = self.results
        results: list[RequestResult] = []
        why = (problem or "the load client ended without reporting this request")[:300]
        for i in range(len(sent_prompts(spec.prompts))):
            if i not in got:
                got[i] = RequestResult(ok=False, start=0.0, end=0.0, error=why)
                if self.on_done is not None:
                    self.on_done(got[i])
            results.append(got[i])
        if summary is None:
            timed = [r for r in results if r.end]
            duration = (max(r.end for r in timed) - min(r.start for r in timed)) if timed else 0.0
            return LoadResult(results=tuple(results), duration_s=duration)
        return LoadResult(
            results=tuple(results),
            duration_s=float(summary.get("duration_s", 0.0)),
            warmup_failures=int(summary.get("warmup_failures", 0)),
            cpu_s=float(summary.get("cpu_s", 0.0)),
        )


def run_load(base_url: str, spec: LoadSpec, *, on_done: Callable[[RequestResult], None] | None = None) -> LoadResult:
    """Warm up, then send every prompt under the spec's load shape, from this process;
    failures are recorded. The engine is the on-host client's (:mod:`._hostclient`: one
    event loop, raw HTTP/1.1 on asyncio streams), so both modes measure alike and cost
    alike. Streamed through httpx, this mode cost 1.7-4.5x SGLang's bench_serving in CPU per
    output token; on this engine it costs less (benchmarks/client_accuracy.py)."""
    address, port, tls = _endpoint(base_url)
    report = LoadReport(on_done=on_done)
    problem = None
    try:
        hc.run_load(load_payload(spec), address, port, hc._Writer(report.message), tls=tls)
    except Exception as exc:  # noqa: BLE001 - a crashed client is a failed cell, never a crashed sweep
        problem = f"load client failed: {type(exc).__name__}: {exc}"
    return report.result(spec, problem)


def flush_cache(base_url: str, *, timeout_s: float = 30.0) -> tuple[bool, str]:
    """``POST /flush_cache?timeout=S`` so one cell's prefix cache does not speed up the next:
    the host client's request and reading of the answer (:func:`._hostclient.flush_cache`),
    sent from this process. Returns (ok, detail) and never raises: a refused flush is for
    the caller to judge."""
    address, port, tls = _endpoint(base_url)
    answer = hc.flush_cache(address, port, timeout_s, tls=tls)
    return bool(answer["ok"]), str(answer["detail"])


def _endpoint(base_url: str) -> tuple[str, int, ssl.SSLContext | None]:
    """(address, port, TLS context or None) of a server URL, for the host client's engine."""
    from urllib.parse import urlsplit

    parts = urlsplit(base_url)
    tls = _tls_context() if parts.scheme == "https" else None
    return parts.hostname or "127.0.0.1", parts.port or (443 if tls is not None else 80), tls


def set_internal_state(base_url: str, body: Mapping[str, Any], *, timeout_s: float = 30.0) -> tuple[int | None, str]:
    """``POST /set_internal_state`` (a live DDTree tree switch): (HTTP status, detail);
    status None where no answer came. Never raises: a failed switch is a failed cell."""
    import httpx

    try:
        with httpx.Client(base_url=base_url, timeout=timeout_s, trust_env=False, verify=_tls_context()) as c:
            r = c.post("/set_internal_state", json=dict(body))
    except httpx.HTTPError as exc:
        return None, _error_text(exc)
    from ddtree_ops.bench.livetree import refusal_detail

    return r.status_code, ("" if r.status_code == 200 else refusal_detail(r.status_code, r.content))


def render_chat(base_url: str, conversations: Sequence[Sequence[tuple[str, str]]], *,
                timeout_s: float = 30.0) -> tuple[list[list[int]] | None, str | None]:
    """Each conversation's token ids through the served model's chat template
    (``POST /v1/tokenize`` with ``messages``): (ids, None), or (None, why). Never raises."""
    import httpx

    ids: list[list[int]] = []
    try:
        with httpx.Client(base_url=base_url, timeout=timeout_s, trust_env=False, verify=_tls_context()) as c:
            for messages in conversations:
                r = c.post("/v1/tokenize", json={"messages": chat_messages(messages)})
                one, why = hc.rendered_ids(r.status_code, r.content)
                if one is None:
                    return None, why
                ids.append(one)
    except httpx.HTTPError as exc:
        return None, _error_text(exc)
    return ids, None


def server_info(base_url: str, *, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """``GET /server_info`` of the server being benchmarked, or None when it cannot be read.

    Never raises: what the serving process says about itself (its version) is
    provenance, worth recording when available and never worth failing a sweep over.
    """
    import httpx

    try:
        with httpx.Client(base_url=base_url, timeout=timeout_s, trust_env=False, verify=_tls_context()) as c:
            r = c.get("/server_info")
        info = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return info if isinstance(info, dict) else None
