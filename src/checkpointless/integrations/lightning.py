"""PyTorch Lightning under checkpointless: ``Trainer(strategy=CheckpointlessStrategy())``.

Lightning owns the training loop, so the strategy works from the hooks Lightning gives every
strategy, and nothing else:

- ``__init__`` joins the job (``checkpointless.init()``; a hot spare blocks there until it is given
  a rank), and the cluster environment reports the job's rank and world size, so Lightning's
  rank-zero logic, loggers and the ``DistributedSampler`` it injects see the right numbers.
- ``configure_ddp`` wraps the LightningModule in the job's abortable ``DataParallel`` instead of DDP.
- ``on_train_start`` registers the replica state (module, optimizers, schedulers, and the small
  ledger below) and forms the job's first generation; a spare joins here and receives a replica.
- ``optimizer_step`` is the step: Lightning's closure (``training_step`` and backward) and the
  optimizer update run inside a checkpointless ``Step``. A fault anywhere in it (this rank's
  exception, or a collective aborted because another rank failed) is caught there; after the
  recovery the closure runs again on the very batch Lightning handed in, so Lightning's progress
  counters and its DataLoader position never move back. With ``accumulate_grad_batches`` the
  step is the window of micro-batches of one update; under manual optimization it is the whole
  ``training_step``, its updates put back as it began if it faults between two of them
  (``_lightning_steps.py``).
- A replacement holds a replica's state for step C while Lightning's loop starts at batch 0: it
  puts the loop at C in O(1), the counters an uninterrupted run has there and the DataLoader's
  next iterator at C's batch, reading no sample before it (``_lightning_seek.py``). Where the
  data or the fit cannot be addressed so (an iterable dataset, a sampler whose order is not a
  function of the epoch, validation on a time interval, a checkpoint whose restart Lightning
  runs as a loop iteration of its own), or with
  ``catch_up="reread"``, it walks the loop forward instead, skipping ``training_step`` and the
  update, until the loop reaches C, and logs why. Either way the batches are those of the same
  DataLoader and sampler as on every other rank; nothing skipped touches the received state.
- When every replica is lost the job restores its snapshot, and every spare that takes a rank
  is put at the snapshot's step as above; a rank still alive has its loop past that step, which
  a running fit cannot move back, so it leaves for a spare (``LoopAheadOfState``).
- Callbacks with state (``state_dict()``: ``EarlyStopping``, ``ModelCheckpoint``, an EMA of the
  weights) are part of the replica, with the position in Lightning's loop their state belongs to,
  so that a rank behind it never lets a hook reach them twice (``_lightning_callbacks.py``).
  The fp16 ``GradScaler`` of ``precision="16-mixed"`` travels too.

What runs outside a step (Lightning's barriers, broadcasts, metric reductions between batches,
the loop's per-batch SIGTERM broadcast) cannot be replayed, so the strategy keeps those local:
ranks are replicas and compute the same values. Reductions inside a step (``self.log(..., sync_dist=True)`` in ``training_step``) are real,
abortable collectives. See docs/adoption.md, "PyTorch Lightning".
"""

from __future__ import annotations

import signal
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import nn

import checkpointless
from checkpointless.comm.data_parallel import DataParallel
from checkpointless.errors import ConfigError
from checkpointless.events import get_logger
from checkpointless.integrations._lightning_callbacks import CallbackReplica
from checkpointless.integrations._lightning_devices import devices_warning
from checkpointless.integrations._lightning_environment import CheckpointlessEnvironment
from checkpointless.integrations._lightning_internals import (
    ManualStepCount,
    batches_done,
    epochs_last_batch,
    keep_sigterm_local,
)
from checkpointless.integrations._lightning_loggers import LoggerVersions
from checkpointless.integrations._lightning_samplers import own_shuffle_generators
from checkpointless.integrations._lightning_seek import fit_position, seek, seek_refusal
from checkpointless.integrations._lightning_state import PlateauMetrics, SchedulerLedger, warn_if_untested
from checkpointless.integrations._lightning_steps import LightningSteps

__all__ = ["CheckpointlessEnvironment", "CheckpointlessStrategy"]

log = get_logger()


