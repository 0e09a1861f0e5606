"""A canary's gate: what a changed server must answer before the rest of the fleet gets it.

Speculative decoding is lossless: whatever the algorithm and tree, the target's greedy
continuation does not change. So the canary's server answers a fixed set of prompts at
T = 0 **before** its change (the server it runs now; the target alone, AR, where none runs),
with the target's log-probabilities (SGLang's ``return_logprob`` / ``top_logprobs_num``), and
again **after** it, and the gate asks, token by token:

* **no changed greedy token that is not a near-tie**: for each prompt, the first token that
  differs from the baseline's is forgiven only where the baseline itself could not tell the
  two apart: its log-probability of the canary's token is within ``tie_epsilon`` of its own
  choice (default 0.125 nats, one bf16 step of a logit of magnitude 16-32: two kernels that
  round such a logit differently can swap two tokens that close, and nothing else). Any other
  divergence fails, at whatever position and whatever share of tokens agreed. Where the
  baseline gave no log-probabilities (a server that cannot return them) no divergence is a
  proven tie: every one fails. After a tie the canary legitimately continues another text, so
  each prompt is compared up to its first divergence only;
* **enough compared**: the share of the baseline's tokens compared that way (up to each
  prompt's first divergence) is at least ``agreement`` (default 0.5: ties may end prompts
  early, but a gate that compared less than half of its tokens checked too little);
* **decode speed**: the median over the prompts of (decode tok/s after / before), both from
  the same T = 0 requests, at least ``min_speed`` (default 0.9). A request's decode rate
  leaves the time to its first token out where the answer says it (SGLang's
  ``decode_throughput`` or ``first_token_latency``, with ``--enable-metrics``), else it is
  completion tokens over the server's ``e2e_latency`` (the agent's own clock last). A
  simulator running compressed time (``sim_time_scale`` < 1) is not judged: its own CPU
  work, not the cost model, sets its pace there;
* **an acceptance length at or above a floor**, at T = 0 and at a sampled temperature: the
  ledger's median for that machine type and tree times 0.75 where a ledger has one
  (:func:`ledger_floors`; the gate's prompts are not the sweep's), else 1.3: a speculating
  tree accepts a draft token every few rounds at least; a collapsed one accepts none (1.0);
* **no failed request** (an error status, no tokens, a timeout, a crash).

The prompts are the first two of each shipped prompt set (chat, code, math), sent together
in one batch: the first chat and the first code prompt generate 256 tokens (late faults: a
kernel that goes wrong only at long contexts), the others 64. Everything here is pure;
sending the requests is the rollout's executor's (through the service agent, from the host
itself).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ddtree_ops.errors import (
    CanaryFailed,
    ConfigError,
    DdtreeOpsError,
    LeaseHeld,
    ServiceError,
    UnitRefused,
    VerifyError,
)
from ddtree_ops.service.launch import RunConfig
from ddtree_ops.shipped import PROJECT_PROMPTS
from ddtree_ops.workload.prompts import load_prompt_file

DEFAULT_AGREEMENT = 0.5
DEFAULT_ACCEPT_FLOOR = 1.3
# One bf16 step (ulp) of a logit in [16, 32): bf16 keeps 8 significant bits, so such a logit
# is stored to within half of 0.125, and two kernels that accumulate it in another order and
# round it differently can disagree by a whole step (at 8-16 by 0.0625). A baseline gap below
# that is one the canary's numerics may legitimately reverse; a gap above it is a decision.
DEFAULT_TIE_EPSILON = 0.125
DEFAULT_MIN_SPEED = 0.9
LEDGER_FLOOR_RATIO = 0.75
SAMPLED_TEMPERATURE = 0.7
MAX_NEW_TOKENS = 64
LONG_TOKENS = 256
PROMPTS_PER_CATEGORY = 2
CATEGORIES = ("chat", "code", "math")
# Whose first prompt generates LONG_TOKENS: long answers are what these are asked for.
LONG_CATEGORIES = ("chat", "code")
# The baseline's best tokens asked for at each position: the canary's token must be among
# them to be judged a tie (a flip picks the runner-up; five leaves room for a three-way tie).
TOP_LOGPROBS = 5
SEED = 1234


@dataclass(frozen=True)
class GatePrompt:
    id: str
    category: str
    text: str
    # Generates the spec's long_tokens instead of its max_new_tokens.
    long: bool = False


def gate_prompts(per_category: int = PROMPTS_PER_CATEGORY) -> tuple[GatePrompt, ...]:
    """The first ``per_category`` prompts of each shipped prompt set (plain text prompts);
    the first of each of LONG_CATEGORIES is long."""
    out: list[GatePrompt] = []
    for category in CATEGORIES:
        prompts = [p for p in load_prompt_file(PROJECT_PROMPTS / f"{category}.jsonl") if not p.chat]
        out += [GatePrompt(p.id or f"{category}-{i}", category, p.text, long=i == 0 and category in LONG_CATEGORIES)
                for i, p in enumerate(prompts[:per_category])]
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
    sampled one); a floor of None is not checked (an AR server does not speculate).
    ``min_speed`` 0 does not judge speed; ``tie_epsilon`` 0 forgives no divergence."""

    prompts: tuple[GatePrompt, ...] = field(default_factory=gate_prompts)
    agreement: float = DEFAULT_AGREEMENT
    sampled_temperature: float = SAMPLED_TEMPERATURE
    max_new_tokens: int = MAX_NEW_TOKENS
    floors: Mapping[float, Floor] = field(default_factory=dict)
    request_timeout_s: float = 120.0
    tie_epsilon: float = DEFAULT_TIE_EPSILON
    min_speed: float = DEFAULT_MIN_SPEED
    long_tokens: int = LONG_TOKENS

    def __post_init__(self) -> None:
        if not 0.0 <= self.agreement <= 1.0:
            raise ConfigError(f"--gate-agreement {self.agreement}: must be in [0, 1]")
        if not self.sampled_temperature > 0:
            raise ConfigError(f"--gate-temperature {self.sampled_temperature}: must be above 0")
        if not (math.isfinite(self.tie_epsilon) and self.tie_epsilon >= 0):
            raise ConfigError(f"--gate-tie-epsilon {self.tie_epsilon}: must be 0 or more (nats)")
        if not (math.isfinite(self.min_speed) and self.min_speed >= 0):
            raise ConfigError(f"--gate-min-speed {self.min_speed}: must be 0 or more (a fraction of the speed before)")
        if not self.prompts:
            raise ConfigError("the gate has no prompts")

    @property
    def temperatures(self) -> tuple[float, float]:
        return (0.0, self.sampled_temperature)

    def floor(self, temperature: float) -> Floor:
        return self.floors.get(temperature) or Floor(DEFAULT_ACCEPT_FLOOR, "default")

    def tokens(self, prompt: GatePrompt) -> int:
        return self.long_tokens if prompt.long else self.max_new_tokens

    def round(self, temperature: float, *, logprobs: bool = True) -> list[dict[str, Any]]:
        """One batch: every prompt at once, at ``temperature`` (a sampled one seeded per
        prompt, so a rerun sends the same requests). At T = 0 each request asks for the
        target's log-probabilities (``logprobs``), before and after the change alike, so the
        two rounds cost the server the same and their speeds compare."""
        out = []
        for i, prompt in enumerate(self.prompts):
            params: dict[str, Any] = {"max_new_tokens": self.tokens(prompt), "temperature": temperature,
                                      "ignore_eos": True}
            if temperature > 0:
                params["sampling_seed"] = SEED + i
            request: dict[str, Any] = {"text": prompt.text, "sampling_params": params}
            if temperature == 0 and logprobs:
                request |= {"return_logprob": True, "top_logprobs_num": TOP_LOGPROBS, "logprob_start_len": -1}
            out.append(request)
        return out

    def describe(self) -> str:
        floors = ", ".join(f"T={t:g} {self.floor(t).describe()}" for t in self.temperatures)
        lengths: dict[int, int] = {}
        for p in self.prompts:
            lengths[self.tokens(p)] = lengths.get(self.tokens(p), 0) + 1
        sizes = " + ".join(f"{n} x {tokens}" for tokens, n in sorted(lengths.items(), reverse=True))
        speed = f"decode speed >= {self.min_speed:g} x before" if self.min_speed > 0 else "decode speed not judged"
        return (f"{len(self.prompts)} prompts ({sizes} tokens); a changed greedy token passes only as a near-tie "
                f"of the baseline (gap < {self.tie_epsilon:g} nats), compared up to each prompt's first divergence "
                f"over >= {self.agreement:g} of the tokens; {speed}; acceptance floor {floors}; no failed request")


