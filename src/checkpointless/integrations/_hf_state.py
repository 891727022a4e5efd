"""What the Trainer integration adds to the replica, and where each optimizer step's data is.

Kept free of transformers, so it is tested as plain code (tests/unit/integrations/test_hf_unit.py):

- :class:`StepPlan`: which micro-batches (positions in the job's ``job.loader``) optimizer step
  ``s`` trains on, with gradient accumulation and an epoch whose length is not a multiple of it.
- :class:`LossLedger`: the training loss summed since the last log line, reduced inside the step
  that produced it, so a log line never depends on a collective between steps and never counts a
  replayed step twice.
- :func:`replica_objects`: what a Trainer's replica is, Trainer's own objects and these.
- :class:`TrainerStateCarrier`: ``TrainerState`` (global step, epoch, log history, best metric),
  ``TrainerControl`` and every callback with exportable state, as one tracked object.
- :class:`SectionUndo`: the state that evaluation and checkpointing change (the carrier's, the
  ledger's, the scheduler's), as their protected section began, so that a section redone after a
  fault starts from it again on every rank, a replacement included.
- :class:`ProtectedResults`: what an Accelerate loop's protected functions (its evaluation)
  returned at each step boundary, so that a replacement passing finished epochs gets them too.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from checkpointless.errors import ConfigError
from checkpointless.state.snapshot import Stateful

__all__ = [
    "LossLedger",
    "ProtectedResults",
    "SectionUndo",
    "StepPlan",
    "TrainerStateCarrier",
    "micro_batches_digest",
    "replica_objects",
]

# TrainerState fields that do not travel: this process's own place in the job, and Trainer's
# file copy of the callbacks' state (the live callbacks travel instead)
_LOCAL_FIELDS = frozenset({"is_local_process_zero", "is_world_process_zero", "stateful_callbacks"})


@dataclass(frozen=True)
class StepPlan:
    """Optimizer steps over an epoch of ``batches_per_epoch`` micro-batches, ``accumulation`` per
    step (the epoch's last step takes what is left, as Trainer's loop does)."""

    batches_per_epoch: int
    accumulation: int

    def __post_init__(self) -> None:
        if self.batches_per_epoch <= 0 or self.accumulation <= 0:
            raise ConfigError(
                f"the training DataLoader has {self.batches_per_epoch} batches per epoch and "
                f"gradient_accumulation_steps={self.accumulation}: both must be positive"
            )

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.batches_per_epoch // self.accumulation)

    def epoch(self, step: int) -> int:
        return step // self.steps_per_epoch

    def micro_batches(self, step: int) -> range:
        """Loader positions (``epoch * batches_per_epoch + i``) of step ``step``'s micro-batches."""
        epoch, update = divmod(step, self.steps_per_epoch)
        first = update * self.accumulation
        last = min(first + self.accumulation, self.batches_per_epoch)
        base = epoch * self.batches_per_epoch
        return range(base + first, base + last)

    def epoch_progress(self, step: int) -> float:
        """``TrainerState.epoch`` after step ``step`` (Trainer's ``epoch + (step + 1) / steps_in_epoch``)."""
        epoch, update = divmod(step, self.steps_per_epoch)
        done = min((update + 1) * self.accumulation, self.batches_per_epoch)
        return epoch + done / self.batches_per_epoch


@dataclass
class LossLedger:
    """The loss of the committed steps (the ranks' mean) since the last log line."""

    loss: float = 0.0  # sum over steps of the ranks' mean loss
    total_loss: float = 0.0  # every logged loss so far (Trainer's final train_loss)
    last_logged: int = 0  # the global step of the last log line

    def add(self, loss: float) -> None:
        self.loss += loss

    def drain(self, global_step: int) -> float:
        """The mean loss per step since the last log line; starts a new interval."""
        steps = max(global_step - self.last_logged, 1)
        loss = self.loss / steps
        self.total_loss += self.loss
        self.loss, self.last_logged = 0.0, global_step
        return loss

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss = float(state["loss"])
        self.total_loss, self.last_logged = float(state["total_loss"]), int(state["last_logged"])


