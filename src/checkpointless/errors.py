"""The exception hierarchy of checkpointless.

Every error that the library raises on purpose derives from :class:`CheckpointlessError`, so a
user can catch one base class. The subclasses are few on purpose: each names a different thing
that the caller (a user, the launcher or the recovery loop) does differently in response.
"""

from __future__ import annotations

__all__ = [
    "CONFIG_ERROR_EXIT",
    "CheckpointlessError",
    "CommAborted",
    "ConfigError",
    "DataError",
    "NotRecoverableError",
    "RendezvousError",
    "StateTransferError",
    "StepAborted",
]


class CheckpointlessError(Exception):
    """Base class of every error raised by checkpointless on purpose."""


class ConfigError(CheckpointlessError, ValueError):
    """A setting, argument or environment value is wrong; the message names it and the fix.

    Deterministic: a replacement or a restart would raise it again. A worker whose script ends on
    one exits with :data:`CONFIG_ERROR_EXIT`, and the launcher ends the job at once instead of
    spending spares or restarts on it."""


# The exit status of a process whose script ended on a ConfigError (sysexits.h's EX_CONFIG).
CONFIG_ERROR_EXIT = 78


class RendezvousError(CheckpointlessError):
    """Participants could not meet: a peer is missing, unreachable or too late."""


class CommAborted(CheckpointlessError):
    """A collective was abandoned because its generation of the communicator was aborted."""


class StepAborted(CheckpointlessError):
    """The current training step cannot commit and will be replayed after a recovery."""


class StateTransferError(CheckpointlessError):
    """Training state could not be sent, received or verified against the sender's checksums."""


class DataError(CheckpointlessError):
    """A dataset file or batch cache is missing, malformed or inconsistent with the job."""


class NotRecoverableError(CheckpointlessError):
    """The job cannot continue (no spare in time, no valid replica, a fault that keeps recurring)."""
