"""One exception tree for ddtree-ops, with one exit code per class.

Only the CLI layer catches :class:`DdtreeOpsError`; it prints ``str(exc)`` on one line
and exits with ``exc.exit_code``. Everything else raises these (foreign exceptions are
translated once, at the boundary where they occur: transports, config loaders, HTTP).

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
    │   └── VerifyError                 post-apply verification failed (rolled back)
    ├── ServiceError                    exit 5   start / stop / readiness
    │   ├── ReadinessTimeout
    │   ├── ServerCrashed
    │   └── PortBusy
    ├── BenchError                      exit 6
    └── FleetError                      exit 7   at least one host failed in a fan-out

``Interrupted`` (exit 130) is raised when the user presses Ctrl-C during a wait.
"""

from __future__ import annotations

from collections.abc import Sequence


class DdtreeOpsError(Exception):
    """Root of every error ddtree-ops raises on purpose."""

    exit_code: int = 1

    def __init__(self, message: str = "", *, host: str | None = None) -> None:
        self.message = message
        self.host = host
        super().__init__(message)

    def __str__(self) -> str:
        if self.host and not self.message.startswith(f"{self.host}:"):
            return f"{self.host}: {self.message}"
        return self.message


class ConfigError(DdtreeOpsError):
    exit_code = 2


class InventoryError(ConfigError):
    pass


class TargetError(ConfigError):
    pass


class BundleError(ConfigError):
    pass


class SweepError(ConfigError):
    pass


class TransportError(DdtreeOpsError):
    exit_code = 3


class ConnectError(TransportError):
    pass


class AuthError(TransportError):
    pass


class HostKeyError(TransportError):
    pass


class CommandTimeout(TransportError):
    def __init__(self, message: str = "", *, host: str | None = None, timeout: float | None = None) -> None:
        super().__init__(message, host=host)
        self.timeout = timeout


class CommandFailed(TransportError):
    """A command exited non-zero. Carries what a person needs to act on it."""

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
    pass


class PatchError(DdtreeOpsError):
    exit_code = 4


class UnsupportedVersion(PatchError):
    pass


class DriftError(PatchError):
    pass


class LockError(PatchError):
    pass


class VerifyError(PatchError):
    pass


class ServiceError(DdtreeOpsError):
    exit_code = 5


class ReadinessTimeout(ServiceError):
    pass


class ServerCrashed(ServiceError):
    pass


class PortBusy(ServiceError):
    pass


class BenchError(DdtreeOpsError):
    exit_code = 6


class FleetError(DdtreeOpsError):
    """Raised by the CLI after rendering a fan-out in which some hosts failed."""

    exit_code = 7


class Interrupted(DdtreeOpsError):
    exit_code = 130


def stderr_tail(text: str, *, lines: int = 3, limit: int = 400) -> str:
    """Last non-empty lines of a command's stderr, joined on one line."""
    kept = [ln.strip() for ln in text.strip().splitlines() if ln.strip()][-lines:]
    joined = " | ".join(kept)
    return joined[-limit:]
