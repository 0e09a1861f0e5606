"""A canary's gate: what a changed server must answer before the rest of the fleet gets it.

Speculative decoding is lossless: whatever the algorithm and tree, the target's greedy
continuation does not change. So the canary's server answers a fixed set of prompts at
T = 0 **before** its change (the server it runs now; the target alone, AR, where none runs)
and again **after** it, and the gate asks:

* **the same greedy tokens**: for each prompt the tokens up to its first divergence, over
  all prompts, at least ``agreement`` of the tokens (default 0.98: GPU kernels may break a
  near-tie differently in one place, a broken verify diverges at once);
* **an acceptance length at or above a floor**, at T = 0 and at a sampled temperature: the
  ledger's median for that machine type and tree times 0.75 where a ledger has one
  (:func:`ledger_floors`; the gate's prompts are not the sweep's), else 1.3: a speculating
  tree accepts a draft token every few rounds at least; a collapsed one accepts none (1.0);
* **no failed request** (an error status, no tokens, a timeout, a crash).

The prompts are the first two of each shipped prompt set (chat, code, math), 64 tokens
each, sent together in one batch. Everything here is pure; sending the requests is the
rollout's executor's (through the service agent, from the host itself).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ddtree_ops.errors import ConfigError
from ddtree_ops.service.launch import RunConfig
from ddtree_ops.shipped import PROJECT_PROMPTS
from ddtree_ops.workload.prompts import load_prompt_file

DEFAULT_AGREEMENT = 0.98
DEFAULT_ACCEPT_FLOOR = 1.3
LEDGER_FLOOR_RATIO = 0.75
SAMPLED_TEMPERATURE = 0.7
MAX_NEW_TOKENS = 64
PROMPTS_PER_CATEGORY = 2
CATEGORIES = ("chat", "code", "math")
SEED = 1234


@dataclass(frozen=True)
class GatePrompt:
    id: str
    category: str
    text: str


def gate_prompts(per_category: int = PROMPTS_PER_CATEGORY) -> tuple[GatePrompt, ...]:
    """The first ``per_category`` prompts of each shipped prompt set (plain text prompts)."""
    out: list[GatePrompt] = []
    for category in CATEGORIES:
        prompts = [p for p in load_prompt_file(PROJECT_PROMPTS / f"{category}.jsonl") if not p.chat]
        out += [GatePrompt(p.id or f"{category}-{i}", category, p.text) for i, p in enumerate(prompts[:per_category])]
    return tuple(out)


@dataclass(frozen=True)
class Floor:
    """An acceptance-length floor and where it came from (``default``, or the ledger's
    median it was derived from)."""

    value: float
    source: str

    def describe(self) -> str:
        return f"{self.value:.2f} ({self.source})"


@dataclass(frozen=True)
class GateSpec:
    """What the gate sends and what it demands. ``floors``: per temperature (0 and the
    sampled one); a floor of None is not checked (an AR server does not speculate)."""

    prompts: tuple[GatePrompt, ...] = field(default_factory=gate_prompts)
    agreement: float = DEFAULT_AGREEMENT
    sampled_temperature: float = SAMPLED_TEMPERATURE
    max_new_tokens: int = MAX_NEW_TOKENS
    floors: Mapping[float, Floor] = field(default_factory=dict)
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not 0.0 < self.agreement <= 1.0:
            raise ConfigError(f"--gate-agreement {self.agreement}: must be in (0, 1]")
        if not self.sampled_temperature > 0:
            raise ConfigError(f"--gate-temperature {self.sampled_temperature}: must be above 0")
        if not self.prompts:
            raise ConfigError("the gate has no prompts")

    @property
    def temperatures(self) -> tuple[float, float]:
        return (0.0, self.sampled_temperature)

    def floor(self, temperature: float) -> Floor:
        return self.floors.get(temperature) or Floor(DEFAULT_ACCEPT_FLOOR, "default")

    def round(self, temperature: float) -> list[dict[str, Any]]:
        """One batch: every prompt at once, at ``temperature`` (a sampled one seeded per
        prompt, so a rerun sends the same requests)."""
        out = []
        for i, prompt in enumerate(self.prompts):
            params: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": temperature,
                                      "ignore_eos": True}
            if temperature > 0:
                params["sampling_seed"] = SEED + i
            out.append({"text": prompt.text, "sampling_params": params})
        return out

    def describe(self) -> str:
        floors = ", ".join(f"T={t:g} {self.floor(t).describe()}" for t in self.temperatures)
        return (f"{len(self.prompts)} prompts x {self.max_new_tokens} tokens; greedy agreement >= "
                f"{self.agreement:g}; acceptance floor {floors}; no failed request")


@dataclass(frozen=True)
class GateAnswer:
    """One prompt's answer: its tokens (the text where the server gives no ids), or why not."""

    prompt: str
    tokens: tuple[int, ...] | None
    text: str | None
    completion_tokens: int
    verify_ct: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def sequence(self) -> Sequence[int] | str:
        return self.tokens if self.tokens is not None else (self.text or "")


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def answers(reply: Mapping[str, Any], spec: GateSpec) -> tuple[GateAnswer, ...]:
    """The agent's smoke reply (one round, ``keep_tokens``) as one answer per prompt."""
    results = [r for r in reply.get("results") or [] if isinstance(r, Mapping)]
    out: list[GateAnswer] = []
    for i, prompt in enumerate(spec.prompts):
        r = results[i] if i < len(results) else {}
        ids = r.get("output_ids")
        tokens = tuple(int(t) for t in ids) if isinstance(ids, list) and all(isinstance(t, int) for t in ids) else None
        text = r.get("text") if isinstance(r.get("text"), str) else None
        completion = _count(r.get("completion_tokens"))
        error = r.get("error") if isinstance(r.get("error"), str) else None
        if error is None and r.get("status") != 200:
            error = "no answer" if not r else f"status {r.get('status')}"
        if error is None and completion == 0 and not tokens and not text:
            error = "no tokens"
        out.append(GateAnswer(prompt.id, tokens, text, completion, _count(r.get("spec_verify_ct")), error))
    if not reply.get("alive", True):
        out = [a if a.error else GateAnswer(a.prompt, a.tokens, a.text, a.completion_tokens, a.verify_ct,
                                            "the server died during the gate") for a in out]
    return tuple(out)


