"""The one framing of every program ddtree-ops runs on a host with the host's Python.

The service agent, the probe, the patch steps, the selftests and the on-host benchmark
client all travel the same way (as SkyPilot's ``sky/utils/message_utils.py`` frames its
remote messages, "robust to any additional strings"):

* **in**: the program text, a NUL byte, then its payload as one JSON document, all on
  stdin; the command line is a constant bootstrap (``python -c BOOTSTRAP``), so no value
  (a token from the inventory's ``env``, a path, a prompt) is ever readable in
  ``/proc/*/cmdline``, and no payload is capped by the exec line's length over SSH;
* **out**: the program calls ``reply(obj)`` (a global the bootstrap defines) for each
  message, which writes one line ``MARKER + json``; every other byte on stdout (a
  ``sitecustomize``, a conda hook, a library's banner) is ignored.

The program sees its payload as the global ``PAYLOAD`` (the decoded JSON). Messages are
read back either all at once (:func:`messages`, :func:`last_message`) or as they arrive
(:func:`run_program`'s ``on_message``), which is how the on-host client streams one record
per finished request.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ddtree_ops.transport.base import CommandResult, Script, Transport

MARKER = "@@DDTREE-OPS@@"

# A constant: ``python -`` would read ahead past the program and take the payload for
# code, so the bootstrap reads all of stdin and splits it at the first NUL byte. The
# leading newline of a message ends whatever the host printed without one.
BOOTSTRAP = (
    "import sys,json\n"
    "d=sys.stdin.buffer.read()\n"
    "s,_,a=d.partition(b'\\0')\n"
    "def reply(o,_w=sys.stdout):\n"
    f" _w.write('\\n{MARKER}'+json.dumps(o,separators=(',',':'))+'\\n');_w.flush()\n"
    "exec(compile(s,'<ddtree-ops>','exec'),"
    "{'__name__':'__main__','PAYLOAD':json.loads(a.decode('utf-8')),'reply':reply})\n"
)

Message = dict[str, Any]


def host_program(python: str, source: str, payload: Mapping[str, Any]) -> Script:
    """``source`` run by the host's ``python`` with ``payload`` as its ``PAYLOAD``."""
    return Script(
        argv=(python, "-c", BOOTSTRAP), source=source + "\0", extra_stdin=json.dumps(payload, separators=(",", ":"))
    )


def message(line: str) -> Message | None:
    """The message one stdout line carries; None for a line that is not ours."""
    if not line.startswith(MARKER):
        return None
    try:
        value = json.loads(line[len(MARKER) :])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def messages(stdout: str) -> list[Message]:
    return [m for m in map(message, stdout.splitlines()) if m is not None]


def last_message(stdout: str) -> Message | None:
    found = messages(stdout)
    return found[-1] if found else None


@dataclass(frozen=True)
class ProgramRun:
    """One run of a host program: its last message (None: it sent none) and the command's
    result (exit code, stderr, duration) for the caller's error message."""

    reply: Message | None
    result: CommandResult


def run_program(
    transport: Transport,
    python: str,
    source: str,
    payload: Mapping[str, Any],
    *,
    timeout: float | None,
    on_message: Callable[[Message], None] | None = None,
) -> ProgramRun:
    """Run a host program (one round trip). ``on_message`` receives each message as it
    arrives, while the program still runs. Transport errors propagate; a program that
    answers nothing is the caller's to name (``reply`` None)."""
    on_line = None
    if on_message is not None:
        callback = on_message

        def on_line(line: str) -> None:
            found = message(line)
            if found is not None:
                callback(found)

    result = transport.run(host_program(python, source, payload), timeout=timeout, on_line=on_line)
    return ProgramRun(last_message(result.stdout), result)


__all__ = ["BOOTSTRAP", "MARKER", "Message", "ProgramRun", "host_program", "last_message", "message", "messages",
           "run_program"]