class CheckpointlessStrategy(DDPStrategy):
    """Data-parallel training that survives faults in process (docs/adoption.md).

    ``rendezvous_timeout`` and ``max_step_retries`` are passed to ``checkpointless.init()``.
    ``catch_up``: how a replacement reaches its step in Lightning's loop: ``"seek"`` (where the
    training data allows it, else a walk) or ``"reread"`` (always walk, reading every batch
    before the step: the old way, for comparison).
    """

    strategy_name = "checkpointless"

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Lightning's hook for a strategy's names: ``Trainer(strategy="checkpointless")``
        (registered as this module is imported; Lightning 2.x loads no strategies from other
        packages by itself)."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="data parallel that survives faults in process"
            )

    def __init__(
        self,
        *,
        rendezvous_timeout: float = 60.0,
        max_step_retries: int = 3,
        catch_up: str = "seek",
        **kwargs: Any,
    ) -> None:
        if catch_up not in ("seek", "reread"):
            raise ConfigError(f"CheckpointlessStrategy(catch_up={catch_up!r}): use 'seek' or 'reread'")
        warn_if_untested("CheckpointlessStrategy")
        # Join now rather than in setup_environment: a spare then waits with the model already
        # built, and Lightning's rank-zero helpers see the real rank from the Trainer's start.
        self._job = checkpointless.init(
            rendezvous_timeout=rendezvous_timeout, max_step_retries=max_step_retries
        )
        super().__init__(cluster_environment=CheckpointlessEnvironment(self._job), **kwargs)
        self._steps: LightningSteps | None = None  # job.steps(), one step per optimizer update
        self._catch_up = catch_up
        self._ledger = SchedulerLedger()
        self._sigterm: Any = None
        self._callbacks: CallbackReplica | None = None
        self._devices_checked = False  # Trainer(devices=...) compared with the job's ranks
        self._logger_versions = LoggerVersions(self._job.job_id, self._job.rank, self._job.is_replacement)

    # -- ranks, devices, data ------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        return self._job.device

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self._job.world_size, "rank": self._job.rank}

    def set_world_ranks(self) -> None:
        import lightning_utilities.core.rank_zero as utils_rank_zero
        from lightning.pytorch.utilities import rank_zero

        # the rank Lightning's @rank_zero_only helpers compare with (as DDPStrategy sets it)
        for fn in (utils_rank_zero.rank_zero_only, getattr(rank_zero, "rank_zero_only")):  # noqa: B009
            setattr(fn, "rank", self._job.rank)  # noqa: B010
        self._warn_devices()

    def _warn_devices(self) -> None:
        """Once: ``Trainer(devices=N)`` asks for more processes than the job has (Lightning
        hands the strategy its devices before it asks for the ranks, and never starts processes
        for a strategy whose processes are made outside)."""
        if self._devices_checked:
            return
        self._devices_checked = True
        job = self._job
        launched = job.job_id is not None or job.world_size > 1
        why = devices_warning(len(self.parallel_devices or []), job.world_size, launched)
        if why is not None:
            warnings.warn(why, stacklevel=3)

    def setup_distributed(self) -> None:
        # checkpointless.init() has made the job's communicator and torch's default group (a
        # resilient one); Lightning must not make another (it would be unabortable)
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        # before Lightning's setup hook opens rank 0's loggers (and makes their directories)
        self._logger_versions.fix(self._module.trainer.loggers)
        # Lightning installs a SIGTERM handler that turns the signal into a quiet end of fit (a
        # worker would leave with exit code 0 as if done); the launcher's SIGTERM must end it
        self._sigterm = signal.getsignal(signal.SIGTERM)

    def configure_ddp(self) -> None:
        assert self.model is not None
        self.model = self._setup_model(self.model)

    def _setup_model(self, model: nn.Module) -> nn.Module:  # type: ignore[override]
        return self._job.data_parallel(model)

    @property
    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        if module is None:
            raise ConfigError("CheckpointlessStrategy used before Lightning connected a LightningModule")
        return module

    # -- the first generation ------------------------------------------------------------------
    def on_train_start(self) -> None:
        trainer = self._module.trainer
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
        self._guard_schedulers(trainer)
        keep_sigterm_local(trainer)
        # before a replacement's generators become its predecessor's (_lightning_samplers.py)
        own_shuffle_generators(trainer.train_dataloader)
        objects: dict[str, Any] = {"model": self._module, "lightning_schedulers": self._ledger}
        for i, opt in enumerate(self.optimizers):
            objects[f"optimizer{i}"] = opt
        for i, cfg in enumerate(trainer.lr_scheduler_configs):
            objects[f"scheduler{i}"] = cfg.scheduler
        if any(cfg.reduce_on_plateau for cfg in trainer.lr_scheduler_configs):
            # the values they step on, which a replacement's seek does not log (_lightning_state.py)
            objects["lightning_plateau_metrics"] = PlateauMetrics(trainer)
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:  # precision="16-mixed": the loss scale and its growth tracker
            objects["grad_scaler"] = scaler
        # under manual optimization, what a step's updates change (put back as the step began
        # when it faults between two of them), and Lightning's count of those updates
        if not self._module.automatic_optimization:
            objects["lightning_steps"] = ManualStepCount(trainer)
        manual = None if self._module.automatic_optimization else dict(objects)
        self._callbacks = CallbackReplica(trainer)
        if self._callbacks.callbacks:
            objects["lightning_callbacks"] = self._callbacks
        self._job.track(**objects)
        dp = self.model
        local = dp.local_backward if isinstance(dp, DataParallel) else None
        # fit(ckpt_path=...): every rank restored the checkpoint, and the job's steps begin at
        # its updates, or its batches under manual optimization (a replacement, which restores
        # it too, takes its step from a peer instead)
        start = trainer.global_step if manual is None else batches_done(trainer)
        self._steps = LightningSteps(self._job, trainer, self._callbacks, local, manual, start)
        if self._job.is_replacement:
            self._logger_versions.resume(self._job.committed_step)
            log.info(
                "joined at step %d; Lightning's loop catches up from %d %s",
                self._job.committed_step,
                start,
                self._seek(trainer, start, manual is not None),
            )

    def _seek(self, trainer: pl.Trainer, start: int, manual: bool) -> str:
        """Put a replacement's loop at its step where the data allows it; says how it catches up."""
        step = self._job.committed_step
        why = "catch_up='reread'" if self._catch_up == "reread" else seek_refusal(trainer)
        if why is None and step > start:  # a resumed fit's loop starts at its checkpoint's step
            pos = fit_position(trainer, step, manual)
            seek(trainer, pos, manual)
            if self._callbacks is not None:
                self._callbacks.sought()
            return f"by seeking to epoch {pos.epoch}, batch {pos.batch} (no batch before it is read)"
        return f"by re-reading its DataLoader from the start ({why or 'nothing to skip'})"

    def _guard_schedulers(self, trainer: pl.Trainer) -> None:
        # Lightning steps schedulers after the optimizer step, outside the strategy: a rank that
        # received a replica's scheduler must not step it again for batches the replica covered
        module = self._module
        inner = module.lr_scheduler_step
        keys = {
            id(cfg.scheduler): (str(i), cfg.interval) for i, cfg in enumerate(trainer.lr_scheduler_configs)
        }

        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            key, interval = keys[id(scheduler)]
            mark = trainer.global_step if interval == "step" else trainer.current_epoch + 1
            if self._ledger.should_step(key, mark):
                inner(scheduler, metric)

        module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]

    # -- the step ------------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._steps is not None and self._steps.skipping:
            # A loss connected to no parameter: Lightning refuses None from training_step in a
            # distributed run, and this one's backward reaches no gradient hook, no collective
            return torch.zeros((), device=self.root_device, requires_grad=True)

        # Called directly, not redirected through the wrapper's forward as DDP needs: our
        # DataParallel has no per-forward set-up, and a redirection that a fault interrupts
        # leaves the module's forward patched for the replay.
        def run() -> Any:
            with self.precision_plugin.train_step_context():
                return self._module.training_step(*args, **kwargs)

        if self._steps is not None and not self._module.automatic_optimization:
            return self._steps.manual_step(run)  # the step is the whole training_step
        return run()

    @property
    def handles_gradient_accumulation(self) -> bool:
        """True under ``accumulate_grad_batches``: Lightning then hands ``optimizer_step`` every
        micro-batch, so that the window of one update is one job step (``_lightning_steps.py``);
        False on an epoch's last batch, so that Lightning steps there, as it does by itself."""
        if self._steps is None:
            return False
        trainer = self._module.trainer
        return trainer.accumulate_grad_batches > 1 and not epochs_last_batch(trainer)

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        if self._steps is None or not self._module.automatic_optimization:
            # not fitting under the job, or an update inside a manual step (manual_step)
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def update(result: Any) -> Any:
            return super(CheckpointlessStrategy, self).optimizer_step(
                optimizer, lambda: result, model, **kwargs
            )

        return self._steps.micro_batch(closure, update)

    def on_train_end(self) -> None:
        if self._steps is not None:
            self._steps.finish()
        if self._callbacks is not None:
            self._callbacks.rejoin()

    # -- collectives outside a step ------------------------------------------------------------
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass  # see the module docstring: nothing outside a step may block on a peer

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj  # replicas compute the same value

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor) or not self._in_step():
            return tensor
        op = str(reduce_op).lower() if reduce_op is not None else "mean"
        if op.endswith(("max", "min")):
            red = torch.distributed.ReduceOp.MAX if op.endswith("max") else torch.distributed.ReduceOp.MIN
            return self._job.all_reduce(tensor.clone(), red)
        if not op.endswith(("sum", "mean", "avg")):
            raise ConfigError(f"reduce_op={reduce_op!r}: CheckpointlessStrategy reduces sum, mean, max, min")
        out = self._job.all_reduce(tensor.clone().float() if op.endswith(("mean", "avg")) else tensor.clone())
        return out / self._job.world_size if op.endswith(("mean", "avg")) else out

    def all_gather(
        self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> torch.Tensor:
        if self._job.world_size == 1:
            return tensor.unsqueeze(0)
        raise ConfigError(
            "all_gather is not supported by CheckpointlessStrategy yet; use self.log(sync_dist=True)"
        )

    def _in_step(self) -> bool:
        return self._steps is not None and self._steps.inside and not self._steps.skipping

    # -- files and faults ----------------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if self._steps is not None and (self._steps.skipping or self._steps.catching_up):
            return  # a replacement catching up holds a later state than the step it walks past
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self._steps is not None and self._steps.catching_up:
            return  # the files belong to the rank this one replaced; keep them
        super().remove_checkpoint(filepath)

    def teardown(self) -> None:
        if isinstance(self.model, nn.Module) and self.model is not self.lightning_module:
            self.model = self.lightning_module  # unwrap our DataParallel, as DDP's teardown does
        super().teardown()


CheckpointlessStrategy.register_strategies(StrategyRegistry)
