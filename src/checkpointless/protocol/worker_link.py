"""The messages on a worker's link: between a worker (or spare) and the coordinator.

One of the two halves of the message set, split by the link a message travels on (the other is
:mod:`~checkpointless.protocol.agent_link`): a worker's link (``recovery/link.py``) and the
coordinator's rounds speak only these. Each is a frozen dataclass; its fields are what travels,
and :mod:`~checkpointless.protocol.codec` checks their types on arrival. Import them from
:mod:`checkpointless.protocol`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Any and ClassVar stay runtime names: the codec resolves these annotations (typing.get_type_hints)
# in this module's namespace.
from typing import Any, ClassVar

from checkpointless.protocol.base import Message
from checkpointless.protocol.plan import ResumePlan

__all__ = [
    "Abort",
    "Assign",
    "Committed",
    "Done",
    "DoneSeen",
    "Fatal",
    "Fired",
    "FiredSeen",
    "Heartbeat",
    "Hello",
    "Inexact",
    "PeerTable",
    "PeerTableRequest",
    "Prefetch",
    "Prepare",
    "Recover",
    "Recovered",
    "ReplayDiffers",
    "Shutdown",
    "SpareReady",
    "Stopped",
]


# -- worker -> coordinator ------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello(Message):
    """The first message on a worker's connection: which process this is."""

    TYPE: ClassVar[str] = "hello"
    worker_id: int
    pid: int = 0
    role: str = "worker"
    # after a coordinator failover (a reconnect): the term it accepts and who it is, for the
    # new coordinator's rebuild (coordinator/rules/rebuild.py); -1 means "none yet"
    term: int = 0
    rank: int = -1
    generation: int = -1  # the newest generation it formed
    aborted: int = -1  # the newest generation it stopped for (told to abort, or reported for)
    step: int = -1
    ready: bool = False  # a spare that finished warming up
    done: bool = False  # it finished its loop (its Done may have gone to the lost coordinator)


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
    step: int = -1  # the step it fires at: its fault event's step (-1: not said)


@dataclass(frozen=True)
class FiredSeen(Message):
    """The coordinator has recorded that injected fault ``id`` fired. A fault that ends its
    process (kill, killall, exit) waits for this before it does: the process's exit can be
    handled before its last frame is read, and a replacement not told that the fault fired would
    fire it again."""

    TYPE: ClassVar[str] = "fired_seen"
    id: str


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
    # [owner, step] of every verified buddy copy this member keeps (state/buddy_keeper.py)
    copies: list[list[int]] = field(default_factory=list)
    # steps of this rank's own per-rank shared-memory snapshots (a sharded mesh)
    own_snapshots: list[int] = field(default_factory=list)
    # the protected sections whose closing barrier this rank passed at the boundary after
    # ``committed_step`` steps: a peer's may have failed as it completed (recovery/driver.py)
    sections_closed: list[str] = field(default_factory=list)
    # the boundary those are at when not ``committed_step``: a replacement reports the section
    # its predecessor passed last (recovery/section_pass.py)
    sections_step: int | None = None
    # section -> ranks that entered its closing barrier there and that nobody can say passed it
    # (a replacement's predecessor, a keeper's owner): redone, their part past it may come twice
    sections_entered: dict[str, list[int]] = field(default_factory=dict)
    # the sections whose closing barrier this rank entered at ``committed_step`` and failed
    sections_left: list[str] = field(default_factory=list)


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
    # rank 0's tracked DTensor optimizers, for spares to warm up on (recovery/warm_specs.py)
    warm: dict[str, Any] | None = None


@dataclass(frozen=True)
class Done(Message):
    TYPE: ClassVar[str] = "done"
    step: int = 0


@dataclass(frozen=True)
class Inexact(Message):
    """This rank resumed step ``step`` without some of its own per-rank state (``what``: e.g.
    ``rng``, its global generators, which no record held): the job goes on, but may now differ
    from the run without the fault. ``detail`` says what was used instead, and the fix."""

    TYPE: ClassVar[str] = "inexact"
    step: int
    what: str
    detail: str = ""


@dataclass(frozen=True)
class ReplayDiffers(Message):
    """This rank's first replay of step ``step`` after a recovery recorded another loss than the
    attempt the fault interrupted (``interrupted``, ``replayed``: the ``loss`` values the script
    gave ``job.record``, as JSON): something the step computes is not a function of its state
    and its step (a rank's data order, a replacement's generators, a kernel), so the run may
    differ from the run without the fault."""

    TYPE: ClassVar[str] = "replay_differs"
    step: int
    interrupted: str
    replayed: str
    generation: int = -1


@dataclass(frozen=True)
class Fatal(Message):
    """The job must end: no recovery can help. ``kind`` "config": the script ended on a
    ConfigError, which a replacement would raise again (``error`` is its traceback)."""

    TYPE: ClassVar[str] = "fatal"
    error: str = ""
    kind: str = "fatal"  # fatal | config | retries
    tries: int = 0  # kind retries: how often the step raised in this process (0: not said)


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
    # placement, host-major (coordinator/rules/placement.py): torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE
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
    """A spare should page in this much memory for the state it will receive (and, once, warm
    up the job's DTensor optimizer steps: recovery/warm_specs.py)."""

    TYPE: ClassVar[str] = "prepare"
    state_bytes: int
    warm: dict[str, Any] | None = None


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

    ``plan`` is a typed record (``protocol/plan.py``) whose per-rank lists travel compact (the
    codec compacts and expands them). A root-less rendezvous's peer table is not in
    ``rendezvous``: the worker holds it (``PeerTable``) and this carries the change since version
    ``table_base`` (ranks that moved, their new addresses), the resulting ``table_version`` and its
    digest (``peer_table.py``); -1: no table."""

    TYPE: ClassVar[str] = "recover"
    generation: int
    rendezvous: dict[str, Any]
    plan: ResumePlan
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
class DoneSeen(Message):
    """The coordinator has recorded the worker's Done: it may leave. On many hosts a finished
    worker waits for this at its exit, so that a Done lost with its coordinator is not lost for
    good (recovery/link_failover.py)."""

    TYPE: ClassVar[str] = "done_seen"


@dataclass(frozen=True)
class Shutdown(Message):
    TYPE: ClassVar[str] = "shutdown"
    code: int = 0
    reason: str | None = None
