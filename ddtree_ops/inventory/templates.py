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
the file and key where the template is written, never taken literally.

An inventory is read by every command, so what its templates may cost is bounded, and
refused before it is spent (:class:`Budget`): one step (a call, a filter, an operator, a
comparison, a loop's turn) builds at most :data:`MAX_SIZE` characters or items — checked
before a string is padded, repeated, replaced, joined or formatted, a list or mapping
grown, a value turned into text or compared —; the templates of one inventory together
take at most :data:`MAX_STEPS` steps and :data:`MAX_WORK` characters or items built,
copied, compared or hashed, and :data:`MAX_CPU_S` of CPU; while they run the process may
not grow by more than :data:`MEMORY_HEADROOM` (``RLIMIT_AS``, the one bound that holds
whatever path a template found). So ``"{{ 'x' * 10**10 }}"``, a list doubled 40 times, a
format padding 3,000 fields to a million characters, a macro calling itself twice per call,
or loops inside loops are refused in well under a second, not evaluated. A list or mapping
that YAML's aliases put in many places (30 lines make a billion) is walked and copied once.

A value read by ``lookup('env', ...)`` may be a secret (a token, a password), and so is
anything a template computed from it (``|upper``, ``|int``, a slice, a concatenation): the
result of a template that read one comes back marked (:class:`~ddtree_ops.inventory.values.FromEnv`,
``EnvInt``, ...), whose ``repr`` — what error messages and the CLI's listings show — names the
variables instead. An evaluation error of such a template shows what failed, not its
message (a KeyError quotes the key).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import itertools
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MappingView, Sequence
from typing import TYPE_CHECKING, Any, cast

from ddtree_ops.inventory.values import EnvFlag, EnvFloat, EnvInt, FromEnv, Unsafe, Vaulted, env_mask

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
# The most characters or items one step of a template may build (a string, a list, a
# format's or a join's output, a value turned into text), and the most digits a number in
# a format (`%9999999d`) may have.
MAX_SIZE = 1_000_000
_BIG_WIDTH = re.compile(r"\d{7,}")
# The largest whole number a template may compute, in bits (2**4096: far beyond any port,
# size or count; multiplying or dividing it is still cheap).
MAX_INT_BITS = 4096
# What the templates of one inventory may spend together (every host's: a group's template
# is evaluated once per host): steps (calls, filters, operators, comparisons, turns of a
# loop), characters or items built, copied, compared or hashed, CPU seconds. A template
# an inventory needs takes a few steps.
MAX_STEPS = 50_000
MAX_WORK = 4 * MAX_SIZE
MAX_CPU_S = 0.5
# How much the process may grow while templates run: the bound that holds even on a path
# the checks above missed (the checks keep a template far below it).
MEMORY_HEADROOM = 1 << 30
# Lists and mappings inside one another, at most (a deeper tuple can crash the hash of it).
MAX_NESTING = 100
# The longest template: compiling one costs time in proportion.
MAX_TEMPLATE = 65_536
# Variables evaluated inside one another, at most: far more than an inventory needs.
MAX_DEPTH = 32
_ENV_LOOKUPS = ("env", "ansible.builtin.env")
_HINT = ("ddtree-ops evaluates the host's variables, inventory_hostname(_short), group_names, Jinja's own "
         "filters and lookup('env', NAME); write the resolved value")
# An undefined-name message quotes a name written in the template, never a value.
_NAME_UNDEFINED = re.compile(r"'[A-Za-z_][A-Za-z0-9_]*' is undefined")
_MASKS = re.compile(r"(<value of lookup\('env', [^>]*\)>)")


def is_template(value: Any) -> bool:
    """Whether Ansible would evaluate ``value`` (``!unsafe`` strings it never does)."""
    return isinstance(value, str) and not isinstance(value, Unsafe) and any(m in value for m in TEMPLATE_MARKS)


def has_template(value: Any) -> bool:
    """Whether ``value`` or anything inside it is a template (each list or mapping looked
    at once: YAML's aliases make one list appear a billion times in 30 lines)."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (dict, list)):
            if id(item) not in seen:
                seen.add(id(item))
                stack.extend(item.values() if isinstance(item, dict) else item)
        elif is_template(item):
            return True
    return False


class TemplateRefused(Exception):
    """Why a template cannot be evaluated; ``path``: the key (below the variable) it is at.
    ``without_values``: the message for a template that read ``lookup('env')``, where the
    message quotes a value (None: it quotes none)."""

    def __init__(self, message: str, *, undefined: bool = False, hint: bool = False,
                 without_values: str | None = None) -> None:
        super().__init__(message)
        self.undefined = undefined
        self.hint = hint or undefined  # the line ends with what is evaluated
        self.path: str | None = None
        self.without_values = without_values


class _Bound(TemplateRefused):
    """A bound of the module docstring reached: said after the template's text."""

    quoted = False


# ---------------------------------------------------------------------------- budget


class Budget:
    """What the templates of one inventory may still spend (module docstring). One per
    :func:`~ddtree_ops.inventory.build.load_inventory`; shared by its hosts."""

    def __init__(self) -> None:
        self.steps = 0
        self.work = 0
        self._cpu_s = 0.0
        self._since = 0.0
        self._depth = 0
        self._capped = False

    def step(self, work: int = 0) -> None:
        """One step that builds, copies, compares or hashes ``work`` characters or items."""
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise _Bound(f"takes more than {MAX_STEPS} steps (calls, filters, operators, turns of a loop; "
                         f"the inventory's templates together)")
        self.charge(work)
        if not self.steps % 512 and self._cpu_s + time.process_time() - self._since > MAX_CPU_S:
            raise _Bound(f"takes more than {MAX_CPU_S} s of CPU (the inventory's templates together)")

    def charge(self, work: int) -> None:
        self.work += work
        if self.work > MAX_WORK:
            raise _Bound(f"builds, copies or compares more than {MAX_WORK} characters or items (the "
                         f"inventory's templates together)")

    def room(self) -> int:
        return max(MAX_WORK - self.work, 0)

    @contextlib.contextmanager
    def capping(self) -> Iterator[None]:
        """The process's memory capped once for every template evaluated meanwhile (an
        inventory's hosts), rather than for each of them."""
        restore = _cap_memory()
        self._capped = True
        try:
            yield
        finally:
            self._capped = False
            if restore is not None:
                restore()

    @contextlib.contextmanager
    def spending(self) -> Iterator[None]:
        """While a template (and the variables it uses, inside it) is evaluated: this budget
        is the one every check charges, and the process's memory is capped."""
        self._depth += 1
        if self._depth > 1:
            try:
                yield
            finally:
                self._depth -= 1
            return
        token = _ACTIVE.set(self)
        restore = None if self._capped else _cap_memory()
        self._since = time.process_time()
        try:
            yield
        finally:
            self._cpu_s += time.process_time() - self._since
            if restore is not None:
                restore()
            _ACTIVE.reset(token)
            self._depth -= 1


_ACTIVE: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("ddtree_template_budget", default=None)
# The host whose template is being evaluated (for the undefined messages that would quote a
# value the template computed).
_EVALUATING: contextvars.ContextVar[HostTemplates | None] = contextvars.ContextVar("ddtree_template_host",
                                                                                   default=None)


def _budget() -> Budget:
    # Outside an evaluation (Jinja folds constants when it compiles): a budget of its own.
    return _ACTIVE.get() or Budget()


def _cap_memory() -> Callable[[], None] | None:
    """Lower the soft address-space limit to the process's size plus MEMORY_HEADROOM; the
    function that puts it back (None where there is no such limit to set)."""
    try:
        import resource

        with open("/proc/self/statm", "rb") as fh:
            size = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = size + MEMORY_HEADROOM
        if hard != resource.RLIM_INFINITY:
            cap = min(cap, hard)
        if soft != resource.RLIM_INFINITY and soft <= cap:
            return None  # already as low (a ulimit of the user's)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (ImportError, OSError, ValueError):
        return None

    def restore() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

    return restore


# ---------------------------------------------------------------------------- sizes


_LEAVES = (bool, type(None), float)
_CONTAINERS = (list, tuple, dict, set, frozenset, MappingView)


def weight(value: Any, limit: int) -> int:
    """About how many characters ``str(value)`` has — what turning it into text, comparing
    or hashing it reads —, counted until more than ``limit`` (a list holding itself, or one
    string a million times, is not walked whole: each list or mapping is walked once)."""
    memo: dict[int, int] = {}
    walking: set[int] = set()

    def walk(item: Any, depth: int) -> int:
        if isinstance(item, (str, bytes)):
            return len(item) + 2
        if isinstance(item, _LEAVES):
            return 5
        if isinstance(item, int):
            return item.bit_length() // 3 + 1
        if not isinstance(item, _CONTAINERS):
            return 16  # a range, a generator, a macro: their text is short
        if id(item) in memo:
            return memo[id(item)]
        if id(item) in walking:  # as text, compared or hashed: endless, or an error
            raise _Bound("holds a list or mapping that holds itself")
        if depth >= MAX_NESTING:
            raise _Bound(f"nests lists or mappings more than {MAX_NESTING} deep")
        walking.add(id(item))
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else list(cast(Iterable[Any], item))
        total = 2 + 2 * len(children)
        kinds = set(map(type, children))  # the common cases at C speed
        if kinds <= {str}:
            total += sum(map(len, children))
        elif kinds <= {int, bool}:
            total += sum(map(int.bit_length, children)) // 3 + len(children)
        else:
            for child in children:
                total += walk(child, depth + 1)
                if total > limit:
                    break
        walking.discard(id(item))
        memo[id(item)] = min(total, limit + 1)
        return memo[id(item)]

    return walk(value, 0)


def _cost(value: Any) -> int:
    """What reading ``value`` whole (as text, to compare or hash it) costs (see
    :func:`weight`), charged; refused when larger than MAX_SIZE."""
    if isinstance(value, (str, bytes)):
        size = len(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        size = value.bit_length() // 64
    elif isinstance(value, _CONTAINERS):
        size = weight(value, min(MAX_SIZE, _budget().room()))
    else:
        return 0
    _budget().charge(size)
    if size > MAX_SIZE:
        raise _Bound(f"reads a value of more than {MAX_SIZE} characters (as text)")
    return size


def _built(value: Any) -> Any:
    """``value``, a step's result: refused when larger than MAX_SIZE, else its size charged."""
    if isinstance(value, (str, bytes, list, tuple, dict)):
        if len(value) > MAX_SIZE:
            raise _Bound(f"builds more than {MAX_SIZE} characters or items in one step")
        _budget().charge(len(value))
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise _Bound(f"computes a number of more than {MAX_INT_BITS} bits")
    return value


def _fits(size: int, what: str) -> None:
    """Refuse a step that would build ``size`` characters or items, before it builds them."""
    if size > MAX_SIZE:
        raise _Bound(f"{what} would build more than {MAX_SIZE} characters or items")


def _taken(iterable: Any) -> list[Any]:
    """``iterable``'s items, at most MAX_SIZE of them (a generator is read once)."""
    if isinstance(iterable, (list, tuple, str, dict)) and len(iterable) > MAX_SIZE:
        raise _Bound(f"reads more than {MAX_SIZE} items")
    items = list(itertools.islice(iterable, MAX_SIZE + 1))
    if len(items) > MAX_SIZE:
        raise _Bound(f"reads more than {MAX_SIZE} items")
    _budget().charge(len(items))
    return items


def _text_size(value: Any) -> int:
    return len(value) if isinstance(value, str) else _cost(value)


def _int_arg(value: Any, what: str) -> int:
    """A size given as an argument (a width, a count): refused above MAX_SIZE."""
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_SIZE:
        raise _Bound(f"{value} is larger than {MAX_SIZE} where a size is expected ({what})",
                     without_values=f"a number larger than {MAX_SIZE} where a size is expected ({what})")
    return value if isinstance(value, int) else 0


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse what ``left OPERATOR right`` would build when too large, before it is built;
    charge what it builds."""
    budget = _budget()
    sequences = (str, bytes, list, tuple)
    ints = isinstance(left, int) and isinstance(right, int)
    if ints:
        bits = max(left.bit_length(), right.bit_length())
        budget.step(bits * bits // MAX_INT_BITS)  # long multiplication and division
        if operator == "*" and left.bit_length() + right.bit_length() > MAX_INT_BITS + 1:
            raise _Bound(f"'*' would compute a number of more than {MAX_INT_BITS} bits")
        if operator == "**" and right > 0 and (abs(left).bit_length() - 1) * right > MAX_INT_BITS:
            raise _Bound(f"'**' would compute a number of more than {MAX_INT_BITS} bits")
        return
    budget.step()
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, sequences) and isinstance(times, int):
                _fits(len(seq) * max(times, 0), "'*'")
    elif operator == "+" and isinstance(left, sequences) and isinstance(right, sequences):
        _fits(len(left) + len(right), "'+'")
    elif operator == "%" and isinstance(left, (str, bytes)):
        _check_percent(left, right)


def _check_percent(fmt: str | bytes, args: Any) -> None:
    """``fmt % args``: each ``%`` writes at most its width (or a ``*`` width from the
    arguments) plus one argument as text; refused when that could pass MAX_SIZE."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    widths = [int(n) if len(n) < 8 else MAX_SIZE + 1 for n in re.findall(r"\d+", text)]
    if isinstance(args, (tuple, list)):
        values = list(args)
    elif isinstance(args, dict):
        values = list(args.values())
    else:
        values = [args]
    if "*" in text:
        widths += [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    widest = max(widths, default=0)
    if widest > MAX_SIZE:
        raise _Bound(f"'%' with a width of more than {MAX_SIZE}")
    largest = max((_text_size(v) for v in values), default=0)
    _fits(len(text) + text.count("%") * (widest + largest), "'%'")


def _check_spec(spec: str) -> None:
    if _BIG_WIDTH.search(spec):
        raise _Bound(f"a format's width or precision of more than {MAX_SIZE}")


def _check_method(bound: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Refuse what a method of a string, list or mapping would build when too large, before
    it is built (its arguments, with an iterable read into a list once)."""
    text: Any = bound  # str or bytes, below
    if isinstance(bound, (str, bytes)):
        _budget().charge(len(bound))  # every one of them reads the string
        if name in ("center", "ljust", "rjust", "zfill"):
            _int_arg(args[0] if args else 0, f"{name}()")
        elif name == "expandtabs":
            tab = _int_arg(args[0] if args else kwargs.get("tabsize", 8), "expandtabs()")
            tabs = text.count("\t" if isinstance(bound, str) else b"\t")
            _fits(len(bound) + tabs * max(tab, 0), "expandtabs()")
        elif name == "replace" and len(args) >= 2 and isinstance(args[0], type(bound)):
            old, new = args[0], args[1]
            count = text.count(old) if old else len(bound) + 1
            if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
                count = min(count, args[2])
            if isinstance(new, (str, bytes)):
                _fits(len(bound) + count * len(new), "replace()")
        elif name == "join" and args:
            items = _taken(args[0])
            size = sum(len(i) if isinstance(i, (str, bytes)) else 0 for i in items)
            _fits(size + len(bound) * max(len(items) - 1, 0), "join()")
            return (items, *args[1:])
        elif name == "translate" and args:
            table = args[0]
            outs = table.values() if isinstance(table, dict) else table if isinstance(table, (list, tuple)) else ()
            longest = max((len(o) for o in outs if isinstance(o, (str, bytes))), default=1)
            _fits(len(bound) * longest, "translate()")
    elif isinstance(bound, list):
        if name in ("insert", "pop", "reverse"):  # moves every item (pop() the last only, but alike)
            _budget().charge(len(bound))
        if name in ("append", "insert"):
            _fits(len(bound) + 1, f"{name}()")
        elif name == "extend" and args:
            items = _taken(args[0])
            _fits(len(bound) + len(items), "extend()")
            return (items,)
        elif name == "sort":
            _budget().charge(_cost(bound) * max(len(bound).bit_length(), 1))
        elif name in ("count", "index", "remove"):
            _cost(bound)
    elif isinstance(bound, dict):
        if name == "update":
            other = args[0] if args else {}
            if not isinstance(other, Mapping):
                other = _taken(other)
            _fits(len(bound) + len(other) + len(kwargs), "update()")
            return (other,) if args else ()
        if name == "setdefault":
            _fits(len(bound) + 1, "setdefault()")
    elif isinstance(bound, type) and name == "fromkeys" and args:
        items = _taken(args[0])
        _fits(len(items), "fromkeys()")
        return (items, *args[1:])
    elif isinstance(bound, tuple) and name in ("count", "index"):
        _cost(bound)
    elif isinstance(bound, int) and name == "to_bytes":
        _int_arg(args[0] if args else kwargs.get("length", 1), "to_bytes()")
    return args


# ---------------------------------------------------------------------------- evaluation


class HostTemplates:
    """Evaluates templates for one host, over its resolved variables (each evaluated once)."""

    def __init__(self, name: str, values: Mapping[str, Any], groups: Sequence[str], *,
                 budget: Budget | None = None) -> None:
        self._values = values
        self._magic: dict[str, Any] = {
            "inventory_hostname": name,
            "inventory_hostname_short": name.split(".")[0],
            "group_names": sorted(groups),  # Ansible's order; `all` is never one of them
        }
        self._budget = budget or Budget()
        # name -> (value, the environment variables its templates read, the value with what
        # they computed from them marked).
        self._done: dict[str, tuple[Any, tuple[str, ...], Any]] = {}
        # Which lists and mappings hold a template or a vault value (by id: the host's
        # values live as long as this).
        self._templated: dict[int, bool] = {}
        self._stack: list[str] = []
        # Environment variables read while evaluating the current template (a taint that
        # follows it through other variables) and every value read, to blank out of errors.
        self._from_env: set[str] = set()
        self._secrets: set[str] = set()
        # The text of every value render_var gave out marked, and the variables it came from.
        self._marked: dict[str, tuple[str, ...]] = {}

    def render_var(self, name: str, where: Callable[[str], str]) -> Any:
        """The variable ``name`` with every template in it evaluated. InventoryError, one
        line, at ``where(path)`` for the key (``name`` or a dotted path below it) that failed.
        What a template computed from ``lookup('env')`` comes back marked (module docstring)."""
        from ddtree_ops.errors import InventoryError

        try:
            _, names, marked = self._var(name)
        except TemplateRefused as exc:
            hint = f"; {_HINT}" if exc.hint else ""
            raise InventoryError(f"{where(exc.path or name)}: {self._blank(str(exc))}{hint}") from None
        if names:
            self._marked.update(_marked_texts(marked))
        return marked

    def masked(self, message: str) -> str:
        """``message``, an error about this host's values, with the text of every value a
        template computed from ``lookup('env')`` replaced by its mask: a check that put one
        into its message as text (``f"{value}"``, a key in a path) shows no secret either.
        A text of under 4 characters only where it stands alone (``a`` is in every word)."""
        if not self._marked:
            return message
        texts = sorted(self._marked, key=len, reverse=True)
        pattern = re.compile(
            "|".join(re.escape(t) if len(t) >= 4 else rf"(?<![\w.-]){re.escape(t)}(?![\w.-])" for t in texts))
        # Outside the masks already there (a secret "env" is in each of them).
        parts = _MASKS.split(message)
        return "".join(part if i % 2 else pattern.sub(lambda m: env_mask(self._marked[m.group(0)]), part)
                       for i, part in enumerate(parts))

    # ------------------------------------------------------------------ variables

    def _var(self, name: str) -> tuple[Any, tuple[str, ...], Any]:
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
            value, marked = self._walk(self._values[name], name, {})
        except TemplateRefused as exc:
            if len(self._stack) > 1:  # inside another variable's template: say which
                exc.args = (f"in {name}: {exc}",)
                # Its message holds nothing of the template that uses it, and was made
                # safe where it was evaluated.
                exc.without_values = None
            raise
        finally:
            self._stack.pop()
            names = tuple(sorted(self._from_env))
            self._from_env = outer | self._from_env
        self._done[name] = (value, names, marked)
        return self._done[name]

    def _walk(self, value: Any, path: str, memo: dict[int, tuple[Any, Any]]) -> tuple[Any, Any]:
        """``value`` (a variable, or a part of one at ``path``) with its templates evaluated,
        and the same with what each template computed from ``lookup('env')`` marked (only
        that template's result: a key beside it is no secret). A list or mapping that YAML's
        aliases put in several places is walked once (``memo``), and so is copied as one."""
        if isinstance(value, (dict, list)):
            if id(value) in memo:
                return memo[id(value)]
            if not self._holds_template(value):
                copied = copy.deepcopy(value)  # a template may change what it is given
                memo[id(value)] = (copied, copied)
                return copied, copied
            if isinstance(value, dict):
                plain: Any = {}
                marked: Any = {}
                memo[id(value)] = (plain, marked)
                for key, item in value.items():
                    plain[key], marked[key] = self._walk(item, f"{path}.{key}", memo)
            else:
                plain, marked = [], []
                memo[id(value)] = (plain, marked)
                for i, item in enumerate(value):
                    both = self._walk(item, f"{path}[{i}]", memo)
                    plain.append(both[0])
                    marked.append(both[1])
            return plain, marked
        if isinstance(value, Vaulted):
            raise TemplateRefused("a vault-encrypted value (!vault) cannot be used: ddtree-ops does not decrypt vault")
        if not is_template(value):
            return value, value
        # Each template's own taint: a key of a mapping that read no variable is no secret.
        outer = self._from_env
        self._from_env = set()
        try:
            result = self._evaluate(value)
        except TemplateRefused as exc:
            if exc.path is None and len(self._stack) == 1:
                exc.path = path
            raise
        finally:
            read, self._from_env = self._from_env, outer | self._from_env
        return result, (_mark(result, tuple(sorted(read))) if read else result)

    def _holds_template(self, value: Any) -> bool:
        """Whether a template or a vault value is anywhere in the list or mapping ``value``."""
        known = self._templated.get(id(value))
        if known is None:
            self._templated[id(value)] = False  # a list inside itself: what else it holds decides
            items = value.values() if isinstance(value, dict) else value
            known = any(self._holds_template(item) if isinstance(item, (dict, list))
                        else isinstance(item, Vaulted) or is_template(item) for item in items)
            self._templated[id(value)] = known
        return known

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

        if len(text) > MAX_TEMPLATE:
            raise TemplateRefused(f"a template of {len(text):,} characters (at most {MAX_TEMPLATE:,})")
        evaluating = _EVALUATING.set(self)
        try:
            with self._budget.spending():
                template = _compile(text)
                context = template.new_context(_Scope(self), shared=True)  # type: ignore[arg-type]
                parts: list[Any] = []
                size = 0
                budget = _budget()
                for part in template.root_render_func(context):
                    budget.step()
                    parts.append(part)
                    size += _text_size(part)
                    if size > MAX_SIZE:
                        raise _Bound(f"builds more than {MAX_SIZE} characters")
                value = parts[0] if len(parts) == 1 else "".join(str(part) for part in parts)
                # Whole: a list may hold one string a million times, or itself (the checks
                # below, an error message, the CLI's listings read it whole).
                size = weight(value, min(MAX_SIZE, budget.room()))
                budget.charge(size)
                if size > MAX_SIZE:
                    raise _Bound(f"builds a value of more than {MAX_SIZE} characters (as text)")
                _check_defined(value)
            return value
        except TemplateRefused as exc:
            if self._from_env and exc.without_values is not None:
                exc.args = (exc.without_values,)
                exc.without_values = None
            if isinstance(exc, _Bound) and not exc.quoted:
                exc.args = (f"{text!r}: {exc}",)
                exc.quoted = True
            raise
        except UndefinedError as exc:
            message = exc.message or "undefined"
            mask = self.mask()
            # Safe as they are: a name written in the template, a variable's own refusal
            # ("in ip: ..."), a key already masked.
            safe = _NAME_UNDEFINED.fullmatch(message) or message.startswith("in ") or message.endswith(str(mask))
            if mask is not None and not safe:
                message = f"undefined ({self._not_shown()})"
            raise TemplateRefused(f"{text!r}: {message}", undefined=True) from None
        except TemplateSyntaxError as exc:
            problem = (exc.message or "invalid template").rstrip(".")
            raise TemplateRefused(f"{text!r}: {problem}", hint=problem.startswith(("No filter", "No test"))) from None
        except Exception as exc:  # whatever the expression raised (1/0, int('x'), recursion, ...)
            detail = f"{type(exc).__name__} ({self._not_shown()})" if self._from_env else f"{type(exc).__name__}: {exc}"
            raise TemplateRefused(f"{text!r}: cannot be evaluated: {detail}") from None
        finally:
            _EVALUATING.reset(evaluating)

    def mask(self) -> str | None:
        """What shows a value the template being evaluated computed, if it read ``lookup('env')``."""
        return env_mask(sorted(self._from_env)) if self._from_env else None

    def _not_shown(self) -> str:
        return f"its message is not shown: it may hold {self.mask()}"

    def _lookup(self, plugin: Any, *terms: Any, **options: Any) -> Any:
        """Ansible's ``lookup()``, for the ``env`` plugin only."""
        if plugin not in _ENV_LOOKUPS:
            raise TemplateRefused(f"lookup({plugin!r}) is not evaluated", hint=True,
                                  without_values="a lookup() other than lookup('env', ...) is not evaluated")
        unknown = sorted(set(options) - {"default"})
        if unknown:
            raise TemplateRefused(f"lookup('env') has no option {unknown[0]!r} (only default=)",
                                  without_values="lookup('env') has no option but default=")
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


def _marked_texts(value: Any) -> dict[str, tuple[str, ...]]:
    """The text of each :class:`FromEnv` in ``value`` (keys included), by its variables."""
    found: dict[str, tuple[str, ...]] = {}
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, FromEnv) and item:
            found[str(item)] = item.names
        elif isinstance(item, (dict, list)) and id(item) not in seen:
            seen.add(id(item))
            stack.extend([*item, *item.values()] if isinstance(item, dict) else item)
    return found


def _mark(value: Any, names: tuple[str, ...], memo: dict[int, Any] | None = None) -> Any:
    """A template's result, every value in it (keys too) marked as read from ``names``."""
    if isinstance(value, str):
        return FromEnv(value, names)
    if isinstance(value, bool):
        return EnvFlag(value, names)
    if isinstance(value, int):
        return EnvInt(value, names)
    if isinstance(value, float):
        return EnvFloat(value, names)
    if not isinstance(value, (list, tuple, dict)):
        return value
    memo = {} if memo is None else memo
    if id(value) not in memo:  # a list in many places is marked once
        if isinstance(value, dict):
            memo[id(value)] = {FromEnv(key, names) if isinstance(key, str) else key: _mark(item, names, memo)
                               for key, item in value.items()}
        else:
            memo[id(value)] = [_mark(item, names, memo) for item in value]
    return memo[id(value)]


def _check_defined(value: Any) -> None:
    """Raise the UndefinedError of an undefined value anywhere in ``value`` (each list or
    mapping looked at once: one may be in it a million times)."""
    from jinja2 import Undefined

    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Undefined):
            item._fail_with_undefined_error()
        elif isinstance(item, (dict, list, tuple)) and id(item) not in seen:
            seen.add(id(item))
            stack.extend(item.values() if isinstance(item, dict) else item)


@functools.lru_cache(maxsize=1024)
def _compile(text: str) -> Template:
    return _environment().from_string(text)


# ---------------------------------------------------------------------------- the sandbox


def _ticking(iterable: Iterable[Any]) -> Iterator[Any]:
    """A loop's items, one step each (a loop inside a loop is a million steps, not free)."""
    budget = _budget()
    for item in iterable:
        budget.step()
        yield item


def _concat(parts: Iterable[Any]) -> str:
    """Text put together (``~``, a macro's or a ``{% set %}`` block's output), its size
    checked before it is built."""
    items = list(parts)
    _fits(sum(_text_size(part) for part in items), "'~'")  # each part's size charged
    return "".join(str(part) for part in items)


def _compare(first: Any, *pairs: Any) -> Any:
    """``first OP1 second OP2 third ...`` (Python's chained comparison, its operands
    evaluated first), each comparison's cost charged: comparing, or finding an item in,
    lists reads them whole."""
    import operator

    ops: dict[str, Callable[[Any, Any], Any]] = {
        "eq": operator.eq, "ne": operator.ne, "gt": operator.gt, "gteq": operator.ge, "lt": operator.lt,
        "lteq": operator.le, "in": lambda a, b: a in b, "notin": lambda a, b: a not in b,
    }
    budget = _budget()
    left, result = first, True
    for op, right in zip(pairs[::2], pairs[1::2], strict=True):
        budget.step()
        _cost(left)
        _cost(right)
        result = ops[op](left, right)
        if not result:
            return result
        left = right
    return result


def _hashed(key: Any) -> Any:
    """A mapping's key written in a template (hashing a tuple reads it whole)."""
    _budget().step()
    _cost(key)
    return key


def _guarded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """Jinja's filter ``name``, its arguments' cost charged before and its result's size
    checked after; join, sum and tojson checked before they build."""
    from jinja2.filters import make_attrgetter
    from jinja2.utils import _PassArg

    passed = 1 if _PassArg.from_obj(func) is not None else 0

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.step()
        value, rest = (args[passed], args[passed + 1:]) if len(args) > passed else (None, ())
        if name == "join" and len(args) > passed:
            items = _taken(value)
            attribute = kwargs.get("attribute", rest[1] if len(rest) > 1 else None)
            if attribute is not None:
                items = [make_attrgetter(args[0].environment, attribute)(item) for item in items]
                kwargs.pop("attribute", None)
                rest = rest[:1]
            sep = kwargs.get("d", rest[0] if rest else "")
            _fits(sum(_text_size(i) for i in items) + _text_size(sep) * max(len(items) - 1, 0), "join")
            return _built(func(args[0], items, *rest, **kwargs))
        if name == "sum" and len(args) > passed:
            items = _taken(value)
            attribute = kwargs.get("attribute", rest[0] if rest else None)
            if attribute is not None:
                items = [make_attrgetter(args[0], attribute)(item) for item in items]
            total = kwargs.get("start", rest[1] if len(rest) > 1 else 0)
            if isinstance(total, (str, bytes)):  # as Python's sum() says
                raise TypeError("sum() can't sum strings [use ''.join(seq) instead]")
            for item in items:  # each addition checked: summing lists is quadratic
                _check_binop("+", total, item)
                total = _built(total + item)
            return total
        if name == "tojson" and len(args) > passed:
            indent = kwargs.get("indent", rest[0] if rest else None)
            spaces = _int_arg(indent, "tojson") if isinstance(indent, int) else len(str(indent or ""))
            # Every line indented as deep as it is nested: at most MAX_NESTING levels, a line
            # for every 3 characters or more.
            _fits(_cost(value) * (1 + max(spaces, 0) * MAX_NESTING // 3), "tojson")
        elif name in ("sort", "dictsort", "unique", "min", "max"):
            if not isinstance(value, (list, tuple, dict, str)):  # a generator: its items, once
                value = _taken(value)
                args = (*args[:passed], value, *rest)
            # Each item compared about log2(n) times, and hashed once.
            budget.charge(_cost(value) * max(len(value).bit_length(), 1))
        else:
            for arg in (*args[passed:], *kwargs.values()):
                _cost(arg)
        return _built(func(*args, **kwargs))

    return guarded


def _guarded_test(func: Any) -> Callable[..., Any]:
    """A Jinja test (``is eq``, ``is in``, ...), what it reads charged."""

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _budget().step()
        for arg in (*args, *kwargs.values()):
            _cost(arg)
        return func(*args, **kwargs)

    return guarded


@functools.cache
def _environment() -> SandboxedEnvironment:
    """Jinja2 (imported only when an inventory has a template): the sandbox, native types
    as ansible-core 2.19 keeps them, undefined names an error, and every step bounded
    (module docstring)."""
    import types
    from string import Formatter

    from jinja2 import StrictUndefined, nodes
    from jinja2.compiler import Frame, optimizeconst
    from jinja2.defaults import DEFAULT_FILTERS, DEFAULT_TESTS
    from jinja2.nativetypes import NativeCodeGenerator
    from jinja2.runtime import Context, LoopContext, missing
    from jinja2.sandbox import SandboxedEnvironment, SandboxedFormatter
    from jinja2.utils import object_type_repr

    class Generator(NativeCodeGenerator):
        """Native values, and a constant expression is one too: ``"{{ 8 }}"`` is 8 and
        ``"{{ '8' }}"`` is "8", as in ansible-core 2.19 (Jinja would fold both to text).
        What Jinja's sandbox lets run unchecked goes through the environment: ``~``,
        comparisons, slices and a mapping's keys."""

        def _output_child_to_const(self, node: nodes.Expr, frame: Frame, finalize: Any) -> str:
            if not isinstance(node, nodes.TemplateData):
                raise nodes.Impossible()
            return super()._output_child_to_const(node, frame, finalize)

        @optimizeconst
        def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
            self.write("environment.ddtree_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

        @optimizeconst
        def visit_Compare(self, node: nodes.Compare, frame: Frame) -> None:
            self.write("environment.ddtree_compare(")
            self.visit(node.expr, frame)
            for operand in node.ops:
                self.write(f", {operand.op!r}, ")
                self.visit(operand.expr, frame)
            self.write(")")

        @optimizeconst
        def visit_Getitem(self, node: nodes.Getitem, frame: Frame) -> None:
            if not isinstance(node.arg, nodes.Slice):
                super().visit_Getitem(node, frame)
                return
            self.write("environment.getitem(")
            self.visit(node.node, frame)
            self.write(", slice(")
            for i, part in enumerate((node.arg.start, node.arg.stop, node.arg.step)):
                self.write(", " if i else "")
                if part is None:
                    self.write("None")
                else:
                    self.visit(part, frame)
            self.write("))")

        def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
            self.write("{")
            for idx, item in enumerate(node.items):
                self.write(", " if idx else "")
                self.write("environment.ddtree_key(")
                self.visit(item.key, frame)
                self.write("): ")
                self.visit(item.value, frame)
            self.write("}")

    class Undefined(StrictUndefined):
        """An undefined name is an error; a missing key or attribute that a template read
        by lookup('env') computed is named by its mask (``{{ d[lookup('env', 'K')] }}``)."""

        @property
        def _undefined_message(self) -> str:
            host = _EVALUATING.get()
            mask = host.mask() if host is not None else None
            if self._undefined_hint or self._undefined_obj is missing or mask is None:
                return super()._undefined_message
            what = "attribute" if isinstance(self._undefined_name, str) else "element"
            return f"{object_type_repr(self._undefined_obj)!r} has no {what} {mask}"

    class GuardedFormatter(SandboxedFormatter):
        """``str.format``: each field's width checked before it is padded, what it turns
        into text charged, and the output's size as it is built."""

        def vformat(self, format_string: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
            self._built = len(format_string)
            _fits(self._built, "format()")
            _budget().charge(self._built)
            return super().vformat(format_string, args, kwargs)

        def convert_field(self, value: Any, conversion: str | None) -> Any:
            _cost(value)
            return super().convert_field(value, conversion)

        def format_field(self, value: Any, format_spec: str) -> Any:
            _check_spec(format_spec)
            _cost(value)
            out = Formatter.format_field(self, value, format_spec)
            self._built += len(out)
            _fits(self._built, "format()")
            _budget().charge(len(out))
            return out

    class Sandbox(SandboxedEnvironment):
        code_generator_class = Generator
        intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})
        concat = staticmethod(_concat)  # a macro's, a {% set %} block's, a recursive loop's output

        def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
            tree = super()._parse(source, name, filename)
            # Every loop's iterable through ddtree_loop: a step per turn.
            for loop in list(tree.find_all(nodes.For)):
                loop.iter = nodes.Call(nodes.EnvironmentAttribute("ddtree_loop"), [loop.iter], [], None, None,
                                       lineno=loop.lineno)
            return tree

        ddtree_loop = staticmethod(_ticking)
        ddtree_concat = staticmethod(_concat)
        ddtree_compare = staticmethod(_compare)
        ddtree_key = staticmethod(_hashed)

        def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            return _built(super().call_binop(context, operator, left, right))

        def getattr(self, obj: Any, attribute: str) -> Any:
            _budget().step()
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            budget = _budget()
            if isinstance(argument, slice):  # a copy of what it selects
                budget.step(len(range(*argument.indices(len(obj)))) if hasattr(obj, "__len__") else 0)
                return obj[argument]
            budget.step()
            _cost(argument)
            return super().getitem(obj, argument)

        def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
            if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or value.__name__ not in (
                "format", "format_map"
            ):
                return None
            text = value.__self__
            if not isinstance(text, str):
                return None
            formatter = GuardedFormatter(self)
            mapped = value.__name__ == "format_map"

            def wrapper(*args: Any, **kwargs: Any) -> str:
                if mapped:
                    if kwargs or len(args) != 1:
                        raise TypeError("format_map() takes exactly one argument")
                    kwargs = args[0]
                    args = ()
                return formatter.vformat(str(text), args, kwargs)

            return functools.update_wrapper(wrapper, value)

        def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            if __obj is _ticking:  # a loop's iterable (Sandbox._parse)
                return _ticking(args[0])
            budget = _budget()
            budget.step()
            if __obj is safe_range:
                for arg in args:
                    _int_arg(arg, "range()")
            elif isinstance(__obj, LoopContext) and args:  # a recursive loop's next level
                args = (_ticking(args[0]), *args[1:])
            elif isinstance(__obj, types.BuiltinMethodType) and not isinstance(__obj.__self__, types.ModuleType):
                args = _check_method(__obj.__self__, __obj.__name__, args, kwargs)
            for arg in (*args, *(v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars"))):
                _cost(arg)
            return _built(super().call(__context, __obj, *args, **kwargs))

    env = Sandbox(undefined=Undefined, autoescape=False)
    safe_range = env.globals["range"]

    def replace(text: Any, old: Any, new: Any, count: int | None = None) -> str:
        """Jinja's replace (no autoescape here), refusing to build something huge."""
        text, old, new = str(text), str(old), str(new)
        _fits(len(text) + (text.count(old) if old else len(text) + 1) * len(new), "replace()")
        return text.replace(old, new, -1 if count is None else count)

    filters = {name: DEFAULT_FILTERS[name] for name in FILTERS}
    filters["replace"] = replace
    env.filters = {name: _guarded_filter(name, func) for name, func in filters.items()}
    env.tests = {name: _guarded_test(func) for name, func in DEFAULT_TESTS.items()}
    # range() is the sandbox's (capped); lipsum, cycler, joiner and namespace are of no use here.
    env.globals = {"range": safe_range, "dict": dict}
    return env
