"""Every place where the Trainer integration reaches into transformers' or accelerate's internals.

``CheckpointlessTrainer`` (integrations/hf.py) uses Trainer's public hooks where they exist
(``training_step``, ``get_train_dataloader``, the callback handler, ``log``). The rest of the
training loop has no public hook, so it overrides ``Trainer._run_epoch`` (one epoch of optimizer
steps; 5.x factored it out of ``_inner_training_loop``) and reaches a few private helpers. They are
all here, against the exact versions below, which tests/unit/integrations/test_hf_unit.py pins: a
new release that moves one of them fails that test, not a training job.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "RUN_EPOCH_PARAMS",
    "TESTED_ACCELERATE",
    "TESTED_TRANSFORMERS",
    "evaluate_and_save",
    "hand_over_loss",
    "load_rng_state",
    "log_to",
    "num_items_in_batch",
    "refresh_devices",
    "save_checkpoint",
    "set_sync_gradients",
    "train_collator",
    "warn_if_untested",
]

TESTED_TRANSFORMERS = "5.25.0"
TESTED_ACCELERATE = "1.16.0"

# Trainer._run_epoch's parameters, in order: CheckpointlessTrainer overrides it with this signature
RUN_EPOCH_PARAMS = (
    "self",
    "model",
    "epoch",
    "train_dataloader",
    "steps_in_epoch",
    "num_update_steps_per_epoch",
    "trial",
    "ignore_keys_for_eval",
    "start_time",
    "resume_from_checkpoint",
    "epochs_trained",
    "steps_trained_in_current_epoch",
)


def warn_if_untested() -> None:
    """One warning when the installed pair is not the tested one (the `hf` extra pins it)."""
    for dist, tested in (("transformers", TESTED_TRANSFORMERS), ("accelerate", TESTED_ACCELERATE)):
        installed = importlib.metadata.version(dist)
        if installed != tested:
            warnings.warn(
                f"CheckpointlessTrainer is tested with {dist}=={tested}, this is {installed}; install "
                "the `checkpointless[hf]` extra for the tested versions",
                stacklevel=3,
            )


def run_epoch_params(trainer_cls: type) -> tuple[str, ...]:
    """The parameter names of ``trainer_cls._run_epoch`` (compared with RUN_EPOCH_PARAMS)."""
    return tuple(inspect.signature(getattr(trainer_cls, "_run_epoch")).parameters)  # noqa: B009


def refresh_devices(args: Any) -> None:
    """Make ``TrainingArguments`` set up accelerate's distributed state again.

    Building ``TrainingArguments`` already creates accelerate's ``PartialState`` (a cached
    property), before ``checkpointless.init()`` has given this process a rank: it would see a
    single process. After ``init()`` the torchrun variables are set and torch's default group is
    the job's resilient one, so a fresh set-up finds the job's rank and world size and uses that
    group instead of making its own."""
    args.__dict__.pop("_setup_devices", None)
    _ = args.device  # recomputed now, while no Accelerator exists yet


def set_sync_gradients(accelerator: Any, sync: bool) -> None:
    """Tell accelerate whether this micro-batch ends the accumulation (its optimizer wrapper
    steps only then), as Trainer's loop does for its prefetched micro-batches."""
    accelerator.gradient_state._set_sync_gradients(sync)


def num_items_in_batch(trainer: Any, batches: list[Any], device: torch.device) -> Any:
    """Trainer's count of label tokens over the step's micro-batches (the loss's denominator);
    with ``average_tokens_across_devices`` it is a collective, so it runs inside the step."""
    return trainer._get_num_items_in_batch(batches, device)


def train_collator(trainer: Any, dataset: Any) -> tuple[Any, Callable[..., Any]]:
    """The dataset and collate function Trainer's own training DataLoader would use (columns
    the model's forward does not take are removed)."""
    try:
        datasets: Any = importlib.import_module("datasets")  # optional: only when installed
    except ImportError:
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        return trainer._remove_unused_columns(dataset, description="Training"), trainer.data_collator
    return dataset, trainer._get_collator_with_removed_columns(trainer.data_collator, description="Training")


def evaluate_and_save(trainer: Any, model: nn.Module, trial: Any, ignore_keys_for_eval: Any) -> None:
    """The evaluation and checkpoint half of ``Trainer._maybe_log_save_evaluate`` (the logging
    half is CheckpointlessTrainer's own: its loss was reduced inside the step)."""
    control = trainer.control
    if control.should_evaluate:
        metrics = trainer._evaluate(trial, ignore_keys_for_eval)
        is_new_best = trainer._determine_best_metric(metrics=metrics, trial=trial)
        if trainer.args.save_strategy == "best":  # SaveStrategy is a str enum
            trainer.control.should_save = is_new_best
    if trainer.control.should_save:
        save_checkpoint(trainer, model, trial)


def save_checkpoint(trainer: Any, model: nn.Module, trial: Any) -> None:
    """Trainer's checkpoint of the current step, then its callbacks' ``on_save``."""
    trainer._save_checkpoint(model, trial)
    trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)


def hand_over_loss(trainer: Any, total_loss: float, device: torch.device) -> None:
    """Leave Trainer's loss accumulators as its own loop would at the end of training: its final
    ``train_loss`` is read from them."""
    trainer._tr_loss = torch.tensor(0.0, device=device)
    trainer._total_loss_scalar = total_loss


def load_rng_state(trainer: Any, checkpoint: str) -> None:
    """The random generators as ``checkpoint`` saved them (Trainer restores them in its own
    ``_run_epoch``, which CheckpointlessTrainer replaces)."""
    trainer._load_rng_state(checkpoint)


def log_to(handler: Any, callback: Any, args: Any, state: Any, control: Any, logs: dict[str, float]) -> Any:
    """Trainer's ``CallbackHandler.on_log`` for one of its callbacks alone: the handler calls
    each of ``handler.callbacks`` with its model, optimizer, schedulers and data loaders; here
    that list is ``[callback]`` for the call (a callback that raised is called again without
    the ones before it)."""
    callbacks = handler.callbacks
    handler.callbacks = [callback]
    try:
        return handler.on_log(args, state, control, logs)
    finally:
        handler.callbacks = callbacks
