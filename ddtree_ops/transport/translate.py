"""Foreign exceptions become ours here: one table, one context manager, for every transport.

As httpx's ``map_httpcore_exceptions`` does for httpcore: each transport method wraps
what it does in :func:`translate_errors`, naming the host, what it was doing (the head
of the message) and the class a failure means there — ConnectError while connecting or
running a command, RemoteFileError for a file, HostKeyError while reading known_hosts.

The table (:func:`translation_table`) says which foreign exceptions are transport
failures at all, and which of them mean the same specific thing wherever they occur (a
rejected key is an AuthError whatever was being done). The entry for the nearest class
in the exception's MRO wins, as ``except`` clauses ordered subclass-first would, so no
entry can shadow another and the order of the entries does not matter. A call may give
its own message for some foreign types (looked up the same way) and a cleanup to run
before raising (drop a dead connection, remove a temp file), written once per operation.

Exceptions of our own tree, KeyboardInterrupt and anything the table does not know pass
through untouched: an unexpected error keeps its traceback instead of being disguised.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType

from ddtree_ops.errors import AuthError, HostKeyError, TransportError

#: A call's own message for a foreign type: fixed text, or built from the exception.
Message = str | Callable[[BaseException], str]


def text_or_type(exc: BaseException) -> str:
    """``str(exc)``, or the type's name when that is empty (``EOFError()``)."""
    return str(exc) or type(exc).__name__


def strerror_or_text(exc: BaseException) -> str:
    """An OSError's bare reason ("Connection refused", without ``[Errno N]``), else :func:`text_or_type`."""
    return getattr(exc, "strerror", None) or text_or_type(exc)


@functools.cache
def translation_table() -> Mapping[type[BaseException], type[TransportError] | None]:
    """Foreign exception type -> the class it becomes; ``None``: the failing operation's
    own class (``error=`` of :func:`translate_errors`), since what an OSError or a
    dropped SSH session means depends on what was being done.

    Subclasses inherit their nearest base's entry, so a type is listed only where its
    class differs from its base's (tests check that no entry is shadowed or redundant);
    finer distinctions (refused, timed out, passphrase needed) are messages, given per call.

    Built on first use, not at import: the local transport shares the table, and a run
    that only touches local hosts never loads paramiko.
    """
    import paramiko

    return MappingProxyType(
        {
            paramiko.BadHostKeyException: HostKeyError,  # a known host now shows another key
            # every key rejected; also its subclasses PasswordRequiredException (an encrypted
            # key, no passphrase) and BadAuthenticationType (the server wants a password)
            paramiko.AuthenticationException: AuthError,
            paramiko.SSHException: None,  # protocol failure, channel refused, session dropped
            EOFError: None,  # paramiko: the peer closed the connection mid-message
            OSError: None,  # sockets (refused, timed out, DNS), SFTP status replies, local files
        }
    )


def most_specific(
    exc_type: type[BaseException], candidates: Iterable[type[BaseException]]
) -> type[BaseException] | None:
    """The candidate nearest to ``exc_type`` in its MRO (``exc_type`` itself first), or None."""
    keys = set(candidates)
    return next((cls for cls in exc_type.__mro__ if cls in keys), None)


def table_entry(
    exc_type: type[BaseException], also: tuple[type[BaseException], ...] = ()
) -> type[BaseException] | None:
    """The table key (or ``also`` type) that decides what ``exc_type`` becomes; None when
    it is not a foreign failure we know (ours, KeyboardInterrupt, a bug) and passes through."""
    return most_specific(exc_type, [*translation_table(), *also])


@contextmanager
def translate_errors(
    host: str | None,
    doing: str,
    *,
    error: type[TransportError],
    reason: Callable[[BaseException], str] = text_or_type,
    messages: Mapping[type[BaseException], Message] | None = None,
    also: tuple[type[BaseException], ...] = (),
    on_error: Callable[[BaseException], object] | None = None,
) -> Iterator[None]:
    """Raise our exception ``from`` any foreign failure in the block (see the module docstring).

    ``error`` is what a failure means here, for the table's ``None`` entries. The message
    is the call's own for the nearest type in ``messages``, else ``"{doing}: {reason(exc)}"``.
    ``also`` names further foreign types that mean ``error`` for this call only (e.g.
    ValueError from a config parser). ``on_error`` runs before raising, only for a failure
    being translated (drop a dead connection, remove a temp file); it gets the foreign one.
    """
    try:
        yield
    except BaseException as exc:
        key = table_entry(type(exc), also)
        if key is None:
            raise
        own = most_specific(type(exc), messages or {})
        if own is None or messages is None:
            text = f"{doing}: {reason(exc)}"
        else:
            message = messages[own]
            text = message if isinstance(message, str) else message(exc)
        if on_error is not None:
            on_error(exc)
        raise (translation_table().get(key) or error)(text, host=host) from exc