def _prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Agreement:
    """Greedy tokens after the change against before: the share of the baseline's tokens
    up to each prompt's first divergence, and where each diverging prompt diverged."""

    share: float
    diverged: tuple[tuple[str, int], ...]  # (prompt, token index of the first difference)

    def describe(self) -> str:
        where = ", ".join(f"{p}@{i}" for p, i in self.diverged[:4]) + (" ..." if len(self.diverged) > 4 else "")
        return f"{self.share:.3f}" + (f" (diverged: {where})" if self.diverged else "")


def agreement(before: Sequence[GateAnswer], after: Sequence[GateAnswer]) -> Agreement:
    matched = total = 0
    diverged: list[tuple[str, int]] = []
    for b, a in zip(before, after, strict=True):
        if not b.ok:
            continue
        ref, got = b.sequence(), a.sequence() if a.ok else ()
        common = _prefix(ref, got)
        matched += common
        total += len(ref)
        if common < len(ref):
            diverged.append((b.prompt, common))
    return Agreement(matched / total if total else 0.0, tuple(diverged))


def acceptance(after: Sequence[GateAnswer]) -> float | None:
    """Completion tokens over verify rounds, summed over the answers (None: no verify round)."""
    verify = sum(a.verify_ct for a in after if a.ok)
    return sum(a.completion_tokens for a in after if a.ok) / verify if verify else None


@dataclass(frozen=True)
class GateVerdict:
    """The gate's figures and whether the canary passed. ``accept``: acceptance length per
    temperature after the change (None: the server did not speculate)."""

    passed: bool
    agreement: float
    diverged: tuple[tuple[str, int], ...]
    accept: Mapping[float, float | None]
    floors: Mapping[float, Floor]
    failed_requests: int
    requests: int
    before_failed: int
    reasons: tuple[str, ...] = ()
    # The server before the change, on the same greedy prompts (None: it did not speculate).
    accept_before: float | None = None

    def describe(self) -> str:
        accept = ", ".join(
            f"T={t:g} {'-' if v is None else f'{v:.2f}'}" + (f" (floor {self.floors[t].value:.2f})"
                                                              if t in self.floors else "")
            for t, v in self.accept.items()
        )
        failed = f"{self.failed_requests} of {self.requests} request(s) failed"
        if not self.passed:
            return f"gate FAILED: {'; '.join(self.reasons)} (greedy agreement {self.agreement:.3f}, {failed})"
        before = f" (before: T=0 {self.accept_before:.2f})" if self.accept_before is not None else ""
        return f"gate passed — greedy agreement {self.agreement:.3f}, acceptance {accept}{before}, {failed}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "agreement": self.agreement,
            "diverged": [{"prompt": p, "at": i} for p, i in self.diverged],
            "accept_length": {f"{t:g}": v for t, v in self.accept.items()},
            "floors": {f"{t:g}": {"value": f.value, "source": f.source} for t, f in self.floors.items()},
            "failed_requests": self.failed_requests,
            "requests": self.requests,
            "baseline_failed_requests": self.before_failed,
            "baseline_accept_length": self.accept_before,
            "reasons": list(self.reasons),
        }