# One output position's best tokens before the change: (token, logprob), best first.
TopLogprobs = tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class GateAnswer:
    """One prompt's answer: its tokens (the text where the server gives no ids), or why not;
    at T = 0 the target's best tokens at each position (None: the server gave none), and the
    request's decode rate (tok/s, None: unknown) and the simulator's time scale, if any."""

    prompt: str
    tokens: tuple[int, ...] | None
    text: str | None
    completion_tokens: int
    verify_ct: int
    error: str | None = None
    top_logprobs: tuple[TopLogprobs | None, ...] | None = None
    decode_tok_s: float | None = None
    sim_time_scale: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def sequence(self) -> Sequence[int] | str:
        return self.tokens if self.tokens is not None else (self.text or "")


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _top_rows(raw: object) -> tuple[TopLogprobs | None, ...] | None:
    """The agent's ``top_logprobs`` (per position, ``[token, logprob]`` pairs) as rows, best
    first; a malformed row is None (no tie can be shown there)."""
    if not isinstance(raw, list):
        return None
    rows: list[TopLogprobs | None] = []
    for row in raw:
        pairs: list[tuple[int, float]] = []
        if isinstance(row, list):
            for pair in row:
                if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int) \
                        and not isinstance(pair[0], bool) and _number(pair[1]) is not None:
                    pairs.append((pair[0], float(pair[1])))
        rows.append(tuple(sorted(pairs, key=lambda p: -p[1])) or None)
    return tuple(rows)


