"""How a setting is declared: a dataclass field that carries its flag, help, checks and wire rule.

A command's settings are one frozen dataclass (:mod:`~checkpointless.settings.job`,
:mod:`~checkpointless.settings.agent`). Each field that is a command-line flag is made with
:func:`flag`, which stores a :class:`Flag` in the field's metadata next to the field's default and
type; everything else is generated from those: the argparse flags and help
(:mod:`~checkpointless.settings.argv`), the per-value validation (:func:`check_fields`), the JSON
an agent receives (the protocol codec reads :data:`WIRE`) and the documented defaults
(:mod:`~checkpointless.settings.docs`). A setting is therefore written once.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from checkpointless.errors import ConfigError

__all__ = [
    "FLAG",
    "WIRE",
    "Flag",
    "Range",
    "arms",
    "base_type",
    "check_fields",
    "default_of",
    "doc_default",
    "flag",
    "flag_fields",
    "flag_of",
    "format_value",
    "hints",
    "local",
    "option",
]

FLAG = "checkpointless.flag"  # a field's metadata key for its Flag
# A field's metadata key saying whether it travels to other hosts (default: it does). The protocol
# codec honours it for a settings object inside a message; the settings sit below the protocol,
# so the key is defined here.
WIRE = "checkpointless.wire"


@dataclass(frozen=True)
class Range:
    """The values a number may take, and the words that say so in the refusal:
    ``FLAG must be WORDS (got VALUE)``, then ``; e.g. FLAG EXAMPLE`` or ``; NOTE``. Infinity and
    NaN are always outside it."""

    low: float
    words: str
    above: bool = False  # strictly above ``low``, not merely at least it
    off: float | None = None  # this value is allowed too (it turns the feature off)
    example: bool = False  # end the message with an example of a good value
    note: str = ""  # or with this

    def allows(self, value: float) -> bool:
        if self.off is not None and value == self.off:
            return True
        # written so that NaN fails every comparison, and so the check
        return math.isfinite(value) and (value > self.low if self.above else value >= self.low)


@dataclass(frozen=True)
class Flag:
    """What a setting is on the command line. The type, the default and whether it is required
    (no default) come from the field itself."""

    help: str  # without the default: the generated help adds it
    name: str = ""  # the option when it is not --<field-name>, e.g. --inject for ``faults``
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    const: float | None = None  # the value of the option given alone (nargs="?")
    invert: bool = False  # a bool field that the switch sets False (--no-fork-server)
    positional: bool = False  # an argument, not an option (a list one takes all that follows)
    env: str = ""  # an environment variable that gives the default; the flag wins
    unset: bool = False  # absent from the command line it is None, which the command resolves
    doc_default: str = ""  # the documented default when it is prose, not the field's value
    off: object = None  # the value that turns the feature off: documented as "<value> (off)"
    example: str = ""  # a good value for messages (default: the field's default)
    finite: bool = False  # NaN and infinity get their own message, before ``limit``
    limit: Range | None = None
    check: Callable[[Any], None] | None = None  # the value alone; raises ConfigError


def flag(
    default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, wire: bool = True, **kw: Any
) -> Any:
    """A settings field that is a command-line flag (``kw``: :class:`Flag`'s fields)."""
    meta = {FLAG: Flag(**kw), WIRE: wire}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def local(default: Any) -> Any:
    """A settings field that is no flag and stays on this host (an interpreter path, the command)."""
    return dataclasses.field(default=default, metadata={WIRE: False})


def flag_of(f: dataclasses.Field[Any]) -> Flag | None:
    found = f.metadata.get(FLAG)
    return found if isinstance(found, Flag) else None


def flag_fields(cls: type) -> list[tuple[dataclasses.Field[Any], Flag]]:
    """The fields of settings class ``cls`` that are flags, in declaration order."""
    return [(f, fl) for f in dataclasses.fields(cls) if (fl := flag_of(f)) is not None]


def option(f: dataclasses.Field[Any], fl: Flag) -> str:
    """The flag's name on the command line."""
    if fl.positional:
        return f.name
    return fl.name or "--" + f.name.replace("_", "-")


def default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def format_value(value: Any) -> str:
    """A value as the docs and the messages write it: 10.0 as 10, 0.5 as 0.5."""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def doc_default(f: dataclasses.Field[Any], fl: Flag) -> str:
    """The default as docs/configuration.md writes it (markdown), derived from the field."""
    value = default_of(f)
    if fl.doc_default:
        text = fl.doc_default
    elif fl.env:
        text = f"`${fl.env}`, else {format_value(value)}"
    elif value is None or isinstance(value, bool):
        text = "off"  # a switch's default, or a feature that is off until given a value
    elif value == []:
        text = "none"
    elif fl.off is not None and value == fl.off:
        text = f"{format_value(value)} (off)"
    else:
        text = format_value(value)
    if fl.const is not None:
        text += f" ({format_value(fl.const)} when given alone)"
    return text


def hints(cls: type) -> dict[str, Any]:
    """The fields' types, resolved (the modules write annotations as text)."""
    return typing.get_type_hints(cls)


def arms(hint: Any) -> tuple[Any, ...]:
    """The types a field may hold (``int | None``: int), None left out."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(hint) if a is not type(None))
    return (hint,)


def base_type(hint: Any) -> Any:
    """A setting's type without None and without its items: int, float, str, bool, Path, list."""
    (arm,) = arms(hint)  # a setting has one type, or it and None
    return typing.get_origin(arm) or arm


def _example(f: dataclasses.Field[Any], fl: Flag) -> str:
    return fl.example or format_value(default_of(f))


def check_fields(settings: Any) -> None:
    """Refuse the first field of ``settings`` whose value alone is bad, naming the flag, the
    value and the fix; the rules are the fields' own (finite, limit, choices, check)."""
    # the options first, then the script: a bad count is named before a missing file
    for f, fl in sorted(flag_fields(type(settings)), key=lambda pair: pair[1].positional):
        value = getattr(settings, f.name)
        name = option(f, fl)
        if fl.finite and not math.isfinite(value):
            # NaN passes every "<= limit" test and infinity waits forever: refuse both first
            raise ConfigError(f"{name} must be a finite number (got {value}); e.g. {name} {_example(f, fl)}")
        if fl.limit is not None and not fl.limit.allows(value):
            tail = f"; e.g. {name} {_example(f, fl)}" if fl.limit.example else ""
            tail += f"; {fl.limit.note}" if fl.limit.note else ""
            raise ConfigError(f"{name} must be {fl.limit.words} (got {value}){tail}")
        if fl.choices and value not in fl.choices:
            *most, last = fl.choices
            raise ConfigError(f"{name} must be {', '.join(most)} or {last} (got {value!r})")
        if fl.check is not None:
            fl.check(value)
