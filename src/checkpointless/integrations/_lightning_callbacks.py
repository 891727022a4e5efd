"""Lightning callbacks with state, kept as part of the replica.

Callbacks such as ``EarlyStopping``, ``ModelCheckpoint`` or an EMA of the weights change as
Lightning calls their hooks around each batch: ``on_train_batch_start`` before the strategy's
``optimizer_step``, ``on_train_batch_end`` after it. Their state therefore belongs to a position
in Lightning's loop, not to a job step alone, and a rank that receives it may stand elsewhere:

- a replacement starts Lightning's loop at batch 0 while the state it received is of batch C;
- a survivor that faulted in batch B may receive the state of batch B + 1 (its peers finished
  B's update and the plan rolled it forward), in which the peers' ``on_train_batch_end(B)`` and
  ``on_train_batch_start(B + 1)`` have run already, and Lightning will call them here too.

So the state travels with its position: the batch whose ``optimizer_step`` the sender was in.
A receiver behind that position loads it and leaves the callbacks out of Lightning's hooks until
its own loop enters that batch's ``optimizer_step``, so that no hook reaches them twice. A
receiver at that position or past it keeps its own callbacks, which have seen as much.

Checkpoint callbacks are the exception to being left out: what they did in this process (the
last file saved, the step saved last) decides what they write at the end of the fit, so they walk
along (the strategy drops their writes while the rank is behind), and the state they received is
loaded again once the walk is over.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint

__all__ = ["CallbackReplica", "has_state"]


def has_state(callback: pl.Callback) -> bool:
    """A callback whose ``state_dict()`` says something: the base Callback's says nothing."""
    return type(callback).state_dict is not pl.Callback.state_dict


# Trainer.callbacks is an attribute the callback connector sets, which Lightning's annotations do
# not declare; its hooks iterate it afresh on every call (trainer/call.py)
def _callbacks(trainer: pl.Trainer) -> list[pl.Callback]:
    return list(getattr(trainer, "callbacks"))  # noqa: B009


def _set_callbacks(trainer: pl.Trainer, callbacks: list[pl.Callback]) -> None:
    setattr(trainer, "callbacks", callbacks)  # noqa: B010


class CallbackReplica:
    """The Trainer's stateful callbacks as one tracked object (``job.track``)."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        # every rank builds the same callbacks in the same order, so the list lines up
        self.callbacks = [cb for cb in _callbacks(trainer) if has_state(cb)]
        self.position = -1  # the batch whose optimizer_step this rank is in; -1 before the first
        self._rejoin_at: int | None = None
        self._full: list[pl.Callback] | None = None  # the whole list, while some are left out
        self._walked: list[tuple[pl.Callback, dict[str, Any]]] = []

    @property
    def behind(self) -> bool:
        """This rank's loop has not reached the position of the callback state it holds."""
        return self._rejoin_at is not None

    def state_dict(self) -> dict[str, Any]:
        return {"batch": self.position, "callbacks": [cb.state_dict() for cb in self.callbacks]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        batch = int(state["batch"])
        if batch <= self.position and not self.behind:
            return  # this rank's own callbacks have seen every hook the sender's had
        states = state["callbacks"]
        if len(states) != len(self.callbacks):
            raise ValueError(
                f"received the state of {len(states)} stateful callbacks, this rank has "
                f"{len(self.callbacks)}: every rank must build the same Trainer callbacks"
            )
        for cb, s in zip(self.callbacks, states, strict=True):
            cb.load_state_dict(s)
        if self._full is None:
            self._full = _callbacks(self.trainer)
        walking = [cb for cb in self.callbacks if isinstance(cb, Checkpoint)]
        self._walked = [(cb, copy.deepcopy(cb.state_dict())) for cb in walking]
        _set_callbacks(self.trainer, [cb for cb in self._full if cb not in self.callbacks or cb in walking])
        self._rejoin_at = batch

    def enter(self, batch: int) -> None:
        """The strategy's optimizer_step for ``batch`` begins."""
        self.position = batch
        if self._rejoin_at is not None and batch >= self._rejoin_at:
            self.rejoin()

    def rejoin(self) -> None:
        """Every callback takes Lightning's hooks again, as the sender's did from here on."""
        if self._full is not None:
            _set_callbacks(self.trainer, self._full)
            self._full = None
        for cb, state in self._walked:
            cb.load_state_dict(state)  # what the walk changed of it, the received state covers
        self._walked = []
        self._rejoin_at = None
