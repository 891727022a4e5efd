"""checkpointless: keep a PyTorch distributed training job running through faults.

The public API is small: :func:`init` joins the job, :class:`Job` tracks what makes a replica and
runs the recoverable step loop, :class:`DataParallel` averages gradients in a way that survives
an aborted backward. Everything else is reached through the ``checkpointless`` command; helpers
for rehearsing faults in tests live in :mod:`checkpointless.testing`.

The names are imported on first use: the launcher and its reaper watchdog import this package
too, and they never need torch (importing it costs them seconds of CPU on every start).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from checkpointless.errors import (
    CheckpointlessError,
    CommAborted,
    ConfigError,
    DataError,
    NotRecoverableError,
    RendezvousError,
    StateTransferError,
    StepAborted,
)

if TYPE_CHECKING:
    from checkpointless.comm.data_parallel import DataParallel
    from checkpointless.recovery.job import Job, Step, init

__all__ = [
    "CheckpointlessError",
    "CommAborted",
    "ConfigError",
    "DataError",
    "DataParallel",
    "Job",
    "NotRecoverableError",
    "RendezvousError",
    "StateTransferError",
    "Step",
    "StepAborted",
    "init",
]
__version__ = "0.1.0"

_LAZY = {
    "DataParallel": "checkpointless.comm.data_parallel",
    "Job": "checkpointless.recovery.job",
    "Step": "checkpointless.recovery.job",
    "init": "checkpointless.recovery.job",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'checkpointless' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value
