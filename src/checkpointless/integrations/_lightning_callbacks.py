"""Lightning callbacks with state, kept as part of the replica.

Callbacks such as ``EarlyStopping``, ``ModelCheckpoint`` or an EMA of the weights change as
Lightning calls their hooks around each batch: ``on_train_batch_start`` before the strategy's
``optimizer_step``, ``on_train_batch_end`` after it. Their state therefore belongs to a position
in Lightning's loop, not to a job step alone: the batch whose ``optimizer_step`` the sender was
in (at the end of the fit, the batch after the last: every hook has run).

- A replacement starts Lightning's loop at batch 0 while the state it receives is of batch C. It
  loads that state and leaves the callbacks out of Lightning's hooks until its loop trains batch
  C, or has walked past it (the sender may have been past that batch's update, still inside its
  ``optimizer_step``), so that no hook reaches them twice.
- A rank that has trained keeps its own callbacks whatever it receives. A fault leaves them
  valid (it breaks the weights or the optimizer, not what the hooks saw), and a rank rolled
  forward past the batch it faulted in still gets that batch's later hooks from Lightning, now
  with the received weights: what the callbacks of a run without the fault saw.

Hooks that run inside Lightning's closure (``on_before_backward``, ``on_after_backward``,
``on_before_zero_grad``, ``on_before_optimizer_step``) run again when a step is replayed: the
state of the callbacks that implement one is kept as each step begins and put back for a replay.

Checkpoint callbacks are the exception to being left out: what they did in this process (the
last file saved, the step saved last) decides what they write at the end of the fit, so they walk
along (the strategy drops their writes while the replacement catches up), and the state they
received is loaded again once the walk is over. A replacement that seeks to its batch instead of
walking (``_lightning_seek.py``) takes what the sender's checkpoint callbacks did in its process
(:meth:`CallbackReplica.sought`): every rank's make the same saves, and a walk would have made
them again.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint

from checkpointless.integrations._lightning_internals import checkpoint_marks, set_checkpoint_marks

__all__ = ["CallbackReplica", "has_state"]


def has_state(callback: pl.Callback) -> bool:
    """A callback whose ``state_dict()`` says something: the base Callback's says nothing."""
    return type(callback).state_dict is not pl.Callback.state_dict


_CLOSURE_HOOKS = (
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
)


def _hooks_closure(callback: pl.Callback) -> bool:
    return any(getattr(type(callback), h) is not getattr(pl.Callback, h) for h in _CLOSURE_HOOKS)


# Trainer.callbacks is an attribute the callback connector sets, which Lightning's annotations do
# not declare; its hooks iterate it afresh on every call (trainer/call.py)
def _callbacks(trainer: pl.Trainer) -> list[pl.Callback]:
    return list(getattr(trainer, "callbacks"))  # noqa: B009


def _set_callbacks(trainer: pl.Trainer, callbacks: list[pl.Callback]) -> None:
    setattr(trainer, "callbacks", callbacks)  # noqa: B010


class CallbackReplica:
    """The Trainer's stateful callbacks as one tracked object (``job.track``)."""

    # a rank that has trained keeps its own callbacks, so a received state must not be written
    # into their live tensors (state/snapshot.py, landing_zone)
    lands_in_place = False

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        # every rank builds the same callbacks in the same order, so the list lines up
        self.callbacks = [cb for cb in _callbacks(trainer) if has_state(cb)]
        self.position = -1  # the batch whose optimizer_step this rank is in; -1 before the first
        self._rejoin_at: int | None = None
        self._full: list[pl.Callback] | None = None  # the whole list, while some are left out
        self._walked: list[tuple[pl.Callback, dict[str, Any]]] = []
        # callbacks whose state a replayed closure would change twice, and their state at the
        # step's start
        self._in_closure = [cb for cb in self.callbacks if _hooks_closure(cb)]
        self._at_start: list[dict[str, Any]] = []
        # under gradient accumulation, every callback's state as the open window began: the
        # state a peer receives for the window's step, whose first micro-batch it trains (the
        # hooks of the micro-batches this rank has run since must reach its callbacks again)
        self._window: list[dict[str, Any]] | None = None
        self._marks: list[dict[str, Any]] = []  # the sender's checkpoint marks, received

    @property
    def behind(self) -> bool:
        """This rank's loop has not reached the position of the callback state it holds."""
        return self._rejoin_at is not None

    def state_dict(self) -> dict[str, Any]:
        states = self._window if self._window is not None else [cb.state_dict() for cb in self.callbacks]
        marks = [checkpoint_marks(cb) if isinstance(cb, Checkpoint) else {} for cb in self.callbacks]
        return {"batch": self.position, "callbacks": states, "marks": marks}

    def window_begins(self) -> None:
        """A window of accumulated micro-batches (one job step) begins on this rank."""
        self._window = [copy.deepcopy(cb.state_dict()) for cb in self.callbacks]

    def window_ends(self) -> None:
        """The window's update is applied: the callbacks' own state is the step's again."""
        self._window = None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        batch = int(state["batch"])
        if batch <= self.position or (self.position >= 0 and not self.behind):
            return  # a rank that has trained keeps its own callbacks (see the module's notes)
        states = state["callbacks"]
        if len(states) != len(self.callbacks):
            raise ValueError(
                f"received the state of {len(states)} stateful callbacks, this rank has "
                f"{len(self.callbacks)}: every rank must build the same Trainer callbacks"
            )
        for cb, s in zip(self.callbacks, states, strict=True):
            cb.load_state_dict(s)
        self._marks = list(state.get("marks", []))
        self._at_start = []  # the received state is newer than this step's start
        if self._full is None:
            self._full = _callbacks(self.trainer)
        walking = [cb for cb in self.callbacks if isinstance(cb, Checkpoint)]
        self._walked = [(cb, copy.deepcopy(cb.state_dict())) for cb in walking]
        _set_callbacks(self.trainer, [cb for cb in self._full if cb not in self.callbacks or cb in walking])
        self._rejoin_at = batch

    def sought(self) -> None:
        """This replacement's loop was put at the received state's batch without walking there:
        its checkpoint callbacks take the sender's marks of what they saved, which the walk's
        hooks would have set alike."""
        for cb, marks in zip(self.callbacks, self._marks, strict=False):
            if isinstance(cb, Checkpoint):
                set_checkpoint_marks(cb, marks)

    def at(self, batch: int) -> None:
        """The strategy's optimizer_step for ``batch`` begins (every attempt at it)."""
        self.position = batch

    def train(self, batch: int) -> None:
        """This rank trains ``batch`` now: callbacks left out take hooks from here on, and the
        state that a replay would change twice is kept."""
        if self._rejoin_at is not None and batch >= self._rejoin_at:
            self.rejoin()
        self._at_start = [copy.deepcopy(cb.state_dict()) for cb in self._in_closure]

    def rewind(self) -> None:
        """A replay of the step: its closure's hooks reach the callbacks again from the start."""
        for cb, state in zip(self._in_closure, self._at_start, strict=False):
            cb.load_state_dict(copy.deepcopy(state))

    def passed(self, batch: int) -> None:
        """This rank skipped ``batch`` (its update is in the state it holds); its later hooks are
        the ones the callbacks' state still needs when it was sent from inside this batch."""
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
