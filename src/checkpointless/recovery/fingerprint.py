"""Per-step fingerprints for ``checkpointless audit`` (checkpointless/audit/).

Only when the audit sets ``$CHECKPOINTLESS_AUDIT_DIR``: each process then appends one JSON line per
committed step to its own file in that folder, with the step, the rank, a digest of the rank's
parameters and optimizer state after the update, and a digest of the gradients the update read.
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

    def begin_step(self) -> None:
        # a retried step must not carry the gradients of its failed attempt
        self._grads.reset()
        self._seen_grads = False

    def add_grads(self, opt: Any) -> None:
        """Called before each optimizer update of the step: fold in the gradients it reads."""
        for group in getattr(opt, "param_groups", []):
            for p in group["params"]:
                g = p.grad
                if g is None:
                    self._grads.update(b"-;")
                    continue
                local = getattr(g, "to_local", None)
                c = (local() if callable(local) else g).detach()
                c = c.cpu().contiguous().reshape(-1)
                self._grads.update(f"{c.dtype}{c.numel()};".encode())
                if c.numel():
                    self._grads.update(memoryview(c.view(torch.uint8).numpy()))
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