class TrainerStateCarrier:
    """``TrainerState``, ``TrainerControl`` and the exportable callbacks' attributes.

    ``state`` and ``control`` are read through callables because Trainer makes a new
    ``TrainerState`` at the start of each ``train()``; the carrier always means the current one.
    A callback's state is what its ``ExportableState.state()`` returns, the same thing Trainer
    writes to ``trainer_state.json`` for it: its ``"attributes"``, and its ``"args"`` where they
    are attributes of the object (``TrainerControl`` keeps its flags there)."""

    def __init__(
        self,
        state: Callable[[], Any],
        control: Callable[[], Any],
        callbacks: Callable[[], list[Any]],
    ) -> None:
        self._state = state
        self._control = control
        self._callbacks = callbacks

    def _exportable(self) -> list[Any]:
        return [self._control(), *(cb for cb in self._callbacks() if hasattr(cb, "state"))]

    def state_dict(self) -> dict[str, Any]:
        fields = {
            f.name: getattr(self._state(), f.name)
            for f in dataclasses.fields(self._state())
            if f.name not in _LOCAL_FIELDS
        }
        attributes = [_exported(obj) for obj in self._exportable()]
        # copies: the replica must not change when the live log history grows
        return copy.deepcopy({"state": fields, "callbacks": attributes})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        target = self._state()
        for name, value in copy.deepcopy(state["state"]).items():
            setattr(target, name, value)
        objects = self._exportable()
        if len(objects) != len(state["callbacks"]):
            raise ConfigError(
                f"this rank has {len(objects)} callbacks with state and the replica has "
                f"{len(state['callbacks'])}: give every rank the same callbacks"
            )
        for obj, attributes in zip(objects, state["callbacks"], strict=True):
            for name, value in copy.deepcopy(attributes).items():
                setattr(obj, name, value)


def _exported(obj: Any) -> dict[str, Any]:
    state = obj.state()
    args = {k: v for k, v in state.get("args", {}).items() if hasattr(obj, k)}
    return {**args, **state.get("attributes", {})}


class SectionUndo:
    """The state of ``objects()`` as the protected section at a step boundary began.

    An evaluation appends to the log history, may step a ``ReduceLROnPlateau`` scheduler and
    counts an ``EarlyStoppingCallback``'s patience; a fault after some of that, before the section
    completed, would count it twice when the section runs again. So :meth:`begin` keeps the state
    on a section's first attempt and puts it back on a later one at the same boundary. The kept
    state is tracked with the replica: a replacement that joins to redo the section restores it
    too, whatever the rank it received from had done of the section when the fault came."""

    def __init__(self, objects: Callable[[], dict[str, Stateful]]) -> None:
        self._objects = objects
        self.at: int | None = None  # the boundary (committed steps) whose section is under way
        self.kept: dict[str, Any] = {}

    def begin(self, at: int) -> bool:
        """Enter the section at boundary ``at``; True when it is a redo (the state was put back)."""
        objects = self._objects()
        if self.at == at:
            for name, obj in objects.items():
                obj.load_state_dict(copy.deepcopy(self.kept[name]))
            return True
        self.at, self.kept = at, {name: copy.deepcopy(obj.state_dict()) for name, obj in objects.items()}
        return False

    def pending(self, at: int) -> bool:
        """A section at boundary ``at`` began and did not complete: it must run again."""
        return self.at == at

    def end(self) -> None:
        """The section completed: nothing to put back any more."""
        self.at, self.kept = None, {}

    def state_dict(self) -> dict[str, Any]:
        return {"at": self.at, "kept": copy.deepcopy(self.kept)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        at = state["at"]
        self.at = None if at is None else int(at)
        self.kept = copy.deepcopy(state["kept"])


class ProtectedResults:
    """What each protected function of an Accelerate loop returned, by the step boundary it ran at.

    Tracked with the replica: a replacement whose loop passes epochs its state already holds gets
    the results its peers computed there, and one that joins to redo a function finds the result
    of the other boundaries."""

    def __init__(self) -> None:
        self.results: dict[str, dict[int, Any]] = {}

    def get(self, name: str, at: int) -> tuple[bool, Any]:
        """(whether ``name`` ran at boundary ``at``, its result)."""
        done = self.results.get(name, {})
        return (at in done, done.get(at))

    def put(self, name: str, at: int, result: Any) -> None:
        self.results.setdefault(name, {})[at] = result

    def state_dict(self) -> dict[str, Any]:
        return {"results": copy.deepcopy(self.results)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.results = {str(n): {int(a): r for a, r in d.items()} for n, d in state["results"].items()}


def micro_batches_digest(batches: list[Any]) -> str:
    """A short digest of an optimizer step's micro-batches (their tensors, in order), recorded in
    its commit event so that tests can compare the data of every (rank, step) across runs."""
    h = hashlib.sha256()
    for batch in batches:
        items = sorted(batch.items()) if isinstance(batch, dict) else enumerate(batch)
        for _, value in items:
            if isinstance(value, torch.Tensor):
                h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def replica_objects(trainer: Any, added: dict[str, Any]) -> dict[str, Any]:
    """What ``job.track`` keeps of a ``CheckpointlessTrainer``: the model, the optimizer (not
    accelerate's wrapper), the scheduler and fp16's grad scaler where there are ones, and the
    integration's ``added`` objects."""
    objects: dict[str, Any] = {
        "model": trainer.model,
        "optimizer": getattr(trainer.optimizer, "optimizer", trainer.optimizer),
        **added,
    }
    if trainer.lr_scheduler is not None:
        objects["scheduler"] = trainer.lr_scheduler
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is not None:  # fp16 mixed precision: the loss scale and its growth tracker
        objects["grad_scaler"] = scaler
    return objects
