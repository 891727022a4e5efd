"""A run directory's records as readers may use them: each line parsed and each field checked.

A run directory may be hostile (shared, predictable, or simply damaged), so every record that
``status`` and ``report`` read is checked here first: each field they use has the type and range
they expect, so the code behind gets numbers where it expects numbers. A field that is wrong is a
:class:`BadRecord` (the reader, ``observe/jsonl.py``, adds ``FILE:LINE``); a line that is not JSON
at all is a :class:`TornLine` (the torn last line of a file being written, or garbage).
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["BadRecord", "TornLine", "check_record", "parse_line"]

_MAX_RANK = 1 << 20  # more ranks than any job has; a larger nproc is a damaged record


class BadRecord(Exception):
    """A field of one record is wrong; the reader adds FILE:LINE."""


class TornLine(Exception):
    """A line is not JSON: the torn last line of a file being written, or garbage."""


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise BadRecord(f"number {text[:40]} is out of range")
    return x


def _no_constant(name: str) -> float:
    raise BadRecord(f"{name} is not a number a writer produces")


def parse_line(line: bytes) -> Any:
    """The JSON value of one line: :class:`TornLine` if it is not JSON, :class:`BadRecord` if it
    is JSON that no writer produces (a non-finite number, nesting too deep, a huge integer)."""
    try:
        return json.loads(line, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:
        raise BadRecord("is nested too deeply to be a record") from None
    except UnicodeDecodeError:
        raise BadRecord("is not UTF-8 text") from None
    except json.JSONDecodeError:
        raise TornLine from None
    except ValueError as e:  # an integer of thousands of digits
        raise BadRecord(f"is not a record ({str(e)[:80]})") from None


def _int(rec: dict[str, Any], key: str, lo: int = 0, hi: int = 1 << 62, need: bool = True) -> None:
    v = rec.get(key)
    if v is None and not need:
        return
    if type(v) is not int or not lo <= v <= hi:  # bool is no count
        raise BadRecord(f"field {key!r} must be an integer in [{lo}, {hi}] (got {_show(v)})")


def _num(rec: dict[str, Any], key: str, need: bool = False, lo: float = 0.0) -> None:
    v = rec.get(key)
    if v is None and not need:
        return
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v:  # finite: the parser saw to it
        raise BadRecord(f"field {key!r} must be a number >= {lo:g} (got {_show(v)})")


def _str(rec: dict[str, Any], key: str, need: bool = False) -> None:
    v = rec.get(key)
    if (v is not None or need) and not isinstance(v, str):
        raise BadRecord(f"field {key!r} must be a string (got {_show(v)})")


def _show(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, str | int | float | bool) or v is None else type(v).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _check_fault(f: Any) -> None:
    if not isinstance(f, dict):
        raise BadRecord("a fault in 'faults' must be an object")
    _num(f, "time", need=True)
    _str(f, "kind")
    _int(f, "rank", need=False, hi=_MAX_RANK)
    _int(f, "generation", lo=-1, need=False)
    _int(f, "step", lo=-1, need=False)


def check_record(rec: dict[str, Any]) -> None:
    """The fields of ``rec`` that readers use have the types they expect (``BadRecord`` if not)."""
    _num(rec, "time", need=True)
    _str(rec, "event", need=True)
    kind = rec["event"]
    if kind == "commit":
        _int(rec, "rank", hi=_MAX_RANK)
        _int(rec, "step", lo=-1)
        _int(rec, "generation", lo=-1, need=False)
        _int(rec, "worker", need=False)
        if not isinstance(rec.get("rolled_forward", False), bool):
            raise BadRecord("field 'rolled_forward' must be true or false")
    elif kind == "commit_log":
        _int(rec, "rank", hi=_MAX_RANK)
        _int(rec, "commits")
        _int(rec, "steps")
        _int(rec, "last_step", lo=-1)
        kept = rec.get("kept")
        if not isinstance(kept, list) or not all(_kept_ok(k) for k in kept):
            raise BadRecord("field 'kept' must be a list of [time, step, generation, rolled_forward]")
    elif kind == "job_start":
        _int(rec, "nproc", hi=_MAX_RANK)
        _int(rec, "pid", need=False)
        _str(rec, "host")
        _str(rec, "job")
    elif kind == "job_end":
        _str(rec, "status")
    elif kind == "spawn":
        _int(rec, "worker")
        _int(rec, "pid")
        _str(rec, "role", need=True)
    elif kind in ("spare_ready", "spare_lost"):
        _int(rec, "worker")
    elif kind == "spare_assigned":
        _int(rec, "rank", hi=_MAX_RANK)
        _int(rec, "worker")
        _int(rec, "generation", lo=-1, need=False)
    elif kind == "started":
        _int(rec, "generation", lo=-1)
    elif kind == "recovery":
        _int(rec, "generation", lo=-1)
        _num(rec, "downtime_s", need=True)
        for k in ("detect_s", "collect_s", "rebuild_s", "transfer_s", "first_batch_s", "first_step_s"):
            _num(rec, k)
        _num(rec, "state_bytes")
        faults = rec.get("faults")
        if faults is not None:
            if not isinstance(faults, list):
                raise BadRecord("field 'faults' must be a list")
            for f in faults:
                _check_fault(f)
    elif kind == "fault":
        _check_fault(rec)


def _kept_ok(k: Any) -> bool:
    return (
        isinstance(k, list)
        and len(k) == 4
        and type(k[0]) in (int, float)
        and type(k[1]) is int
        and (k[2] is None or type(k[2]) is int)
        and isinstance(k[3], bool)
    )
