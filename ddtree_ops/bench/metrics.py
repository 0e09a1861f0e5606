"""Per-request records -> per-cell figures. Pure: no I/O, no clock, no printing.

Throughput is output tokens (as the server counted them in ``meta_info``) over the wall
time from the first request sent to the last response finished. ITL is per token: a
streamed chunk that carries n new tokens (speculation emits several per step) contributes
n gaps of chunk_gap/n, as SGLang's own benchmark does, so ITL stays comparable between
DDTree and the autoregressive baseline. The acceptance length is weighted by verify count
(sum completion tokens / sum verify steps over the cell's requests) — never the server's
lifetime average and never ``spec_accept_rate``, whose chain denominator is wrong for trees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RequestResult:
    """One request as the client saw it. Times are seconds; ``start``/``end`` are on the
    client's monotonic clock (only differences mean anything)."""

    ok: bool
    start: float
    end: float
    ttft: float | None = None
    itls: tuple[float, ...] = ()
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec_accept_length: float | None = None
    spec_verify_ct: int | None = None
    chunks: int = 0
    # Chunks after the first that arrived in one read with the chunk before them: their
    # gaps were not observed (the client was busy), so their ITLs are zeros.
    coalesced: int = 0
    error: str | None = None
    # sha256 (16 hex) of the output: its token ids on /generate, its text on the OpenAI
    # routes; None where the server sent neither. Equal at T = 0 for a lossless verify.
    output_hash: str | None = None
    # The server's own e2e (``meta_info.e2e_latency``), kept to check the client's clock.
    server_e2e: float | None = None
    # ``meta_info["ddtree_trace"]`` where the server traced the request's tree (issue 43:
    # a predicted sweep's trace run), as the server sent it; None otherwise.
    trace: Any = None

    @property
    def e2e(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Stat:
    mean: float | None = None
    median: float | None = None
    p90: float | None = None
    p99: float | None = None


def _stat(values_s: Sequence[float]) -> Stat:
    """Summary in milliseconds; None when there is nothing to summarise (all failed)."""
    if not values_s:
        return Stat()
    import numpy as np  # here, not at the top: the CLI imports this module on every start

    arr = np.asarray(values_s, dtype=float) * 1000.0
    return Stat(
        mean=float(arr.mean()),
        median=float(np.median(arr)),
        p90=float(np.percentile(arr, 90)),
        p99=float(np.percentile(arr, 99)),
    )


@dataclass(frozen=True)
class CellMetrics:
    requests: int
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    output_tok_s: float
    request_s: float
    ttft_ms: Stat = field(default_factory=Stat)
    itl_ms: Stat = field(default_factory=Stat)
    tpot_ms: Stat = field(default_factory=Stat)
    e2e_ms: Stat = field(default_factory=Stat)
    accept_length: float | None = None
    verify_steps: int = 0
    errors: tuple[str, ...] = ()
    # Fraction of the completed requests' chunks after the first that the client read
    # together with the one before (see RequestResult.coalesced); None without such chunks.
    coalesced_frac: float | None = None

    @property
    def client_bound(self) -> bool | None:
        """Whether the client, not the server, set this cell's ITL statistics."""
        return None if self.coalesced_frac is None else self.coalesced_frac > CLIENT_BOUND_FRAC

    def flat(self) -> dict[str, object]:
        """Flat ``name_stat`` keys (``ttft_ms_p99``…) as the ledger stores them."""
        out: dict[str, object] = {}
        for key, value in asdict(self).items():
            if isinstance(value, dict):
                for stat, v in value.items():
                    out[f"{key}_{stat}"] = v
            elif isinstance(value, tuple):
                out[key] = list(value)
            else:
                out[key] = value
        return out


@dataclass(frozen=True)
class GroupMetrics:
    """One data set / category of a cell (the ledger's ``categories``): what its requests
    saw, so a report can show accept length and speedup per category of a mixed workload.
    Throughput is per user (a request's tokens over its own e2e): the cell's wall time is
    shared by every category that ran in it."""

    requests: int
    completed: int
    output_tokens: int
    verify_ct: int
    accept_length: float | None
    user_tok_s: float | None
    tpot_ms_median: float | None


def group_metrics(results: Sequence[RequestResult], groups: Sequence[str]) -> dict[str, GroupMetrics]:
    """Per group (``Prompt.group`` of the prompt each result answered, in send order)."""
    if len(results) != len(groups):
        raise ValueError(f"{len(results)} results for {len(groups)} prompts")
    by: dict[str, list[RequestResult]] = {}
    for result, group in zip(results, groups, strict=True):
        by.setdefault(group, []).append(result)
    out: dict[str, GroupMetrics] = {}
    for group, rs in sorted(by.items()):
        good = [r for r in rs if r.ok]
        spec = [r for r in good if r.spec_verify_ct]
        verify = sum(r.spec_verify_ct or 0 for r in spec)
        rates = [r.completion_tokens / r.e2e for r in good if r.e2e > 0]
        tpots = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in good
                 if r.ttft is not None and r.completion_tokens > 1]
        out[group] = GroupMetrics(
            requests=len(rs),
            completed=len(good),
            output_tokens=sum(r.completion_tokens for r in good),
            verify_ct=verify,
            accept_length=sum(r.completion_tokens for r in spec) / verify if verify else None,
            user_tok_s=sum(rates) / len(rates) if rates else None,
            tpot_ms_median=_stat(tpots).median,
        )
    return out


#: Above this fraction of coalesced chunks (RequestResult.coalesced) a cell's ITL
#: percentiles are the client's: with more than one gap in twenty unseen, the p90 and the
#: median move by a whole step once the client falls behind at high concurrency.
CLIENT_BOUND_FRAC = 0.05


def calculate_metrics(results: Sequence[RequestResult], *, duration_s: float | None = None) -> CellMetrics:
    """Summarise one cell. ``duration_s`` defaults to first start -> last end of all requests
    (failed ones included: they occupied the run)."""
    if duration_s is None:
        duration_s = (max(r.end for r in results) - min(r.start for r in results)) if results else 0.0
    good = [r for r in results if r.ok]
    output_tokens = sum(r.completion_tokens for r in good)
    ttfts = [r.ttft for r in good if r.ttft is not None]
    itls = [x for r in good for x in r.itls]
    tpots = [
        (r.e2e - r.ttft) / (r.completion_tokens - 1) for r in good if r.ttft is not None and r.completion_tokens > 1
    ]
    spec = [r for r in good if r.spec_verify_ct]
    verify = sum(r.spec_verify_ct or 0 for r in spec)
    accept = sum(r.completion_tokens for r in spec) / verify if verify else None
    errors = tuple(dict.fromkeys(r.error or "failed" for r in results if not r.ok))[:5]
    gaps = sum(max(r.chunks - 1, 0) for r in good)
    return CellMetrics(
        requests=len(results),
        completed=len(good),
        failed=len(results) - len(good),
        duration_s=duration_s,
        input_tokens=sum(r.prompt_tokens for r in good),
        output_tokens=output_tokens,
        output_tok_s=output_tokens / duration_s if duration_s > 0 else 0.0,
        request_s=len(good) / duration_s if duration_s > 0 else 0.0,
        ttft_ms=_stat(ttfts),
        itl_ms=_stat(itls),
        tpot_ms=_stat(tpots),
        e2e_ms=_stat([r.e2e for r in good]),
        accept_length=accept,
        verify_steps=verify,
        errors=errors,
        coalesced_frac=sum(r.coalesced for r in good) / gaps if gaps else None,
    )
