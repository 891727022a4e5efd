"""A GPU rank's state copied to host memory beside the training stream, for the copies made while a
step runs (the buddy copy and the shared-memory snapshot).

Why: those copies take the state as the step begins and must leave the training thread and the
GPU's compute alone while forward and backward run. Bringing each device tensor to the host at
once (``t.cpu()`` as the step begins) does neither: it is a device-to-host copy through pageable
memory on the training stream, so the training thread waits for the queued kernels and then for
the bytes, and the GPU computes nothing meanwhile. For a shard of a few GB that is most of a step.

How, instead:

- as the step begins, on the training thread (``state/staging.py``), the tensors only the
  optimizer changes stay where they are (a byte view of the device memory), the others are
  cloned *on the device* on the training stream (ordered before the forward that may change
  them), and an event is recorded on that stream after the clones (:func:`ready_events`): the
  state as the step begins is complete on the device once the event has passed;
- the thread that makes the copy (:func:`copy_out`) has a stream of its own wait for that event
  and copies each message into its host destination there. Streams from torch's pool are created
  non-blocking, so the copy engine moves the bytes while the training stream computes, even when
  the training runs on the default stream; the host destination is pinned where we allocate it
  (the buddy's undo copy), so the copy is a DMA;
- the copy thread waits for its stream before it reports the copy done, and the optimizer's update
  waits for that report (``BuddyCopies.wait_sent``, the snapshot's ``copied``): no update kernel is
  enqueued before the bytes have left the device.

Only CUDA devices are copied this way; a tensor on another accelerator is brought to the host as
the step begins, as before. Tested on CPU through the host path; the CUDA path by
``benchmarks/gpu_check.py`` (``staging_cuda``) where a GPU is lent.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["copy_out", "device_byte_view", "host_buffer", "on_device", "ready_events"]


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes are copied to the host by :func:`copy_out` (not as the step begins)."""
    return bool(t.device.type == "cuda")


def device_byte_view(t: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor's bytes as a flat uint8 tensor on its device: a view when it is contiguous."""
    if t.requires_grad:
        t = t.detach()
    return t.contiguous().reshape(-1).view(torch.uint8)


def ready_events(messages: Sequence[torch.Tensor]) -> list[Any] | None:
    """One event per device the messages lie on, recorded now on that device's current stream
    (the training stream, after the clones just made on it); None when every message is on the
    host. Called on the training thread as the step begins."""
    devices = {m.device for m in messages if on_device(m)}
    if not devices:
        return None
    events = []
    for d in sorted(devices, key=str):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(d))
        events.append(ev)
    return events


_lock = threading.Lock()
_streams: dict[torch.device, Any] = {}


def _copy_stream(device: torch.device) -> Any:
    """The stream copies out of ``device`` run on: one per device for the process (from torch's
    pool, created non-blocking), shared by the copy threads; a stream is safe to use from several."""
    with _lock:
        s = _streams.get(device)
        if s is None:
            s = _streams[device] = torch.cuda.Stream(device=device)
        return s


def _forget_streams() -> None:
    _streams.clear()  # CUDA does not survive a fork; nor may its streams


os.register_at_fork(after_in_child=_forget_streams)


def host_buffer(nbytes: int, ready: list[Any] | None) -> torch.Tensor:
    """Host memory for ``nbytes`` of copied state: pinned when the bytes come from a device
    (``ready`` set), so that :func:`copy_out` is a DMA beside the compute."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=ready is not None)


def copy_out(messages: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], ready: list[Any] | None) -> None:
    """Copy each message into its host destination (same sizes, uint8). ``ready``: the layout's
    events (:func:`ready_events`); device messages are copied on this process's copy stream after
    them, and this returns once they have landed. Called on the copy's own thread."""
    if len(messages) != len(dsts):
        raise ValueError(f"copy_out: {len(messages)} messages for {len(dsts)} destinations")
    if ready is None:
        for d, m in zip(dsts, messages, strict=True):
            d.copy_(m)
        return
    streams = {m.device: _copy_stream(m.device) for m in messages if on_device(m)}
    for s in streams.values():
        for ev in ready:
            s.wait_event(ev)
    for d, m in zip(dsts, messages, strict=True):
        if on_device(m):
            with torch.cuda.stream(streams[m.device]):
                d.copy_(m, non_blocking=True)
        else:
            d.copy_(m)
    for s in streams.values():
        s.synchronize()
