"""A settings class on the command line: its argparse flags and help, and the values parsed back.

Everything here is read from the fields (their type, default and :class:`~.spec.Flag`), so a
flag is declared once, in the settings class.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from checkpointless.errors import ConfigError
from checkpointless.settings.spec import (
    Flag,
    arms,
    base_type,
    default_of,
    doc_default,
    flag_fields,
    hints,
    option,
)

__all__ = ["add_flags", "cell", "values_from"]


def _dest(f: Any, fl: Flag) -> str:
    # an inverted switch keeps its own name in the namespace (args.no_fork_server is True when
    # given), so that the parser's default is the switch's: off
    return option(f, fl).lstrip("-").replace("-", "_") if fl.invert else f.name


def _help(f: Any, fl: Flag, base: Any) -> str:
    if fl.positional or base in (bool, list) or default_of(f) is dataclasses.MISSING:
        return fl.help  # a switch is off, a list empty, a required flag has none
    return f"{fl.help} (default {doc_default(f, fl).replace('`', '')})"


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add the flags of settings class ``cls`` to ``parser``, in the order of its fields."""
    types_of = hints(cls)
    for f, fl in flag_fields(cls):
        base = base_type(types_of[f.name])
        if fl.positional:
            if base is list:
                parser.add_argument(f.name, nargs=argparse.REMAINDER, help=fl.help)
            else:
                parser.add_argument(f.name, help=fl.help)
            continue
        kw: dict[str, Any] = {"dest": _dest(f, fl), "help": _help(f, fl, base)}
        if base is bool:
            kw["action"] = "store_true"
        elif base is list:
            kw.update(action="append", default=[], metavar=fl.metavar)
        else:
            if base in (int, float):
                kw["type"] = base
            default = default_of(f)
            if default is dataclasses.MISSING:
                kw["required"] = True
            else:
                kw["default"] = None if (fl.env or fl.unset) else default
            if fl.choices:
                kw["choices"] = list(fl.choices)
            if fl.const is not None:
                kw.update(nargs="?", const=fl.const)
            if fl.metavar:
                kw["metavar"] = fl.metavar
        parser.add_argument(option(f, fl), **kw)


def cell(f: Any, fl: Flag, base: Any) -> str:
    """The flag as docs/configuration.md's table names it: ``--name METAVAR``."""
    name = option(f, fl)
    if base is bool:
        return name
    if fl.metavar and fl.const is not None:
        return f"{name} [{fl.metavar}]"
    if fl.metavar:
        return f"{name} {fl.metavar}"
    return f"{name} {'|'.join(fl.choices)}" if fl.choices else name


def _from_env(name: str, fallback: Any) -> Any:
    text = os.environ.get(name, "").strip()
    if not text:
        return fallback
    try:
        return int(text)
    except ValueError as e:
        raise ConfigError(f"{name}={text!r} is not an integer") from e


def values_from(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of ``cls``'s flags in parsed ``args``, as the fields hold them: paths as
    :class:`~pathlib.Path` (an empty one refused: it would mean the current directory), an
    environment default where the flag was not given, an inverted switch inverted. A flag with
    ``unset`` is None when it was not given; the command resolves it."""
    types_of = hints(cls)
    fields = flag_fields(cls)
    # every environment default is read, and must parse, whether or not its flag was given
    env = {f.name: _from_env(fl.env, default_of(f)) for f, fl in fields if fl.env}
    out: dict[str, Any] = {}
    for f, fl in fields:
        value = getattr(args, _dest(f, fl))
        if fl.invert:
            value = not value
        elif value is None and f.name in env:
            value = env[f.name]
        elif value is not None and Path in arms(types_of[f.name]):
            if not value.strip():
                name = option(f, fl)
                raise ConfigError(f"{name} is empty; name a directory, e.g. {name} {fl.example}")
            value = Path(value)
        out[f.name] = value
    return out
