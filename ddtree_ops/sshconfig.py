"""The one ssh_config reader: OpenSSH's ``Include`` expanded, then paramiko's parser.

paramiko's ``SSHConfig`` parses Host/Match blocks and answers lookups the way OpenSSH
does, but it does not implement ``Include`` (it stores it as an unknown option). This
module expands every ``Include`` into one text, as ssh_config(5) describes, and hands
that text to ``paramiko.SSHConfig.from_text``; the transport (HostName, User, Port,
IdentityFile, ProxyJump) and the inventory (which names are ssh aliases) both read
through it, so both see the same configuration.

What ``Include`` does here, as OpenSSH does it:

- each argument is a path; several on one line are read in order; ``~`` and ``${VAR}``
  are expanded, as are the tokens ``%d`` (home), ``%u`` (local user) and ``%%``;
- a relative path is relative to ``~/.ssh`` (the user configuration's directory), for
  nested includes too — not to the including file's directory;
- glob wildcards match files in sorted order; a pattern that matches nothing, or a
  file that does not exist, is skipped silently (OpenSSH only logs it at debug level);
- an ``Include`` inside a ``Host``/``Match`` block applies within that block: the
  included lines count only for hosts that block matches, a ``Host``/``Match`` inside the
  included file narrows that block further (both must match), and the including file's
  block resumes after the include;
- includes nest up to 16 deep (OpenSSH's READCONF_MAX_DEPTH); a file that includes
  itself, directly or not, is a ConfigError naming the chain (OpenSSH fails on it too,
  with "too many recursive includes").

How a block inside a block is written for paramiko: a ``Host`` pattern list becomes a
``Match originalhost`` criterion (the same patterns, negation included, matched against
the name as given), and the criteria of the enclosing and the included block are joined
in one ``Match`` line, which paramiko, like OpenSSH, requires all to hold. A ``Match all``
joined with other criteria is dropped (it always holds).

What is not honoured (documented rather than guessed): tokens that depend on the target
(``%h``, ``%r``, ``%p``, ``%C``, ...) in an Include path are refused with a ConfigError,
since one expanded text serves every host. paramiko evaluates ``Match`` on ``all``,
``canonical``, ``final``, ``exec``, ``host``, ``originalhost``, ``user`` and ``localuser``
only, and would take any other criterion (``localnetwork``, ``tagged``, ...) as holding;
here a ``Match`` line with one of those never applies, so that options meant for another
network are not used blindly. ``Match exec`` runs its command, as ssh does (paramiko needs
the ``invoke`` package for it); a lookup that paramiko cannot complete is a ConfigError.
"""

from __future__ import annotations

import fnmatch
import getpass
import glob
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddtree_ops.errors import ConfigError

if TYPE_CHECKING:
    import paramiko

# paramiko is imported where a config is parsed or looked up, not here: the inventory
# imports this module on every CLI start, and paramiko's import (~80 ms) is wasted on
# commands and hosts that never read an ssh_config.

MAX_INCLUDE_DEPTH = 16  # OpenSSH's READCONF_MAX_DEPTH
# paramiko's own line syntax (SSHConfig.SETTINGS_REGEX): `Key value` or `Key = value`.
_LINE = re.compile(r"(\w+)(?:\s*=\s*|\s+)(.+)")
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_TOKEN = re.compile(r"%(.)")
_NO_MATCH_PARAM = ("all", "canonical", "final")
_PARAMIKO_MATCH = ("exec", "host", "originalhost", "user", "localuser")  # with an argument


def user_ssh_config_path() -> Path:
    return Path("~/.ssh/config").expanduser()


# One criterion of a block's condition: ("host", patterns) for a `Host` line, or
# ("match", tokens) for a `Match` line (its criteria as shlex tokens).
_Criterion = tuple[str, tuple[str, ...]]
_Condition = tuple[_Criterion, ...]


@dataclass
class _Expansion:
    lines: list[str] = field(default_factory=list)
    host_lines: list[tuple[tuple[str, ...], ...]] = field(default_factory=list)  # see SshConfig.host_patterns
    files: list[Path] = field(default_factory=list)
    emitted: _Condition | None = None

    def header(self, condition: _Condition) -> None:
        if condition != self.emitted:
            self.lines.append(_render(condition))
            self.emitted = condition


