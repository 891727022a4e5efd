"""The wire codec of the messages: a message to a JSON object and back, checking every field.

On the wire a message is a JSON object: the dataclass's fields, plus ``"type"`` and the protocol
version ``"v"`` (inside sealed frames, see :mod:`checkpointless.wire`). :func:`decode` turns a
received object back into its dataclass and checks every field's type on the way, so the decision
code never sees a malformed message. The codec is separate from the message classes because it is
the one part that handles untrusted input: it knows every message type (its registry) and nothing
else, and the fuzzer in ``tests/unit/protocol/test_protocol.py`` aims at it. The same codec carries a
``Succession`` through a process's environment (:data:`SUCCESSION_ENV`), the one place a message
travels outside a frame.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path, PurePath
from typing import Any, Union

from checkpointless.peer_table import compact_plan, expand_plan
from checkpointless.protocol.agent_link import (
    AgentHeartbeat,
    AgentHello,
    AgentRefused,
    AgentWelcome,
    HealthReport,
    KillCmd,
    ProcConnected,
    ProcExited,
    ProcStarted,
    ProcVerdict,
    SpawnCmd,
    Succession,
    Vote,
)
from checkpointless.protocol.base import VERSION, Message, ProtocolError
from checkpointless.protocol.plan import PLAN_FIELDS_ALWAYS_SENT, ResumePlan
from checkpointless.protocol.worker_link import (
    Abort,
    Assign,
    Committed,
    Done,
    DoneSeen,
    Fatal,
    Fired,
    FiredSeen,
    Heartbeat,
    Hello,
    Inexact,
    PeerTable,
    PeerTableRequest,
    Prefetch,
    Prepare,
    Recover,
    Recovered,
    ReplayDiffers,
    Shutdown,
    SpareReady,
    Stopped,
)
from checkpointless.settings.spec import WIRE

__all__ = ["SUCCESSION_ENV", "decode", "encode", "succession_from_env", "succession_to_env"]

# Every type a receiver accepts, listed rather than collected from Message's subclasses: a class
# is on the wire only when it is named here, never because some module happened to define it.
_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        Heartbeat,
        PeerTableRequest,
        SpareReady,
        Fired,
        FiredSeen,
        Inexact,
        ReplayDiffers,
        Stopped,
        Recovered,
        Committed,
        Done,
        DoneSeen,
        Fatal,
        Assign,
        Prepare,
        Prefetch,
        Abort,
        Recover,
        PeerTable,
        Shutdown,
        AgentHello,
        ProcStarted,
        ProcExited,
        ProcVerdict,
        AgentHeartbeat,
        HealthReport,
        AgentWelcome,
        AgentRefused,
        SpawnCmd,
        KillCmd,
        ProcConnected,
        Succession,
        Vote,
    )
}


def encode(msg: Message) -> dict[str, Any]:
    """The JSON object a message travels as."""
    out: dict[str, Any] = {"type": msg.TYPE, "v": VERSION}
    nested = _nested(type(msg))
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        out[f.name] = _object(value) if f.name in nested else value
    return out


def _object(value: Any) -> Any:
    """A dataclass inside a message (the job's settings in a welcome) as a JSON object: the fields
    that travel (metadata ``WIRE``, default yes), paths as text."""
    if value is None:
        return None
    out = {
        f.name: str(v) if isinstance(v := getattr(value, f.name), PurePath) else v
        for f in dataclasses.fields(value)
        if f.metadata.get(WIRE, True)
    }
    return _plan_to_wire(out) if isinstance(value, ResumePlan) else out


# -- a recovery plan: its rank lists travel compact (peer_table.compact_plan) ------------------------
_MAX_PLAN_RANKS = 1 << 22  # far above any job; a compact list that expands to more is refused


def _plan_to_wire(fields: dict[str, Any]) -> dict[str, Any]:
    """A plan's fields as they travel: unset optional ones left out, long rank lists compacted."""
    sent = {k: v for k, v in fields.items() if k in PLAN_FIELDS_ALWAYS_SENT or v}
    return compact_plan(sent)


def _plan_from_wire(value: dict[str, Any], name: str) -> ResumePlan:
    """The plan in a received object: its compact lists expanded (within bounds), then every field
    checked as any record's."""
    ranges = _int_rows(value, "receiver_ranges", 2, name)  # [start, stop]
    runs = _int_rows(value, "source_runs", 5, name)  # [receiver, count, source, step, repeats]
    expanding = sum(max(0, r[1] - r[0]) for r in ranges) + sum(max(0, r[1] * r[4]) for r in runs)
    if expanding > _MAX_PLAN_RANKS:
        raise ProtocolError(f"field {name!r}: its compact lists expand to {expanding} entries")
    try:
        expanded = expand_plan(value)
    except ValueError as e:  # peer_table.TableError: a range or run that is not one
        raise ProtocolError(f"field {name!r}: {e}") from None
    plan: ResumePlan = _build(ResumePlan, expanded, name)
    if any(len(pair) != 2 for pair in plan.sources):
        raise ProtocolError(f"field {name!r}: sources must be [receiver, source] pairs")
    if any(len(pair) != 2 or pair[0] == pair[1] or min(pair) < 0 for pair in plan.holders):
        raise ProtocolError(f"field {name!r}: holders must be [slot, holder] pairs of two ranks")
    if len({pair[0] for pair in plan.holders}) != len(plan.holders):
        raise ProtocolError(f"field {name!r}: a slot is held twice in holders")
    if {pair[0] for pair in plan.holders} & {pair[1] for pair in plan.holders}:
        raise ProtocolError(f"field {name!r}: a held slot's process cannot hold another slot")
    return plan


def _int_rows(value: dict[str, Any], key: str, width: int, name: str) -> list[list[int]]:
    rows = value.get(key, [])
    if not isinstance(rows, list) or not all(
        isinstance(r, list) and len(r) == width and all(type(x) is int for x in r) for r in rows
    ):
        raise ProtocolError(f"field {name!r}: {key} is not a list of {width}-int lists")
    return rows


_NESTED: dict[type[Message], frozenset[str]] = {}


def _nested(cls: type[Message]) -> frozenset[str]:
    """The fields of ``cls`` that hold a dataclass (looked up once per class: encode is hot)."""
    found = _NESTED.get(cls)
    if found is None:
        found = _NESTED[cls] = frozenset(
            name
            for name, hint in _hints(cls).items()
            if any(_is_record(arm) for arm in (typing.get_args(hint) or (hint,)))
        )
    return found


def _is_record(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _check(name: str, value: Any, hint: Any) -> Any:
    """``value`` if it fits the annotation ``hint`` (the few shapes our messages use)."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        for arm in typing.get_args(hint):
            if arm is type(None) and value is None:
                return None
            if arm is not type(None):
                try:
                    return _check(name, value, arm)
                except ProtocolError:
                    continue
        raise ProtocolError(f"field {name!r}: {value!r} is not {hint}")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif hint is Path:
        if isinstance(value, str):
            return Path(value)
    elif _is_record(hint):
        if isinstance(value, dict):
            return _plan_from_wire(value, name) if hint is ResumePlan else _build(hint, value, name)
    elif origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, list):
            fast = _fast_list(value, item)  # an agent's heartbeat columns: no call per element
            return fast if fast is not None else [_check(name, v, item) for v in value]
    elif origin is dict and isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return value
    raise ProtocolError(f"field {name!r}: {value!r} is not {getattr(hint, '__name__', hint)}")


def _fast_list(value: list[Any], item: Any) -> list[Any] | None:
    """``value`` checked in one pass when ``item`` is a plain scalar type; None: check each."""
    if item is int:
        ok = all(type(v) is int for v in value)  # bool is not an int here, as in _check
    elif item is bool:
        ok = all(type(v) is bool for v in value)
    elif item is str:
        ok = all(type(v) is str for v in value)
    elif item is float:
        if all(type(v) is float for v in value):
            return value
        return None  # ints among them become floats in _check
    else:
        return None
    return value if ok else None


_HINTS: dict[type, dict[str, Any]] = {}


def decode(obj: Any) -> Message:
    """The typed message in a received JSON object; :class:`ProtocolError` if it is not one."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message must be a JSON object, not {type(obj).__name__}")
    kind = obj.get("type")
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {obj.get('type')!r}")
    version = obj.get("v", VERSION)
    if version != VERSION:
        raise ProtocolError(f"{cls.TYPE}: protocol version {version!r}, this side speaks {VERSION}")
    msg: Message = _build(cls, obj, cls.TYPE)
    return msg


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _build(cls: type[Any], obj: dict[str, Any], label: str) -> Any:
    """An instance of dataclass ``cls`` from the fields in ``obj``, each checked; fields that do
    not travel (metadata ``WIRE``) keep their defaults, and unknown keys are ignored."""
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.metadata.get(WIRE, True):
            continue
        if f.name in obj:
            kwargs[f.name] = _check(f"{label}.{f.name}", obj[f.name], hints[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{label}: missing field {f.name!r}")
    return cls(**kwargs)


# -- a succession handed to a process as it starts ------------------------------------------------
SUCCESSION_ENV = "CHECKPOINTLESS_SUCCESSION"  # the agent's newest Succession, as JSON


def succession_to_env(s: Succession) -> str:
    """The value of :data:`SUCCESSION_ENV` for a process the agent starts: a process starting
    as the coordinator is lost has not heard a ``Succession`` yet, and needs one to reconnect."""
    return json.dumps(encode(s), separators=(",", ":"))


def succession_from_env(text: str | None) -> Succession | None:
    """The succession in :data:`SUCCESSION_ENV`, or None when unset; :class:`ProtocolError`
    when it is set but is not one (an agent of another version, a mangled environment)."""
    if not text:
        return None
    try:
        msg = decode(json.loads(text))
    except ValueError as e:
        raise ProtocolError(f"{SUCCESSION_ENV} is not JSON: {e}") from None
    if not isinstance(msg, Succession):
        raise ProtocolError(f"{SUCCESSION_ENV} holds a {msg.TYPE}, not a succession")
    return msg
