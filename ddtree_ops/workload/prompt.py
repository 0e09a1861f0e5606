"""One prompt, the unit of what is sent: completion text, or chat messages for the served
model's chat template.

Prompt files (:mod:`.prompts`) and published data sets (:mod:`.datasets`) both build it;
the load clients (``ddtree_ops.bench.client``) send it. It sits in a module of its own so
that the readers and the workload drawn from them (:mod:`.draw`) all import it downwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    """One prompt: a completion prompt (``text``, sent as is) or a chat prompt
    (``messages``), which is only ever sent through the served model's chat template: as
    messages on the OpenAI chat route, or, for ``/generate``, as the ``input_ids`` that
    the server's ``/v1/tokenize`` renders them to (``input_ids``, filled per launch by the
    runner). A chat prompt's ``text`` is a plain transcript, kept for the workload hash
    and for display, never sent.

    ``dataset`` and ``category`` say where it came from (``gsm8k``; MATH-500's subject);
    ``followups`` are the later turns of a multi-turn question (chat only): the load
    client sends each once the model has answered the turn before it."""

    text: str
    id: str = ""
    category: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    dataset: str = ""
    followups: tuple[str, ...] = ()
    input_ids: tuple[int, ...] = ()

    @property
    def chat(self) -> bool:
        return bool(self.messages)

    @property
    def group(self) -> str:
        """The row breakdown's key: ``dataset/category``, or whichever of them is set."""
        return "/".join(part for part in (self.dataset, self.category) if part) or "-"


def chat_messages(messages: Sequence[tuple[str, str]]) -> list[dict[str, str]]:
    """(role, content) pairs as the chat routes and ``/v1/tokenize`` take them."""
    return [{"role": r, "content": c} for r, c in messages]
