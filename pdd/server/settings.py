"""A setting's flag, env name, type and default, all derived from its config dataclass field.

Every service's ``__main__`` lists, per frozen config dataclass, the fields it exposes
(``Settings``); one rule turns each field into an argparse flag:

- flag: ``--`` + the group's prefix + the field's name with ``_`` spelled ``-``, the field's unit
  suffix swapped for the flag's (``max_message_bytes`` in MB → ``--max-message-mb``); a ``Flag``
  may name it instead (names older than this rule) and keep older spellings as aliases;
- env name: ``PDD_`` + the flag's name upper-cased (``--tls-client-auth`` →
  ``PDD_TLS_CLIENT_AUTH``), so a flag and its variable never drift apart;
- default: the field's own (or one the service passes to ``add``, e.g. its port), never a second
  literal; a field with neither is a required flag unless its env variable is set;
- type: the field's annotation: int, float, str, bool (``--x/--no-x``), an Enum (by value),
  ``X | None`` (``Flag.none`` is the text that stands for None), ``tuple[str, ...]``
  (repeatable flag; env comma-separated).

Precedence: flag > env > default. A value that does not parse is an argparse error naming the
flag or the env variable; whether a parsed value is allowed is decided once, by the dataclass's
``__post_init__`` (a ValueError naming the field), which ``parse_config`` turns into an argparse
error too: one line, no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

ENV_PREFIX = "PDD_"
T = TypeVar("T")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Unit:
    """A flag counted in another unit than its field (``--kv-cache-mb`` → ``kv_cache_bytes``)."""

    field_suffix: str
    flag_suffix: str
    factor: int
    # False: field = flag * factor (MB → bytes); True: field = flag / factor (ms → s).
    divides: bool = False

    def to_field(self, value: Any) -> Any:
        return value / self.factor if self.divides else value * self.factor

    def to_flag(self, value: Any) -> Any:
        if self.divides:
            return value * self.factor
        return value // self.factor if value % self.factor == 0 else value / self.factor


MB = Unit("_bytes", "_mb", 2**20)
KB = Unit("_bytes", "_kb", 2**10)
MS = Unit("_s", "_ms", 1000, divides=True)


@dataclass(frozen=True)
class Flag:
    """How one field is offered, where the rule alone is not enough."""

    field: str
    help: str = ""
    # The flag's name without "--"; "" = derived from the field (see the module docstring).
    name: str = ""
    # Older spellings that still work (no env variable of their own).
    aliases: tuple[str, ...] = ()
    unit: Unit | None = None
    # For an ``X | None`` field: the text that means None ("" when not given).
    none: str | None = None
    # Text → field value, for a field whose type reads no text by itself (e.g. json → True).
    choices: Mapping[str, Any] | None = None
    # Text → value (before the unit), raising ValueError, where the annotation's type won't do.
    parse: Callable[[str], Any] | None = None
    # For a bool field: an older flag that turns it off (e.g. --relay-remote-host).
    off: str = ""


@dataclass(frozen=True)
class _Spec:
    """A ``Flag`` resolved against its dataclass."""

    field: str
    flag: str
    aliases: tuple[str, ...]
    dest: str
    env: str
    kind: str  # "bool" | "list" | "value"
    convert: Callable[[str], Any]
    show: Callable[[Any], str]
    default: Any
    help: str
    off: str
    metavar: str | None


class Settings:
    """The flags of some fields of one config dataclass (an argument group)."""

    def __init__(self, config: type, *flags: Flag | str, prefix: str = "", title: str = "") -> None:
        self.config = config
        self.title = title
        hints = typing.get_type_hints(config)
        fields = {f.name: f for f in dataclasses.fields(config)}
        self.specs = tuple(
            _resolve(config, fields, hints, f if isinstance(f, Flag) else Flag(f), prefix)
            for f in flags
        )

    def add(self, parser: argparse.ArgumentParser, **defaults: Any) -> None:
        """Add the flags to ``parser``; ``defaults`` (field → value) replace the dataclass's."""
        unknown = set(defaults) - {s.field for s in self.specs}
        if unknown:
            raise TypeError(f"{self.config.__name__}: no flag for {sorted(unknown)}")
        group = _group(parser, self.title)
        for spec in self.specs:
            _add(group, spec, defaults.get(spec.field, spec.default))

    def values(self, args: argparse.Namespace) -> dict[str, Any]:
        """Field → parsed value, for the fields these flags set."""
        return {s.field: getattr(args, s.dest) for s in self.specs}

    def build(self, args: argparse.Namespace, **extra: Any) -> Any:
        """The config from the flags (and ``extra`` fields); its ``__post_init__`` validates."""
        return self.config(**self.values(args), **extra)


