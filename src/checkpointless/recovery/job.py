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

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checkpointless.comm.data_parallel import DataParallel
from checkpointless.comm.process_group import ResilientProcessGroup
from checkpointless.config import WorkerEnv
from checkpointless.data.held_slot import follow_job
from checkpointless.errors import CheckpointlessError, ConfigError
from checkpointless.events import setup_logging
from checkpointless.faults.inject import parse_faults
from checkpointless.recovery.default_group import configure_standalone
from checkpointless.recovery.driver import run_steps
from checkpointless.recovery.epochs import EpochDriver, hold_state
from checkpointless.recovery.first_generation import open_first_generation
from checkpointless.recovery.loader import StepLoader
from checkpointless.recovery.member import Member
from checkpointless.recovery.own_rng import report_inexact
from checkpointless.recovery.script_mesh import adopt_script_mesh, settle_before_update
from checkpointless.recovery.sharded import has_dtensors
from checkpointless.recovery.startup import connect, form_mesh, join_torchrun, standalone
from checkpointless.recovery.stateful_loader import StatefulStepLoader, is_stateful_loader
from checkpointless.recovery.step import Step
from checkpointless.recovery.torchrun import export_torchrun_env, started_by_torchrun
from checkpointless.recovery.warm_specs import adopt as adopt_warmed_meshes

__all__ = ["Job", "Step", "init"]  # Step re-exported: users type their loop variables with it


