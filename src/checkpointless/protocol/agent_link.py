"""The messages on an agent's link: between an agent and the coordinator, and between agents.

The other half of the message set, split by the link a message travels on (the first is
:mod:`~checkpointless.protocol.worker_link`): a host's agent (``agent/``), the launcher's side of
the remote agents (``launcher/agents.py``) and the election of a new coordinator
(``agent/failover.py``) speak these. A ``Succession`` also reaches the workers, which need it to
find a new coordinator. Import them from :mod:`checkpointless.protocol`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

# ClassVar and JobSettings stay runtime names: the codec resolves these annotations
# (typing.get_type_hints) in this module's namespace.
from typing import ClassVar

from checkpointless.protocol.base import Message
from checkpointless.settings.job import JobSettings

# wire.seal_value's label for AgentWelcome.shm_key: the one secret a welcome carries
SHM_KEY_LABEL = "control/welcome/shm_key"

__all__ = [
    "SHM_KEY_LABEL",
    "AgentHeartbeat",
    "AgentHello",
    "AgentRefused",
    "AgentWelcome",
    "HealthReport",
    "KillCmd",
    "ProcConnected",
    "ProcExited",
    "ProcStarted",
    "ProcVerdict",
    "SpawnCmd",
    "Succession",
    "Vote",
    "local_node",
]


# -- agent -> coordinator -------------------------------------------------------------------------
@dataclass(frozen=True)
class AgentHello(Message):
    """The first message on an agent's connection: the host it runs on and what it offers."""

    TYPE: ClassVar[str] = "agent_hello"
    host: str  # the address this host's processes listen on (the agent's --host)
    slots: int = 0  # processes it may run (0: as many as the coordinator asks)
    pid: int = 0
    hostname: str = ""
    order: int = -1  # a placement hint (Slurm's node id): lower first; -1 keeps arrival order
    failover: str = ""  # host:port this agent serves the control channel on if it takes over
    node: str = ""  # the machine's name for one-agent-per-host checks (local_node())
    health: bool = False  # it checks its host and reports (HealthReport) before it may be promoted


def local_node() -> str:
    """This machine's name as a host identity: Slurm's node name where there is one (several
    slurmd on one machine share its address and hostname, one node each), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


@dataclass(frozen=True)
class ProcStarted(Message):
    TYPE: ClassVar[str] = "proc_started"
    worker_id: int
    store_address: str = ""
    pid: int = 0


@dataclass(frozen=True)
class ProcExited(Message):
    TYPE: ClassVar[str] = "proc_exited"
    worker_id: int
    code: int
    own_failure: bool
    detail: str = ""
    tail: str = ""
    finished_rank: int = -1  # it had finished its loop as this rank (for a successor's rebuild)


@dataclass(frozen=True)
class ProcVerdict(Message):
    """The agent's process table says a live process must go (stopped, wedged)."""

    TYPE: ClassVar[str] = "proc_verdict"
    worker_id: int
    pid: int
    why: str


@dataclass(frozen=True)
class AgentHeartbeat(Message):
    """Both ways, every half second: each side fences the other after a lease of silence.

    From an agent it also carries its workers' beats (``protocol/beats.py``), one column per field,
    one row per worker that published since the last one: ``ages`` is how long ago (seconds)
    the worker wrote it; -1 in ``steps``, ``progress_ages``, ``step_times``, ``busy_times``
    stands for None."""

    TYPE: ClassVar[str] = "agent_heartbeat"
    time: float = 0.0
    workers: list[int] = field(default_factory=list)
    ages: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    progress_ages: list[float] = field(default_factory=list)
    in_collective: list[bool] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    busy_times: list[float] = field(default_factory=list)  # empty from an agent that has none


@dataclass(frozen=True)
class HealthReport(Message):
    """The newest result of the agent's host health checks (agent/health.py): after it joins (or
    rejoins a successor), then after every periodic run. One column per field, one row per check
    (parallel lists: name, passed, detail, seconds it took). ``age`` is how long before sending
    the checks finished, so the coordinator judges freshness on its own clock."""

    TYPE: ClassVar[str] = "host_health"
    ok: bool
    age: float = 0.0
    names: list[str] = field(default_factory=list)
    passed: list[bool] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


# -- coordinator -> agent -------------------------------------------------------------------------
@dataclass(frozen=True)
class AgentWelcome(Message):
    """The coordinator accepted an agent: its id, where the job lives, and the job's settings.

    ``job`` is the job's :class:`~checkpointless.settings.JobSettings` as the coordinator holds
    them (the fields that travel; its ``script`` made absolute): the agent starts its processes
    from them, and a successor coordinator runs the job on with them after a takeover."""

    TYPE: ClassVar[str] = "agent_welcome"
    agent_id: int
    job_id: str
    control: str  # host:port the workers connect to
    run_dir: str
    # the job's /dev/shm key, confidential: sealed (wire.seal_value, SHM_KEY_LABEL), never in clear
    shm_key: str
    job: JobSettings
    term: int = 0  # the coordinator's term (failover): an agent never goes back to a lower one


@dataclass(frozen=True)
class AgentRefused(Message):
    """The coordinator will not take this agent, and asking again cannot help (another live
    agent already serves the host it claims): the agent stops with ``reason``."""

    TYPE: ClassVar[str] = "agent_refused"
    reason: str


@dataclass(frozen=True)
class Succession(Message):
    """Who may take over the coordinator, sent to every agent and worker when the membership
    changes: candidate ``i`` is agent ``successors[i]`` serving on ``addresses[i]``; the
    membership is what a majority is counted against (coordinator/rules/election.py)."""

    TYPE: ClassVar[str] = "succession"
    term: int
    members: list[int]
    successors: list[int]
    addresses: list[str]
    lease: float = 5.0


@dataclass(frozen=True)
class SpawnCmd(Message):
    TYPE: ClassVar[str] = "spawn"
    worker_id: int
    role: str


@dataclass(frozen=True)
class ProcConnected(Message):
    """A process of the agent's host said hello to the coordinator: it is no longer starting."""

    TYPE: ClassVar[str] = "proc_connected"
    worker_id: int


@dataclass(frozen=True)
class KillCmd(Message):
    TYPE: ClassVar[str] = "kill"
    worker_id: int
    why: str = ""


# -- agent -> agent (the candidate of a term) -----------------------------------------------------
@dataclass(frozen=True)
class Vote(Message):
    """An agent accepts the candidate of ``term`` and reports its host's live processes (parallel
    lists: worker id, role, pid, rendezvous address) for the rebuild."""

    TYPE: ClassVar[str] = "vote"
    term: int
    agent_id: int
    host: str
    worker_ids: list[int] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    stores: list[str] = field(default_factory=list)
    failover: str = ""  # the voter's own failover address, for the next succession
    connected: list[bool] = field(default_factory=list)  # had it said hello to the coordinator?
    # workers that left after finishing their loop (parallel lists: worker id, rank, exit code)
    finished_workers: list[int] = field(default_factory=list)
    finished_ranks: list[int] = field(default_factory=list)
    finished_codes: list[int] = field(default_factory=list)
