"""checkpointless: keep a PyTorch distributed training job running through faults."""

from __future__ import annotations

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

__all__ = [
    "CheckpointlessError",
    "CommAborted",
    "ConfigError",
    "DataError",
    "NotRecoverableError",
    "RendezvousError",
    "StateTransferError",
    "StepAborted",
]
__version__ = "0.1.0"
