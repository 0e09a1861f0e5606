"""The translation table and translate_errors, without any server: pure unit tests."""

from __future__ import annotations

import socket
from typing import Any

import paramiko
import pytest

from ddtree_ops.errors import (
    AuthError,
    ConnectError,
    HostKeyError,
    RemoteFileError,
    TransportError,
)
from ddtree_ops.transport.translate import (
    Message,
    most_specific,
    strerror_or_text,
    table_entry,
    text_or_type,
    translate_errors,
    translation_table,
)


def translated(foreign: BaseException, **context: Any) -> BaseException:
    """What ``translate_errors(**context)`` raises for ``foreign`` (``host`` and ``doing`` default)."""
    context.setdefault("host", "h1")
    context.setdefault("doing", "doing it")
    try:
        with translate_errors(**context):
            raise foreign
    except BaseException as exc:  # noqa: BLE001 - the point is to see whatever comes out
        return exc
    raise AssertionError("unreachable")


class _Key:
    """Just enough of a PKey for BadHostKeyException's constructor."""

    def __init__(self, name: str) -> None:
        self.name = name

    def get_base64(self) -> str:
        return self.name

    def get_name(self) -> str:
        return "ssh-ed25519"


# Every foreign exception a transport meets, and the class it becomes; None: the operation's own.
FOREIGN: list[tuple[BaseException, type[TransportError] | None]] = [
    (paramiko.BadHostKeyException("h", _Key("new"), _Key("old")), HostKeyError),  # type: ignore[arg-type]
    (paramiko.AuthenticationException("Authentication failed."), AuthError),
    (paramiko.PasswordRequiredException("Private key file is encrypted"), AuthError),
    (paramiko.BadAuthenticationType("Bad authentication type", ["password"]), AuthError),
    (paramiko.ChannelException(2, "Connect failed"), None),
    (paramiko.SSHException("Error reading SSH protocol banner"), None),
    (paramiko.ssh_exception.NoValidConnectionsError({("127.0.0.1", 22): OSError(111, "refused")}), None),
    (EOFError(), None),
    (socket.gaierror(-2, "Name or service not known"), None),
    (ConnectionRefusedError(111, "Connection refused"), None),
    (TimeoutError("timed out"), None),
    (FileNotFoundError(2, "No such file"), None),
    (PermissionError(13, "Permission denied"), None),
    (OSError(5, "Input/output error"), None),
]


@pytest.mark.parametrize("operation", [ConnectError, RemoteFileError, HostKeyError])
@pytest.mark.parametrize(("foreign", "expected"), FOREIGN, ids=lambda v: type(v).__name__)
def test_every_foreign_type_we_meet_becomes_its_class(
    foreign: BaseException, expected: type[TransportError] | None, operation: type[TransportError]
) -> None:
    ours = translated(foreign, error=operation)
    assert type(ours) is (expected or operation)
    assert isinstance(ours, TransportError) and ours.__cause__ is foreign
    assert ours.host == "h1" and str(ours).startswith("h1: doing it: ")
    assert "\n" not in str(ours)


def test_no_table_entry_is_shadowed_or_redundant() -> None:
    table = translation_table()
    entries = list(table)
    for i, entry in enumerate(entries):
        # As except clauses, in this order: no earlier entry catches a later one.
        assert not any(issubclass(entry, earlier) for earlier in entries[:i]), entry
        # The lookup reaches every entry, and an entry that only repeats what its nearest
        # listed base says would be dead weight.
        assert most_specific(entry, table) is entry
        base = next((cls for cls in entry.__mro__[1:] if cls in table), None)
        assert base is None or table[base] is not table[entry], (entry, base)


def test_password_required_is_an_auth_error_with_the_calls_passphrase_message() -> None:
    # PasswordRequiredException subclasses AuthenticationException: an except clause for it
    # after AuthenticationException never ran. Lookup by MRO picks the nearest message.
    messages: dict[type[BaseException], Message] = {
        paramiko.AuthenticationException: lambda exc: f"authentication failed: {exc}",
        paramiko.PasswordRequiredException: "private key is encrypted and no passphrase is available",
    }
    cases = {
        paramiko.PasswordRequiredException("Private key file is encrypted"): (
            "h1: private key is encrypted and no passphrase is available"
        ),
        paramiko.AuthenticationException("Authentication failed."): "h1: authentication failed: Authentication failed.",
    }
    for foreign, text in cases.items():
        ours = translated(foreign, doing="SSH handshake failed", error=ConnectError, messages=messages)
        assert type(ours) is AuthError and str(ours) == text


def test_the_nearest_message_wins_and_the_rest_get_the_default() -> None:
    messages: dict[type[BaseException], Message] = {
        OSError: lambda exc: f"os: {strerror_or_text(exc)}",
        ConnectionRefusedError: "refused",
    }

    def message(exc: BaseException) -> str:
        return str(translated(exc, host=None, doing="connecting", error=ConnectError, messages=messages))

    assert message(ConnectionRefusedError(111, "Connection refused")) == "refused"
    assert message(TimeoutError("timed out")) == "os: timed out"
    assert message(paramiko.SSHException("bad banner")) == "connecting: bad banner"
    assert message(EOFError()) == "connecting: EOFError"


@pytest.mark.parametrize(
    "unknown",
    [ValueError("not ours"), KeyError("k"), RuntimeError("bug"), KeyboardInterrupt(), ConnectError("ours", host="h1")],
    ids=lambda e: type(e).__name__,
)
def test_unknown_and_own_exceptions_pass_through_untouched(unknown: BaseException) -> None:
    cleaned: list[BaseException] = []
    assert table_entry(type(unknown)) is None
    assert translated(unknown, error=ConnectError, on_error=cleaned.append) is unknown
    assert cleaned == []


def test_translate_errors_raises_from_the_foreign_exception_after_cleanup() -> None:
    cleaned: list[BaseException] = []
    foreign = PermissionError(13, "Permission denied")
    ours = translated(
        foreign, doing="cannot write /x", error=RemoteFileError, reason=strerror_or_text, on_error=cleaned.append
    )
    assert type(ours) is RemoteFileError and str(ours) == "h1: cannot write /x: Permission denied"
    assert ours.__cause__ is foreign and ours.exit_code == 3
    assert cleaned == [foreign]


def test_also_translates_further_types_for_one_call_only() -> None:
    bad = ValueError("No closing quotation")
    assert translated(bad, error=ConnectError) is bad
    ours = translated(bad, doing="cannot read cfg", error=ConnectError, also=(ValueError,))
    assert type(ours) is ConnectError and str(ours) == "h1: cannot read cfg: No closing quotation"


def test_reason_helpers() -> None:
    assert text_or_type(EOFError()) == "EOFError"
    assert text_or_type(paramiko.SSHException("x")) == "x"
    assert strerror_or_text(ConnectionRefusedError(111, "Connection refused")) == "Connection refused"
    assert strerror_or_text(OSError("no errno")) == "no errno"
    assert strerror_or_text(EOFError()) == "EOFError"
