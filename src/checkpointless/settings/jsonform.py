"""A settings object as JSON and back: the fields that travel (:data:`~.spec.WIRE`), paths as text.

The agents receive the job's settings typed, inside the welcome, through the protocol codec, which
checks every field; these two are for a settings object kept as plain JSON (a file, a test).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path, PurePath
from typing import Any, TypeVar

from checkpointless.settings.spec import WIRE, arms, hints

__all__ = ["from_json", "to_json"]

T = TypeVar("T")


def to_json(settings: Any) -> dict[str, Any]:
    """The fields of ``settings`` that travel, as JSON values."""
    return {
        f.name: str(v) if isinstance(v := getattr(settings, f.name), PurePath) else v
        for f in dataclasses.fields(settings)
        if f.metadata.get(WIRE, True)
    }


def from_json(cls: type[T], raw: dict[str, Any]) -> T:
    """The settings :func:`to_json` wrote; fields this side does not know are dropped, and those
    that do not travel take their defaults."""
    types_of = hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in raw or not f.metadata.get(WIRE, True):
            continue
        value = raw[f.name]
        kwargs[f.name] = Path(value) if value is not None and Path in arms(types_of[f.name]) else value
    return cls(**kwargs)
