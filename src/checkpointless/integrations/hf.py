"""Hugging Face ``transformers.Trainer`` under checkpointless: ``Trainer`` -> ``CheckpointlessTrainer``.

The adoption is two lines (docs/adoption.md, "Hugging Face")::

    from checkpointless.integrations.hf import CheckpointlessTrainer
    trainer = CheckpointlessTrainer(model=model, args=args, train_dataset=ds)   # was Trainer(...)

run under ``checkpointless run --nproc N --spares 1 script.py``. What the subclass changes (the
full account is docs/adoption.md's):

- ``__init__`` joins the job (a hot spare waits there) and sets accelerate up again, so Trainer
  sees the job's rank, world size and resilient default group; Trainer wraps the model in torch's
  ``DistributedDataParallel`` over that group itself, and the job resets its reducer after an
  abandoned step, in one bucket layout on every rank (comm/torch_ddp.py).
- The training DataLoader (_hf_data.py) goes through ``job.loader``: a step's micro-batches are a
  function of the step, so a replay trains on the same ones and a replacement seeks to its step.
- Each optimizer step (its micro-batches, clipping, update, scheduler step) is one ``Step``,
  replayed after a fault. Its loss is reduced inside it and logged once it commits.
- The model, optimizer, scheduler, ``TrainerState``, ``TrainerControl``, the callbacks' exportable
  state and the loss since the last log line are the replica a replacement receives.
- Evaluation, checkpoints and an epoch's end run in a protected section after the steps where
  Trainer asks for them; a fault inside it is recovered and the section runs again on every rank
  from the state it began with (``SectionUndo``), its log lines shown once.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from transformers import Trainer

import checkpointless
from checkpointless.comm.torch_ddp import serve_ddp
from checkpointless.errors import ConfigError
from checkpointless.events import get_logger
from checkpointless.integrations._hf_boundary import ClosingLines, HeldLogs, ends_epoch, work_at
from checkpointless.integrations._hf_data import train_dataloader
from checkpointless.integrations._hf_internals import (
    evaluate_and_save,
    hand_over_loss,
    load_rng_state,
    refresh_devices,
    save_checkpoint,
    warn_if_untested,
)
from checkpointless.integrations._hf_run import EvalContext, StepOut, TrainerRun
from checkpointless.integrations._hf_settings import refuse_unsupported, refuse_unsupported_setup
from checkpointless.integrations._hf_state import (
    LossLedger,
    SectionUndo,
    StepPlan,
    TrainerStateCarrier,
    replica_objects,
)
from checkpointless.integrations._hf_step import optimizer_step
from checkpointless.recovery.job import Job, Step

__all__ = ["CheckpointlessTrainer"]

log = get_logger()

# the protected section at every step boundary: evaluation, checkpoints, the end of an epoch
BOUNDARY_SECTION = "trainer_boundary"


class CheckpointlessTrainer(Trainer):
    """A ``transformers.Trainer`` whose training survives faults in process.

    ``rendezvous_timeout`` and ``max_step_retries`` go to ``checkpointless.init()``;
    ``record_batches`` adds a digest of each step's micro-batches to its commit event (tests)."""

    def __init__(
        self,
        *args: Any,
        rendezvous_timeout: float = 60.0,
        max_step_retries: int = 3,
        record_batches: bool = False,
        **kwargs: Any,
    ) -> None:
        warn_if_untested()
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            refuse_unsupported(training_args)  # before joining: every rank stops at once
        # Join before Trainer builds its Accelerator: a spare waits here with its model built
        self.job: Job = checkpointless.init(
            rendezvous_timeout=rendezvous_timeout, max_step_retries=max_step_retries
        )
        if training_args is not None:
            refresh_devices(training_args)
        serve_ddp(dist.group.WORLD)  # Trainer's own DDP on the job's group (comm/torch_ddp.py)
        super().__init__(*args, **kwargs)
        self._record_batches = record_batches
        self._run: TrainerRun | None = None
        self._ledger = LossLedger()
        # read through callables: Trainer makes a new TrainerState at each train()
        self._carrier = TrainerStateCarrier(
            state=lambda: self.state,
            control=lambda: self.control,
            callbacks=lambda: list(self.callback_handler.callbacks),
        )
        self._undo = SectionUndo(self._section_objects)
        self._eval = EvalContext()
        self._held: HeldLogs | None = None  # inside the boundary's section: its on_log calls
        self._closing = ClosingLines()  # held by the section's last attempt, shown as it closes
        refuse_unsupported_setup(self)  # Trainer's defaults, accelerate's config, the GPUs

    # -- data and model ------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader[Any]:
        """A map-style DataLoader whose batches are a function of (epoch, position): a
        ``DistributedSampler`` over the job's ranks, seeded with ``data_seed`` (or ``seed``)."""
        return train_dataloader(self, self.job.rank, self.job.world_size)

    # -- the loop: Trainer._run_epoch, one optimizer step per checkpointless step --------------
    def _run_epoch(  # type: ignore[override]
        self,
        model: nn.Module,
        epoch: int,
        train_dataloader: DataLoader[Any],
        steps_in_epoch: int,
        num_update_steps_per_epoch: int,
        trial: Any,
        ignore_keys_for_eval: list[str] | None,
        start_time: float,
        resume_from_checkpoint: str | None,
        epochs_trained: int,
        steps_trained_in_current_epoch: int,
    ) -> None:
        self._eval = EvalContext(model, trial, ignore_keys_for_eval, start_time)
        run = (
            self._run
            if self._run is not None
            else self._start(model, train_dataloader, resume_from_checkpoint)
        )
        while True:
            # the job's next step, after the section at this boundary (evaluation, checkpoint, the
            # epoch's end; _boundary); a stop a callback asked for ends the job there
            step = self._peek(run)
            if step is None:  # every step of the job has committed
                self.control.should_training_stop = True
                break
            at = run.plan.epoch(step.index)
            if at < epoch:
                raise ConfigError(
                    f"the job went back to step {step.index} (epoch {at}) while Trainer is in epoch "
                    f"{epoch}: every replica was lost and an older state was restored, which "
                    "CheckpointlessTrainer cannot follow; rerun with resume_from_checkpoint"
                )
            if at > epoch:
                break  # on_epoch_end ran in the boundary's section
            run.pending = None
            self._train_step(run, step, model)
        if self.control.should_training_stop:
            self._finish(run)

    def _start(
        self, model: nn.Module, train_dataloader: DataLoader[Any], resume_from_checkpoint: str | None
    ) -> TrainerRun:
        plan = StepPlan(len(train_dataloader), self.args.gradient_accumulation_steps)
        if isinstance(model, DistributedDataParallel):  # Trainer's own (not with a job of one)
            self.job.internals.tracked.add_ddp(model)
        # what the tests check: the model Trainer trains is torch's DDP (or, in a job of one, bare)
        log.info("Trainer trains a %s.%s", type(model).__module__, type(model).__qualname__)
        loader = self.job.loader(train_dataloader)
        added = {"trainer_state": self._carrier, "loss_ledger": self._ledger, "section_undo": self._undo}
        self.job.track(**replica_objects(self, added))
        # asked at every boundary, run only where Trainer has work there (_boundary_due)
        # the state the section began with is kept, and its log lines held, until it has closed
        # on every rank together
        self.job.internals.schedule.add_section(
            BOUNDARY_SECTION,
            self._boundary,
            1,
            False,
            self._boundary_due,
            self._section_closed,
            self._closing,
        )
        self._ledger.last_logged = self.state.global_step  # a resumed run logs from its step on
        if resume_from_checkpoint is not None and not self.job.is_replacement:
            load_rng_state(self, resume_from_checkpoint)  # before the job's first state sync
        # a resumed checkpoint's steps (resume_from_checkpoint); a replacement ignores it
        start = self.state.global_step
        steps = self.job.steps(self.state.max_steps, start=start, steps_per_epoch=plan.steps_per_epoch)
        run = self._run = TrainerRun(steps, plan, loader, joining=self.job.is_replacement)
        if not self.job.is_replacement:
            run.resumed_at = start  # the checkpoint was saved after its boundary's work
        first = self._peek(run)  # the job's first state sync; a replacement receives its replica here
        run.joining = False
        if self.job.is_replacement and first is not None:
            log.info("joined at step %d; Trainer's data seeks there", first.index)
        return run

    def _section_objects(self) -> dict[str, Any]:
        """What evaluation and checkpoints change besides files: put back when they run again."""
        objects: dict[str, Any] = {"trainer_state": self._carrier, "loss_ledger": self._ledger}
        if self.lr_scheduler is not None:  # ReduceLROnPlateau steps on the evaluation's metric
            objects["scheduler"] = self.lr_scheduler
        return objects

    def _boundary_due(self) -> bool:
        """Whether the boundary's section runs after this step: asked by the step loop once per
        boundary on every rank, after ``on_step_end``; a no is kept with the loop state
        (recovery/sections.py). Not where there is nothing to do, so most steps pay no generator
        record and no event for it. The flags ``on_step_end`` set (evaluate, save, stop) and the
        end of an epoch are the same on every rank; a rank that missed the step's bookkeeping
        (rolled forward, or joining) runs the section to do it, alone if nothing else is due (no
        collective then); a section begun here and interrupted runs again, whatever its first
        attempt left of the flags."""
        run, at = self._run, self.job.committed_step
        if run is None or at == run.resumed_at:
            return False
        if run.joining or run.booked < at - 1 or self._undo.pending(at):
            return True
        return self._work_at(run, at)

    def _work_at(self, run: TrainerRun, at: int) -> bool:
        return work_at(self.control, at, run.plan.steps_per_epoch, self.state.max_steps)

    def _boundary(self) -> None:
        """The protected section after a committed step (``job.section``), where
        ``_boundary_due``: evaluation and the checkpoint Trainer asks for at this step, and at the
        end of an epoch (or of training) ``on_epoch_end`` with its own. A fault in here is
        recovered and this runs again on every rank from the state it began with; a stop asked
        for by a callback ends the job here."""
        run, at = self._run, self.job.committed_step
        self._closing.logs = None  # an interrupted attempt's lines are not shown
        if run is None or at == run.resumed_at:
            return
        redo = self._undo.pending(at)
        if redo:
            # begun and interrupted, here or on the rank this state came from: back to the state
            # it began with first (a received log history may hold what that attempt logged)
            self._undo.begin(at)
        if run.joining:
            run.booked = max(run.booked, at - 1)  # the bookkeeping came with the received state
        elif run.booked < at - 1:
            # this rank was rolled forward past a failed update: the step's bookkeeping first
            self._after_step(run, at - 1, run.last_out, in_section=True)
        # an interrupted attempt may have cleared the flags it acted on: begin() puts them back
        if not (redo or self._work_at(run, at)):
            return
        ctx = self._eval
        assert ctx.model is not None  # set by _run_epoch before the first step
        if self._undo.begin(at):
            log.info("the evaluation and checkpoint at global step %d run again", at)
        self._held = held = HeldLogs()
        try:
            evaluate_and_save(self, ctx.model, ctx.trial, ctx.ignore_keys)
            if (
                ends_epoch(at, run.plan.steps_per_epoch, self.state.max_steps)
                or self.control.should_training_stop
            ):
                self.control = self.callback_handler.on_epoch_end(self.args, self.state, self.control)
                self._log_save_evaluate(run.last_out)
        finally:
            self._held = None
        if self.control.should_training_stop:
            self.job.stop()  # replicated: the flags travel with TrainerState's carrier
        self._closing.logs = held

    def _section_closed(self) -> None:
        """The boundary's section has closed on every rank together (recovery/driver.py): no
        fault can make it run again, so the state it began with can go, and its held log lines
        are shown, once. A callback's ``on_log`` that raises here is recovered in process (its
        peers are past the section, so it is not redone) and this runs again, going on from
        that callback (``HeldLogs.show``). A replacement of a rank lost before it showed them
        runs this too, its predecessor's lines restored (recovery/held_lines.py)."""
        self._undo.end()
        held = self._closing.logs
        if held is not None:
            self.control = held.show(self.callback_handler, self.args, self.state, self.control)
        self._closing.logs = None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer's ``log``; inside the boundary's section its ``on_log`` is held (``HeldLogs``)."""
        held = self._held
        if held is None:
            super().log(logs, start_time)
            return
        handler, self.callback_handler = self.callback_handler, held  # type: ignore[assignment]
        try:
            super().log(logs, start_time)
        finally:
            self.callback_handler = handler

    def _peek(self, run: TrainerRun) -> Step | None:
        if run.pending is None and not run.done:
            try:
                run.pending = next(run.steps)
            except StopIteration:
                run.done = True
        return run.pending

    def _train_step(self, run: TrainerRun, step: Step, model: nn.Module) -> None:
        """Run ``step`` until its update is in this rank's state, then do Trainer's bookkeeping."""
        while True:
            index = step.index
            if run.begun != index:
                self.control = self.callback_handler.on_step_begin(self.args, self.state, self.control)
                run.begun = index
            out = run.last_out = StepOut()
            with step:
                optimizer_step(self, run, index, model, out, self._record_batches)
            if not step.committed:
                # recovered: the job settled on this step again (replay it on the batches held)
                # or on the next one (this rank's update was applied, or it received the state)
                following = self._peek(run)
                if following is not None and following.index == index:
                    run.pending = None
                    step = following
                    continue
                if following is not None and following.index < index:
                    # every replica was lost and an older snapshot restored (TrainerState with
                    # it): the steps from there are done again, bookkeeping included;
                    # _run_epoch refuses a step behind Trainer's epoch
                    run.booked = run.begun = following.index - 1
                    return
            self._after_step(run, index, out)
            return

    def _after_step(self, run: TrainerRun, index: int, out: StepOut, in_section: bool = False) -> None:
        """Trainer's bookkeeping of step ``index``, once on this rank, after its update is in the
        state: counters, the loss, ``on_step_end``, then logging (evaluation and checkpoints
        follow in the boundary's section, unless it completed on the rank this state came from)."""
        if run.booked >= index:
            return
        run.booked = index
        committed = self.job.committed_step  # updates in this rank's state
        received = self.state.global_step >= committed  # from a rank that did this bookkeeping
        if not received:
            self.state.global_step = committed
            self.state.epoch = run.plan.epoch_progress(index)
            if out.loss is not None:
                self._ledger.add(out.loss)
                self.state.total_flos += out.flos
        self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)
        if received:
            self._show_received_log()
            if not in_section and self.control.should_save:
                # the boundary's section (its evaluation included) completed on the rank this
                # state came from, so it does not run here: this rank's own checkpoint files (rank
                # 0 writes the model, each rank its RNG state) are written now
                assert self._eval.model is not None
                save_checkpoint(self, self._eval.model, self._eval.trial)
        self._log(out)

    def _show_received_log(self) -> None:
        # This rank failed inside its update and received the state of a rank that went on and
        # logged the step (and maybe its evaluation): the lines are in log_history already; the
        # callbacks here (rank 0's printer, a tracker) have not seen them
        for entry in self.state.log_history:
            if entry.get("step") == self.state.global_step:
                logs = {k: v for k, v in entry.items() if k != "step"}
                self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def _log(self, out: StepOut) -> None:
        if self.control.should_log and self.state.global_step > self._ledger.last_logged:
            logs: dict[str, float] = {"loss": self._ledger.drain(self.state.global_step)}
            if out.grad_norm is not None:
                logs["grad_norm"] = out.grad_norm
            if out.learning_rate is not None:
                logs["learning_rate"] = out.learning_rate
            self.log(logs, self._eval.start_time)

    def _log_save_evaluate(self, out: StepOut) -> None:
        self._log(out)
        ctx = self._eval
        assert ctx.model is not None
        evaluate_and_save(self, ctx.model, ctx.trial, ctx.ignore_keys)

    def store_flos(self) -> None:
        """Trainer gathers its per-rank FLOP count here (before a checkpoint, at the end), a
        collective between steps that a fault would break; the count was summed over the ranks
        inside each step instead (``state.total_flos``), so there is nothing left to gather."""
        self.current_flos = 0

    def _finish(self, run: TrainerRun) -> None:
        """The end of training: every rank waits until all hold the final state (recovering a rank
        that fails meanwhile), then Trainer's final metrics read the ledger."""
        if not run.done:
            self.job.stop()
            while self._peek(run) is not None:
                run.pending = None
        hand_over_loss(self, self._ledger.total_loss + self._ledger.loss, self.args.device)
