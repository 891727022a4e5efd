"""The messages between the coordinator, the agents and the workers, as typed records.

Every message is a frozen dataclass with a ``TYPE`` name. On the wire it is a JSON object: the
dataclass's fields, plus ``"type"`` and the protocol version ``"v"`` (sealed frames, see
:mod:`checkpointless.wire`). :func:`decode` turns a received object back into its dataclass and
checks every field's type on the way, so the decision code never sees a malformed message:
anything wrong (an unknown type, a missing field, a string where a number belongs) raises
:class:`ProtocolError`, which the receiver treats as a broken peer. Fields a receiver does not know
are ignored, so a newer sender can add optional fields without breaking an older receiver.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from checkpointless.errors import CheckpointlessError

__all__ = [
    "SUCCESSION_ENV",
    "VERSION",
    "Abort",
    "AgentHeartbeat",
    "AgentHello",
    "AgentWelcome",
    "Assign",
    "Committed",
    "Done",
    "Fatal",
    "Fired",
    "Heartbeat",
    "Hello",
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

# 2: Recover carries a peer-table delta and a compact plan; PeerTable/PeerTableRequest;
# AgentHeartbeat carries the host's workers' beats
VERSION = 2


class ProtocolError(CheckpointlessError):
    """A message that is not one of ours, or whose fields have the wrong types."""


@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[str] = ""


# -- worker -> coordinator ------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello(Message):
    """The first message on a worker's connection: which process this is."""

    TYPE: ClassVar[str] = "hello"
    worker_id: int
    pid: int = 0
    role: str = "worker"
    # after a coordinator failover (a reconnect): the term it accepts and who it is, for the
    # new coordinator's rebuild (coordinator/rebuild.py); -1 means "none yet"
    term: int = 0
    rank: int = -1
    generation: int = -1  # the newest generation it formed
    aborted: int = -1  # the newest generation it stopped for (told to abort, or reported for)
    step: int = -1
    ready: bool = False  # a spare that finished warming up


@dataclass(frozen=True)
class Heartbeat(Message):
    """Every 0.25 s from a worker's heartbeat thread: enough to judge hangs and stalls."""

    TYPE: ClassVar[str] = "heartbeat"
    step: int | None = None
    progress_age: float | None = None  # seconds since the main thread last made step progress
    in_collective: bool = False
    step_time: float | None = None  # the last committed step's duration
    busy_time: float | None = None  # that step less its waits in collectives (straggler rule)


@dataclass(frozen=True)
class PeerTableRequest(Message):
    """The worker cannot apply a plan's peer-table delta (it holds version ``have``): send it all."""

    TYPE: ClassVar[str] = "peer_table_request"
    have: int = -1


@dataclass(frozen=True)
class SpareReady(Message):
    TYPE: ClassVar[str] = "spare_ready"


@dataclass(frozen=True)
class Fired(Message):
    """An injected fault is about to fire (it fires once per job)."""

    TYPE: ClassVar[str] = "fired"
    id: str
    kind: str
    time: float


@dataclass(frozen=True)
class Stopped(Message):
    """A member left its step (a fault, an abort) and reports its state for the next generation."""

    TYPE: ClassVar[str] = "stopped"
    for_generation: int
    committed_step: int
    valid: bool
    cause: str = "comm"  # start | join | exception | comm | recovery
    error: str | None = None
    step: int | None = None  # the step that was running
    snapshot_step: int | None = None  # newest complete shared-memory snapshot it can see
    checkpoint_step: int | None = None  # newest complete durable checkpoint it can see
    # every complete one it can see (a sharded mesh: its own shard's, which must match a step
    # that every other rank also has)
    checkpoint_steps: list[int] = field(default_factory=list)
    time: float = 0.0
    mesh: list[int] | None = None  # (replicate, shard) of a sharded job's mesh; None: data parallel
    # [owner, step] of every verified buddy copy this member keeps (state/buddy.py)
    copies: list[list[int]] = field(default_factory=list)
    # steps of this rank's own per-rank shared-memory snapshots (a sharded mesh)
    own_snapshots: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Recovered(Message):
    TYPE: ClassVar[str] = "recovered"
    generation: int
    time: float = 0.0
    timings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Committed(Message):
    """The first step a member committed after a recovery (and rank 0's state size)."""

    TYPE: ClassVar[str] = "committed"
    generation: int
    step: int
    time: float = 0.0
    first_batch_s: float | None = None
    state_bytes: int | None = None


