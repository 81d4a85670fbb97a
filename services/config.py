"""Dataclass configs built from CLI flags and the environment.

Each service defines one `@dataclass class XConfig` and gets, for free, an
argparse parser whose `--help` lists every field:

    @dataclass
    class SchedulerConfig(ServerConfig):
        max_num_seqs: int = option(256, help="most sequences in one step")

    cfg = load_config(SchedulerConfig, service="scheduler")

Precedence: CLI flag > environment > field default. Field `max_num_seqs` is
flag `--max-num-seqs` and env var `LLMESH_SCHEDULER_MAX_NUM_SEQS` (when a
service name is given) or `LLMESH_MAX_NUM_SEQS`; the service-scoped name wins,
so that one shell can configure several local services apart.

Supported field types: str, int, float, bool (`--x/--no-x`; env 1/0, true/false,
yes/no, on/off), pathlib.Path, Literal[...] and Enum (choices), `T | None`
("none" or "" means None), list[T] (comma-separated), and ByteSize (an int
written `2GiB`, `512MiB`, `1.5G` or plain bytes). Help text comes from
the field's metadata["help"] (`option(help=...)`), else from the `# comment`
that ends the field's line in the class source. `option(ge=1)` / `option(gt=0)`
bound a number where it is parsed (flag, env) and in `check_bounds` (a
`__post_init__`); `option(secret=True)` marks a value that must never travel
on a command line (names ending in key, token, password or secret are too).

Configs compose, never copy: a field whose type is itself a dataclass (the
scheduler's `MeshConfig.planner: PlannerConfig`) is flattened, its fields
becoming flags of the outer config under their own names (`--max-num-seqs`),
so that a core's knobs are declared once, in the core's dataclass, and every
service and the offline engine that holds that dataclass gets them.
`from_flat` builds such a nested config from flat keyword settings
(`LLM(max_num_seqs=8)`), and `add_flag_group` / `forward` let a launcher
(`llmesh up`) offer a service's flags under a prefix (`--worker.seed 3`) and
forward what was given to that service.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import inspect
import io
import os
import re
import tokenize
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

T = TypeVar("T")

ENV_PREFIX = "LLMESH_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"", "none", "null"}


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str = "",
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    ge: float | None = None,
    gt: float | None = None,
    secret: bool = False,
) -> Any:
    """A dataclass field with a help string for `--help` (a thin `dataclasses.field`).

    ge / gt: the smallest value allowed (inclusive / exclusive), checked where a flag or env var
    is parsed and by `check_bounds`. secret: the value (a key, a URL with a password) is handed
    to a child process in its environment, never on its command line (`forward`).
    """
    meta: dict[str, Any] = {"help": help}
    meta |= {k: v for k, v in (("ge", ge), ("gt", gt)) if v is not None}
    if secret:
        meta["secret"] = True
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


_SECRET_WORDS = {"key", "token", "password", "secret"}


def is_secret(f: dataclasses.Field[Any]) -> bool:
    """Whether a field's value must stay off command lines (`option(secret=True)` or its name says so)."""
    return bool(f.metadata.get("secret")) or f.name.rsplit("_", 1)[-1] in _SECRET_WORDS


def _bound_error(f: dataclasses.Field[Any], value: Any) -> str | None:
    ge, gt = f.metadata.get("ge"), f.metadata.get("gt")
    if value is None or isinstance(value, bool):
        return None
    if ge is not None and value < ge:
        return f"must be >= {ge}, got {value}"
    if gt is not None and value <= gt:
        return f"must be > {gt}, got {value}"
    return None


def check_bounds(config: Any) -> None:
    """Raise ValueError for the first field of `config` outside its `option(ge=, gt=)` bound."""
    for f in dataclasses.fields(config):
        if (error := _bound_error(f, getattr(config, f.name))) is not None:
            raise ValueError(f"{f.name} {error}")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_names(field_name: str, service: str | None = None) -> list[str]:
    """Env vars read for a field, most specific first."""
    base = field_name.upper()
    names = [f"{ENV_PREFIX}{service.upper().replace('-', '_')}_{base}"] if service else []
    return [*names, f"{ENV_PREFIX}{base}"]


# -- types -----------------------------------------------------------------------

_BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BYTE_UNITS |= {f"{u}i": 1024 ** (i + 1) for i, u in enumerate("kmgt")}
_BYTE_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)


