"""What every message is: a frozen dataclass with a ``TYPE`` name, versioned as a set.

This is the root the message modules (:mod:`~checkpointless.protocol.worker_link`,
:mod:`~checkpointless.protocol.agent_link`) and the codec (:mod:`~checkpointless.protocol.codec`)
all build on. It is separate so that they can share it without importing each other: the codec
must import every message class for its registry, so the base cannot live in the codec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from checkpointless.errors import CheckpointlessError

__all__ = ["VERSION", "Message", "ProtocolError"]

# 2: Recover carries a peer-table delta and a compact plan; PeerTable/PeerTableRequest;
# AgentHeartbeat carries the host's workers' beats
# 3: the control channel's client speaks first (launcher/control.py's opening); AgentWelcome's
# shm_key is a sealed token (wire.seal_value); AgentRefused
# 4: AgentWelcome carries the job's settings as one typed object (settings.JobSettings) instead of
# ten copied fields and a dict
# 5: HealthReport (an agent's host health checks, for health-gated admission); AgentHello.health
# 6: Fired carries the step it fires at (the fault event's step); Fatal a kind ("config": a
# ConfigError ended the script, and the job ends without a spare)
# 7: JobSettings (AgentWelcome) carries --when-no-spare and --min-replicas; ResumePlan carries
# the slots each live rank holds in degraded mode (``holders``); Inexact (a worker resumed with
# per-rank state it could not find: the run may differ from the run without the fault)
VERSION = 7


class ProtocolError(CheckpointlessError):
    """A message that is not one of ours, or whose fields have the wrong types."""


@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[str] = ""
