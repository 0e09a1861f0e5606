"""Jinja2 templates in the variables we use, evaluated as Ansible evaluates them.

Inventories written for Ansible say ``ansible_host: "{{ inventory_hostname }}.lab.example"``
or ``ansible_user: "{{ lookup('env', 'FLEET_USER') }}"``. Ansible evaluates such a value
when it is used, with the host's variables in scope; so do we, for the values we use
(the connection variables and ``ddtree:``, see ``build``), after precedence has picked
them. In scope: every variable of the host (a variable that is itself a template is
evaluated in turn; variables that refer to each other in a loop are an error),
``inventory_hostname``, ``inventory_hostname_short``, ``group_names``; Jinja's own
filters (``default``, ``lower``, ``replace``, ``int``, ``join``, ...: :data:`FILTERS`) and
tests; ``lookup('env', NAME)`` (``default=`` as in Ansible; an unset variable is ``""``).
Results keep their type as in ansible-core 2.19: ``"{{ 8 }}"`` is the number 8,
``"{{ 8 }}x"`` the string ``8x``.

Anything else — another lookup, Ansible's own filters (``regex_replace``, ``bool``, ...),
``hostvars``/``groups``, an undefined name, a syntax error — is refused in one line naming
the file and key where the template is written, never taken literally. Templates run in
Jinja's sandbox, with sizes capped (``"{{ 'x' * 10**10 }}"`` is refused, not allocated).

A value read by ``lookup('env', ...)`` may be a secret (a token, a password): it comes
back as :class:`~ddtree_ops.inventory.values.FromEnv`, whose ``repr`` — what error
messages and the CLI's listings show — names the variable instead, and an evaluation
error has it blanked out.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ddtree_ops.inventory.values import FromEnv, Unsafe, Vaulted

if TYPE_CHECKING:
    from jinja2 import Template
    from jinja2.sandbox import SandboxedEnvironment

TEMPLATE_MARKS = ("{{", "{%", "{#")
# Jinja's filters that Ansible has too, with the same meaning, and that cannot be made to
# build something huge from a small template (center, indent, format, wordwrap can).
FILTERS = (
    "default", "d", "lower", "upper", "capitalize", "title", "trim", "replace", "string", "int", "float",
    "abs", "round", "first", "last", "length", "count", "join", "list", "min", "max", "sort", "unique",
    "reverse", "sum", "map", "select", "reject", "selectattr", "rejectattr", "dictsort", "items", "tojson",
)
# The most characters or items one step of a template may build, and the most digits a
# number in a format (`%9999999d`) may have.
MAX_SIZE = 1_000_000
_BIG_WIDTH = re.compile(r"\d{7,}")
# Variables evaluated inside one another, at most: far more than an inventory needs.
MAX_DEPTH = 32
_ENV_LOOKUPS = ("env", "ansible.builtin.env")
_HINT = ("ddtree-ops evaluates the host's variables, inventory_hostname(_short), group_names, Jinja's own "
         "filters and lookup('env', NAME); write the resolved value")


def is_template(value: Any) -> bool:
    """Whether Ansible would evaluate ``value`` (``!unsafe`` strings it never does)."""
    return isinstance(value, str) and not isinstance(value, Unsafe) and any(m in value for m in TEMPLATE_MARKS)


def has_template(value: Any) -> bool:
    """Whether ``value`` or anything inside it is a template."""
    if isinstance(value, dict):
        return any(has_template(v) for v in value.values())
    if isinstance(value, list):
        return any(has_template(v) for v in value)
    return is_template(value)


class TemplateRefused(Exception):
    """Why a template cannot be evaluated; ``path``: the key (below the variable) it is at."""

    def __init__(self, message: str, *, undefined: bool = False, hint: bool = False) -> None:
        super().__init__(message)
        self.undefined = undefined
        self.hint = hint or undefined  # the line ends with what is evaluated
        self.path: str | None = None


class HostTemplates:
    """Evaluates templates for one host, over its resolved variables (each evaluated once)."""

    def __init__(self, name: str, values: Mapping[str, Any], groups: Sequence[str]) -> None:
        self._values = values
        self._magic: dict[str, Any] = {
            "inventory_hostname": name,
            "inventory_hostname_short": name.split(".")[0],
            "group_names": sorted(groups),  # Ansible's order; `all` is never one of them
        }
        self._done: dict[str, tuple[Any, tuple[str, ...]]] = {}
        self._stack: list[str] = []
        # Environment variables read while evaluating the current value (a taint that
        # follows it through other variables) and every value read, to blank out of errors.
        self._from_env: set[str] = set()
        self._secrets: set[str] = set()

    def render_var(self, name: str, where: Callable[[str], str]) -> Any:
        """The variable ``name`` with every template in it evaluated. InventoryError, one
        line, at ``where(path)`` for the key (``name`` or a dotted path below it) that failed."""
        from ddtree_ops.errors import InventoryError

        try:
            value, names = self._var(name)
        except TemplateRefused as exc:
            hint = f"; {_HINT}" if exc.hint else ""
            raise InventoryError(f"{where(exc.path or name)}: {self._blank(str(exc))}{hint}") from None
        return _mark(value, names) if names else value

    # ------------------------------------------------------------------ variables

    def _var(self, name: str) -> tuple[Any, tuple[str, ...]]:
        if name in self._done:
            self._from_env.update(self._done[name][1])
            return self._done[name]
        if name in self._stack:
            loop = " -> ".join([*self._stack[self._stack.index(name):], name])
            raise TemplateRefused(f"variables refer to each other in a loop: {loop}")
        if len(self._stack) >= MAX_DEPTH:
            raise TemplateRefused(f"variables nested more than {MAX_DEPTH} deep ({' -> '.join(self._stack)})")
        outer = self._from_env
        self._from_env = set()
        self._stack.append(name)
        try:
            value = self._walk(self._values[name], name)
        except TemplateRefused as exc:
            if len(self._stack) > 1:  # inside another variable's template: say which
                exc.args = (f"in {name}: {exc}",)
            raise
        finally:
            self._stack.pop()
            names = tuple(sorted(self._from_env))
            self._from_env = outer | self._from_env
        self._done[name] = (value, names)
        return value, names

    def _walk(self, value: Any, path: str) -> Any:
        if isinstance(value, dict):
            return {key: self._walk(item, f"{path}.{key}") for key, item in value.items()}
        if isinstance(value, list):
            return [self._walk(item, f"{path}[{i}]") for i, item in enumerate(value)]
        if isinstance(value, Vaulted):
            raise TemplateRefused("a vault-encrypted value (!vault) cannot be used: ddtree-ops does not decrypt vault")
        if not is_template(value):
            return value
        try:
            return self._evaluate(value)
        except TemplateRefused as exc:
            if exc.path is None and len(self._stack) == 1:
                exc.path = path
            raise

    def _scope_get(self, key: str) -> Any:
        """A name a template uses (Jinja asks only for names in :meth:`_scope_has`)."""
        if key in self._magic:
            return self._magic[key]
        if key == "lookup":
            return self._lookup
        if key in self._values:
            try:
                return self._var(key)[0]
            except TemplateRefused as exc:
                if not exc.undefined:
                    raise
                # As in Ansible, a variable whose template uses an undefined name is
                # undefined itself: `default()` replaces it, anything else says why.
                return _environment().undefined(hint=str(exc))
        return _environment().globals[key]

    def _scope_has(self, key: str) -> bool:
        return key in self._magic or key == "lookup" or key in self._values or key in _environment().globals

    # ------------------------------------------------------------------ evaluation

    def _evaluate(self, text: str) -> Any:
        from jinja2 import TemplateSyntaxError, UndefinedError

        try:
            template = _compile(text)
            context = template.new_context(_Scope(self), shared=True)  # type: ignore[arg-type]
            parts: list[Any] = []
            for part in template.root_render_func(context):
                parts.append(part)
                if len(parts) > MAX_SIZE:
                    raise TemplateRefused(f"{text!r}: builds more than {MAX_SIZE} pieces")
            value = parts[0] if len(parts) == 1 else "".join(str(part) for part in parts)
            _check_defined(value)
            return value
        except TemplateRefused:
            raise
        except UndefinedError as exc:
            raise TemplateRefused(f"{text!r}: {exc.message}", undefined=True) from None
        except TemplateSyntaxError as exc:
            problem = (exc.message or "invalid template").rstrip(".")
            raise TemplateRefused(f"{text!r}: {problem}", hint=problem.startswith(("No filter", "No test"))) from None
        except Exception as exc:  # whatever the expression raised (1/0, int('x'), recursion, ...)
            raise TemplateRefused(f"{text!r}: cannot be evaluated: {type(exc).__name__}: {exc}") from None

    def _lookup(self, plugin: Any, *terms: Any, **options: Any) -> Any:
        """Ansible's ``lookup()``, for the ``env`` plugin only."""
        if plugin not in _ENV_LOOKUPS:
            raise TemplateRefused(f"lookup({plugin!r}) is not evaluated", hint=True)
        unknown = sorted(set(options) - {"default"})
        if unknown:
            raise TemplateRefused(f"lookup('env') has no option {unknown[0]!r} (only default=)")
        if not terms or not all(isinstance(term, str) for term in terms):
            raise TemplateRefused("lookup('env', NAME) takes environment variable names")
        default = options.get("default", "")
        values = [os.environ.get(term, default) for term in terms]
        self._from_env.update(terms)
        self._secrets.update(v for v in values if isinstance(v, str) and v)
        # One name: its value; several: joined with commas (a lookup's list as Ansible joins it).
        return values[0] if len(values) == 1 else ",".join(str(v) for v in values)

    def _blank(self, message: str) -> str:
        for secret in sorted(self._secrets, key=len, reverse=True):
            message = message.replace(secret, "<value from lookup('env')>")
        return message


