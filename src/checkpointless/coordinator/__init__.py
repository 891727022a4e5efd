"""The coordinator: the job's decisions as a pure state machine (events in, commands out)."""

from checkpointless.coordinator.coordinator import Coordinator
from checkpointless.coordinator.state import (
    Command,
    Emit,
    HostTable,
    Kill,
    Log,
    Member,
    Round,
    Send,
    Spawn,
    Stop,
)

__all__ = [
    "Command",
    "Coordinator",
    "Emit",
    "HostTable",
    "Kill",
    "Log",
    "Member",
    "Round",
    "Send",
    "Spawn",
    "Stop",
]