class ByteSize(int):
    """A size in bytes that config fields, flags and env vars may write with a unit.

    `ByteSize("2GiB")` = 2 * 1024**3, `ByteSize("1.5G")` = 1_500_000_000 (K/M/G/T are
    powers of 1000, Ki/Mi/Gi/Ti of 1024, as in Kubernetes), `ByteSize("4096")` = 4096.
    """

    def __new__(cls, value: int | str) -> ByteSize:
        if isinstance(value, str):
            m = _BYTE_SIZE.match(value)
            if not m:
                raise ValueError(f"expected a size like 4096, 512MiB or 2GiB, got {value!r}")
            number, scale = m.group(1), _BYTE_UNITS[(m.group(2) or "").lower()]
            value = int(float(number) * scale) if "." in number else int(number) * scale
        if value < 0:
            raise ValueError(f"a size must be >= 0, got {value}")
        return super().__new__(cls, value)


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}, got {text!r}")


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """`T | None` -> (T, True); anything else -> (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
        raise TypeError(f"unsupported union type {tp}")
    return tp, False


def _scalar_converter(tp: Any) -> tuple[Callable[[str], Any], list[str] | None]:
    """A str -> value function for a scalar type, and its choices (for --help) if any."""
    if tp is bool:
        return _parse_bool, None
    if tp in (int, float, str, Path, ByteSize):
        return tp, None
    if typing.get_origin(tp) is Literal:
        values = typing.get_args(tp)
        by_text = {str(v): v for v in values}

        def literal(text: str) -> Any:
            if text not in by_text:
                raise ValueError(f"expected one of {list(by_text)}, got {text!r}")
            return by_text[text]

        return literal, list(by_text)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        members = {m.name.lower(): m for m in tp} | {str(m.value).lower(): m for m in tp}

        def enum_value(text: str) -> Any:
            try:
                return members[text.strip().lower()]
            except KeyError:
                raise ValueError(f"expected one of {[m.name.lower() for m in tp]}, got {text!r}") from None

        return enum_value, [m.name.lower() for m in tp]
    raise TypeError(f"unsupported config field type {tp!r}")


def converter(tp: Any) -> tuple[Callable[[str], Any], list[str] | None]:
    """The str -> value function for a field type (CLI and env share it), and its choices."""
    inner, optional = _split_optional(tp)
    if typing.get_origin(inner) is list:
        (item_tp,) = typing.get_args(inner) or (str,)
        item, choices = _scalar_converter(item_tp)

        def to_list(text: str) -> list[Any]:
            return [item(part.strip()) for part in text.split(",") if part.strip()]

        conv: Callable[[str], Any] = to_list
    else:
        conv, choices = _scalar_converter(inner)
    if not optional:
        return conv, choices

    def maybe_none(text: str) -> Any:
        return None if text.strip().lower() in _NONE else conv(text)

    return maybe_none, choices


# -- help text -------------------------------------------------------------------


def _source_comments(cls: type) -> dict[str, str]:
    """Trailing `# comment` of each `name: type = ...` line in the classes' source."""
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # built in a REPL / exec: no source, no comment help
            continue
        lines = source.splitlines()
        try:
            tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        except (tokenize.TokenError, SyntaxError):
            continue
        for tok in tokens:
            if tok.type != tokenize.COMMENT:
                continue
            line = lines[tok.start[0] - 1]
            head = line[: tok.start[1]].strip()
            name = head.split(":", 1)[0].strip()
            if head and ":" in head and name.isidentifier():
                comments[name] = tok.string.lstrip("#").strip()
    return comments


def _describe_default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "empty"
    if isinstance(value, enum.Enum):
        return value.name.lower()
    return "none" if value is None else str(value)


# -- parser ----------------------------------------------------------------------


def _class_doc(cls: type) -> str | None:
    doc = inspect.getdoc(cls)
    # @dataclass invents a docstring (the signature) for classes without one: not a description.
    return None if doc is None or doc.startswith(f"{cls.__name__}(") else doc


def _nested(tp: Any) -> bool:
    """A field typed as a dataclass: its fields are flattened into the outer config's flags."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One knob: a field of a config, or of a dataclass nested in it (flattened), with its help."""

    field: dataclasses.Field[Any]
    type: Any
    help: str

    @property
    def name(self) -> str:
        return self.field.name

    def converter(self) -> tuple[Callable[[str], Any], list[str] | None]:
        """str -> value (types, choices and `option(ge=, gt=)` bounds), and the choices for --help."""
        conv, choices = converter(self.type)

        def checked(text: str) -> Any:
            value = conv(text)
            if (error := _bound_error(self.field, value)) is not None:
                raise argparse.ArgumentTypeError(error)
            return value

        checked.__name__ = getattr(conv, "__name__", "value")  # argparse names it in its messages
        return checked, choices


