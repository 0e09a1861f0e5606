"""Text side of the synthetic language: words <-> token ids, prompt categories, hashing.

Kept free of torch so the HTTP layer can import it before the (slow) torch import,
which the server does while it "loads weights" with the port closed.
"""

from __future__ import annotations

VOCAB = 512
EOS_TOKEN = 0
_MOD = 1 << 31

_CODE_MARKERS = ("def ", "class ", "import ", "return ", "{", "}", "();", "```", "function", "#include", "code")
_MATH_MARKERS = ("solve", "compute", "equation", "integral", "prove", "sum of", "math", "=", "+", "*")


def classify_prompt(text: str) -> str:
    """Pick a category from surface markers (documented in the sim README)."""
    lowered = text.lower()
    if any(m in lowered for m in _CODE_MARKERS):
        return "code"
    digits = sum(ch.isdigit() for ch in lowered)
    if digits >= 3 or any(m in lowered for m in _MATH_MARKERS):
        return "math"
    return "chat"


def _mix_int(x: int) -> int:
    """Scalar twin of :func:`_mix` (same constants, same result)."""
    x %= _MOD
    for mul, add in ((1103515245, 12345), (1664525, 1013904223)):
        x = (x * mul + add) % _MOD
        x ^= x >> 13
    return x


def hash_ints(*parts: int) -> int:
    """Hash a sequence of integers (request keys, words) to 31 bits."""
    acc = 0
    for part in parts:
        acc = _mix_int(acc * 31 + (int(part) % _MOD))
    return acc


_WORD_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "sh", "ch")
_WORD_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea")
_WORD_CODAS = ("", "n", "r", "s")


def _make_words() -> list[str]:
    words = ["<eos>"]
    for onset in _WORD_ONSETS:
        for vowel in _WORD_VOWELS:
            for coda in _WORD_CODAS:
                words.append(onset + vowel + coda)
    return words[:VOCAB]


WORDS: list[str] = _make_words()


def tokenize(text: str) -> list[int]:
    """Whitespace words -> ids in 1..VOCAB-1 (stable across processes, no EOS)."""
    return [hash_ints(*w.encode("utf-8")) % (VOCAB - 1) + 1 for w in text.split()]


def detokenize(ids: list[int]) -> str:
    return "".join(" " + WORDS[i % len(WORDS)] for i in ids if i != EOS_TOKEN)
