"""Checking a received state manifest before anything is allocated from it.

A manifest arrives sealed, so only a process holding the job secret can send one; a bad one is a
bug or corruption, not an attack. It must still fail as one clear :class:`StateTransferError` and
never as a stray ``KeyError``, a recursion overflow, or an allocation of whatever size it names:
the receiver allocates its buffers from the announced message sizes, so they are capped (by the
machine's physical memory unless the caller says less) before a byte is reserved.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import torch

from checkpointless.errors import StateTransferError

__all__ = ["MAX_TREE_DEPTH", "check_manifest", "check_tree", "parse_manifest"]

MAX_TREE_DEPTH = 64  # nested state deeper than this is not an optimizer's or a model's
_MARKERS = ("__t", "__np", "__tuple", "__dict", "__npscalar", "__dtype")


def _memory_cap() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # not exposed here: fall back to a generous fixed bound
        return 1 << 40


def _bad(why: str) -> StateTransferError:
    return StateTransferError(f"malformed state manifest: {why}")


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_tensor(i: int, m: Any, sizes: list[int]) -> None:
    if not isinstance(m, dict):
        raise _bad(f"tensor {i} is not an object")
    path, shape = m.get("path"), m.get("shape")
    if not isinstance(path, str):
        raise _bad(f"tensor {i} has no path")
    dt = getattr(torch, str(m.get("dtype")), None)
    if not isinstance(dt, torch.dtype):
        raise _bad(f"tensor {path} names an unknown dtype {m.get('dtype')!r}")
    if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
        raise _bad(f"tensor {path} has an invalid shape {shape!r}")
    nbytes, msg, offset, solo = m.get("nbytes"), m.get("msg"), m.get("offset"), m.get("solo")
    if not (
        isinstance(nbytes, int)
        and isinstance(msg, int)
        and isinstance(offset, int)
        and all(_is_count(x) for x in (nbytes, msg, offset))
        and isinstance(solo, bool)
    ):
        raise _bad(f"tensor {path} lacks nbytes/msg/offset/solo")
    if nbytes != math.prod(shape) * dt.itemsize:
        raise _bad(f"tensor {path}: {nbytes} bytes do not match shape {shape} of {dt}")
    if msg >= len(sizes) or offset + nbytes > sizes[msg] or (solo and (offset or nbytes != sizes[msg])):
        raise _bad(f"tensor {path} lies outside its message")


def check_tree(node: Any, n_tensors: int) -> None:
    """Raise :class:`StateTransferError` unless ``node`` is a state tree whose tensor references
    lie within ``n_tensors``."""
    # iterative, with an explicit depth, so a deep tree cannot overflow the interpreter's stack
    stack: list[tuple[Any, int]] = [(node, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            raise _bad(f"state tree nested deeper than {MAX_TREE_DEPTH}")
        if v is None or isinstance(v, (bool, int, float, str)):
            continue
        if isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
            continue
        if not isinstance(v, dict):
            raise _bad(f"unexpected value of type {type(v).__name__}")
        marker = next((k for k in _MARKERS if k in v), None)
        if marker is None:
            stack.extend((x, depth + 1) for x in v.values())
        elif marker in ("__t", "__np"):
            if not _is_count(v[marker]) or v[marker] >= n_tensors:
                raise _bad(f"tensor reference {v[marker]!r} out of range")
        elif marker == "__tuple":
            if not isinstance(v[marker], list):
                raise _bad("a tuple is not a list")
            stack.extend((x, depth + 1) for x in v[marker])
        elif marker == "__dict":
            items = v[marker]
            if not isinstance(items, list) or not all(isinstance(p, list) and len(p) == 2 for p in items):
                raise _bad("a dict is not a list of key/value pairs")
            for key, value in items:
                if isinstance(key, dict) and not any(k in key for k in ("__tuple", "__dtype", "__npscalar")):
                    raise _bad("a dict key is not hashable")
                stack.extend(((key, depth + 1), (value, depth + 1)))
        elif marker == "__npscalar":
            pair = v[marker]
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                raise _bad("a numpy scalar is not [dtype, value]")
            try:
                np.dtype(pair[0]).type(pair[1])
            except (TypeError, ValueError, OverflowError) as e:
                raise _bad(f"numpy scalar {pair!r}: {e}") from e
        elif not isinstance(getattr(torch, str(v[marker]), None), torch.dtype):
            raise _bad(f"unknown dtype {v[marker]!r}")


def check_manifest(manifest: Any, max_bytes: int | None = None) -> dict[str, Any]:
    """Validate a decoded manifest; return it, or raise :class:`StateTransferError`."""
    if not isinstance(manifest, dict):
        raise _bad("not a JSON object")
    sizes, metas = manifest.get("messages"), manifest.get("tensors")
    if not isinstance(sizes, list) or not all(_is_count(n) for n in sizes):
        raise _bad("'messages' is not a list of byte counts")
    if not isinstance(metas, list):
        raise _bad("'tensors' is not a list")
    cap = _memory_cap() if max_bytes is None else max_bytes
    if sum(sizes) > cap:
        raise _bad(f"announces {sum(sizes)} bytes, more than the {cap} this receiver accepts")
    for i, m in enumerate(metas):
        _check_tensor(i, m, sizes)
    if "tree" not in manifest:
        raise _bad("no 'tree'")
    check_tree(manifest["tree"], len(metas))
    return manifest


def parse_manifest(mbytes: bytes | bytearray, max_bytes: int | None = None) -> dict[str, Any]:
    """Decode and validate a manifest's bytes."""
    try:
        manifest = json.loads(mbytes)
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested past the stack
        raise _bad(f"not valid JSON ({type(e).__name__}: {str(e)[:200]})") from e
    return check_manifest(manifest, max_bytes)