@dataclass(frozen=True)
class Done(Message):
    TYPE: ClassVar[str] = "done"
    step: int = 0


@dataclass(frozen=True)
class Fatal(Message):
    TYPE: ClassVar[str] = "fatal"
    error: str = ""


# -- coordinator -> worker ------------------------------------------------------------------------
@dataclass(frozen=True)
class Assign(Message):
    """A rank for a worker (at start) or a spare (taking a failed rank's place)."""

    TYPE: ClassVar[str] = "assign"
    rank: int
    world_size: int
    generation: int
    faults: list[str] = field(default_factory=list)
    fired: list[str] = field(default_factory=list)
    snapshot_every: int = 0
    checkpoint_every: str = "0"  # durable checkpoints: "0" (off), steps or a time (state/durable.py)
    checkpoint_dir: str = ""  # where this job's checkpoints are ("" without any)
    # placement, host-major (coordinator/placement.py): torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE
    # and GROUP_RANK; -1 from an older coordinator means "one machine" (local == global)
    local_rank: int = -1
    local_world_size: int = -1
    node_rank: int = -1
    divergence_check: int = 100  # steps between replica digest comparisons (0: off)
    buddy_copies: str = "auto"  # auto | on | off: shard copies on another host (state/buddy.py)
    buddy_every: int = 1  # steps between those copies
    # given before the job's first state sync formed (a rank lost during start-up): the process
    # starts as that rank's original would have, restoring the script's own checkpoint
    initial: bool = False


@dataclass(frozen=True)
class Prepare(Message):
    """A spare should page in this much memory for the state it will receive."""

    TYPE: ClassVar[str] = "prepare"
    state_bytes: int


@dataclass(frozen=True)
class Prefetch(Message):
    """To a spare on a spare host: the job's step and the ranks it may take (data/spare_cache.py)."""

    TYPE: ClassVar[str] = "prefetch"
    step: int
    ranks: list[int]
    world_size: int


@dataclass(frozen=True)
class Abort(Message):
    TYPE: ClassVar[str] = "abort"
    generation: int
    reason: str = ""


@dataclass(frozen=True)
class Recover(Message):
    """The plan of a round: where to resume, who sends state to whom, how to meet.

    The plan's per-rank lists travel compact (``peer_table.compact_plan``). A root-less
    rendezvous's peer table is not in ``rendezvous``: the worker holds it (``PeerTable``) and this
    carries the change since version ``table_base`` (ranks that moved, their new addresses), the
    resulting ``table_version`` and its digest (``peer_table.py``); -1: no table."""

    TYPE: ClassVar[str] = "recover"
    generation: int
    rendezvous: dict[str, Any]
    plan: dict[str, Any]
    table_version: int = -1
    table_base: int = -1  # the version the delta applies to; -1: none (the full table was sent)
    table_digest: str = ""
    moved_ranks: list[int] = field(default_factory=list)
    moved_to: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PeerTable(Message):
    """One chunk of the full peer table (``peer_table.encode_chunks``); chunks go in rank order."""

    TYPE: ClassVar[str] = "peer_table"
    version: int
    digest: str
    world_size: int
    first: int
    hosts: list[str] = field(default_factory=list)
    runs: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class Shutdown(Message):
    TYPE: ClassVar[str] = "shutdown"
    code: int = 0
    reason: str | None = None


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

    From an agent it also carries its workers' beats (``agent/beats.py``), one column per field,
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


# -- coordinator -> agent -------------------------------------------------------------------------
@dataclass(frozen=True)
class AgentWelcome(Message):
    """The coordinator accepted an agent: its id, its lease and how to start the job's processes."""

    TYPE: ClassVar[str] = "agent_welcome"
    agent_id: int
    lease: float
    job_id: str
    control: str  # host:port the workers connect to
    run_dir: str
    shm_key: str
    script: str
    script_args: list[str] = field(default_factory=list)
    nproc: int = 1  # processes this host runs at most at once (sets the thread count)
    rendezvous: str = "rootless"
    port_base: int = 29600
    port_range: int = 1000
    hang_timeout: float = 10.0
    start_timeout: float = 180.0
    quiet_workers: bool = False
    fork_server: bool = True
    term: int = 0  # the coordinator's term (failover): an agent never goes back to a lower one
    config: dict[str, Any] = field(default_factory=dict)  # the job's settings, for a takeover