class Job:
    """This process's membership in a resilient data-parallel job: what a training script uses.

    A façade: this rank's state and the parts that keep it (groups, replicas, the recovery
    client, the step clock, ...) belong to its :class:`~checkpointless.recovery.member.Member`
    (``job.internals``, for checkpointless's own integrations and tests, not for scripts)."""

    def __init__(
        self, env: WorkerEnv | None, *, rendezvous_timeout: float = 60.0, max_step_retries: int = 3
    ) -> None:
        self._member = Member(env, rendezvous_timeout, max_step_retries)
        self._epochs: EpochDriver | None = None  # job.epochs(): the step loop split into epochs

    @property
    def internals(self) -> Member:
        """This rank's state and components, for checkpointless's own integrations and tests.
        Not a stable API: a training script needs none of it."""
        return self._member

    # -- who this rank is ----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank, 0 to ``world_size - 1``; the same for the whole job. On a mesh
        it is also the data-parallel coordinate (the flat rank over (replicate, shard)): give
        it to the data loader. In degraded mode, inside the loop body of a held slot's pass
        (from ``job.steps()`` yielding it to yielding the next), it is that slot: a batch or a
        rank-0 line picked from ``job.rank`` there is the slot's, as at full width
        (recovery/held_pass.py)."""
        m = self._member
        held = m.held_pass.slot
        return m.rank if held is None else held

    @property
    def world_size(self) -> int:
        """The number of ranks; the same for the whole job (replacements take lost ranks)."""
        return self._member.world_size

    @property
    def committed_step(self) -> int:
        """The number of steps committed so far: the index of the next step to run."""
        return self._member.committed_step

    @property
    def generation(self) -> int:
        """The current generation of the job's process groups (one more after each recovery)."""
        return self._member.generation

    @property
    def is_replacement(self) -> bool:
        """True in a spare that took a rank after the job's first state sync: it receives its
        state from a peer, so skip loading your own checkpoint."""
        return self._member.is_replacement

    @property
    def job_id(self) -> str | None:
        """The launcher's job id (names the job's shared memory); None when run plainly."""
        return self._member.job_id

    @property
    def device(self) -> torch.device:
        """Where this rank's model should live: its GPU under NCCL, else the CPU."""
        return self._member.device

    # -- registration --------------------------------------------------------------------------
    def data_parallel(
        self, module: nn.Module, bucket_cap_mb: float = 25.0, *, optimizer: Any = None
    ) -> DataParallel:
        """Wrap ``module`` to average gradients over the job's ranks (instead of DDP). With
        ``optimizer``, also ``track(model=module, optimizer=optimizer)``: the replica's state."""
        if optimizer is not None:
            self.track(model=module, optimizer=optimizer)
        dp = DataParallel(module, self._member.comm, bucket_cap_mb=bucket_cap_mb)
        self._member.tracked.dps.append(dp)
        return dp

    def device_mesh(self, names: tuple[str, ...], shape: tuple[int, ...]) -> Any:
        """A ``DeviceMesh`` for torch's ``fully_shard(module, mesh=...)`` whose groups survive
        recoveries: ``(("replicate", "shard"), (R, S))`` for HSDP, ``(("shard",), (S,))`` for
        FSDP. Call it once, after ``init()`` and before ``track()`` (docs/adoption.md)."""
        return form_mesh(self._member, names, shape)

    def track(self, **objects: Any) -> None:
        """Register what makes a replica: modules, optimizers, schedulers, your own objects with
        ``state_dict``/``load_state_dict``. Registered state travels to a replacement."""
        m = self._member
        if m.clock.started:
            raise ConfigError("track() must be called before job.steps() starts")
        guard = m.guard
        for name, obj in objects.items():
            if not m.tracked.add(name, obj):
                continue
            if isinstance(obj, nn.Module):
                # with the keyword arguments too: Hugging Face calls model(**batch)
                obj.register_forward_pre_hook(lambda mod, a, kw: _on_forward(m, (a, kw)), with_kwargs=True)
                first = next((p for p in obj.parameters() if p.requires_grad), None)
                if first is not None:
                    first.register_post_accumulate_grad_hook(lambda p: guard.site("backward"))
            if isinstance(obj, torch.optim.Optimizer):
                if has_dtensors(obj):  # any mesh: Partial gradients are settled inside the step
                    settle_before_update(obj)
                    adopt_warmed_meshes(obj)  # a spare's warmed-up meshes become this job's
                obj.register_step_pre_hook(guard.before_update)
                obj.register_step_post_hook(guard.after_update)

    def loader(self, dataloader: Any) -> StepLoader | StatefulStepLoader:
        """Make a map-style ``DataLoader`` step-addressable: ``.batch(step.index)``; a torchdata
        ``StatefulDataLoader`` goes through its own state, tracked with the job's (docs/adoption.md)."""
        m = self._member
        if is_stateful_loader(dataloader):
            stateful = StatefulStepLoader(
                dataloader,
                next_step=lambda: m.committed_step,
                slot_of=lambda: m.held_pass.data_slot(m.clock.held_slot),
            )
            name = f"_loader{len(m.tracked.loaders)}"
            self.track(**{name: stateful})  # its position travels too
            # ... and, since it may differ per rank, is kept with this rank's own records
            m.tracked.positions.add(name, stateful)
            m.replicas.rank_rng.positions = m.tracked.positions.capture
            wrapped: StepLoader | StatefulStepLoader = stateful
        else:
            wrapped = StepLoader(
                dataloader,
                dp_rank=m.rank,
                dp_size=m.world_size,
                slot_of=lambda: m.held_pass.data_slot(m.clock.held_slot),
            )
        m.tracked.loaders.append(wrapped)
        return wrapped

    def section(self, name: str, fn: Callable[[], Any], every: int, at_start: bool = False) -> None:
        """Run ``fn()`` after every ``every``-th committed step (evaluation, anything with
        collectives outside a step); a fault inside it is recovered and ``fn`` runs again on every
        rank, a replacement included (recovery/sections.py). Register before job.steps()."""
        if self._member.clock.started:
            raise ConfigError(f"job.section({name!r}, ...) must be called before job.steps() starts")
        self._member.schedule.add_section(name, fn, every, at_start)

    def inject(self, *specs: str) -> None:
        """Add faults to rehearse from code, same syntax as ``--inject`` (e.g. "kill:rank=1:step=20")."""
        self._member.guard.injector.specs.extend(parse_faults(list(specs), self._member.world_size))

    # -- the loop ------------------------------------------------------------------------------
    def steps(self, total: int, start: int = 0, steps_per_epoch: int | None = None) -> Iterator[Step]:
        """Yield steps until ``total`` have committed on every rank.

        ``start``: the number of steps the state the script restored (its own checkpoint, a
        torch.distributed.checkpoint) had committed; rank 0's restored state and start are every
        rank's. A replacement ignores it: it receives state and step from a peer, so guard the
        loading code with ``if not job.is_replacement``. ``steps_per_epoch`` gives ``step.epoch``
        (default: the length of the one ``job.loader()``)."""
        adopt_script_mesh(self._member)  # a mesh of the script's own (tensor parallel), if any
        ResilientProcessGroup.local_until_formed = False  # a replacement's start-up is over
        return run_steps(self._member, total, start, steps_per_epoch)

    def epochs(self, count: int, loader: Any, start: int = 0) -> Iterator[int]:
        """``range(start, count)`` over epochs of ``loader`` (a DataLoader, a StatefulDataLoader or
        a job.loader()), recoverable: run each epoch's steps with ``job.epoch_steps()`` and read
        ``step.batch``; code after the inner loop runs once per epoch (recovery/epochs.py)."""
        m = self._member
        wrapped = loader if isinstance(loader, (StepLoader, StatefulStepLoader)) else self.loader(loader)
        per = wrapped.batches_per_epoch
        if not per:
            raise ConfigError(
                "job.epochs() needs a loader of known length (len(loader)); for one without, use "
                "job.steps(total, steps_per_epoch=N) and loader.batch(step.index)"
            )
        if not 0 <= start <= count:
            raise ConfigError(f"job.epochs({count}, start={start}): start must be in 0..{count}")
        m.schedule.step_loader = wrapped
        steps = self.steps(count * per, start * per, steps_per_epoch=per)
        self._epochs = EpochDriver(
            steps, per, m.loop, start, hold=lambda: hold_state(m.tracked.objects, lambda: m.committed_step)
        )
        return self._epochs.epochs()

    def epoch_steps(self) -> Iterator[Step]:
        """The steps of the current epoch of ``job.epochs()`` (use as its inner loop)."""
        if self._epochs is None:
            raise ConfigError("job.epoch_steps() runs inside `for epoch in job.epochs(...)`")
        return self._epochs.epoch_steps()

    @property
    def epoch_abandoned(self) -> bool:
        """True after an epoch of ``job.epochs()`` whose inner loop ended in a rollback to an
        earlier epoch (its per-epoch work still runs; recovery/epochs.py)."""
        return self._epochs is not None and self._epochs.abandoned

    def stop(self) -> None:
        """End the loop after the running step commits (or now, between steps). Call it on every
        rank at the same step, from replicated values (an all-reduced loss, the step index)."""
        m = self._member
        m.loop.request_stop(m.committed_step + 1 if m.inside_step() else m.committed_step)

    # -- inside a step -------------------------------------------------------------------------
    def generator(self, name: str, seed: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
        """Inside a step or a section: a generator seeded from (seed, name, rank, step), for
        randomness that differs per rank yet is reproduced by a replay or a replacement
        (recovery/rng.py). In a section, the step is the boundary's (the steps committed). In
        degraded mode's pass for a held slot, the rank is the slot's: the lost rank's stream."""
        m = self._member
        section = m.clock.in_section  # set only while a section runs, between steps
        if section is not None:
            step: int | None = m.committed_step
        else:
            step = m.clock.step_index if m.inside_step() else None
        held = m.clock.held_slot
        rank = m.rank if held is None else held
        return m.record.streams.get(name, seed=seed, rank=rank, step=step, device=device, section=section)

    def record(self, **fields: Any) -> None:
        """Attach fields (loss, a batch digest, ...) to this step's commit event."""
        self._member.record.fields.update(fields)

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """All-reduce over the job's ranks (in place), abortable like every job collective.

        Refused while this process holds lost slots (degraded mode): the held slots' parts would
        come only from passes still to run, so every rank would wait in it for good."""
        held = self._member.groups.held.slots
        if held:
            raise ConfigError(
                f"job.all_reduce while this process holds the lost slots {held} (degraded mode): "
                "their parts of it are not computed, and every rank would wait; run such a script "
                "with --when-no-spare fail (docs/fault-model.md, degraded mode)"
            )
        comm = self._member.comm
        return comm.wait(comm.allreduce(tensor, op))  # type: ignore[no-any-return]


_JOB: Job | None = None


def _on_forward(member: Member, args: Any) -> None:
    """A tracked module's forward hook: the fault site, and degraded mode's check that a held
    slot's pass did not get the rank's own inputs again (recovery/held_pass.py)."""
    member.guard.on_forward(args)
    detail = member.held_pass.on_forward(args)
    if detail is not None:
        report_inexact(member, member.clock.step_index or 0, "batch", detail)


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
    member = job.internals
    if env is None and started_by_torchrun():
        join_torchrun(member)  # torchrun's variables stay as torchrun set them
    elif env is None:
        setup_logging("rank 0")
        standalone(member)
        configure_standalone(member.install_default_group())
        export_torchrun_env(0, 1, keep_existing=True)
    else:
        setup_logging(f"{env.role} {env.worker_id}")
        connect(member)
        # a BatchLoader of this rank's share serves a held slot's share in its pass (degraded mode)
        follow_job(member.rank, member.world_size, lambda: member.held_pass.data_slot(member.clock.held_slot))
        member.install_default_group()
        if member.is_replacement:
            # its peers are in the recovery round: the start-up's collectives have no partners,
            # and the state it receives at job.steps() replaces what they would bring
            ResilientProcessGroup.local_until_formed = True
        else:  # the groups have communicators from here on; the state sync is job.steps()'s
            open_first_generation(member)
        export_torchrun_env(
            member.rank, member.world_size, placement=member.placement
        )  # RANK, WORLD_SIZE, LOCAL_RANK, ...
    _JOB = job
    return job