def decode_rate(result: Mapping[str, Any], completion: int) -> float | None:
    """A request's decode tok/s from its answer: SGLang's ``decode_throughput``, else the
    tokens after the first over the time after it (``first_token_latency``), else over the
    server's ``e2e_latency``, else over the agent's ``seconds`` (the last two include the
    first token's wait: the same prefill before and after, so a ratio still holds)."""
    if completion <= 1:
        return None
    throughput = _number(result.get("decode_throughput"))
    if throughput is not None and throughput > 0:
        return throughput
    e2e = _number(result.get("e2e_latency"))
    first = _number(result.get("first_token_latency"))
    if e2e is not None and first is not None and e2e > first >= 0:
        return (completion - 1) / (e2e - first)
    for key in ("e2e_latency", "seconds"):
        seconds = _number(result.get(key))
        if seconds is not None and seconds > 0:
            return completion / seconds
    return None


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
        out.append(GateAnswer(
            prompt.id, tokens, text, completion, _count(r.get("spec_verify_ct")), error,
            top_logprobs=_top_rows(r.get("top_logprobs")), decode_tok_s=decode_rate(r, completion),
            sim_time_scale=_number(r.get("sim_time_scale")),
        ))
    if not reply.get("alive", True):
        out = [a if a.error else GateAnswer(a.prompt, a.tokens, a.text, a.completion_tokens, a.verify_ct,
                                            "the server died during the gate") for a in out]
    return tuple(out)


def has_logprobs(before: Sequence[GateAnswer]) -> bool:
    """Whether the baseline's answers carry log-probabilities (a server that cannot return
    them answers without, or only without)."""
    return any(a.ok and a.top_logprobs for a in before)


def _prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Divergence:
    """Where a prompt's greedy tokens after the change first differ from before: the
    baseline's token and the canary's there (None: that answer ended first; a string: a
    text answer's character), the baseline's log-probability gap between the two (None:
    unknown), and whether that makes it a near-tie."""

    prompt: str
    at: int
    want: int | str | None
    got: int | str | None
    gap: float | None
    tie: bool
    why: str = ""

    def describe(self) -> str:
        got = "nothing" if self.got is None else f"{self.got!r}"
        gap = [f"gap {self.gap:.3f} nats"] if self.gap is not None else []
        notes = ", ".join([*gap, "a near-tie" if self.tie else self.why])
        return f"{self.prompt}@{self.at}: {got} where the baseline has {self.want!r} ({notes})"

    def as_dict(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "at": self.at, "want": self.want, "got": self.got, "gap": self.gap,
                "tie": self.tie, "why": self.why}


