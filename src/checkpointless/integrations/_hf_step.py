"""One optimizer step of ``CheckpointlessTrainer`` as Trainer computes it, inside the job's ``Step``.

integrations/hf.py runs this inside each ``with step:``: the step's micro-batches (held, so a
replay trains on the very batches it had), their forward and backward with the gradients synced
on the last one only, the loss and FLOPs summed over the ranks, clipping, the optimizer's update
and the scheduler's step, with Trainer's callbacks around the update. What it computed goes into
a ``StepOut`` that the caller keeps, so a rank rolled forward past it still logs the step.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from checkpointless.integrations._hf_internals import num_items_in_batch, set_sync_gradients
from checkpointless.integrations._hf_run import StepOut, TrainerRun
from checkpointless.integrations._hf_state import micro_batches_digest

__all__ = ["optimizer_step"]


def optimizer_step(
    trainer: Any, run: TrainerRun, index: int, model: nn.Module, out: StepOut, record_batches: bool
) -> None:
    """Step ``index`` on ``trainer`` (a ``CheckpointlessTrainer``): its micro-batches through
    ``model``, then the update; ``record_batches`` adds their digest to the step's commit event."""
    if run.held is None or run.held[0] != index:
        run.held = (index, [run.loader.batch(i) for i in run.plan.micro_batches(index)])
    batches = run.held[1]
    job, args = trainer.job, trainer.args
    if record_batches:
        job.record(batch=micro_batches_digest(batches))  # before anything in the step can fail
    trainer.current_gradient_accumulation_steps = len(batches)
    model.zero_grad(set_to_none=True)  # an interrupted attempt may have left gradients
    items = num_items_in_batch(trainer, batches, args.device)
    loss = torch.zeros((), dtype=torch.float64, device=args.device)
    flos = 0.0
    for i, inputs in enumerate(batches):
        last = i == len(batches) - 1
        set_sync_gradients(trainer.accelerator, last)
        sync: Any = contextlib.nullcontext() if last else model.no_sync()  # type: ignore[operator]
        with sync:
            loss = loss + trainer.training_step(model, inputs, items).double()
        flos += float(trainer.floating_point_ops(inputs))
    # reduced here, in the step: the log line must not depend on a collective between steps
    sums = torch.stack([loss.detach(), torch.tensor(flos, dtype=torch.float64, device=loss.device)])
    job.all_reduce(sums)
    out.loss, out.flos = float(sums[0]) / job.world_size, float(sums[1])
    if args.max_grad_norm is not None and args.max_grad_norm > 0:
        norm = trainer.accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        out.grad_norm = float(norm) if norm is not None else None
    assert trainer.optimizer is not None  # Trainer made it before the loop
    handler = trainer.callback_handler
    trainer.control = handler.on_pre_optimizer_step(args, trainer.state, trainer.control)
    trainer.optimizer.step()
    trainer.control = handler.on_optimizer_step(args, trainer.state, trainer.control)
    scheduler = trainer.lr_scheduler
    if scheduler is not None:
        out.learning_rate = float(scheduler.get_last_lr()[0])
        plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        if not trainer.accelerator.optimizer_step_was_skipped and not plateau:
            scheduler.step()