@dataclass(frozen=True)
class SshConfig:
    """A parsed ssh_config, its includes expanded. Empty when there is no file."""

    path: Path | None
    text: str
    # Per Host line, in order: the patterns of the Host lines it sits in (the blocks of the
    # Includes that led to it), its own last.
    host_patterns: tuple[tuple[tuple[str, ...], ...], ...]
    files: tuple[Path, ...]  # the files read: the config, then its includes in order
    _parsed: paramiko.SSHConfig = field(repr=False, compare=False)

    @classmethod
    def from_text(cls, text: str, *, source: str = "<text>", ssh_dir: Path | None = None) -> SshConfig:
        """Parse ``text`` as a user config (its relative Includes are read from ``ssh_dir``,
        default ``~/.ssh``)."""
        exp = _Expansion()
        _expand_text(text, source, exp, base=(), chain=(source,), ssh_dir=ssh_dir)
        return cls._build(None, exp)

    @classmethod
    def empty(cls) -> SshConfig:
        return cls._build(None, _Expansion())

    @classmethod
    def _build(cls, path: Path | None, exp: _Expansion) -> SshConfig:
        import paramiko

        text = "\n".join(exp.lines) + ("\n" if exp.lines else "")
        try:
            parsed = paramiko.SSHConfig.from_text(text)
        except paramiko.ssh_exception.ConfigParseError as exc:
            raise ConfigError(f"{path or 'ssh_config'}: {exc}") from None
        return cls(path, text, tuple(exp.host_lines), tuple(exp.files), parsed)

    def lookup(self, name: str) -> dict[str, Any]:
        """paramiko's lookup: lower-case keys, first value wins, ``hostname`` always set."""
        import paramiko

        try:
            return dict(self._parsed.lookup(name))
        except (ImportError, paramiko.ssh_exception.SSHException) as exc:  # Match exec without invoke; canonicalize
            raise ConfigError(f"{self.path or 'ssh_config'}: cannot look up {name!r}: {exc}") from None

    def has_alias(self, name: str) -> bool:
        """Whether ssh would know ``name`` as more than a hostname: a ``Host`` line names it
        with a pattern that is not only wildcards (and does not negate it), or a block that
        matches it sets a ``HostName`` other than the name itself."""
        for condition in self.host_patterns:
            own = condition[-1]
            named = any(not p.startswith("!") and (p.strip("*?") or p == name) and _matches(p, name) for p in own)
            if named and all(_patterns_match(pats, name) for pats in condition):
                return True
        return self.lookup(name).get("hostname", name) != name


def load_ssh_config(path: Path | None = None, *, ssh_dir: Path | None = None) -> SshConfig:
    """Read ``path`` (default ``~/.ssh/config``) with its includes; a missing file is an
    empty config. Raises ConfigError naming the file (and line) for anything unreadable,
    unparsable, cyclic or nested too deep."""
    path = path if path is not None else user_ssh_config_path()
    exp = _Expansion()
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return SshConfig.empty()
    except OSError as exc:
        raise ConfigError(f"cannot read ssh config {path}: {exc.strerror or exc}") from None
    exp.files.append(path)
    _expand_text(text, str(path), exp, base=(), chain=(_identity(path),), ssh_dir=ssh_dir)
    return SshConfig._build(path, exp)


# --------------------------------------------------------------------------- expansion


def _identity(path: Path) -> str:
    try:
        return str(path.resolve())
    except OSError:
        return str(path)


def _expand_text(
    text: str, source: str, exp: _Expansion, *, base: _Condition, chain: tuple[str, ...], ssh_dir: Path | None
) -> None:
    """Append ``text``'s lines to ``exp``, each under the condition it has in OpenSSH:
    ``base`` (the block the Include sat in) narrowed by this file's own Host/Match lines."""
    current = base
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{lineno}"
        m = _LINE.match(line)
        if not m:
            raise ConfigError(f"{where}: cannot parse ssh_config line {line!r} (expected 'Keyword value')")
        key, value = m.group(1).lower(), m.group(2).strip()
        if key == "host":
            patterns = tuple(_split(value, where))
            current = (*base, ("host", patterns))
            exp.host_lines.append(tuple(words for kind, words in current if kind == "host"))
        elif key == "match":
            tokens = tuple(_split(value, where))
            current = (*base, ("match", _evaluable(tokens, where)))
        elif key == "include":
            if len(chain) > MAX_INCLUDE_DEPTH:
                raise ConfigError(f"{where}: Include nested deeper than {MAX_INCLUDE_DEPTH} files")
            for arg in _split(value, where):
                for included in _include_paths(arg, where, ssh_dir):
                    _include(included, where, exp, base=current, chain=chain, ssh_dir=ssh_dir)
        else:
            exp.header(current)
            exp.lines.append(f"  {line}")
    # The including file's block resumes after this file (its header is re-emitted when needed).


