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
that ends the field's line in the class source.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect
import io
import os
import re
import tokenize
import types
import typing
from collections.abc import Callable, Mapping, Sequence
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
) -> Any:
    """A dataclass field with a help string for `--help` (a thin `dataclasses.field`)."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"help": help})


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


def _fields(cls: type) -> tuple[list[dataclasses.Field[Any]], dict[str, Any]]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    return fields, hints


def build_parser(
    cls: type,
    *,
    prog: str | None = None,
    description: str | None = None,
    service: str | None = None,
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per field. Flags left out are absent from the result."""
    fields, hints = _fields(cls)
    comments = _source_comments(cls)
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description if description is not None else _class_doc(cls),
        # Defaults are shown by hand (they come from the dataclass, not argparse).
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for f in fields:
        tp = hints[f.name]
        conv, choices = converter(tp)
        text = f.metadata.get("help") or comments.get(f.name, "")
        envs = " or ".join(env_names(f.name, service))
        extra = f"[env {envs}; default {_describe_default(f)}]"
        if choices:
            extra = f"{{{','.join(choices)}}} {extra}"
        help_text = f"{text} {extra}".strip().replace("%", "%%")
        if tp is bool and f.name.startswith("no_"):
            # BooleanOptionalAction reads any flag spelt `--no-...` as False: a field that is
            # itself a negation (no_tokenizer) gets a plain switch (and `--x` to undo it).
            parser.add_argument(
                flag_name(f.name), dest=f.name, action="store_const", const=True, help=help_text
            )
            parser.add_argument(
                flag_name(f.name[3:]), dest=f.name, action="store_const", const=False, help=argparse.SUPPRESS
            )
        elif tp is bool:
            parser.add_argument(
                flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            parser.add_argument(
                flag_name(f.name), dest=f.name, type=conv, metavar=f.name.upper(), help=help_text
            )
    return parser


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
    fields, hints = _fields(cls)
    kwargs: dict[str, Any] = {}
    for f in fields:
        if f.name in ns:
            kwargs[f.name] = ns[f.name]
            continue
        for env in env_names(f.name, service):
            if env in environ:
                conv, _ = converter(hints[f.name])
                try:
                    kwargs[f.name] = conv(environ[env])
                except (TypeError, ValueError) as e:
                    parser.error(f"{env}={environ[env]!r}: {e}")
                break
        else:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                parser.error(f"{flag_name(f.name)} (or {env_names(f.name, service)[-1]}) is required")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
