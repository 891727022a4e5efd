"""The messages between the coordinator, the agents and the workers, as typed records.

Every message is a frozen dataclass with a ``TYPE`` name. On the wire it is a JSON object: the
dataclass's fields, plus ``"type"`` and the protocol version ``"v"`` (sealed frames, see
:mod:`checkpointless.wire`). :func:`decode` turns a received object back into its dataclass and
checks every field's type on the way, so the decision code never sees a malformed message:
anything wrong (an unknown type, a missing field, a string where a number belongs) raises
:class:`ProtocolError`, which the receiver treats as a broken peer. Fields a receiver does not know
are ignored, so a newer sender can add optional fields without breaking an older receiver.

This package is where every name is imported from; its modules split the definitions by concept:

* :mod:`~checkpointless.protocol.base`: :class:`Message`, :data:`VERSION`, :class:`ProtocolError`;
* :mod:`~checkpointless.protocol.worker_link`: the messages between a worker and the coordinator;
* :mod:`~checkpointless.protocol.plan`: :class:`ResumePlan`, the recovery plan a ``Recover`` carries;
* :mod:`~checkpointless.protocol.agent_link`: the messages between an agent and the coordinator,
  and between agents (the election);
* :mod:`~checkpointless.protocol.codec`: :func:`encode`, :func:`decode` (the field checks) and the
  succession handed to a process in its environment.
"""

from checkpointless.protocol.agent_link import (
    AgentHeartbeat,
    AgentHello,
    AgentRefused,
    AgentWelcome,
    HealthReport,
    KillCmd,
    ProcConnected,
    ProcExited,
    ProcStarted,
    ProcVerdict,
    SpawnCmd,
    Succession,
    Vote,
)
from checkpointless.protocol.base import VERSION, Message, ProtocolError
from checkpointless.protocol.codec import (
    SUCCESSION_ENV,
    decode,
    encode,
    succession_from_env,
    succession_to_env,
)
from checkpointless.protocol.plan import ResumePlan
from checkpointless.protocol.worker_link import (
    Abort,
    Assign,
    Committed,
    Done,
    DoneSeen,
    Fatal,
    Fired,
    FiredSeen,
    Heartbeat,
    Hello,
    Inexact,
    PeerTable,
    PeerTableRequest,
    Prefetch,
    Prepare,
    Recover,
    Recovered,
    ReplayDiffers,
    Shutdown,
    SpareReady,
    Stopped,
)

__all__ = [
    "SUCCESSION_ENV",
    "VERSION",
    "Abort",
    "AgentHeartbeat",
    "AgentHello",
    "AgentRefused",
    "AgentWelcome",
    "Assign",
    "Committed",
    "Done",
    "DoneSeen",
    "Fatal",
    "Fired",
    "FiredSeen",
    "HealthReport",
    "Heartbeat",
    "Hello",
    "Inexact",
    "KillCmd",
    "Message",
    "PeerTable",
    "PeerTableRequest",
    "Prefetch",
    "Prepare",
    "ProcConnected",
    "ProcExited",
    "ProcStarted",
    "ProcVerdict",
    "ProtocolError",
    "Recover",
    "Recovered",
    "ReplayDiffers",
    "ResumePlan",
    "Shutdown",
    "SpareReady",
    "SpawnCmd",
    "Stopped",
    "Succession",
    "Vote",
    "decode",
    "encode",
    "succession_from_env",
    "succession_to_env",
]
