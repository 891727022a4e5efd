"""Degraded mode: which slot the loop body is running for, and a check that a held slot's pass
did not train the rank's own batch again.

A process that holds a lost rank's slot runs each step once per slot it holds (recovery/step.py).
A script written for full width picks its batch from its rank in one of three ways:

* through the job (``job.loader``, ``step.batch``, a ``BatchLoader`` of its share): these already
  serve the held slot's batch in its pass (recovery/loader.py, data/held_slot.py);
* from ``job.rank`` read inside the loop: from the moment ``job.steps()`` yields a held slot's
  pass until it yields the next, ``job.rank`` *is* that slot (:attr:`HeldPass.slot`), so such a
  script reads the slot's batch too, and whatever else it does per rank in the step (a rank-0
  log line, a per-rank file) follows the slot as it would at full width;
* from a rank it read once before the loop (``rank = dist.get_rank()``): nothing can redirect
  that, and the held pass would train the rank's own batch a second time while the lost slot's
  is never trained. The job cannot tell the batch it should have been, but it can see the
  symptom: the held pass's first forward gets exactly the inputs of the rank's own pass. That
  is reported as ``inexact`` (never silent), once per slot.

Inputs equal on purpose (every rank reading the same batches) are exact at full width and in a
held pass alike, so the check stays quiet when a job data source served the held pass; a script
that reads rank-independent batches by itself gets the report, which says so.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["HeldPass", "inputs_digest"]


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a forward's ``(args, kwargs)``, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _tensors(obj[key])


def inputs_digest(args: Any) -> bytes | None:
    """A digest of the tensors a forward is called with (their dtypes, shapes and bytes); None
    when it gets none (nothing to compare)."""
    h = hashlib.blake2b(digest_size=16)
    found = False
    for t in _tensors(args):
        found = True
        flat = t.detach().reshape(-1).contiguous()
        if flat.device.type != "cpu":
            flat = flat.cpu()
        h.update(f"{flat.dtype}{tuple(t.shape)}".encode())
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.digest() if found else None


class HeldPass:
    """The pass ``job.steps()`` has yielded and what its body did, one per process."""

    def __init__(self) -> None:
        # the held slot whose pass the loop body runs (None: the rank's own, or full width),
        # from the yield of its Step to the yield of the next
        self.slot: int | None = None
        self._step: int | None = None
        self._passes = 1
        self._served = False  # a job data source gave this held pass its slot's batch
        self._own: bytes | None = None  # the own pass's first-forward inputs, this step
        self._compared = False  # this pass's first forward was seen
        self._reported: set[int] = set()  # slots already reported (once each)

    def begin(self, step: int, slot: int | None, pass_index: int, passes: int) -> None:
        """``job.steps()`` yields pass ``pass_index`` of ``passes`` of ``step``; ``slot`` is
        the held slot it trains (None for the rank's own pass)."""
        if pass_index == 0:
            self._own = None
        self.slot, self._step, self._passes = slot, step, passes
        self._served = False
        self._compared = False

    def end(self) -> None:
        """The body of the yielded pass is over (the loop asked for the next, or left)."""
        self.slot = None

    def data_slot(self, held: int | None) -> int | None:
        """A job data source asks which held slot's batch to read (``held``: the clock's);
        reading through one means the pass got that slot's batch."""
        if held is not None:
            self._served = True
        return held

    def on_forward(self, args: Any) -> str | None:
        """A tracked module's forward is about to run on ``args``: in degraded mode, the first
        of each pass is compared with the own pass's. Returns what to report, if anything."""
        if self._passes < 2 or self._compared:
            return None  # full width costs nothing beyond this test
        self._compared = True
        digest = inputs_digest(args)
        if self.slot is None:
            self._own = digest
            return None
        slot = self.slot
        if digest is None or digest != self._own or self._served or slot in self._reported:
            return None
        self._reported.add(slot)
        return (
            f"degraded mode: the pass for held slot {slot} at step {self._step} got exactly the "
            "inputs of this rank's own pass, and no job loader served it: a batch picked from "
            "a rank read before the loop (e.g. `rank = dist.get_rank()`) trains this rank's "
            f"batch twice and slot {slot}'s never, so the result may differ from the run without "
            "the fault. Read `job.rank` inside the loop (it is the held slot in its pass) or "
            "take the batch from `job.loader(...)`/`step.batch` (docs/fault-model.md, degraded "
            "mode). If every rank reads the same batches on purpose, this is expected."
        )