def env_name(flag: str) -> str:
    """THE rule: a flag's env variable (``tls-client-auth`` → ``PDD_TLS_CLIENT_AUTH``)."""
    return ENV_PREFIX + flag.replace("-", "_").upper()


def env_names(parser: argparse.ArgumentParser) -> set[str]:
    """Every env variable the flags of ``parser`` read."""
    return {a.env_name for a in parser._actions if hasattr(a, "env_name")}


def parse_config(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    make: Callable[[argparse.Namespace], T],
) -> T:
    """Parse ``argv`` and build the config; a field's ValueError becomes an argparse error."""
    args = parser.parse_args(argv)
    try:
        return make(args)
    except ValueError as exc:
        parser.error(str(exc))


def _resolve(
    config: type,
    fields: Mapping[str, dataclasses.Field],
    hints: Mapping[str, Any],
    flag: Flag,
    prefix: str,
) -> _Spec:
    if flag.field not in fields:
        raise TypeError(f"{config.__name__} has no field {flag.field!r}")
    f = fields[flag.field]
    stem = f.name
    if flag.unit is not None:
        if not stem.endswith(flag.unit.field_suffix):
            raise TypeError(
                f"{f.name}: a {flag.unit.flag_suffix} flag needs a *{flag.unit.field_suffix} field"
            )
        stem = stem.removesuffix(flag.unit.field_suffix) + flag.unit.flag_suffix
    name = flag.name or (f"{prefix}_{stem}" if prefix else stem).replace("_", "-")
    dest = f"{prefix}_{f.name}" if prefix else f.name
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        default = dataclasses.MISSING
    kind, convert, show = _reader(f.name, hints[f.name], flag)
    return _Spec(
        field=f.name,
        flag=name,
        aliases=flag.aliases,
        dest=dest,
        env=env_name(name),
        kind=kind,
        convert=convert,
        show=show,
        default=default,
        help=flag.help,
        off=flag.off,
        metavar=_metavar(name, flag, hints[f.name]),
    )


def _metavar(name: str, flag: Flag, hint: Any) -> str:
    if flag.choices is not None:
        return "{" + ",".join(flag.choices) + "}"
    if isinstance(hint, type) and issubclass(hint, enum.Enum) and flag.parse is None:
        return "{" + ",".join(str(m.value) for m in hint) + "}"
    if flag.unit is not None:
        return flag.unit.flag_suffix.lstrip("_").upper()
    return name.replace("-", "_").upper()


def _reader(
    field: str, hint: Any, flag: Flag
) -> tuple[str, Callable[[str], Any], Callable[[Any], str]]:
    """(kind, text → field value, field value → text) of a field's annotation."""
    optional = False
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"{field}: cannot read a {hint} from a flag")
        hint, optional = rest[0], True
    none = flag.none if flag.none is not None else ""
    if flag.choices is not None:
        names = " | ".join(flag.choices)

        def base(text: str) -> Any:
            if text not in flag.choices:
                raise ValueError(f"expected {names}, got {text!r}")
            return flag.choices[text]

        def show(value: Any) -> str:
            return next((k for k, v in flag.choices.items() if v == value), str(value))

        return "value", base, show
    if hint is bool:
        return "bool", _bool, lambda v: "on" if v else "off"
    if typing.get_origin(hint) is tuple:
        return "list", str, lambda v: ",".join(v) or "none"
    if flag.parse is not None:
        base = flag.parse
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        base = _enum_reader(hint)
    elif hint in (int, float, str):
        base = _number_reader(hint)
    else:
        raise TypeError(f"{field}: no flag type for {hint}; give Flag(parse=...)")
    unit = flag.unit

    def convert(text: str) -> Any:
        if optional and text == none:
            return None
        value = base(text)
        return unit.to_field(value) if unit is not None else value

    def show(value: Any) -> str:
        if value is None:
            return none or '""'
        if isinstance(value, enum.Enum):
            return str(value.value)
        value = unit.to_flag(value) if unit is not None else value
        if isinstance(value, float):
            return f"{value:g}"
        return str(value) if value != "" else '""'

    return "value", convert, show


