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


@dataclass(frozen=True)
class LogprobParams:
    """``/generate``'s log-probability fields, read as SGLang 0.5.23 reads them
    (``GenerateReqInput``: ``return_logprob`` default False, ``top_logprobs_num`` default 0,
    ``logprob_start_len`` default -1 = output tokens only; the scheduler ignores the start
    without ``return_logprob``). Stricter than 0.5.23 on types: a wrong one is a 400 here."""

    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1

    @classmethod
    def from_json(cls, obj: dict[str, object], index: int | None = None) -> LogprobParams:
        """``obj``'s fields; ``index``: the item of a batch (a field may be one value for all,
        or a list with one per prompt, as SGLang's ``normalize_param`` takes it)."""

        def field_of(name: str, default: object) -> object:
            value = obj.get(name, default)
            if index is not None and isinstance(value, list):
                if index >= len(value):
                    raise RequestError(f"{name} has {len(value)} entries for a batch of more prompts")
                value = value[index]
            return default if value is None else value

        ret = field_of("return_logprob", False)
        top = field_of("top_logprobs_num", 0)
        start = field_of("logprob_start_len", -1)
        if not isinstance(ret, bool):
            raise RequestError(f"return_logprob must be a boolean, got {ret!r}")
        for name, value in (("top_logprobs_num", top), ("logprob_start_len", start)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise RequestError(f"{name} must be an integer, got {value!r}")
        assert isinstance(top, int) and isinstance(start, int)
        if start < -1:
            raise RequestError(f"logprob_start_len must be -1 (output tokens only) or at least 0, got {start}")
        # Without return_logprob 0.5.23 ignores the start (scheduler.handle_generate_request).
        return cls(ret, max(0, top), start if ret else -1)

    def start_error(self, prompt_len: int) -> str | None:
        """0.5.23's refusal of a start past the prompt (its message, as the scheduler aborts it)."""
        if self.logprob_start_len > prompt_len:
            return (f"req.logprob_start_len={self.logprob_start_len} is higher than the number of input tokens "
                    f"len(req.origin_input_ids)={prompt_len}. Please use a smaller logprob_start_len.")
        return None
