"""Per-step fingerprints for ``checkpointless audit`` (checkpointless/audit/).

Only when the audit sets ``$CHECKPOINTLESS_AUDIT_DIR``: each process then appends one JSON line per
committed step to its own file in that folder, with the step, the rank, a digest of the rank's
parameters and optimizer state after the update, one of the gradients the update read, and one of
the tensors the tracked modules' forwards were given (the batch).
The audit compares these lines between runs. Without the variable :data:`ACTIVE` is ``None`` and
the hooks in commit.py and guard.py cost one attribute test.

``$CHECKPOINTLESS_AUDIT_STEPS`` ends the loop after that many committed steps, on every rank at
the same step (through :class:`~checkpointless.recovery.loop.LoopControl`, which a replacement
receives), so that an audit runs a script briefly whatever its own step count.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import nn

from checkpointless.config import ENV
from checkpointless.errors import ConfigError
from checkpointless.recovery.divergence import state_digest
from checkpointless.recovery.loop import LoopControl

__all__ = ["ACTIVE", "FingerprintLog", "from_environ"]


class FingerprintLog:
    """This process's fingerprint file and the gradient digest of the step running."""

    def __init__(self, directory: Path, steps: int | None) -> None:
        self.steps = steps
        self.directory = directory
        self._grads = xxhash.xxh3_64()
        self._seen_grads = False
        self._inputs = xxhash.xxh3_64()
        self._seen_inputs = False

    def begin_step(self) -> None:
        # a retried step must not carry the inputs or gradients of its failed attempt
        self._grads.reset()
        self._seen_grads = False
        self._inputs.reset()
        self._seen_inputs = False

    def add_inputs(self, args: Any) -> None:
        """Called before each forward of a tracked module: fold in its tensor inputs, given as
        ``(args, kwargs)`` (the batch, as the model sees it; keywords in sorted order)."""
        stack = [args]
        while stack:
            a = stack.pop()
            if isinstance(a, torch.Tensor):
                _fold(self._inputs, a)
                self._seen_inputs = True
            elif isinstance(a, (list, tuple)):
                stack.extend(reversed(a))
            elif isinstance(a, dict):
                stack.extend(a[k] for k in sorted(a, key=str, reverse=True))

    def add_grads(self, opt: Any) -> None:
        """Called before each optimizer update of the step: fold in the gradients it reads."""
        for group in getattr(opt, "param_groups", []):
            for p in group["params"]:
                g = p.grad
                if g is None:
                    self._grads.update(b"-;")
                    continue
                _fold(self._grads, g)
        self._seen_grads = True

    def at_commit(
        self,
        rank: int,
        step: int,
        modules: Iterable[nn.Module],
        optimizers: Iterable[torch.optim.Optimizer],
        loop: LoopControl,
    ) -> None:
        line = {
            "step": step,
            "rank": rank,
            "state": f"{state_digest(modules, optimizers):016x}",
            "grads": f"{self._grads.intdigest():016x}" if self._seen_grads else None,
            "inputs": f"{self._inputs.intdigest():016x}" if self._seen_inputs else None,
        }
        # one file per process (the pid taken now: a fork server's children share this object),
        # so a replacement never shares a file with the process it replaces; one write of a
        # whole line, so a process killed mid-run leaves no half line behind
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"fingerprints-{os.getpid()}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())
        finally:
            os.close(fd)
        self.begin_step()
        if self.steps is not None and step + 1 >= self.steps:
            loop.request_stop(self.steps)


def _fold(h: xxhash.xxh3_64, t: torch.Tensor) -> None:
    """Fold a tensor's dtype, size and bytes into ``h`` (a DTensor: this rank's own part)."""
    local = getattr(t, "to_local", None)
    c = (local() if callable(local) else t).detach()
    c = c.cpu().contiguous().reshape(-1)
    h.update(f"{c.dtype}{c.numel()};".encode())
    if c.numel():
        # the raw bytes, read in place (numpy has no bfloat16, bytes view every dtype)
        h.update(memoryview(c.view(torch.uint8).numpy()))


def from_environ() -> FingerprintLog | None:
    where = os.environ.get(ENV.AUDIT_DIR)
    if not where:
        return None
    raw = os.environ.get(ENV.AUDIT_STEPS, "")
    steps: int | None = None
    if raw:
        try:
            steps = int(raw)
        except ValueError:
            steps = 0
        if steps < 1:
            raise ConfigError(f"{ENV.AUDIT_STEPS}={raw!r} must be a positive number of steps")
    return FingerprintLog(Path(where), steps)


# read once: the variables are the audit's, set before the launcher starts any process
ACTIVE: FingerprintLog | None = from_environ()
