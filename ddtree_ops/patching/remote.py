"""Running one step of :mod:`._remote` on a host: one round trip, JSON in, JSON out.

The program text is a constant of ours; every value (paths, hashes, file contents) goes
in one JSON document on stdin after a NUL byte, so nothing a user wrote ever becomes
shell or Python syntax (the framing of every host program: transport/hostprogram.py).
Refusals of the remote side come back as data and are mapped here, once, to the
exception tree.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from ddtree_ops.errors import (
    CommandFailed,
    DdtreeOpsError,
    DriftError,
    PatchError,
    RemoteFileError,
    VerifyError,
)
from ddtree_ops.transport.base import Transport
from ddtree_ops.transport.hostprogram import run_program


@lru_cache(maxsize=1)
def program_text() -> str:
    return (Path(__file__).with_name("_remote.py")).read_text()


class RemoteRefusal(PatchError):
    """A remote step declined on purpose; ``kind`` says why, ``extra`` carries details."""

    def __init__(
        self, kind: str, message: str, *, host: str | None = None, extra: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message, host=host)
        self.kind = kind
        self.extra = extra or {}


_KIND_TO_ERROR: dict[str, type[DdtreeOpsError]] = {
    "verify": VerifyError,
    "changed": DriftError,
    "escape": DriftError,
    "io": RemoteFileError,
}


def run_step(
    transport: Transport,
    python: str,
    step: str,
    payload: dict[str, Any],
    *,
    timeout: float | None = 600.0,
) -> dict[str, Any]:
    """Run ``step`` with ``python`` on the host; return its result or raise a mapped error.

    ``locked`` and ``journal`` refusals come back as :class:`RemoteRefusal` so that the
    executor can decide (wait, recover); the others become their natural error class.
    """
    body = dict(payload)
    body["step"] = step
    run = run_program(transport, python, program_text(), body, timeout=timeout)
    res, answer = run.result, run.reply
    if answer is None:
        raise CommandFailed(
            res.returncode,
            [python, "-c", "<ddtree-ops step>"],
            res.stderr,
            host=transport.host,
            detail=f"remote step '{step}' with {python} gave no answer (exit {res.returncode})",
        )
    if answer.get("ok"):
        result = answer.get("result")
        return result if isinstance(result, dict) else {}
    kind = str(answer.get("kind", "error"))
    message = str(answer.get("message", "remote step failed"))
    extra = answer.get("extra") or {}
    if kind in _KIND_TO_ERROR:
        raise _KIND_TO_ERROR[kind](message, host=transport.host)
    raise RemoteRefusal(kind, message, host=transport.host, extra=extra)
