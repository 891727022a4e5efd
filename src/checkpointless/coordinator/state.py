"""What the coordinator knows: each member process as it sees it, each recovery round, and the
commands it hands to the shell that does the I/O.

Nothing here touches a socket, a process or the clock: times are the ``now`` (monotonic) and
``wall`` (Unix) values the shell passes in with every event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from checkpointless.coordinator.rules.budget import FaultRecord
from checkpointless.coordinator.rules.decisions import MemberReport
from checkpointless.protocol import Message, PeerTable

__all__ = [
    "Command",
    "Emit",
    "HostState",
    "HostTable",
    "Kill",
    "Log",
    "Member",
    "Round",
    "Send",
    "Spawn",
    "Stop",
]


@dataclass
class HostState:
    """One host (one agent), as the coordinator knows it."""

    host: int  # the agent's id
    address: str  # the interface its processes listen on
    remote: bool  # reached over a control connection (the embedded agent never goes silent)
    last_seen: float  # monotonic time of its last message
    order: int = -1  # placement hint from the agent (Slurm's node id)
    node_rank: int | None = None  # None: a spare host
    lost: bool = False
    table_version: int = 0  # the newest peer table sent to its agent for its workers (0: none)


# why a coordinator stops an idle spare beside ranks: one on a host without ranks took its place
RETIRED = "moved to a spare host"


@dataclass
class Member:
    """One worker or spare process, as the coordinator knows it from messages and agent reports."""

    worker_id: int
    role: str  # worker | spare
    spawned: float  # monotonic time the agent started it
    host: int = 0  # the agent (host) it runs on
    store_address: str = ""  # host:port of its rendezvous key server ("" without one)
    rank: int | None = None
    connected: bool = False
    greeted: bool = False  # it said hello once (called init()): its exit 0 is not an unadopted script's
    ready: bool = False  # a spare that finished warming up
    done: bool = False  # passed the final barrier
    joined: bool = False  # has formed a generation at least once
    exited: bool = False
    exit_code: int | None = None
    last_message: float = 0.0
    last_progress: float = 0.0
    progress_known: bool = False
    in_collective: bool = False
    step: int | None = None
    announced_step: int | None = None  # the step its injected fault fires at (its Fired): exact,
    # where the heartbeat's step lags the fault by up to a beat
    step_time: float | None = None  # the last committed step's duration, as the worker measured it
    busy_time: float | None = (
        None  # that step less its waits in collectives (coordinator/rules/stragglers.py)
    )
    killed_for: str | None = None  # why we asked the agent to kill it
    assigned_at: float = 0.0

    def __post_init__(self) -> None:
        self.last_message = self.last_progress = self.assigned_at = self.spawned


@dataclass
class Round:
    """One recovery round: the faults it covers, the reports it collects, the plan it sends."""

    target: int
    initial: bool
    started: float
    abort_sent: float = 0.0
    faults: list[dict[str, Any]] = field(default_factory=list)
    reports: dict[int, MemberReport] = field(default_factory=dict)
    report_times: dict[int, float] = field(default_factory=dict)
    replace: set[int] = field(default_factory=set)
    waiting_since: float | None = None
    phase: str = "collect"  # collect -> rebuild
    plan_sent: float = 0.0
    recovered: dict[int, dict[str, Any]] = field(default_factory=dict)
    # lost host -> the spare host its ranks began moving to (some may still wait for a spare there)
    moving: dict[int, int] = field(default_factory=dict)
    # rank -> its own exception in this round (a fault, or a report: rules/respawn.py reads them)
    raised: dict[int, FaultRecord] = field(default_factory=dict)
    # ranks lost with their host in this round: their marks went with it (rules/sections.py)
    lost_with_host: set[int] = field(default_factory=set)


# -- commands: what the shell must do -------------------------------------------------------------
@dataclass(frozen=True)
class Command:
    pass


@dataclass(frozen=True)
class Spawn(Command):
    """Start a process; the shell reports it back with ``Coordinator.on_started``."""

    worker_id: int
    role: str
    host: int = 0  # which agent starts it


@dataclass(frozen=True)
class Kill(Command):
    worker_id: int
    why: str
    host: int = 0


@dataclass(frozen=True)
class Send(Command):
    worker_id: int
    message: Message


@dataclass(frozen=True)
class HostTable(Command):
    """Give a host's agent the whole peer table, which it keeps for its workers (protocol/tables.py)."""

    host: int
    chunks: tuple[PeerTable, ...]  # in rank order


@dataclass(frozen=True)
class Emit(Command):
    """A structured event for events.jsonl (the shell adds the time and the job id)."""

    event: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class Log(Command):
    level: str  # info | warning | error
    text: str


@dataclass(frozen=True)
class Stop(Command):
    """The job ends: ``code`` is the launcher's exit code."""

    code: int
    why: str
