"""A fit resumed from a Lightning checkpoint (``fit(ckpt_path=...)``), as a replacement's seek
places it: Lightning's restart, and how the resumed fit's counters differ from a fit from 0's.

Every process of the job restores the checkpoint, the replacement too; Lightning's restart then
adjusts the restored counters (in ``FitLoop.reset``, before ``on_train_start``, and in the epoch
loop's ``reset``, as the first epoch begins), and they are not always a fit from batch 0's: after
a checkpoint of an epoch's last batch the epoch count runs one behind for the rest of the fit; a
plateau scheduler's call of the checkpoint's batch is lost when the checkpoint was written as the
batch ended (the call comes after that hook); and the fit loop keeps its restart mark through its
first epoch, which skips the plateau schedulers' call at that epoch's end. So the seek takes the
counters as the restart leaves them and moves them on by what a fit counts between the
checkpoint's step and the replacement's (one written at a validation's end inside an epoch has
its batch's end run again by the restart, which counts it for the loggers). Restarts that run a
loop iteration of their own (an epoch's end again) are refused, and so is a batch's end run
again where it calls a plateau scheduler again. The attribute paths are Lightning
2.6's, as in ``_lightning_internals``.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = [
    "counters",
    "epoch_lags",
    "leave_first_epoch",
    "move_counters",
    "plateau_steps_at_end_of",
    "restart_refusal",
    "restarted_counters",
]


def restart_refusal(trainer: Any, loaders: list[Any]) -> str | None:
    """Why the restart of this resumed fit cannot be placed by counting (None: it can)."""
    if any(callable(getattr(loader, "load_state_dict", None)) for loader in loaders):
        return "the fit resumed from a checkpoint with its DataLoader's own position (a stateful loader)"
    fit = trainer.fit_loop
    if fit.restarted_on_epoch_start or fit.restarted_on_epoch_end:
        return (
            "the fit resumed from a checkpoint written as an epoch began or ended, which Lightning's "
            "restart runs as a loop iteration of its own"
        )
    if fit.epoch_loop.val_loop.restarted_mid_evaluation:
        return "the fit resumed from a checkpoint written during a validation, which its restart finishes"
    batches = fit.epoch_loop.batch_progress
    at_end = batches.is_last_batch or batches.current.processed >= trainer.num_training_batches
    if fit.epoch_loop.restarted_on_last and at_end:
        return (
            "the fit resumed from a checkpoint written after its epoch's last batch had ended (at a "
            "validation's end), which Lightning's restart runs as a loop iteration of its own"
        )
    plateau_steps = any(c.reduce_on_plateau and c.interval == "step" for c in trainer.lr_scheduler_configs)
    if fit.epoch_loop.restarted_on_last and plateau_steps:
        return (
            "the fit resumed from a checkpoint written after its batch's end (a validation's), which "
            "Lightning's restart runs again, calling the plateau schedulers again"
        )
    return None


def epoch_lags(fit: Any, epoch: int) -> dict[str, dict[str, int]]:
    """How far the resumed fit's epoch counters are behind a fit from 0's as its first epoch
    ``epoch`` has begun (Lightning begins it, unless it restarted inside it)."""
    begins = 0 if fit.restarted_mid_epoch else 1
    lags = {}
    for name in ("total", "current"):
        now = getattr(fit.epoch_progress, name)
        lags[name] = {
            "ready": epoch + 1 - (now.ready + begins),
            "started": epoch + 1 - (now.started + begins),
            "processed": epoch - now.processed,
            "completed": epoch - now.completed,
        }
    return lags


def plateau_steps_at_end_of(trainer: Any, epoch: int) -> int:
    """The plateau schedulers' calls at the end of ``epoch`` (0-based), in a fit from 0."""
    return sum(
        1
        for cfg in trainer.lr_scheduler_configs
        if cfg.reduce_on_plateau and cfg.interval == "epoch" and (epoch + 1) % cfg.frequency == 0
    )


def leave_first_epoch(fit: Any) -> None:
    """The fit loop as the resumed fit's first epoch has ended (Lightning's end of an
    iteration clears its restart marks): a fit like any other from then on."""
    fit.on_iteration_done()


def counters(loop: Any) -> dict[str, Any]:
    """The epoch loop's counters that a seek sets (a copy)."""
    return copy.deepcopy(
        {
            "batch": loop.batch_progress.state_dict(),
            "scheduler": loop.scheduler_progress.state_dict(),
            "optimizer": loop.automatic_optimization.optim_progress.state_dict(),
            "stepped": loop._batches_that_stepped,
        }
    )


def restarted_counters(loop: Any) -> dict[str, Any]:
    """The epoch loop's counters as the resumed fit's first batch begins, its restart's
    ``reset`` just run: a checkpoint written after its batch had ended (at a validation's end)
    has that batch's end run again first (no validation, no batch), which counts the batch for the
    loggers (the reset counts it for a checkpoint written as the batch ended)."""
    now = counters(loop)
    if loop.restarted_on_last and not loop._should_accumulate():
        now["stepped"] += 1
    return now


def move_counters(loop: Any, base: Any, at_start: Any, at_pos: Any, first: bool, skipped: int) -> None:
    """Set the epoch loop's counters to ``base`` (the resumed fit's, as its restart left them at
    the checkpoint's step) moved on by what a fit from 0 counts from the checkpoint's step to the
    seek's (``at_pos - at_start``), less the ``skipped`` plateau calls; the counts of an epoch
    (``current``) are ``at_pos``'s outside the ``first`` epoch. Its restart marks are cleared, as
    the resumed fit's first batch clears them."""
    moved = _moved(at_pos, at_start, base, first)
    moved["scheduler"]["total"] = {k: v - skipped for k, v in moved["scheduler"]["total"].items()}
    loop.batch_progress.load_state_dict(moved["batch"])
    loop.scheduler_progress.load_state_dict(moved["scheduler"])
    loop.automatic_optimization.optim_progress.load_state_dict(moved["optimizer"])
    loop._batches_that_stepped = moved["stepped"]
    for inner in (loop, loop.val_loop, loop.automatic_optimization, loop.manual_optimization):
        inner.on_iteration_done()  # the restart marks, cleared as after the first batch


def _moved(at_pos: Any, at_start: Any, base: Any, first: bool, shift: bool = True) -> Any:
    if isinstance(at_pos, dict):
        return {
            k: _moved(v, at_start[k], base[k], first, shift and (first or k != "current"))
            for k, v in at_pos.items()
        }
    if isinstance(at_pos, bool) or not shift:
        return at_pos  # a flag, or an epoch's count in a later epoch
    return base + at_pos - at_start