def _number_reader(kind: type) -> Callable[[str], Any]:
    what = {int: "an integer", float: "a number", str: "text"}[kind]

    def read(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"expected {what}, got {text!r}") from None

    return read


def _enum_reader(kind: type[enum.Enum]) -> Callable[[str], Any]:
    def read(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            names = " | ".join(str(m.value) for m in kind)
            raise ValueError(f"expected {names}, got {text!r}") from None

    return read


def _bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(f"expected one of {', '.join(_TRUE)} or {', '.join(_FALSE[1:])}, got {text!r}")


class _EnvText(str):
    """A default read from the environment; argparse parses it only when the flag is not given."""

    env: str


def _env_text(env: str) -> _EnvText | None:
    raw = os.environ.get(env)
    if raw is None:
        return None
    text = _EnvText(raw)
    text.env = env
    return text


def _as_type(spec: _Spec) -> Callable[[str], Any]:
    """An argparse type reading a flag's text, or its env default, into the field's value."""

    def read(text: str) -> Any:
        try:
            if not isinstance(text, _EnvText):
                return spec.convert(text)
            if spec.kind == "bool":
                return _bool(text)
            if spec.kind == "list":
                return tuple(p.strip() for p in text.split(",") if p.strip())
            return spec.convert(text)
        except ValueError as exc:
            where = f"env {text.env}={str(text)!r}: " if isinstance(text, _EnvText) else ""
            raise argparse.ArgumentTypeError(f"{where}{exc}") from None

    read.__name__ = "value"
    return read


class _Append(argparse.Action):
    """A repeatable flag whose first use replaces the default (the env's list) rather than adds."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest)
        start = () if current is self.default else tuple(current)
        setattr(namespace, self.dest, (*start, values))


def _group(parser: argparse.ArgumentParser, title: str) -> Any:
    """The argument group titled ``title`` (made on first use), so help lists it once."""
    if not title:
        return parser
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def _add(group: Any, spec: _Spec, default: Any) -> None:
    # NOTE: an env value stays text until parse time: argparse runs it through ``type`` only
    # when the flag is absent (flag > env > default), and a bad one is an error naming both.
    env = _env_text(spec.env)
    value = default if env is None else env
    required = value is dataclasses.MISSING
    if required:
        shown = "required"
    elif env is not None:
        shown = f"now {str(env)!r}"
    else:
        shown = f"default {spec.show(value)}"
    text = f"{spec.help} " if spec.help else ""
    options = dict(
        dest=spec.dest,
        help=f"{text}(env {spec.env}; {shown})".replace("%", "%%"),
        required=required,
        type=_as_type(spec),
    )
    if not required:
        options["default"] = value
    names = [f"--{spec.flag}", *(f"--{a}" for a in spec.aliases)]
    if spec.kind == "bool":
        action = group.add_argument(*names, action=argparse.BooleanOptionalAction, **options)
        if spec.off:
            group.add_argument(
                f"--{spec.off}", dest=spec.dest, action="store_false", help=f"= --no-{spec.flag}"
            )
    elif spec.kind == "list":
        action = group.add_argument(*names, action=_Append, metavar=spec.metavar, **options)
    else:
        action = group.add_argument(*names, metavar=spec.metavar, **options)
    action.env_name = spec.env
