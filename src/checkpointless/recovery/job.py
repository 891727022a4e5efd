"""The worker side of checkpointless: a training loop that recovers in place.

Usage (the whole adoption; see docs/adoption.md)::

    job = checkpointless.init()                     # a spare blocks here until it gets a rank
    model = job.data_parallel(GPT(cfg))             # instead of DDP(model)
    opt = torch.optim.AdamW(model.parameters())
    job.track(model=model, optimizer=opt)           # what travels to a replacement
    for step in job.steps(total_steps):            # replays a step after a recovery
        with step:
            loss = model(*batch(step.index)).mean()
            opt.zero_grad(); loss.backward(); opt.step()

A step commits when its ``with`` block ends without an exception. An exception anywhere in the
block — the rank's own, or a collective aborted because another rank failed — is caught by the
block, the rank reports to the launcher and takes part in the recovery; then the loop continues at
the step the recovery settled on (the interrupted one, or the next one if this rank had already
applied its update). Models, optimizers and data objects stay in memory throughout.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checkpointless.comm.communicator import Communicator
from checkpointless.comm.data_parallel import DataParallel
from checkpointless.config import WorkerEnv
from checkpointless.errors import CheckpointlessError, ConfigError
from checkpointless.events import EventLog, setup_logging
from checkpointless.faults.inject import parse_faults
from checkpointless.recovery.client import RecoveryClient
from checkpointless.recovery.clock import StepClock
from checkpointless.recovery.default_group import DefaultGroup, configure_standalone, install_default_group
from checkpointless.recovery.divergence import DEFAULT_EVERY
from checkpointless.recovery.driver import run_steps
from checkpointless.recovery.epochs import EpochDriver, hold_state
from checkpointless.recovery.groups import Groups
from checkpointless.recovery.guard import UpdateGuard
from checkpointless.recovery.loader import StepLoader
from checkpointless.recovery.loop import LoopControl
from checkpointless.recovery.replicas import ReplicaKeeper
from checkpointless.recovery.rng import StepStreams
from checkpointless.recovery.sections import Section
from checkpointless.recovery.sharded import (
    SHARD_STATE_NAME,
    ShardedRun,
    mesh_shape_error,
)
from checkpointless.recovery.startup import connect, join_torchrun, sharded_copies, standalone
from checkpointless.recovery.stateful_loader import StatefulStepLoader, is_stateful_loader
from checkpointless.recovery.step import Step
from checkpointless.recovery.torchrun import export_torchrun_env, started_by_torchrun
from checkpointless.recovery.tracked import Tracked
from checkpointless.state.snapshot import RngState

__all__ = ["Job", "Step", "init"]  # Step re-exported: users type their loop variables with it


class Job:
    """This process's membership in a resilient data-parallel job."""

    def __init__(
        self, env: WorkerEnv | None, *, rendezvous_timeout: float = 60.0, max_step_retries: int = 3
    ) -> None:
        self.env = env
        self.rank = 0
        self.world_size = 1
        # (local rank, ranks on this host, host index): host-major placement under a multi-host
        # launcher, -1s otherwise
        self.placement: tuple[int, int, int] = (-1, -1, -1)
        self.generation = -1
        self.committed_step = 0
        self.rendezvous_timeout = rendezvous_timeout
        self.max_step_retries = max_step_retries
        # the communicator, torch's default group and the mesh, driven together (groups.py)
        self.groups = Groups(Communicator(0, 1, datetime.timedelta(seconds=rendezvous_timeout)))
        self.tracked = Tracked()  # what track() registered: the replica's state, by name and kind
        self._streams = StepStreams()
        self._loop = LoopControl()
        self._step_rng: tuple[int, RngState] | None = None
        self._retries: dict[int, int] = {}
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
        self.comm.before_allreduce = lambda: self.guard.site("allreduce")
        self._record: dict[str, Any] = {}
        self._interrupted: tuple[int, dict[str, Any]] | None = None
        self._events: EventLog | None = None
        self.last_recovery: dict[str, Any] = {}
        self.is_replacement = False
        self.divergence_every = DEFAULT_EVERY  # steps between replica digest comparisons (0: off)
        self._sections: list[Section] = []
        self._steps_per_epoch: int | None = None
        self.under_torchrun = False  # started by plain torchrun: one job, without recovery
        self._torchrun_store: dist.Store | None = None  # its store, which the job's groups form from
        self._epochs: EpochDriver | None = None  # job.epochs(): the step loop split into epochs
        self._step_loader: StepLoader | StatefulStepLoader | None = None  # step.batch's loader

    # -- start-up ------------------------------------------------------------------------------
    def _install_default_group(self) -> DefaultGroup:
        # after the rank is known; recovery/default_group.py says why every job gets one
        timeout = datetime.timedelta(seconds=self.rendezvous_timeout)
        default = self.groups.default = install_default_group(
            self.rank, self.world_size, timeout, self.guard.on_collective
        )
        return default

    @property
    def comm(self) -> Communicator:
        """The job's data-parallel communicator (its groups' first)."""
        return self.groups.comm

    # -- registration --------------------------------------------------------------------------
    def data_parallel(
        self, module: nn.Module, bucket_cap_mb: float = 25.0, *, optimizer: Any = None
    ) -> DataParallel:
        """Wrap ``module`` to average gradients over the job's ranks (instead of DDP). With
        ``optimizer``, also ``track(model=module, optimizer=optimizer)``: the replica's state."""
        if optimizer is not None:
            self.track(model=module, optimizer=optimizer)
        dp = DataParallel(module, self.comm, bucket_cap_mb=bucket_cap_mb)
        self.tracked.dps.append(dp)
        return dp

    def device_mesh(self, names: tuple[str, ...], shape: tuple[int, ...]) -> Any:
        """A ``DeviceMesh`` for torch's ``fully_shard(module, mesh=...)`` whose groups survive
        recoveries: ``(("replicate", "shard"), (R, S))`` for HSDP, ``(("shard",), (S,))`` for
        FSDP. Call it once, after ``init()`` and before ``track()`` (docs/adoption.md)."""
        if self.groups.mesh is not None or self.clock.started:
            raise ConfigError("job.device_mesh() can be called once, before job.steps()")
        err = mesh_shape_error(names, shape, self.world_size)
        if err is not None:
            raise err
        timeout = datetime.timedelta(seconds=self.rendezvous_timeout)
        mesh = self.groups.mesh = ShardedRun(
            names,
            shape,
            self.rank,
            self.world_size,
            timeout,
            self.guard.on_collective,
            self.device.type,
        )
        if self.groups.default is not None:  # the mesh's world group is this one: the mesh drives it now
            self.groups.default.handed_to_mesh()
        self.tracked.objects[SHARD_STATE_NAME] = mesh.identity()
        if mesh.shards > 1:
            sharded_copies(self)
        if self._torchrun_store is not None:  # plain torchrun: formed once, from torchrun's store
            deadline = time.monotonic() + self.rendezvous_timeout
            # The mesh's world group is torch's default group, which init() formed already
            # (_join_torchrun); forming it again would park a second gloo group, its threads
            # running, for the rest of the job (plain torchrun releases nothing until exit).
            world = mesh.mesh.world
            formed = (world,) if world.generation == 0 and world.aborted is None else ()
            mesh.configure(0, dist.PrefixStore("mesh/", self._torchrun_store), deadline, None, formed)
        elif not self.recovery.connected:  # run plainly: a world of one, formed at once
            mesh.configure(0, dist.HashStore(), time.monotonic() + 30, None)
        return mesh.device_mesh

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel coordinate: the flat rank over (replicate, shard), since
        FSDP splits the batch over the shard dimension too; give it to the data loader."""
        return self.rank

    @property
    def dp_size(self) -> int:
        return self.world_size

    def track(self, **objects: Any) -> None:
        """Register what makes a replica: modules, optimizers, schedulers, your own objects with
        ``state_dict``/``load_state_dict``. Registered state travels to a replacement."""
        if self.clock.started:
            raise ConfigError("track() must be called before job.steps() starts")
        for name, obj in objects.items():
            if not self.tracked.add(name, obj):
                continue
            if isinstance(obj, nn.Module):
                obj.register_forward_pre_hook(lambda m, a: self.guard.site("forward"))
                first = next((p for p in obj.parameters() if p.requires_grad), None)
                if first is not None:
                    first.register_post_accumulate_grad_hook(lambda p: self.guard.site("backward"))
            if isinstance(obj, torch.optim.Optimizer):
                obj.register_step_pre_hook(self.guard.before_update)
                obj.register_step_post_hook(self.guard.after_update)

    def loader(self, dataloader: Any) -> StepLoader | StatefulStepLoader:
        """Make a map-style ``DataLoader`` step-addressable: ``.batch(step.index)``; a torchdata
        ``StatefulDataLoader`` goes through its own state, tracked with the job's (docs/adoption.md)."""
        if is_stateful_loader(dataloader):
            wrapped: StepLoader | StatefulStepLoader = StatefulStepLoader(
                dataloader, next_step=lambda: self.committed_step
            )
            self.track(**{f"_loader{len(self.tracked.loaders)}": wrapped})  # its position travels too
        else:
            wrapped = StepLoader(dataloader, dp_rank=self.rank, dp_size=self.world_size)
        self.tracked.loaders.append(wrapped)
        return wrapped

    def epochs(self, count: int, loader: Any, start: int = 0) -> Iterator[int]:
        """``range(start, count)`` over epochs of ``loader`` (a DataLoader, a StatefulDataLoader or
        a job.loader()), recoverable: run each epoch's steps with ``job.epoch_steps()`` and read
        ``step.batch``; code after the inner loop runs once per epoch (recovery/epochs.py)."""
        wrapped = loader if isinstance(loader, (StepLoader, StatefulStepLoader)) else self.loader(loader)
        per = wrapped.batches_per_epoch
        if not per:
            raise ConfigError(
                "job.epochs() needs a loader of known length (len(loader)); for one without, use "
                "job.steps(total, steps_per_epoch=N) and loader.batch(step.index)"
            )
        if not 0 <= start <= count:
            raise ConfigError(f"job.epochs({count}, start={start}): start must be in 0..{count}")
        self._step_loader = wrapped
        steps = self.steps(count * per, start * per, steps_per_epoch=per)
        self._epochs = EpochDriver(
            steps,
            per,
            self._loop,
            start,
            hold=lambda: hold_state(self.tracked.objects, lambda: self.committed_step),
        )
        return self._epochs.epochs()

    @property
    def epoch_abandoned(self) -> bool:
        """True after an epoch of ``job.epochs()`` whose inner loop ended in a rollback to an
        earlier epoch (its per-epoch work still runs; recovery/epochs.py)."""
        return self._epochs is not None and self._epochs.abandoned

    def epoch_steps(self) -> Iterator[Step]:
        """The steps of the current epoch of ``job.epochs()`` (use as its inner loop)."""
        if self._epochs is None:
            raise ConfigError("job.epoch_steps() runs inside `for epoch in job.epochs(...)`")
        return self._epochs.epoch_steps()

    def generator(self, name: str, seed: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
        """Inside a step: a generator seeded from (seed, name, rank, step), for randomness that
        differs per rank yet is reproduced by a replay or a replacement (recovery/rng.py)."""
        step = self.clock.step_index if self.clock.inside(self.committed_step) else None
        return self._streams.get(name, seed=seed, rank=self.rank, step=step, device=device)

    def section(self, name: str, fn: Callable[[], Any], every: int, at_start: bool = False) -> None:
        """Run ``fn()`` after every ``every``-th committed step (evaluation, anything with
        collectives outside a step); a fault inside it is recovered and ``fn`` runs again on every
        rank, a replacement included (recovery/sections.py). Register before job.steps()."""
        if self.clock.started:
            raise ConfigError(f"job.section({name!r}, ...) must be called before job.steps() starts")
        if any(s.name == name for s in self._sections):
            raise ConfigError(f"a section named {name!r} is already registered; give each its own name")
        self._sections.append(Section(name, fn, every, at_start))

    def stop(self) -> None:
        """End the loop after the running step commits (or now, between steps). Call it on every
        rank at the same step, from replicated values (an all-reduced loss, the step index)."""
        inside = self.clock.inside(self.committed_step)
        self._loop.request_stop(self.committed_step + 1 if inside else self.committed_step)

    def record(self, **fields: Any) -> None:
        """Attach fields (loss, a batch digest, ...) to this step's commit event."""
        self._record.update(fields)

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """All-reduce over the job's ranks (in place), abortable like every job collective."""
        return self.comm.wait(self.comm.allreduce(tensor, op))  # type: ignore[no-any-return]

    @property
    def step(self) -> int:
        return self.committed_step

    @property
    def device(self) -> torch.device:
        """Where this rank's model should live: its GPU under NCCL, else the CPU."""
        if self.comm.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def inject(self, *specs: str) -> None:
        """Add faults to rehearse from code, same syntax as ``--inject`` (e.g. "kill:rank=1:step=20")."""
        self.guard.injector.specs.extend(parse_faults(list(specs), self.world_size))

    @property
    def job_id(self) -> str | None:
        """The launcher's job id (names the job's shared memory); None when run plainly."""
        return self.env.job_id if self.env is not None else None

    # -- the loop ------------------------------------------------------------------------------
    def steps(self, total: int, start: int = 0, steps_per_epoch: int | None = None) -> Iterator[Step]:
        """Yield steps until ``total`` have committed on every rank.

        ``start``: the number of steps the state the script restored (its own checkpoint, a
        torch.distributed.checkpoint) had committed; rank 0's restored state and start are every
        rank's. A replacement ignores it: it receives state and step from a peer, so guard the
        loading code with ``if not job.is_replacement``. ``steps_per_epoch`` gives ``step.epoch``
        (default: the length of the one ``job.loader()``)."""
        return run_steps(self, total, start, steps_per_epoch)


_JOB: Job | None = None


def init(*, rendezvous_timeout: float = 60.0, max_step_retries: int = 3) -> Job:
    """Join the job. Under ``checkpointless run`` this connects to the launcher (and, in a spare,
    waits to be given a rank); under plain torchrun it joins torchrun's rendezvous as a job without
    recovery (one warning per rank); run plainly, it makes a single-process job."""
    global _JOB
    if _JOB is not None:
        return _JOB
    try:
        env = WorkerEnv.from_environ()
    except CheckpointlessError:
        raise
    job = Job(env, rendezvous_timeout=rendezvous_timeout, max_step_retries=max_step_retries)
    if env is None and started_by_torchrun():
        join_torchrun(job)  # torchrun's variables stay as torchrun set them
    elif env is None:
        setup_logging("rank 0")
        standalone(job)
        configure_standalone(job._install_default_group())
        export_torchrun_env(0, 1, keep_existing=True)
    else:
        setup_logging(f"{env.role} {env.worker_id}")
        connect(job)
        job._install_default_group()
        export_torchrun_env(
            job.rank, job.world_size, placement=job.placement
        )  # RANK, WORLD_SIZE, LOCAL_RANK, ...
    _JOB = job
    return job
