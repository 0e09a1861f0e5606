"""Ansible host patterns: ``name[:port]`` and ranges ``node[01:08]``, ``ct200-[a:h]``, ``x[1:10:2]``.

The same rules as Ansible's ``expand_hostname_range`` (a leading zero in the start fixes
the width, which the end must share; letters range over ``a-zA-Z``; an optional step;
several ranges in one name multiply), so a pattern names exactly the hosts Ansible
would make of it. A malformed range is an error instead of a literal host name.
"""

from __future__ import annotations

import re
import string

from ddtree_ops.numbers import parse_count

# Numbers in ASCII digits (``\d`` and ``int()`` read '٣' as 3, ``isdigit()`` is true for '²',
# which ``int()`` refuses), at most 18 of them (Python refuses to read 4,301).
_PORT = re.compile(r"^(?P<host>.*[^:]):(?P<port>[0-9]{1,18})$")
_IPV6_PORT = re.compile(r"^\[(?P<host>[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*)\](?::(?P<port>[0-9]{1,18}))?$")


# One pattern naming more hosts than this is a typo (``node[1:200000]``), not a fleet:
# Ansible would build them all, and every command would then fan out to each.
MAX_HOSTS = 10_000


class RangeError(ValueError):
    """A host pattern Ansible would refuse too; the message says why."""


def split_port(pattern: str) -> tuple[str, int | None]:
    """``host:22`` -> ("host", 22); a bare IPv6 address keeps its colons; ``[v6]:22`` works."""
    pattern = pattern.strip()
    v6 = _IPV6_PORT.match(pattern)
    if v6 and not _looks_like_range(v6.group("host")):
        port = v6.group("port")
        return v6.group("host"), int(port) if port else None
    outside = _outside_brackets(pattern)
    if outside.count(":") == 1:
        m = _PORT.match(pattern)
        if m and ":" not in _outside_brackets(m.group("host")):
            return m.group("host"), int(m.group("port"))
    if outside.endswith(":"):
        raise RangeError(f"invalid host pattern {pattern!r}: ending in ':' is reserved for a port")
    if outside.count(":") == 1:
        # Ansible would take `host:abc` as a host literally named so; it is a port typo.
        raise RangeError(f"invalid host pattern {pattern!r}: the port after ':' is not a number")
    return pattern, None


def expand(pattern: str) -> list[str]:
    """All host names a pattern (without port) stands for, in Ansible's order."""
    if "[" not in pattern:
        return [pattern]
    head, sep, rest = pattern.partition("[")
    body, close, tail = rest.partition("]")
    if not close:
        raise RangeError(f"host range in {pattern!r} has no closing ']'")
    bounds = body.split(":")
    if len(bounds) not in (2, 3):
        raise RangeError(f"host range [{body}] in {pattern!r} must be begin:end or begin:end:step")
    beg, end = bounds[0] or "0", bounds[1]
    step_text = bounds[2] if len(bounds) == 3 else "1"
    if not end:
        raise RangeError(f"host range [{body}] in {pattern!r} must specify an end value")
    step = parse_count(step_text)
    if step is None:
        raise RangeError(f"host range [{body}] in {pattern!r}: step {step_text!r} is not an integer")
    if step < 1:
        raise RangeError(f"host range [{body}] in {pattern!r}: step must be at least 1")
    width = 0
    if beg[0] == "0" and len(beg) > 1:
        width = len(beg)
        if width != len(end):
            raise RangeError(f"host range [{body}] in {pattern!r} must have equal-length begin and end")
    seq: list[str]
    first, last = parse_count(beg), parse_count(end)
    if first is not None and last is not None:
        if first > last:
            raise RangeError(f"host range [{body}] in {pattern!r} must have begin <= end")
        if (last - first) // step + 1 > MAX_HOSTS:
            raise RangeError(f"host range [{body}] in {pattern!r} names more than {MAX_HOSTS} hosts")
    if beg in string.ascii_letters and end in string.ascii_letters:
        i_beg, i_end = string.ascii_letters.index(beg), string.ascii_letters.index(end)
        if i_beg > i_end:
            raise RangeError(f"host range [{body}] in {pattern!r} must have begin <= end")
        seq = list(string.ascii_letters[i_beg : i_end + 1 : step])
    elif first is not None and last is not None:
        seq = [str(i).zfill(width) for i in range(first, last + 1, step)]
    else:
        raise RangeError(f"host range [{body}] in {pattern!r} is neither numeric nor alphabetic")
    names: list[str] = []
    for item in seq:
        names.extend(expand(f"{head}{item}{tail}"))
        if len(names) > MAX_HOSTS:
            raise RangeError(f"host pattern {pattern!r} names more than {MAX_HOSTS} hosts")
    return names


def expand_pattern(pattern: str) -> tuple[list[str], int | None]:
    """``node[01:03]:2222`` -> (["node01", "node02", "node03"], 2222)."""
    host, port = split_port(pattern)
    return expand(host), port


def _outside_brackets(text: str) -> str:
    depth, out = 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def _looks_like_range(inner: str) -> bool:
    parts = inner.split(":")
    return len(parts) in (2, 3) and parts[1] != "" and all(p.isalnum() or p == "" for p in parts)