@functools.cache
def leaves(cls: type) -> tuple[Leaf, ...]:
    """The knobs of a config dataclass, nested dataclass fields flattened, in field order.

    A name may occur twice (EngineConfig's worker and planner both have max_num_seqs):
    `build_parser` refuses that, `from_flat` hands the value to both.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    comments = _source_comments(cls)
    out: list[Leaf] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if _nested(hints[f.name]):
            out += leaves(hints[f.name])
        else:
            out.append(Leaf(f, hints[f.name], f.metadata.get("help") or comments.get(f.name, "")))
    return tuple(out)


def _unique_leaves(cls: type) -> tuple[Leaf, ...]:
    found = leaves(cls)
    names = [leaf.name for leaf in found]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise TypeError(f"{cls.__name__}: knobs declared twice (one flag each): {', '.join(twice)}")
    return found


def _help_text(leaf: Leaf, service: str | None, choices: list[str] | None) -> str:
    envs = " or ".join(env_names(leaf.name, service))
    extra = f"[env {envs}; default {_describe_default(leaf.field)}]"
    if choices:
        extra = f"{{{','.join(choices)}}} {extra}"
    return f"{leaf.help} {extra}".strip().replace("%", "%%")


def _add_flags(
    target: argparse.ArgumentParser | argparse._ArgumentGroup,
    found: Sequence[Leaf],
    *,
    service: str | None,
    prefix: str = "",
    aliases: Mapping[str, str] | None = None,
) -> None:
    """One flag per knob (`--name`, or `--prefix.name` with dest `prefix.name`), absent unless given."""
    aliases = aliases or {}
    for leaf in found:
        f, tp = leaf.field, leaf.type
        conv, choices = leaf.converter()
        help_text = _help_text(leaf, service, choices)
        dest = f"{prefix}.{f.name}" if prefix else f.name

        def names(field_name: str, alias: str | None = None) -> list[str]:
            flag = flag_name(field_name)
            main = f"--{prefix}.{flag[2:]}" if prefix else flag
            return [main, alias] if alias else [main]

        flags, common = names(f.name, aliases.get(f.name)), {"dest": dest, "default": argparse.SUPPRESS}
        if tp is bool and prefix:
            # `--prefix.x` / `--prefix.no-x` (BooleanOptionalAction would spell `--no-prefix.x`).
            off = names(f.name[3:] if f.name.startswith("no_") else "no_" + f.name)
            target.add_argument(*flags, action=_Switch, off=off, help=help_text, **common)
        elif tp is bool and f.name.startswith("no_"):
            # BooleanOptionalAction reads any flag spelt `--no-...` as False: a field that is
            # itself a negation (no_tokenizer) gets a plain switch (and `--x` to undo it).
            target.add_argument(*flags, action="store_const", const=True, help=help_text, **common)
            undo = names(f.name[3:])
            target.add_argument(*undo, action="store_const", const=False, help=argparse.SUPPRESS, **common)
        elif tp is bool:
            target.add_argument(*flags, action=argparse.BooleanOptionalAction, help=help_text, **common)
        else:
            target.add_argument(*flags, type=conv, metavar=f.name.upper(), help=help_text, **common)


class _Switch(argparse.Action):
    """A prefixed bool: its own flags set it, the `off` spellings (`--prefix.no-x`) clear it."""

    def __init__(self, option_strings: list[str], dest: str, *, off: list[str], **kwargs: Any):
        super().__init__([*option_strings, *off], dest, nargs=0, **kwargs)
        self.off = set(off)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, option_string not in self.off)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def build_parser(
    cls: type,
    *,
    prog: str | None = None,
    description: str | None = None,
    service: str | None = None,
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per knob. Flags left out are absent from the result."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description if description is not None else _class_doc(cls),
        # Defaults are shown by hand (they come from the dataclass, not argparse).
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_flags(parser, _unique_leaves(cls), service=service)
    return parser


def from_flat(cls: type[T], values: Mapping[str, Any], *, what: str = "settings") -> T:
    """`cls` from flat knob values: each name goes to the field (or nested dataclass fields) of that name.

    A nested dataclass none of whose knobs is given keeps its default. Unknown names: TypeError.
    """
    unknown = set(values) - {leaf.name for leaf in leaves(cls)}
    if unknown:
        raise TypeError(f"unknown {what}: {', '.join(sorted(unknown))}")
    return _build(cls, values)


def _build(cls: type[T], values: Mapping[str, Any]) -> T:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init:
            continue
        if _nested(hints[f.name]):
            if any(leaf.name in values for leaf in leaves(hints[f.name])):
                kwargs[f.name] = _build(hints[f.name], values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def load_config(
    cls: type[T],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    service: str | None = None,
    prog: str | None = None,
    description: str | None = None,
) -> T:
    """Build `cls` from CLI flags (argv, default sys.argv[1:]) over env (default os.environ) over defaults.

    Bad values exit with a usage error (status 2) naming the flag or env var,
    as argparse does; so does a ValueError raised by the dataclass itself.
    """
    environ = os.environ if environ is None else environ
    parser = build_parser(cls, prog=prog, description=description, service=service)
    ns = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    for leaf in _unique_leaves(cls):
        f = leaf.field
        if f.name in ns:
            values[f.name] = ns[f.name]
            continue
        for env in env_names(f.name, service):
            if env in environ:
                conv, _ = leaf.converter()
                try:
                    values[f.name] = conv(environ[env])
                except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                    parser.error(f"{env}={environ[env]!r}: {e}")
                break
        else:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                parser.error(f"{flag_name(f.name)} (or {env_names(f.name, service)[-1]}) is required")
    try:
        return from_flat(cls, values)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


# -- a service's flags in a launcher's parser ---------------------------------------


def select(cls: type, *, exclude: Iterable[str] = (), only: Iterable[str] | None = None) -> list[Leaf]:
    """Some knobs of `cls` (all but `exclude`, or just `only`), for `add_flag_group`."""
    skip, keep = set(exclude), None if only is None else set(only)
    return [
        leaf for leaf in _unique_leaves(cls) if leaf.name not in skip and (keep is None or leaf.name in keep)
    ]


def add_flag_group(
    parser: argparse.ArgumentParser,
    found: Sequence[Leaf],
    prefix: str,
    *,
    title: str,
    description: str | None = None,
    service: str | None = None,
    aliases: Mapping[str, str] | None = None,
) -> None:
    """A service's knobs (`select`) as a group of another command's flags: `--PREFIX.NAME` (just
    `--NAME` when prefix is ""), each also spelt `aliases[name]` where given; read them back with
    `given_values` / `forward`. The help names the service's env vars: a child started with this
    process's environment reads them too.
    """
    group = parser.add_argument_group(title, description)
    _add_flags(group, found, service=service, prefix=prefix, aliases=aliases)


def given_values(args: argparse.Namespace, found: Sequence[Leaf], prefix: str = "") -> list[tuple[Leaf, Any]]:
    """The knobs of an `add_flag_group` group given on the command line, with their parsed values."""
    ns = vars(args)
    keys = [(leaf, f"{prefix}.{leaf.name}" if prefix else leaf.name) for leaf in found]
    return [(leaf, ns[key]) for leaf, key in keys if key in ns]


def value_text(value: Any) -> str:
    """A parsed value written back as its flag or env var reads it (bools 1/0, lists comma-separated)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if value is None:
        return "none"
    if isinstance(value, list):
        return ",".join(map(value_text, value))
    if isinstance(value, enum.Enum):
        return value.name.lower()
    return str(value)


def flag_words(leaf: Leaf, value: Any) -> list[str]:
    """The service's own command-line words that set `leaf` to `value` (`--x 3`, `--x`, `--no-x`)."""
    if leaf.type is bool:
        negated = leaf.name.startswith("no_")
        on = value if not negated else not value
        base = leaf.name[3:] if negated else leaf.name
        return [flag_name(base) if on else flag_name("no_" + base)]
    return [flag_name(leaf.name), value_text(value)]


def forward(
    args: argparse.Namespace, found: Sequence[Leaf], prefix: str, service: str
) -> tuple[list[str], dict[str, str]]:
    """A group's given knobs as the service's own flags, and its secrets as its env vars.

    Secrets (`is_secret`) go into the service-scoped variable (LLMESH_<SERVICE>_<NAME>), which only
    that service reads: argv is visible to every user of the host (`ps`), the environment is not.
    """
    argv: list[str] = []
    env: dict[str, str] = {}
    for leaf, value in given_values(args, found, prefix):
        if is_secret(leaf.field):
            env[env_names(leaf.name, service)[0]] = value_text(value)
        else:
            argv += flag_words(leaf, value)
    return argv, env