class _Scope(Mapping[str, Any]):
    """The names a template sees, evaluated only when it uses them (Jinja's shared context)."""

    def __init__(self, templates: HostTemplates) -> None:
        self._templates = templates

    def __getitem__(self, key: str) -> Any:
        if not self._templates._scope_has(key):
            raise KeyError(key)
        return self._templates._scope_get(key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._templates._scope_has(key)

    def __iter__(self) -> Iterator[str]:
        return iter(())  # never listed: a template names what it uses

    def __len__(self) -> int:
        return 0


def _mark(value: Any, names: tuple[str, ...]) -> Any:
    if isinstance(value, str):
        return FromEnv(value, names)
    if isinstance(value, list):
        return [_mark(item, names) for item in value]
    if isinstance(value, dict):
        return {key: _mark(item, names) for key, item in value.items()}
    return value


def _check_defined(value: Any) -> None:
    from jinja2 import Undefined

    if isinstance(value, Undefined):
        value._fail_with_undefined_error()
    elif isinstance(value, dict):
        for item in value.values():
            _check_defined(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_defined(item)


@functools.lru_cache(maxsize=1024)
def _compile(text: str) -> Template:
    return _environment().from_string(text)


@functools.cache
def _environment() -> SandboxedEnvironment:
    """Jinja2 (imported only when an inventory has a template): the sandbox, native types
    as ansible-core 2.19 keeps them, undefined names an error, and the size caps."""
    import types

    from jinja2 import StrictUndefined, nodes
    from jinja2.compiler import Frame
    from jinja2.defaults import DEFAULT_FILTERS
    from jinja2.nativetypes import NativeCodeGenerator
    from jinja2.runtime import Context
    from jinja2.sandbox import SandboxedEnvironment

    class Generator(NativeCodeGenerator):
        """Native values, and a constant expression is one too: ``"{{ 8 }}"`` is 8 and
        ``"{{ '8' }}"`` is "8", as in ansible-core 2.19 (Jinja would fold both to text)."""

        def _output_child_to_const(self, node: nodes.Expr, frame: Frame, finalize: Any) -> str:
            if not isinstance(node, nodes.TemplateData):
                raise nodes.Impossible()
            return super()._output_child_to_const(node, frame, finalize)

    def refuse_big(*values: Any) -> None:
        for value in values:
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SIZE:
                raise TemplateRefused(f"{value} is larger than {MAX_SIZE} where a size is expected")

    def replace(text: Any, old: Any, new: Any, count: int | None = None) -> str:
        """Jinja's replace (no autoescape here), refusing to build something huge."""
        text, old, new = str(text), str(old), str(new)
        if len(text) + text.count(old) * len(new) > MAX_SIZE:
            raise TemplateRefused(f"replace() would build more than {MAX_SIZE} characters")
        return text.replace(old, new, -1 if count is None else count)

    class Sandbox(SandboxedEnvironment):
        code_generator_class = Generator
        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > MAX_SIZE:
                        raise TemplateRefused(f"'*' would build more than {MAX_SIZE} characters or items")
            elif operator == "**":
                if isinstance(left, int) and isinstance(right, int) and left.bit_length() * right > 64 * MAX_SIZE:
                    raise TemplateRefused(f"'**' would build a number of more than {64 * MAX_SIZE} bits")
            elif isinstance(left, str) and _BIG_WIDTH.search(left):
                raise TemplateRefused(f"{left!r} % ...: a width of {MAX_SIZE} or more")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            refuse_big(*args, *kwargs.values())
            bound = getattr(__obj, "__self__", None)
            if isinstance(__obj, types.BuiltinMethodType) and isinstance(bound, str) and _BIG_WIDTH.search(bound):
                raise TemplateRefused(f"{bound!r}.{__obj.__name__}(): a width of {MAX_SIZE} or more")
            return super().call(__context, __obj, *args, **kwargs)

    env = Sandbox(undefined=StrictUndefined, autoescape=False)
    env.filters = {name: DEFAULT_FILTERS[name] for name in FILTERS}
    env.filters["replace"] = replace
    # range() is the sandbox's (capped); lipsum, cycler, joiner and namespace are of no use here.
    env.globals = {"range": env.globals["range"], "dict": dict}
    return env