@dataclass(frozen=True)
class Succession(Message):
    """Who may take over the coordinator, sent to every agent and worker when the membership
    changes: candidate ``i`` is agent ``successors[i]`` serving on ``addresses[i]``; the
    membership is what a majority is counted against (coordinator/election.py)."""

    TYPE: ClassVar[str] = "succession"
    term: int
    members: list[int]
    successors: list[int]
    addresses: list[str]
    lease: float = 5.0


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


_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        Heartbeat,
        PeerTableRequest,
        SpareReady,
        Fired,
        Stopped,
        Recovered,
        Committed,
        Done,
        Fatal,
        Assign,
        Prepare,
        Prefetch,
        Abort,
        Recover,
        PeerTable,
        Shutdown,
        AgentHello,
        ProcStarted,
        ProcExited,
        ProcVerdict,
        AgentHeartbeat,
        AgentWelcome,
        SpawnCmd,
        KillCmd,
        ProcConnected,
        Succession,
        Vote,
    )
}


def encode(msg: Message) -> dict[str, Any]:
    """The JSON object a message travels as."""
    out: dict[str, Any] = {"type": msg.TYPE, "v": VERSION}
    for f in dataclasses.fields(msg):
        out[f.name] = getattr(msg, f.name)
    return out


def _check(name: str, value: Any, hint: Any) -> Any:
    """``value`` if it fits the annotation ``hint`` (the few shapes our messages use)."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        for arm in typing.get_args(hint):
            if arm is type(None) and value is None:
                return None
            if arm is not type(None):
                try:
                    return _check(name, value, arm)
                except ProtocolError:
                    continue
        raise ProtocolError(f"field {name!r}: {value!r} is not {hint}")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, list):
            fast = _fast_list(value, item)  # an agent's heartbeat columns: no call per element
            return fast if fast is not None else [_check(name, v, item) for v in value]
    elif origin is dict and isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return value
    raise ProtocolError(f"field {name!r}: {value!r} is not {getattr(hint, '__name__', hint)}")


def _fast_list(value: list[Any], item: Any) -> list[Any] | None:
    """``value`` checked in one pass when ``item`` is a plain scalar type; None: check each."""
    if item is int:
        ok = all(type(v) is int for v in value)  # bool is not an int here, as in _check
    elif item is bool:
        ok = all(type(v) is bool for v in value)
    elif item is str:
        ok = all(type(v) is str for v in value)
    elif item is float:
        if all(type(v) is float for v in value):
            return value
        return None  # ints among them become floats in _check
    else:
        return None
    return value if ok else None


_HINTS: dict[type[Message], dict[str, Any]] = {}


def decode(obj: Any) -> Message:
    """The typed message in a received JSON object; :class:`ProtocolError` if it is not one."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message must be a JSON object, not {type(obj).__name__}")
    kind = obj.get("type")
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {obj.get('type')!r}")
    version = obj.get("v", VERSION)
    if version != VERSION:
        raise ProtocolError(f"{cls.TYPE}: protocol version {version!r}, this side speaks {VERSION}")
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in obj:
            kwargs[f.name] = _check(f"{cls.TYPE}.{f.name}", obj[f.name], hints[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{cls.TYPE}: missing field {f.name!r}")
    return cls(**kwargs)


# -- a succession handed to a process as it starts ------------------------------------------------
SUCCESSION_ENV = "CHECKPOINTLESS_SUCCESSION"  # the agent's newest Succession, as JSON


def succession_to_env(s: Succession) -> str:
    """The value of :data:`SUCCESSION_ENV` for a process the agent starts: a process starting
    as the coordinator is lost has not heard a ``Succession`` yet, and needs one to reconnect."""
    return json.dumps(encode(s), separators=(",", ":"))


def succession_from_env(text: str | None) -> Succession | None:
    """The succession in :data:`SUCCESSION_ENV`, or None when unset; :class:`ProtocolError`
    when it is set but is not one (an agent of another version, a mangled environment)."""
    if not text:
        return None
    try:
        msg = decode(json.loads(text))
    except ValueError as e:
        raise ProtocolError(f"{SUCCESSION_ENV} is not JSON: {e}") from None
    if not isinstance(msg, Succession):
        raise ProtocolError(f"{SUCCESSION_ENV} holds a {msg.TYPE}, not a succession")
    return msg
