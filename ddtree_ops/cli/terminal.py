"""The consoles the CLI writes through: data never drives the terminal.

Host names, paths, ledger values, error texts and prompts are data; an ANSI escape in one
of them (a ledger row that clears the screen, a host name that recolours the table) must
reach the terminal as visible text, and rich must not read ``:end:`` in an error message
as an emoji. :class:`SafeConsole` escapes control characters in every string and ``Text``
it is given (before layout, so a column is as wide as the escaped text; a ``Text``'s styled
spans move with its characters) and again in every segment it renders (after layout, before
rich adds its own styling codes: whatever else builds text on the way), so tables, progress
lines and plain prints are covered alike; rich's own control segments (cursor moves of a
live display) pass untouched. A ``Text`` that a table measures by itself (a progress
column) keeps the width of its raw characters and may show its escape cut short: never raw.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from rich.console import Console, ConsoleOptions, RenderableType
from rich.segment import Segment
from rich.text import Span, Text


def _escape(code: int) -> str:
    return ascii(chr(code))[1:-1]


# C0 controls but the newline rich lays lines out with, DEL, the C1 controls, and the
# Unicode marks that reorder what follows them (a right-to-left override makes a shown
# name read other than its bytes).
_BIDI = (0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
_TABLE = {code: _escape(code) for code in (*range(0x20), 0x7F, *range(0x80, 0xA0), *_BIDI) if code != 0x0A}


def escape_controls(text: str) -> str:
    """``text`` with every control character written as its ``\\x1b``-style escape."""
    return text.translate(_TABLE)


def _clean(text: str) -> bool:
    return text.isprintable() or not any(ord(c) in _TABLE for c in text)


def escape_text(text: Text) -> Text:
    """A copy of ``text`` with its control characters escaped, its spans moved with them."""
    if _clean(text.plain):
        return text
    starts: list[int] = []  # where each old character begins in the new text
    pieces: list[str] = []
    at = 0
    for char in text.plain:
        starts.append(at)
        piece = _TABLE.get(ord(char), char)
        pieces.append(piece)
        at += len(piece)
    starts.append(at)
    out = text.copy()
    out.plain = "".join(pieces)
    out.spans = [Span(starts[span.start], starts[span.end], span.style) for span in text.spans]
    return out


class SafeConsole(Console):
    """A rich Console (no emoji codes) whose rendered text never carries a control character."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("emoji", False)
        super().__init__(**kwargs)

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(escape_controls(text), **kwargs)

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> Iterable[Segment]:
        if isinstance(renderable, Text):
            renderable = escape_text(renderable)
        return _escaped(super().render(renderable, options))


def _escaped(segments: Iterable[Segment]) -> Iterator[Segment]:
    for segment in segments:
        if segment.control or _clean(segment.text):
            yield segment
        else:
            yield Segment(escape_controls(segment.text), segment.style, segment.control)


# The CLI's two consoles: results on stdout, errors and notices on stderr. Here, below
# every other CLI module, so that the app (cli.main) and the helpers it uses (cli.common)
# write through the same two without importing each other.
console = SafeConsole()
err_console = SafeConsole(stderr=True)
