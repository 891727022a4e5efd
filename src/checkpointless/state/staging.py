"""The step's state laid out as the step begins, for the copies made while it runs (the snapshot
and the buddy copy of the step), at as little cost to the training thread as possible.

Why this is its own concern: it runs on the training thread at the start of every step of a job
with buddy copies, and on a sharded rank the state is a few hundred small tensors (each block's
parameter shards and their optimizer state). Walking them costs the step the same work every
step, so what does not change from one step to the next is remembered:

- which tensors only ``optimizer.step()`` changes (:func:`guarded_pointers`), while the
  optimizers hold the same tensor objects;
- each guarded tensor's byte view, by address;
- the whole manifest entry and message of each tensor that is the same object over the same
  memory, in the same place of the state, as when the last step began (:func:`staged_layout`).

Only the tree of plain values (step counters, learning rates, the loader's position) is walked
anew each step, and only the tensors nothing guards (RNG states, buffers) are copied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from checkpointless.state.codec import Layout, as_byte_view, encode, tensor_meta
from checkpointless.state.device_copy import device_byte_view, on_device, ready_events

__all__ = ["guarded_pointers", "staged_layout"]


_guarded_memo: tuple[tuple[int, ...], set[int]] | None = None


def guarded_pointers(optimizers: list[torch.optim.Optimizer]) -> set[int]:
    """Addresses of the tensors that only ``optimizer.step()`` changes: the parameters and the
    optimizer's state. Those may be copied after the step began; everything else is copied at once.

    Remembered while the same tensor objects make up the optimizers (their ids, cheap to list):
    asked as every step begins, and on a sharded rank each address is a DTensor's ``to_local()``,
    ~1.3 ms a step for a GPT's 200 tensors. The set returned is the same object while it holds,
    which is what lets :func:`staged_layout` trust its own memory."""
    global _guarded_memo
    key = tuple(
        id(t)
        for opt in optimizers
        for t in [
            *(p for g in opt.param_groups for p in g["params"]),
            *(v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)),
        ]
    )
    if _guarded_memo is not None and _guarded_memo[0] == key:
        return _guarded_memo[1]
    out = _guarded_pointers(optimizers)
    _guarded_memo = (key, out)
    return out


def _guarded_pointers(optimizers: list[torch.optim.Optimizer]) -> set[int]:
    out: set[int] = set()

    def ptr(t: torch.Tensor) -> int:
        # a DTensor (FSDP2) is copied through its local shard: that storage is what is guarded
        local = getattr(t, "to_local", None)
        return int(local().data_ptr()) if callable(local) else int(t.data_ptr())

    for opt in optimizers:
        for group in opt.param_groups:
            out.update(ptr(p) for p in group["params"])
        for st in opt.state.values():
            out.update(ptr(v) for v in st.values() if isinstance(v, torch.Tensor))
    return out


_views: tuple[set[int], dict[int, torch.Tensor]] | None = None


def _byte_views(guarded: set[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A tensor's bytes (``codec.as_byte_view``), remembering the byte views of the guarded
    tensors (the parameters' and the optimizer's, alive for the whole run) by address, for as
    long as the guarded set is the same object. Why by address: a sharded rank's state dicts may
    give new tensor objects for the same memory every step; and a remembered view keeps its
    memory alive, so a live tensor at that address is that memory."""
    global _views
    if _views is None or _views[0] is not guarded:
        _views = (guarded, {})
    memo = _views[1]

    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        ptr = t.data_ptr()
        nbytes = t.numel() * t.element_size()
        v = memo.get(ptr)
        if v is not None and v.numel() == nbytes and t.is_contiguous():
            return v
        # a CUDA tensor's bytes stay on the device: the copy's own thread brings them over
        # (state/device_copy.py)
        v = device_byte_view(t) if on_device(t) else as_byte_view(t)
        if ptr in guarded and v.data_ptr() == ptr:  # a view of live memory, not a copy
            memo[ptr] = v
        return v

    return as_bytes


_Key = tuple[str, int, torch.Size, tuple[int, ...]]


@dataclass
class _Staged:
    """The last state laid out: per tensor (in the state's order) the tensor itself, what it was
    (path, address, shape, strides), its manifest entry and, when guarded, its byte view."""

    guarded: set[int]
    tensors: list[torch.Tensor]  # held: while we hold a tensor, its id names no other object
    keys: list[_Key]
    metas: list[dict[str, Any]]
    views: list[torch.Tensor | None]


_last: _Staged | None = None


def staged_layout(state: Any, guarded: set[int]) -> Layout:
    """``state`` laid out for a copy made while the step runs: every tensor is a message of its
    own, a view of the live tensor when it is in ``guarded`` (the optimizer's tensors, which
    nothing changes before the update waits for the copy), cloned now otherwise. One layout
    serves both the snapshot and the buddy copy of a step.

    Why no packing of small tensors here: a sharded rank's tensors are mostly small (a 128x128
    weight split two ways is 32 KiB), so a pack would be nearly the whole state, copied into
    fresh memory (a page fault per 4 KiB) on the training thread as every step begins; as views
    they are copied once, on the copy's own thread, straight into the snapshot or the rank's
    undo copy (state/buddy_owner.py).

    Why remembered: a tensor that is the very object of the last step's state, at the same place
    in it, over the same memory with the same shape and strides, has the same manifest entry and
    the same byte view; only its identity and four cheap attributes are read (a sharded GPT's
    215 tensors: 0.76 -> 0.49 ms). A manifest entry is shared between
    steps' layouts, so nothing may change one in place (nothing does: consumers copy)."""
    global _last
    skeleton, tensors = encode(state)
    last = _last if _last is not None and _last.guarded is guarded else None
    as_bytes = _byte_views(guarded)
    now = _Staged(guarded, [], [], [], [])
    messages: list[torch.Tensor] = []
    for i, (path, t) in enumerate(tensors):
        key = (path, t.data_ptr(), t.shape, t.stride())
        same = last is not None and i < len(last.tensors) and last.tensors[i] is t and last.keys[i] == key
        view = last.views[i] if same and last is not None else None
        if same and last is not None:
            meta = last.metas[i]
        else:
            meta = tensor_meta(path, t)
            meta.update(msg=i, offset=0, solo=True)
        if view is None:
            view = as_bytes(t)
            if view.data_ptr() not in guarded and view.device == t.device:
                # nothing waits for the copy before changing it: copy now, on the host or on
                # the device (on the training stream, before the forward may change it); a
                # tensor of another accelerator was just copied to host memory, held by nobody
                view = view.clone()
        now.tensors.append(t)
        now.keys.append(key)
        now.metas.append(meta)
        now.views.append(view if view.data_ptr() in guarded else None)
        messages.append(view)
    _last = now
    manifest = {"tree": skeleton, "tensors": now.metas, "messages": [int(m["nbytes"]) for m in now.metas]}
    # recorded after the clones: once it has passed on the device, the state as this step began
    # is all there for the copy thread (None when everything is on the host)
    return Layout(manifest, messages, ready=ready_events(messages))
