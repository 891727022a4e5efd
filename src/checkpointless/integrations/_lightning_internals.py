"""The one place where CheckpointlessStrategy reaches into Lightning's loop objects.

Everything else uses the hooks Lightning documents for strategies. A replayed step runs
Lightning's closure again, and the closure counts its ``zero_grad`` call in the optimization
progress that Lightning saves into every checkpoint; without putting that progress back, a
checkpoint written after a recovery would differ from the fault-free run's in those counters.
The second: from 2.6 the training loop broadcasts a SIGTERM flag from rank 0 before every batch,
straight through ``torch.distributed`` and outside any step, where a collective cannot be aborted
and replayed: a replacement walking the loop forward to its replica's step broadcasts once per
batch it walks past while the survivors wait inside the step's all-reduce, and the job deadlocks
until the process group's timeout. The third: a ModelCheckpoint's marks of what it saved in its
process, which a replacement that seeks instead of walking takes from its sender. The attribute
paths below are Lightning 2.6's
(tests/unit/integrations/test_lightning_unit.py pins the version).
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = [
    "EpochMetricsMark",
    "ManualStepCount",
    "ProgressMark",
    "batch_count",
    "batches_done",
    "checkpoint_marks",
    "epochs_last_batch",
    "keep_sigterm_local",
    "set_checkpoint_marks",
    "set_logger_version",
    "updates_now",
]


class ProgressMark:
    """The closure's ``zero_grad`` count as a step began, to be put back before a replay (under
    manual optimization: the count of optimizer steps, Lightning's ``global_step``). Only
    that count: the optimizer-step counters around the strategy's ``optimizer_step`` are
    Lightning's own (under gradient accumulation a step's last micro-batch counts its update as
    ready before the strategy sees it, after the mark was taken at the window's first)."""

    def __init__(self, trainer: Any) -> None:
        loop = trainer.fit_loop.epoch_loop
        if getattr(trainer.lightning_module, "automatic_optimization", True):
            self._progress = loop.automatic_optimization.optim_progress.optimizer.zero_grad
        else:  # manual optimization: the optimizer steps the script's training_step made
            self._progress = loop.manual_optimization.optim_step_progress
        self._state = copy.deepcopy(self._progress.state_dict())

    def restore(self) -> None:
        self._progress.load_state_dict(copy.deepcopy(self._state))


class ManualStepCount:
    """Lightning's count of the optimizer steps a manual ``training_step`` made (its
    ``global_step`` under manual optimization), as part of the replica: a replacement walks past
    the batches its state holds without running ``training_step``, so it counts none of their
    steps itself, and a rank rolled forward past a batch takes the count its update made."""

    def __init__(self, trainer: Any) -> None:
        self._progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._progress.state_dict())  # type: ignore[no-any-return]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._progress.load_state_dict(copy.deepcopy(state))


def batches_done(trainer: Any) -> int:
    """The batches whose ``training_step`` has finished (a fit resumed from a checkpoint restores
    this count; at ``on_train_start`` no batch of the fit has begun)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.total.processed)


def batch_count(trainer: Any) -> int:
    """The batches of the fit before the one in progress: a manual step's place in the job."""
    return int(trainer.fit_loop.epoch_loop.total_batch_idx)


def updates_now(trainer: Any) -> bool:
    """Lightning's optimizer step in progress is a real update, not an accumulating micro-batch:
    Lightning counts an update as ready before it calls the step, and completed after it."""
    step = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    return bool(step.ready > step.completed)


def epochs_last_batch(trainer: Any) -> bool:
    """The batch in progress is its epoch's last, on which Lightning always steps the optimizer
    (as ``_TrainingEpochLoop._num_ready_batches_reached`` decides it)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return bool(progress.current.ready == trainer.num_training_batches or progress.is_last_batch)


def keep_sigterm_local(trainer: Any) -> None:
    """Make the training loop's per-batch SIGTERM broadcast a local check. Nothing is lost: the
    strategy gives SIGTERM back to the launcher's handler, so no rank ever sets
    ``received_sigterm``, and one that did would still stop (as Lightning does, without waiting
    for the others: the launcher ends the job's other processes)."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_broadcast_sigterm_tensor"):
        return  # a Lightning without the broadcast
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    def local_sigterm_check() -> None:
        if getattr(trainer, "received_sigterm", False):
            raise SIGTERMException()

    loop._broadcast_sigterm_tensor = local_sigterm_check


# What a ModelCheckpoint did in its process (the step it saved last, the file it saved last):
# they decide whether it saves again at a step and at the end of the fit (save_last), and its
# state_dict leaves them out
_CHECKPOINT_MARKS = ("_last_global_step_saved", "_last_checkpoint_saved")


def checkpoint_marks(callback: Any) -> dict[str, Any]:
    """A checkpoint callback's marks of what it saved in this process (``{}``: it has none)."""
    return {name: getattr(callback, name) for name in _CHECKPOINT_MARKS if hasattr(callback, name)}


def set_checkpoint_marks(callback: Any, marks: dict[str, Any]) -> None:
    """Set the marks :func:`checkpoint_marks` read, on a callback of the same class."""
    for name, value in marks.items():
        if name in _CHECKPOINT_MARKS and hasattr(callback, name):
            setattr(callback, name, value)


def set_logger_version(logger: Any, version: int | str) -> None:
    """Name the version a ``CSVLogger`` or ``TensorBoardLogger`` writes into, before it has made
    its directory: they take a version only in their constructor, and otherwise pick the next
    free one, which for a replacement of rank 0 is a new one (_lightning_loggers.py)."""
    logger._version = version


class EpochMetricsMark:
    """The training loop's ``on_epoch`` accumulators as a step began: ``self.log(...,
    on_epoch=True)`` in ``training_step`` adds the batch's value to them, and a replayed step
    logs it again, so they are put back before the replay (Lightning keeps them in its
    ``_ResultCollection``, which no hook exposes). Metrics logged as torchmetrics objects keep
    their own state, which the script updates; they are left as they are."""

    def __init__(self, trainer: Any) -> None:
        self._results = trainer.fit_loop.epoch_loop._results
        self._saved = {
            key: {name: _clone(v) for name, v in metric.metric_state.items()}
            for key, metric in self._results.items()
            if metric.is_tensor and metric.meta.on_epoch
        }

    def restore(self) -> None:
        for key, metric in self._results.items():
            if not (metric.is_tensor and metric.meta.on_epoch):
                continue
            saved = self._saved.get(key)
            if saved is None:
                metric.reset()  # first logged by the attempt being replayed
                continue
            for name, v in saved.items():
                setattr(metric, name, _clone(v))


def _clone(v: Any) -> Any:
    return v.clone() if hasattr(v, "clone") else copy.deepcopy(v)
