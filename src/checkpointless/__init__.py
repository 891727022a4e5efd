"""checkpointless: keep a PyTorch distributed training job running through faults.

The public API is small: :func:`init` joins the job, :class:`Job` tracks what makes a replica and
runs the recoverable step loop, :class:`DataParallel` averages gradients in a way that survives
an aborted backward. Everything else is reached through the ``checkpointless`` command.
"""

from __future__ import annotations

from checkpointless.comm.data_parallel import DataParallel
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
from checkpointless.faults.inject import FaultSpec, InjectedFault, parse_faults
from checkpointless.recovery.job import Job, Step, init

__all__ = [
    "CheckpointlessError",
    "CommAborted",
    "ConfigError",
    "DataError",
    "DataParallel",
    "FaultSpec",
    "InjectedFault",
    "Job",
    "NotRecoverableError",
    "RendezvousError",
    "StateTransferError",
    "Step",
    "StepAborted",
    "init",
    "parse_faults",
]
__version__ = "0.1.0"
