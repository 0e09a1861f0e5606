"""Files of ours placed beside a host's applied bundle: a tuned DDTREE policy.

The DDTree plugin reads its runtime states from a file named on the server's command line
(``--speculative-adaptive-config``), so the file must be on the host before the restart
and stay there for every later one. It lives in the patch engine's state directory
(``<prefix>/.ddtree-ops/placed/``), next to the record of the applied bundle and outside
the package, so that a reinstall of SGLang does not remove it while a launch names it.

It is written like a bundle's files (:mod:`._remote` ``place``: under the deploy lock,
temp file beside the target, sha256 checked before and after ``os.replace``), in one
round trip that also returns what was there before: :func:`restore_file` puts that back,
which is how a failed ``tune --deploy`` leaves the host as it was.
"""

from __future__ import annotations

import base64
import hashlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ddtree_ops.errors import LockError, PatchError
from ddtree_ops.inventory_types import Host
from ddtree_ops.lockholder import active_run, controller_identity
from ddtree_ops.patching.remote import RemoteRefusal, run_step
from ddtree_ops.transport.base import Transport

#: The tuned policy's name on every host: one per host (its GPU slots share the prefix).
POLICY_FILE = "ddtree-policy.json"


@dataclass(frozen=True)
class PlacedFile:
    """A file written on ``host``: where, its sha256, and what it replaced (None: nothing)."""

    host: str
    name: str
    path: str  # absolute, on the host
    sha256: str
    previous: bytes | None
    previous_sha256: str | None


def place_file(transport: Transport, host: Host, content: bytes, *, name: str = POLICY_FILE) -> PlacedFile:
    """Write ``content`` as ``name`` beside the host's applied bundle (PatchError without one;
    LockError while a deploy holds the host)."""
    sha = hashlib.sha256(content).hexdigest()
    answer = _place(transport, host, name, {"content_b64": base64.b64encode(content).decode(), "new_sha": sha})
    previous = answer.get("previous_b64")
    return PlacedFile(
        host=host.name,
        name=name,
        path=str(answer["path"]),
        sha256=sha,
        previous=base64.b64decode(previous) if isinstance(previous, str) else None,
        previous_sha256=answer.get("previous_sha"),
    )


def restore_file(transport: Transport, host: Host, placed: PlacedFile) -> None:
    """Put back what :func:`place_file` replaced (or remove the file if there was none).
    Refused (DriftError) when the file is no longer what was placed: another change won."""
    payload: dict[str, Any] = {"expect_sha": placed.sha256, "new_sha": placed.previous_sha256}
    payload["content_b64"] = base64.b64encode(placed.previous).decode() if placed.previous is not None else None
    _place(transport, host, placed.name, payload)


def _place(transport: Transport, host: Host, name: str, payload: dict[str, Any]) -> dict[str, Any]:
    txn = uuid.uuid4().hex
    holder = controller_identity() | {"txn": txn, "started": time.time(), "command": "tune"}
    # Registered as running, so that the deploy lock it holds for one step is never taken
    # for an abandoned one by another thread of this process.
    with active_run(txn):
        try:
            return run_step(transport, host.python, "place", {"name": name, "txn": txn, "holder": holder, **payload})
        except RemoteRefusal as exc:
            if exc.kind == "locked":
                raise LockError(f"a deploy holds the host ({exc.message}); try again when it is done",
                                host=transport.host) from exc
            raise PatchError(exc.message, host=transport.host) from exc


__all__ = ["POLICY_FILE", "PlacedFile", "place_file", "restore_file"]
