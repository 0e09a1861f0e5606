"""Request parameters and step outputs (torch-free: the HTTP layer validates with them)."""

from __future__ import annotations

from dataclasses import dataclass


class RequestError(ValueError):
    """A malformed generation request; the server answers 400 with this message."""


@dataclass(frozen=True)
class SamplingParams:
    """The sampling fields SGLang's ``/generate`` accepts that change generation."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    ignore_eos: bool = False
    sampling_seed: int | None = None

    @classmethod
    def from_json(cls, raw: object) -> SamplingParams:
        """Validate like SGLang does (same bounds, 400 on violation)."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise RequestError("sampling_params must be an object")
        known = {"temperature", "top_p", "top_k", "max_new_tokens", "ignore_eos", "sampling_seed",
                 "min_p", "stop", "stop_token_ids", "frequency_penalty", "presence_penalty",
                 "repetition_penalty", "n", "skip_special_tokens", "min_new_tokens", "no_stop_trim",
                 "spaces_between_special_tokens"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise RequestError(f"Unknown sampling parameter(s): {', '.join(unknown)}")

        def num(name: str, default: float) -> float:
            v = raw.get(name, default)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise RequestError(f"sampling_params.{name} must be a number, got {v!r}")
            return float(v)

        temperature = num("temperature", 1.0)
        top_p = num("top_p", 1.0)
        top_k = raw.get("top_k", -1)
        max_new = raw.get("max_new_tokens", 128)
        seed = raw.get("sampling_seed")
        if temperature < 0:
            raise RequestError(f"temperature must be non-negative, got {temperature}.")
        if not 0.0 < top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {top_p}.")
        if top_k is None:
            top_k = -1
        if isinstance(top_k, bool) or not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
            raise RequestError(f"top_k must be -1 (disable), or at least 1, got {top_k}.")
        if max_new is None:
            max_new = 128
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
            raise RequestError(f"max_new_tokens must be at least 0, got {max_new}.")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise RequestError(f"sampling_seed must be an integer, got {seed!r}.")
        return cls(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new,
            ignore_eos=bool(raw.get("ignore_eos", False)),
            sampling_seed=seed,
        )


@dataclass(frozen=True)
class StepOutput:
    """What one scheduler step hands to a request's consumer."""

    new_ids: tuple[int, ...]
    finished: bool