def divergence(prompt: str, at: int, ref: Sequence[Any], got: Sequence[Any],
               top: TopLogprobs | None, epsilon: float) -> Divergence:
    """Judge the first difference at ``at``: a near-tie only when the baseline's best tokens
    there (``top``) list the canary's token within ``epsilon`` of the baseline's own."""
    want = ref[at] if at < len(ref) else None
    have = got[at] if at < len(got) else None
    if not isinstance(want, int) or not isinstance(have, int):
        why = "the answer after the change ended early" if have is None else "no token ids to judge"
        return Divergence(prompt, at, want, have, None, False, why)
    if not top:
        return Divergence(prompt, at, want, have, None, False, "no baseline log-probabilities there")
    scores = dict(top)
    best = scores.get(want, top[0][1])
    if have not in scores:
        floor = best - top[-1][1]
        return Divergence(prompt, at, want, have, None, False,
                          f"not among the baseline's best {len(top)}: gap > {floor:.3f} nats")
    gap = best - scores[have]
    tie = gap < epsilon
    return Divergence(prompt, at, want, have, gap, tie, "" if tie else f"not below the tie epsilon {epsilon:g}")


@dataclass(frozen=True)
class Agreement:
    """Greedy tokens after the change against before: the share of the baseline's tokens
    up to each prompt's first divergence, and each diverging prompt's divergence."""

    share: float
    divergences: tuple[Divergence, ...]

    @property
    def diverged(self) -> tuple[tuple[str, int], ...]:
        return tuple((d.prompt, d.at) for d in self.divergences)

    @property
    def confident(self) -> tuple[Divergence, ...]:
        return tuple(d for d in self.divergences if not d.tie)

    def describe(self) -> str:
        where = ", ".join(f"{d.prompt}@{d.at}" for d in self.divergences[:4]) \
            + (" ..." if len(self.divergences) > 4 else "")
        return f"{self.share:.3f}" + (f" (diverged: {where})" if self.divergences else "")


def agreement(before: Sequence[GateAnswer], after: Sequence[GateAnswer], *,
              epsilon: float = DEFAULT_TIE_EPSILON) -> Agreement:
    matched = total = 0
    found: list[Divergence] = []
    for b, a in zip(before, after, strict=True):
        if not b.ok:
            continue
        ref, got = b.sequence(), a.sequence() if a.ok else ()
        common = _prefix(ref, got)
        matched += common
        total += len(ref)
        if common < len(ref):
            rows = b.top_logprobs or ()
            top = rows[common] if common < len(rows) else None
            found.append(divergence(b.prompt, common, ref, got, top, epsilon))
    return Agreement(matched / total if total else 0.0, tuple(found))


def acceptance(after: Sequence[GateAnswer]) -> float | None:
    """Completion tokens over verify rounds, summed over the answers (None: no verify round)."""
    verify = sum(a.verify_ct for a in after if a.ok)
    return sum(a.completion_tokens for a in after if a.ok) / verify if verify else None


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


@dataclass(frozen=True)
class Speed:
    """Decode speed after the change against before, on the same T = 0 requests: the median
    per-request tok/s of each, and the median over the prompts of after / before (what is
    judged: one slow or fast outlier moves it little). ``judged`` False: ``note`` says why."""

    before: float | None
    after: float | None
    ratio: float | None
    prompts: int
    judged: bool
    note: str = ""

    def describe(self) -> str:
        if self.ratio is None or self.before is None or self.after is None:
            return f"decode speed not measured ({self.note})" if self.note else "decode speed not measured"
        text = f"decode {self.ratio:.2f}x before ({self.before:.1f} -> {self.after:.1f} tok/s per request)"
        return text if self.judged else f"{text}, not judged: {self.note}"

    def as_dict(self) -> dict[str, Any]:
        return {"before_tok_s": self.before, "after_tok_s": self.after, "ratio": self.ratio,
                "prompts": self.prompts, "judged": self.judged, "note": self.note}


