"""One exception tree for ddtree-ops, with one exit code per class.

Only the CLI layer catches :class:`DdtreeOpsError`; it prints ``str(exc)`` on one line
(under ``--json`` also the envelope, with ``exc.code``) and exits with ``exc.exit_code``.
Everything else raises these (foreign exceptions are translated once, at the boundary
where they occur: transports, config loaders, HTTP).

    DdtreeOpsError                      exit 1
    ├── ConfigError                     exit 2   bad inventory / sweep / bundle / CLI input
    │   ├── InventoryError
    │   ├── TargetError                 unknown host or group on the command line
    │   ├── BundleError                 invalid patch bundle (manifest, paths, sources)
    │   └── SweepError                  invalid sweep file or prompt file
    ├── TransportError                  exit 3   talking to a host failed
    │   ├── ConnectError                refused, unreachable, timed out, DNS
    │   ├── AuthError                   key or password rejected
    │   ├── HostKeyError                unknown or changed host key
    │   ├── CommandTimeout              a remote command outlived its timeout
    │   ├── CommandFailed               non-zero exit (returncode, command, stderr tail)
    │   └── RemoteFileError             read/write/rename of a remote file failed
    ├── PatchError                      exit 4   deploy / rollback refused or failed
    │   ├── UnsupportedVersion
    │   ├── DriftError                  target file is neither original nor patched
    │   ├── LockError                   another deploy holds the host lock
    │   ├── VerifyError                 post-apply verification failed (rolled back)
    │   └── CanaryRejected              the patched canary failed its gate (rolled back)
    ├── ServiceError                    exit 5   start / stop / readiness
    │   ├── ReadinessTimeout
    │   ├── ServerCrashed
    │   ├── PortBusy
    │   ├── LeaseHeld                   a running sweep holds the host (its lease)
    │   ├── UnitRefused                 the systemd unit cannot be driven (nothing changed)
    │   └── CanaryFailed                the restarted canary failed its gate (rolled back)
    ├── BenchError                      exit 6
    └── FleetError                      exit 7   at least one host failed in a fan-out; when
                                                 every failed host's error has the same exit
                                                 code, that one (all unreachable: 3)

``Interrupted`` (exit 130) is raised when the user presses Ctrl-C during a wait.

Each class has a stable ``code`` (``config``, ``target``, ``connect``, ``drift``, ...),
the name scripts see in the ``--json`` envelope; :func:`error_code` gives it for any
exception (``internal`` for one that is not ours).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType


class DdtreeOpsError(Exception):
    """Root of every error ddtree-ops raises on purpose.

    ``code`` is the class's stable name for scripts (the ``--json`` envelope's
    ``errors[].code``); every class in this module has its own.
    """

    code: str = "error"
    exit_code: int = 1
    # The per-host errors behind this one, when it ends a fan-out (FleetError, Interrupted).
    failures: Mapping[str, BaseException] = MappingProxyType({})

    def __init__(self, message: str = "", *, host: str | None = None) -> None:
        self.message = message
        self.host = host
        super().__init__(message)

    def __str__(self) -> str:
        if self.host and not self.message.startswith(f"{self.host}:"):
            return f"{self.host}: {self.message}"
        return self.message


class ConfigError(DdtreeOpsError):
    code = "config"
    exit_code = 2


class InventoryError(ConfigError):
    code = "inventory"


class TargetError(ConfigError):
    code = "target"


class BundleError(ConfigError):
    code = "bundle"


class SweepError(ConfigError):
    code = "sweep"


class TransportError(DdtreeOpsError):
    code = "transport"
    exit_code = 3


class ConnectError(TransportError):
    code = "connect"


class AuthError(TransportError):
    code = "auth"


class HostKeyError(TransportError):
    code = "host_key"


class CommandTimeout(TransportError):
    code = "command_timeout"

    def __init__(self, message: str = "", *, host: str | None = None, timeout: float | None = None) -> None:
        super().__init__(message, host=host)
        self.timeout = timeout


class CommandFailed(TransportError):
    """A command exited non-zero. Carries what a person needs to act on it."""

    code = "command_failed"

    def __init__(
        self,
        returncode: int,
        command: Sequence[str] | str,
        stderr: str = "",
        *,
        host: str | None = None,
        detail: str = "",
    ) -> None:
        self.returncode = returncode
        self.command = command
        self.stderr = stderr
        cmd = command if isinstance(command, str) else " ".join(command)
        tail = stderr_tail(stderr)
        msg = detail or f"command failed with exit code {returncode}: {cmd[:200]}"
        if tail:
            msg += f" — {tail}"
        super().__init__(msg, host=host)


class RemoteFileError(TransportError):
    code = "remote_file"


class PatchError(DdtreeOpsError):
    code = "patch"
    exit_code = 4


class UnsupportedVersion(PatchError):
    code = "unsupported_version"


class DriftError(PatchError):
    code = "drift"


class LockError(PatchError):
    code = "lock"


class VerifyError(PatchError):
    code = "verify"


class NotDeployed(PatchError):
    """A DDTREE launch on a host whose SGLang has no DDTree plugin (never deployed, rolled
    back, or left out by SGLANG_PLUGINS): refused before anything there is stopped."""

    code = "not_deployed"


class CanaryRejected(PatchError):
    """A rollout's canary, patched and restarted, failed its gate: it was put back, and no
    other host was touched (``deploy``/``tune --deploy`` with ``--canary``)."""

    code = "canary_rejected"


class ServiceError(DdtreeOpsError):
    code = "service"
    exit_code = 5


class ReadinessTimeout(ServiceError):
    code = "readiness_timeout"


class ServerCrashed(ServiceError):
    code = "server_crashed"


class PortBusy(ServiceError):
    code = "port_busy"


class LeaseHeld(ServiceError):
    """A sweep holds the host from when it reaches it to its end; restarting or stopping
    its server meanwhile would spoil its measurements."""

    code = "lease_held"


class UnitRefused(ServiceError):
    """The host's systemd unit cannot be driven (not found, masked, a user unit, not an
    SGLang launch, no permission); refused before anything on the host changed."""

    code = "unit_refused"


class CanaryFailed(ServiceError):
    """A rollout's canary, restarted, failed its gate: it was put back, and no other host
    was touched (``restart``/``rollback --restart`` with ``--canary``)."""

    code = "canary_failed"


class BenchError(DdtreeOpsError):
    code = "bench"
    exit_code = 6


class FleetError(DdtreeOpsError):
    """Raised by the CLI after rendering a fan-out in which some hosts failed.

    Like fabric's ``GroupException(result)``: it carries the whole fan-out
    (``result``, a :class:`ddtree_ops.fleet.FleetResult`) and each failed host's error
    (``failures``: the result's exceptions, plus any failure a host's value carried
    itself), so a caller (the ``--json`` envelope) reads them instead of re-deriving them.

    Its ``exit_code`` is the failed hosts' own when they all share one (every host
    unreachable exits 3, as README "Exit codes" promises), 7 only for a mix; ``code``
    stays ``fleet`` either way.
    """

    code = "fleet"
    exit_code = 7

    def __init__(
        self,
        message: str = "",
        *,
        result: Mapping[str, object] | None = None,
        failures: Mapping[str, BaseException] | None = None,
    ) -> None:
        super().__init__(message)
        self.result = result
        if failures is None:
            failed = getattr(result, "failed", None)
            failures = failed if failed is not None else {}
        self.failures = MappingProxyType(dict(failures))
        self.exit_code = shared_exit_code(self.failures.values(), default=FleetError.exit_code)


class Interrupted(DdtreeOpsError):
    code = "interrupted"
    exit_code = 130

    def __init__(
        self, message: str = "", *, host: str | None = None, failures: Mapping[str, BaseException] | None = None
    ) -> None:
        super().__init__(message, host=host)
        self.failures = MappingProxyType(dict(failures or {}))


def error_code(exc: BaseException) -> str:
    """The stable code of ``exc``: its class's ``code``, ``internal`` for an exception that
    is not ours (a bug, kept as a host's value by the fan-out)."""
    if isinstance(exc, DdtreeOpsError):
        return exc.code
    if isinstance(exc, KeyboardInterrupt):
        return Interrupted.code
    return "internal"


def shared_exit_code(errors: Iterable[BaseException], *, default: int) -> int:
    """The exit code every one of ``errors`` has, ``default`` when they differ (or one is
    not ours): all hosts unreachable exits 3 like one unreachable host, a mix exits 7."""
    codes = {exc.exit_code if isinstance(exc, DdtreeOpsError) else None for exc in errors}
    if len(codes) == 1:
        (code,) = codes
        if code is not None:
            return code
    return default


def recorded_error(type_name: str | None, message: str, *, host: str | None = None) -> DdtreeOpsError:
    """An error that was kept as data (a probe's ``error_type`` and ``error``) as an
    exception again, with the code and exit code of our class called ``type_name``
    (the root's when no class of ours has that name). Its message is the recorded one."""
    exc = DdtreeOpsError(message, host=host)
    todo: list[type[DdtreeOpsError]] = [DdtreeOpsError]
    while todo:
        cls = todo.pop()
        if cls.__name__ == type_name:
            exc.code, exc.exit_code = cls.code, cls.exit_code
            break
        todo.extend(cls.__subclasses__())
    return exc


def stderr_tail(text: str, *, lines: int = 3, limit: int = 400) -> str:
    """Last non-empty lines of a command's stderr, joined on one line."""
    kept = [ln.strip() for ln in text.strip().splitlines() if ln.strip()][-lines:]
    joined = " | ".join(kept)
    return joined[-limit:]