def _include(
    path: Path, where: str, exp: _Expansion, *, base: _Condition, chain: tuple[str, ...], ssh_dir: Path | None
) -> None:
    ident = _identity(path)
    if ident in chain:
        cycle = " -> ".join((*chain[chain.index(ident):], ident))
        raise ConfigError(f"{where}: Include cycle: {cycle}")
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return
    except IsADirectoryError:
        raise ConfigError(f"{where}: Include {path} is a directory (use {path}/* for its files)") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read included {path}: {exc.strerror or exc}") from None
    exp.files.append(path)
    _expand_text(text, str(path), exp, base=base, chain=(*chain, ident), ssh_dir=ssh_dir)


def _include_paths(arg: str, where: str, ssh_dir: Path | None) -> list[Path]:
    expanded = os.path.expanduser(_expand_tokens(arg, where))
    if not os.path.isabs(expanded):
        expanded = os.path.join(ssh_dir if ssh_dir is not None else Path("~/.ssh").expanduser(), expanded)
    if glob.has_magic(expanded):
        return [Path(p) for p in sorted(glob.glob(expanded))]
    return [Path(expanded)]


def _expand_tokens(arg: str, where: str) -> str:
    def env(m: re.Match[str]) -> str:
        if m.group(1) not in os.environ:
            raise ConfigError(f"{where}: Include {arg!r}: environment variable {m.group(1)} is not set")
        return os.environ[m.group(1)]

    def token(m: re.Match[str]) -> str:
        t = m.group(1)
        if t == "%":
            return "%"
        if t == "d":
            return str(Path.home())
        if t == "u":
            return getpass.getuser()
        raise ConfigError(
            f"{where}: Include {arg!r}: token %{t} is not supported here "
            f"(one expanded config serves every host; only %d, %u, %% and ${{VAR}} are)"
        )

    return _TOKEN.sub(token, _ENV.sub(env, arg))


def _matches(pattern: str, name: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern.removeprefix("!"))


def _patterns_match(patterns: tuple[str, ...], name: str) -> bool:
    """OpenSSH's pattern-list rule (paramiko's too): a matching negated pattern refuses."""
    if any(p.startswith("!") and _matches(p, name) for p in patterns):
        return False
    return any(not p.startswith("!") and _matches(p, name) for p in patterns)


def _split(value: str, where: str) -> list[str]:
    try:
        words = shlex.split(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc} in {value!r}") from None
    if not words:
        raise ConfigError(f"{where}: missing value")
    return words


def _evaluable(tokens: tuple[str, ...], where: str) -> tuple[str, ...]:
    """A Match line's criteria, checked; one paramiko cannot evaluate becomes
    ``originalhost !*``, which no name matches (see the module docstring)."""
    out: list[str] = []
    i = 0
    while i < len(tokens):
        kind = tokens[i].lstrip("!").lower()
        i += 1
        if kind in _NO_MATCH_PARAM:
            out.append(tokens[i - 1])
            continue
        if i >= len(tokens):
            raise ConfigError(f"{where}: Match {kind!r} needs an argument")
        out.extend(tokens[i - 1:i + 1] if kind in _PARAMIKO_MATCH else ("originalhost", "!*"))
        i += 1
    return tuple(out)


def _match_criteria(tokens: tuple[str, ...], *, drop_all: bool) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(tokens):
        kind = tokens[i]
        i += 1
        if kind.lstrip("!").lower() in _NO_MATCH_PARAM:
            if not (drop_all and kind.lower() == "all"):
                out.append(kind)
            continue
        out.extend((kind, tokens[i]))
        i += 1
    return out


def _render(condition: _Condition) -> str:
    """The header line paramiko reads for a block that holds when every criterion holds."""
    if not condition:
        return "Host *"
    if len(condition) == 1:
        kind, words = condition[0]
        return f"{'Host' if kind == 'host' else 'Match'} {_join(words)}"
    criteria: list[str] = []
    for kind, words in condition:
        if kind == "host":
            criteria.extend(("originalhost", ",".join(words)))
        else:
            criteria.extend(_match_criteria(words, drop_all=True))
    return f"Match {_join(criteria)}" if criteria else "Match all"


def _join(words: tuple[str, ...] | list[str]) -> str:
    """Words as paramiko's shlex.split reads them back; quoted only where they must be."""
    return " ".join(shlex.quote(w) if not w or re.search(r"[\s'\"\\#]", w) else w for w in words)
