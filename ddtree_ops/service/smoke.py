"""The speculative smoke: what a restart proves before it says ready.

SGLang 0.5.23's ``/health_generate`` (readiness's 200) generates one token at
temperature 0 (``entrypoints/http_server.py``): a prefill, no draft, no verify round, no
replay of the decode CUDA graphs. The failures of a speculative server happen exactly
there: a verify that hits an illegal memory access at its first graph replay, a sampled
request that takes the scheduler down. So after the server answers, a few requests of
some tens of tokens run at temperature 0 and at the sampling settings the caller will
use (the sweep's cells, ``restart --smoke-temperature``), each alone and then as one
batch; the process must survive, every request must return its tokens, and a
speculative server must have run verify rounds (``spec_verify_ct > 0``) with an
accept length of at least 1.

Pure: the rounds to send (:meth:`SmokeSpec.rounds`) and the verdict on the host's
answer (:func:`judge_smoke`); the requests themselves go out from the host
(``manager.smoke``), like every other probe, and ``lifecycle.restart`` decides what a
failure means (eager relaunch when it happened with decode CUDA graphs on).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ddtree_ops.errors import ConfigError

# Short prompts of different kinds, so the batch's requests do not share a prefix.
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n",
    "Write a haiku about the sea.",
    "1, 2, 3, 5, 8, 13,",
    "Translate to German: good morning",
    "List three prime numbers:",
    "Once upon a time",
    "SELECT name FROM users WHERE",
)


@dataclass(frozen=True)
class SmokeSampling:
    """One sampling setting the smoke sends (SGLang's native ``sampling_params`` names)."""

    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None

    @classmethod
    def of(cls, temperature: float, top_p: float | None = None, top_k: int | None = None) -> SmokeSampling:
        """Normalised: greedy ignores top-p/top-k; top_p 1 and top_k -1 (SGLang's "off") are unset."""
        if temperature == 0:
            return cls()
        return cls(temperature, None if top_p in (None, 1.0) else top_p, None if top_k in (None, -1, 0) else top_k)

    def params(self, max_new_tokens: int) -> dict[str, Any]:
        out: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": self.temperature, "ignore_eos": True}
        if self.top_p is not None:
            out["top_p"] = self.top_p
        if self.top_k is not None:
            out["top_k"] = self.top_k
        return out

    def label(self) -> str:
        extra = "".join(f", {k} {v}" for k, v in (("top_p", self.top_p), ("top_k", self.top_k)) if v is not None)
        return f"temperature {self.temperature:g}{extra}"


GREEDY = SmokeSampling()


@dataclass(frozen=True)
class SmokeSpec:
    """What the smoke sends: per sampling setting (greedy first, always), one request
    alone and then ``batch`` at once, ``max_new_tokens`` each (the tokens past the first
    are decode rounds: verify rounds for a speculative server)."""

    samplings: tuple[SmokeSampling, ...] = (GREEDY,)
    max_new_tokens: int = 32
    batch: int = 4
    request_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 2 <= self.max_new_tokens <= 4096:
            raise ConfigError(f"smoke: max_new_tokens must be in 2..4096, got {self.max_new_tokens}")
        if not 1 <= self.batch <= len(PROMPTS):
            raise ConfigError(f"smoke: batch must be in 1..{len(PROMPTS)}, got {self.batch}")
        for s in self.samplings:
            if s.temperature < 0:
                raise ConfigError(f"smoke: temperature must be >= 0, got {s.temperature}")

    @classmethod
    def for_samplings(cls, samplings: Iterable[SmokeSampling], **kw: Any) -> SmokeSpec:
        """Greedy first, then each distinct setting once, in the order given."""
        ordered = [GREEDY]
        for s in samplings:
            if s not in ordered:
                ordered.append(s)
        return cls(samplings=tuple(ordered), **kw)

    def plan(self) -> list[tuple[SmokeSampling, list[dict[str, Any]]]]:
        """Each round with the sampling setting it sends: alone, then the batch."""
        out = []
        for sampling in self.samplings:
            params = sampling.params(self.max_new_tokens)
            out.append((sampling, [{"text": PROMPTS[0], "sampling_params": params}]))
            if self.batch > 1:
                out.append((sampling, [{"text": p, "sampling_params": params} for p in PROMPTS[: self.batch]]))
        return out

    def rounds(self) -> list[list[dict[str, Any]]]:
        """The request rounds for the host: each round's requests are sent at once."""
        return [requests for _, requests in self.plan()]


class SmokeFailure(StrEnum):
    """How a smoke failed. CRASHED: the process died during it; HUNG: a request timed
    out with the process alive; FAILED: it lives and answers, but wrongly (an error
    status, no tokens, no verify rounds)."""

    CRASHED = "crashed"
    HUNG = "hung"
    FAILED = "failed"

    @property
    def decode_broke(self) -> bool:
        """A crash or hang: what a broken first decode (graph replay) looks like."""
        return self in (SmokeFailure.CRASHED, SmokeFailure.HUNG)


@dataclass(frozen=True)
class SmokeResult:
    """The verdict on one smoke. ``accept_length`` is completion tokens over verify
    rounds, summed over the requests (None when the server did not speculate)."""

    passed: bool
    seconds: float
    requests: int
    completion_tokens: int
    verify_ct: int
    accept_length: float | None
    failure: SmokeFailure | None = None
    detail: str = ""


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def judge_smoke(answer: Mapping[str, Any], spec: SmokeSpec, *, speculative: bool) -> SmokeResult:
    """The verdict on the host's answer to ``manager.smoke`` (never raises)."""
    results = [r for r in answer.get("results") or () if isinstance(r, Mapping)]
    plan = spec.plan()
    seconds = float(answer.get("seconds") or 0.0)
    tokens = sum(_int(r.get("completion_tokens")) for r in results)
    verify = sum(_int(r.get("spec_verify_ct")) for r in results)
    accept = tokens / verify if verify else None

    def result(failure: SmokeFailure | None, detail: str) -> SmokeResult:
        return SmokeResult(failure is None, seconds, len(results), tokens, verify, accept, failure, detail)

    def where(r: Mapping[str, Any]) -> str:
        n = _int(r.get("round"))
        if n >= len(plan):
            return f"round {n}"
        sampling, requests = plan[n]
        return f"{'batch of ' + str(len(requests)) if len(requests) > 1 else 'one request'} at {sampling.label()}"

    bad = next((r for r in results if r.get("error") or r.get("status") != 200), None)
    if not answer.get("alive", False):
        what = f" ({where(bad)}: {bad.get('error') or bad.get('status')})" if bad is not None else ""
        return result(SmokeFailure.CRASHED, f"the server died during the smoke{what}")
    if bad is not None and bad.get("timed_out"):
        return result(SmokeFailure.HUNG, f"{where(bad)}: no answer ({bad.get('error')}) and the server lives")
    if bad is not None:
        return result(SmokeFailure.FAILED, f"{where(bad)}: {bad.get('error') or 'HTTP ' + str(bad.get('status'))}")
    expected = sum(len(requests) for _, requests in plan)
    if len(results) != expected:
        return result(SmokeFailure.FAILED, f"{len(results)} of {expected} requests answered")
    empty = next((r for r in results if _int(r.get("completion_tokens")) < 1), None)
    if empty is not None:
        return result(SmokeFailure.FAILED, f"{where(empty)}: no tokens came back")
    if speculative and verify == 0:
        return result(SmokeFailure.FAILED, "no verify round ran (spec_verify_ct 0): the server did not speculate")
    if speculative and accept is not None and accept < 1.0:
        return result(SmokeFailure.FAILED, f"accept length {accept:.2f} < 1")
    extra = f", accept length {accept:.2f}" if accept is not None else ""
    return result(None, f"{len(results)} requests, {tokens} tokens{extra}")


# The line of a scheduler crash that names the error: "RuntimeError: CUDA error: ...",
# "torch.AcceleratorError: ...", "AssertionError: ..." (the traceback's last line).
_ERROR_LINE = re.compile(r"^\s*(?:\[[^\]]*\]\s*)?((?:[\w.]+(?:Error|Exception)|CUDA error)\b.*)")


def crash_line(lines: Sequence[str]) -> str | None:
    """The line of a crashed server's log that says what went wrong (None: none does)."""
    for line in lines:
        m = _ERROR_LINE.match(line)
        if m is not None:
            return m.group(1).strip()
    return None


__all__ = [
    "GREEDY",
    "PROMPTS",
    "SmokeFailure",
    "SmokeResult",
    "SmokeSampling",
    "SmokeSpec",
    "crash_line",
    "judge_smoke",
]