def speed(before: Sequence[GateAnswer], after: Sequence[GateAnswer], *, min_speed: float) -> Speed:
    """Decode speed after against before (module docstring), judged unless ``min_speed`` is
    0, no prompt has a rate on both sides, or either side is a simulator in compressed time."""
    pairs = [(b.decode_tok_s, a.decode_tok_s) for b, a in zip(before, after, strict=True)
             if b.ok and a.ok and b.decode_tok_s and a.decode_tok_s]
    if not pairs:
        return Speed(None, None, None, 0, False, "no request has a decode rate on both sides")
    ratio = _median([a / b for b, a in pairs])
    rate_before, rate_after = _median([b for b, _ in pairs]), _median([a for _, a in pairs])
    if min_speed <= 0:
        return Speed(rate_before, rate_after, ratio, len(pairs), False, "--gate-min-speed 0")
    scales = sorted({s for x in (*before, *after) if (s := x.sim_time_scale) is not None and s < 1})
    if scales:
        return Speed(rate_before, rate_after, ratio, len(pairs), False,
                     f"a simulator in compressed time (SIM_TIME_SCALE {scales[0]:g}) is not a clock")
    return Speed(rate_before, rate_after, ratio, len(pairs), True)


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
    divergences: tuple[Divergence, ...] = ()
    speed: Speed | None = None
    tie_epsilon: float = DEFAULT_TIE_EPSILON
    min_speed: float = DEFAULT_MIN_SPEED
    # Whether the baseline's answers carried log-probabilities (False: no divergence is a tie).
    baseline_logprobs: bool = True

    def describe(self) -> str:
        accept = ", ".join(
            f"T={t:g} {'-' if v is None else f'{v:.2f}'}" + (f" (floor {self.floors[t].value:.2f})"
                                                              if t in self.floors else "")
            for t, v in self.accept.items()
        )
        failed = f"{self.failed_requests} of {self.requests} request(s) failed"
        if not self.passed:
            return f"gate FAILED: {'; '.join(self.reasons)} (greedy agreement {self.agreement:.3f}, {failed})"
        ties = [d for d in self.divergences if d.tie]
        tied = f" ({len(ties)} near-tie divergence(s): {', '.join(d.describe() for d in ties[:3])})" if ties else ""
        before = f" (before: T=0 {self.accept_before:.2f})" if self.accept_before is not None else ""
        speed = f", {self.speed.describe()}" if self.speed is not None else ""
        return (f"gate passed — greedy agreement {self.agreement:.3f}{tied}{speed}, acceptance {accept}{before}, "
                f"{failed}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "agreement": self.agreement,
            "diverged": [{"prompt": p, "at": i} for p, i in self.diverged],
            "divergences": [d.as_dict() for d in self.divergences],
            "tie_epsilon": self.tie_epsilon,
            "baseline_logprobs": self.baseline_logprobs,
            "speed": self.speed.as_dict() if self.speed is not None else None,
            "min_speed": self.min_speed,
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
    agree = agreement(before, greedy, epsilon=spec.tie_epsilon) if greedy else Agreement(0.0, ())
    confident = agree.confident
    if confident:
        where = ", ".join(d.describe() for d in confident[:3]) + (" ..." if len(confident) > 3 else "")
        reasons.append(f"{len(confident)} prompt(s) diverged where the baseline was not at a near-tie: {where}")
    if agree.share < spec.agreement:
        reasons.append(f"greedy agreement {agree.describe()} is below {spec.agreement:g}: too few tokens compared")
    all_after = [a for answers_ in after.values() for a in answers_]
    failed = [a for a in all_after if not a.ok]
    if failed:
        reasons.append(f"{len(failed)} request(s) failed ({failed[0].prompt}: {failed[0].error})")
    rate = speed(before, greedy, min_speed=spec.min_speed) if greedy else None
    if rate is not None and rate.judged and rate.ratio is not None and rate.ratio < spec.min_speed:
        reasons.append(f"{rate.describe()} is below {spec.min_speed:g} x before")
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
        accept_before=acceptance(before), divergences=agree.divergences, speed=rate, tie_epsilon=spec.tie_epsilon,
        min_speed=spec.min_speed, baseline_logprobs=has_logprobs(before),
    )


def rejects_canary(exc: DdtreeOpsError) -> bool:
    """Whether a failure of the gated canary before its gate (its baseline launch, its change,
    its restart) is the canary being rejected: its server crashed while loading, hung, refused
    to start, or the change itself failed there. Not a rejection: a host that cannot be
    reached (exit 3), a refusal of bad input (exit 2) or of the patch (drift, a lock, an
    unsupported version, no plugin: nothing changed), a unit that cannot be driven or a
    sweep's lease (their own codes say what to fix), a Ctrl-C."""
    if isinstance(exc, UnitRefused | LeaseHeld | CanaryFailed):
        return False
    return isinstance(exc, ServiceError | VerifyError)


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
    "DEFAULT_MIN_SPEED",
    "DEFAULT_TIE_EPSILON",
    "Agreement",
    "Divergence",
    "Floor",
    "GateAnswer",
    "GatePrompt",
    "GateSpec",
    "GateVerdict",
    "Speed",
    "acceptance",
    "agreement",
    "answers",
    "decode_rate",
    "divergence",
    "gate_prompts",
    "has_logprobs",
    "judge_gate",
    "ledger_floors",
    "rejects_canary",
    "speed",
]
