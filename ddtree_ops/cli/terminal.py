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

Words are data too: a host name, a path, a launch key must be read whole at any terminal
width. :class:`WordText` (every string the consoles render, every table cell) wraps at
spaces and breaks a word too long for its line only after a ``/`` or a ``,``, where rich
folds it at the edge (``si│m-ct200``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from rich.cells import cell_len, chop_cells
from rich.console import Console, ConsoleOptions, JustifyMethod, OverflowMethod, RenderableType
from rich.containers import Lines
from rich.measure import Measurement
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
    return WordText.of(out) if isinstance(text, WordText) else out


# Where a word too long for its line may still break: after a path's "/" and a list's ",",
# where a reader expects it to go on. Never inside a name or a number: rich folds a long
# word at the column's edge ("si│m-ct200", "6│4-topk8").
_BREAK_AFTER = "/,"
_WORD = re.compile(r"\s*\S+\s*")


def word_pieces(word: str) -> list[str]:
    """``word`` cut after each of its break points: ``"a/b,c"`` -> ``["a/", "b,", "c"]``."""
    pieces: list[str] = []
    start = 0
    for i, char in enumerate(word):
        if char in _BREAK_AFTER:
            pieces.append(word[start : i + 1])
            start = i + 1
    if start < len(word):
        pieces.append(word[start:])
    return pieces


def longest_piece(text: str) -> int:
    """The widest part of ``text`` that no line break may cut (:func:`word_pieces` of each word)."""
    return max((cell_len(p) for w in text.split() for p in word_pieces(w)), default=0)


def _cut(word: str, width: int) -> int:
    """Where the first line of a word wider than ``width`` ends: after its last break point
    that fits, else (one piece wider than the line: nothing else can be done) at the edge."""
    fits = len(chop_cells(word, width)[0])
    at = max((i + 1 for i, char in enumerate(word[:fits]) if char in _BREAK_AFTER), default=0)
    return at or fits


def divide_words(text: str, width: int) -> list[int]:
    """Offsets at which ``text`` breaks into lines of at most ``width`` cells: at spaces, and a
    word wider than a line from a new line, after its break points (:data:`_BREAK_AFTER`)."""
    breaks: list[int] = []
    offset = 0
    for match in _WORD.finditer(text):
        start, word = match.start(), match.group()
        length = cell_len(word.rstrip())
        if offset + length <= width:
            offset += cell_len(word)
            continue
        if offset and start:
            breaks.append(start)
        if length <= width:
            offset = cell_len(word)
            continue
        while cell_len(word.rstrip()) > width:
            cut = _cut(word, width)
            start += cut
            word = word[cut:]
            breaks.append(start)
        offset = cell_len(word)
    return breaks


class WordText(Text):
    """Text that wraps at spaces and breaks a word too wide for its line only after a "/" or
    a "," (a path, a list): the words of a table's data stay whole at any width they fit."""

    @classmethod
    def of(cls, text: Text | str) -> WordText:
        """``text`` (its styles kept) as a :class:`WordText`; a ``str`` is plain text, not markup."""
        if isinstance(text, str):
            return cls(text)
        out = cls(text.plain, style=text.style, justify=text.justify, overflow=text.overflow,
                  no_wrap=text.no_wrap, end=text.end, tab_size=text.tab_size)
        out.spans = list(text.spans)
        return out

    def wrap(
        self, console: Console, width: int, *, justify: JustifyMethod | None = None,
        overflow: OverflowMethod | None = None, tab_size: int = 8, no_wrap: bool | None = None,
    ) -> Lines:
        if overflow == "ignore" or (self.no_wrap if no_wrap is None else no_wrap):
            return super().wrap(console, width, justify=justify, overflow=overflow, tab_size=tab_size,
                                no_wrap=no_wrap)
        how_justify = justify or self.justify or "default"
        how_overflow = overflow or self.overflow or "fold"
        lines = Lines()
        for line in self.split(allow_blank=True):
            if "\t" in line.plain:
                line.expand_tabs(tab_size)
            pieces = line.divide(divide_words(line.plain, width))
            for piece in pieces:
                piece.rstrip_end(width)
            pieces.justify(console, width, justify=how_justify, overflow=how_overflow)
            for piece in pieces:
                piece.truncate(width, overflow=how_overflow)
            lines.extend(pieces)
        return lines

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        # A table may narrow the column down to the widest unbreakable piece, not the widest word.
        full = super().__rich_measure__(console, options)
        return Measurement(min(full.minimum, longest_piece(self.plain)), full.maximum)


class SafeConsole(Console):
    """A rich Console (no emoji codes) whose rendered text never carries a control character,
    and whose words are never cut at the edge of a terminal: a string is a :class:`WordText`,
    and a line printed with ``soft_wrap`` (one line whatever its length: piped, it stays one
    line to read or grep) is wrapped at its words on a terminal, which would fold it mid-word."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("emoji", False)
        super().__init__(**kwargs)

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return WordText.of(super().render_str(escape_controls(text), **kwargs))

    def print(self, *objects: Any, soft_wrap: bool | None = None, **kwargs: Any) -> None:
        if soft_wrap and self.is_terminal and not kwargs.get("no_wrap"):
            soft_wrap = False
        super().print(*objects, soft_wrap=soft_wrap, **kwargs)

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> Iterable[Segment]:
        if isinstance(renderable, Text):
            # Every Text, a table's cell or a printed line (an error naming a path): words whole.
            renderable = WordText.of(escape_text(renderable))
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