def judge_gate(
    spec: GateSpec,
    before: Sequence[GateAnswer],
    after: Mapping[float, Sequence[GateAnswer]],
    *,
    speculative: bool,
) -> GateVerdict:
    """The verdict on the canary: ``before`` its greedy answers before the change, ``after``
    its answers per temperature after it. ``speculative``: check the acceptance floors."""
    reasons: list[str] = []
    before_failed = sum(not a.ok for a in before)
    if before_failed == len(before):
        reasons.append("no baseline: every request before the change failed")
    greedy = after.get(0.0, ())
    agree = agreement(before, greedy) if greedy else Agreement(0.0, ())
    if agree.share < spec.agreement:
        reasons.append(f"greedy agreement {agree.describe()} is below {spec.agreement:g}")
    all_after = [a for answers_ in after.values() for a in answers_]
    failed = [a for a in all_after if not a.ok]
    if failed:
        reasons.append(f"{len(failed)} request(s) failed ({failed[0].prompt}: {failed[0].error})")
    accept: dict[float, float | None] = {}
    floors: dict[float, Floor] = {}
    for temperature, answers_ in after.items():
        accept[temperature] = acceptance(answers_)
        if not speculative:
            continue
        floor = floors[temperature] = spec.floor(temperature)
        value = accept[temperature]
        if value is None:
            reasons.append(f"no verify rounds at T={temperature:g} (is the server speculating?)")
        elif value < floor.value:
            reasons.append(f"acceptance length {value:.2f} at T={temperature:g} is below the floor {floor.describe()}")
    return GateVerdict(
        passed=not reasons, agreement=agree.share, diverged=agree.diverged, accept=accept, floors=floors,
        failed_requests=len(failed), requests=len(all_after), before_failed=before_failed, reasons=tuple(reasons),
        accept_before=acceptance(before),
    )


def ledger_floors(
    rows: Sequence[Mapping[str, Any]], *, machine_type: str | None, run: RunConfig, temperatures: Sequence[float],
    ratio: float = LEDGER_FLOOR_RATIO,
) -> dict[float, Floor]:
    """Floors from measured rows: ``ratio`` x the median ``accept_length`` of the ok rows of
    this machine type (``gpu_name``), algorithm, budget and top-k at each temperature; a
    temperature the ledger has no row for keeps the default."""
    out: dict[float, Floor] = {}
    if machine_type is None or run.algorithm == "AR":
        return out
    for temperature in temperatures:
        values = sorted(
            float(r["accept_length"]) for r in rows
            if r.get("status") == "ok" and r.get("gpu_name") == machine_type and r.get("algorithm") == run.algorithm
            and r.get("budget") == run.budget and r.get("topk") == run.topk
            and isinstance(r.get("temperature"), (int, float)) and math.isclose(float(r["temperature"]), temperature)
            and isinstance(r.get("accept_length"), (int, float)) and math.isfinite(float(r["accept_length"]))
        )
        if values:
            mid = len(values) // 2
            median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
            out[temperature] = Floor(ratio * median, f"{ratio:g} x the ledger's median {median:.2f} of "
                                                     f"{len(values)} row(s)")
    return out


__all__ = [
    "DEFAULT_ACCEPT_FLOOR",
    "DEFAULT_AGREEMENT",
    "Agreement",
    "Floor",
    "GateAnswer",
    "GatePrompt",
    "GateSpec",
    "GateVerdict",
    "acceptance",
    "agreement",
    "answers",
    "gate_prompts",
    "judge_gate",
    "ledger_floors",
]
