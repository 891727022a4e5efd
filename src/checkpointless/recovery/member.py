"""This process as a member of the job: who it is, and the parts that keep it going.

``Job`` (``job.py``) is the script's façade; behind it, one :class:`Member` holds this rank's
place in the job (its rank, the world size, the generation it formed, the steps committed) and
the components that each own their own state:

* :class:`~checkpointless.recovery.groups.Groups`: the communicator, torch's default group, the mesh;
* :class:`~checkpointless.recovery.tracked.Tracked`: what ``job.track()`` registered;
* :class:`~checkpointless.recovery.clock.StepClock`: the loop's position and timings (heartbeats);
* :class:`~checkpointless.recovery.replicas.ReplicaKeeper`: snapshots, checkpoints, buddy copies;
* :class:`~checkpointless.recovery.client.RecoveryClient`: the link to the coordinator;
* :class:`~checkpointless.recovery.guard.UpdateGuard`: the step's hooks and fault sites;
* :class:`~checkpointless.recovery.step_record.StepRecord`: the running step's record;
* :class:`~checkpointless.recovery.loop.LoopControl`: where the loop ends (travels with the state);
* :class:`~checkpointless.recovery.schedule.StepSchedule`: sections, epoch length, step.batch's loader.

The code that drives them (``startup.py`` joins, ``driver.py`` runs the loop, ``commit.py`` and
``recover.py`` end a step either way) takes the member, never the ``Job``: it sits below the
façade, so the imports run one way.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from checkpointless.comm.communicator import Communicator
from checkpointless.config import WorkerEnv
from checkpointless.protocol import Recover
from checkpointless.recovery.client import RecoveryClient
from checkpointless.recovery.clock import StepClock
from checkpointless.recovery.default_group import DefaultGroup, install_default_group
from checkpointless.recovery.divergence import DEFAULT_EVERY
from checkpointless.recovery.groups import Groups
from checkpointless.recovery.guard import UpdateGuard
from checkpointless.recovery.held_pass import HeldPass
from checkpointless.recovery.loop import LoopControl
from checkpointless.recovery.replay_check import ReplayCheck
from checkpointless.recovery.replicas import ReplicaKeeper
from checkpointless.recovery.schedule import StepSchedule
from checkpointless.recovery.slot_rng import HeldGenerators
from checkpointless.recovery.step_record import StepRecord
from checkpointless.recovery.tracked import Tracked

__all__ = ["Member", "Opening"]


@dataclass(frozen=True)
class Opening:
    """A generation formed in ``init()`` whose state sync is still to come (``job.steps()``)."""

    generation: int
    plan: Recover  # the round's message: its rendezvous names the route of later buddy copies
    store: dist.Store  # the generation's store: a group made before job.steps() forms from it
    rebuild_s: float
    rendezvous_wait_s: float


class Member:
    """This rank's place in the job and its components (see the module's docstring)."""

    def __init__(self, env: WorkerEnv | None, rendezvous_timeout: float, max_step_retries: int) -> None:
        self.env = env  # the launcher's environment; None under plain torchrun or run plainly
        self.rank = 0
        self.world_size = 1
        # (local rank, ranks on this host, host index): host-major placement under a multi-host
        # launcher, -1s otherwise
        self.placement: tuple[int, int, int] = (-1, -1, -1)
        self.generation = -1  # the newest generation this rank formed
        self.committed_step = 0  # steps committed: the next step to run
        self.rendezvous_timeout = rendezvous_timeout
        self.max_step_retries = max_step_retries
        self.is_replacement = False  # a spare that took a rank after the job's first state sync
        self.divergence_every = DEFAULT_EVERY  # steps between replica digest comparisons (0: off)
        self.under_torchrun = False  # started by plain torchrun: one job, without recovery
        self.torchrun_store: dist.Store | None = None  # its store, which the job's groups form from
        # under the launcher, the generation formed in init() until job.steps() syncs its state
        self.opening: Opening | None = None
        # the communicator, torch's default group and the mesh, driven together (groups.py)
        self.groups = Groups(Communicator(0, 1, datetime.timedelta(seconds=rendezvous_timeout)))
        self.tracked = Tracked()  # what track() registered: the replica's state, by name and kind
        self.clock = StepClock()  # where the loop is and how long its steps take (heartbeats)
        self.replicas = ReplicaKeeper()  # snapshots, checkpoints, buddy copies, a spare's room
        self.recovery = RecoveryClient(self.groups)  # the link to the coordinator, the abort state
        # the step's hooks: fault sites and the update guard (guard.py)
        self.guard = UpdateGuard(
            self.clock,
            self.replicas,
            self.groups,
            rendezvous_timeout,
            lockstep=lambda: self.recovery.connected and self.world_size > 1,
        )
        self.groups.comm.before_allreduce = lambda: self.guard.site("allreduce")
        self.record = StepRecord()  # the running step's event fields, generators, retries
        self.replay = ReplayCheck()  # a replayed step's loss against its interrupted attempt's
        self.loop = LoopControl()  # where the loop ends; travels with the tracked state
        self.schedule = StepSchedule()  # sections, the epoch length, step.batch's loader
        self.held_rng = HeldGenerators()  # degraded mode: the held slots' own global generators
        self.held_pass = HeldPass()  # degraded mode: the slot the loop body runs for (job.rank)

    @property
    def comm(self) -> Communicator:
        """The job's data-parallel communicator (its groups' first)."""
        return self.groups.comm

    @property
    def device(self) -> torch.device:
        """Where this rank's model lives: its GPU under NCCL, else the CPU."""
        if self.comm.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def job_id(self) -> str | None:
        """The launcher's job id (names the job's shared memory); None when run plainly."""
        return self.env.job_id if self.env is not None else None

    def inside_step(self) -> bool:
        """Inside the step the loop is at (not between steps, nor in a section after it)."""
        return self.clock.inside(self.committed_step)

    def install_default_group(self) -> DefaultGroup:
        """Make torch's default group one of the job's groups, once the rank is known
        (``default_group.py`` says why every job gets one)."""
        timeout = datetime.timedelta(seconds=self.rendezvous_timeout)
        default = self.groups.default = install_default_group(
            self.rank, self.world_size, timeout, self.guard.on_collective
        )
        return default
