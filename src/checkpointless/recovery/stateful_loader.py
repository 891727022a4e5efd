"""torchdata's ``StatefulDataLoader`` made step-addressable through its own state.

A ``StatefulDataLoader`` knows how to save where it is (``state_dict()``) and to go on from there
(``load_state_dict()``), workers included. :class:`StatefulStepLoader` uses exactly that instead
of index arithmetic, so it also works where arithmetic cannot: an ``IterableDataset`` that is
itself stateful, a sampler whose order is not a function of the epoch, or a loader of unknown
length.

The wrapper iterates the user's loader directly and keeps two positions, each a loader state
tagged with the step whose batch the loader yields next:

- *before*: the loader's state just before it yielded the batch of the step in progress (or of the
  last step handed out). A replay returns the batch it holds; a rank that sends its state for that
  step sends this one, so the receiver yields that very batch again.
- *after*: the loader's state now, that is before the batch of the following step.

Both travel in :meth:`state_dict` (the job tracks the wrapper like any other object), and
:meth:`load_state_dict` keeps them until ``batch(step)`` says which step is wanted: the job's
recovery settles on the interrupted step or the next one, and this object is not told which.
Before its first read the loader stands before the batch of the job's next step (a resumed job
starts wherever the script's checkpoint put it), and its state is that one position, tagged with
that step (``next_step``, the job's; without one, with no step: for whichever step is asked
first). It is read without starting an iterator (which would start workers and draw a seed): the
state the script loaded and the loader has not used yet, the iterator a ``state_dict()`` call of
the script made, or ``{}`` for a loader at its start. Positions received and not used yet (a
replacement's state is taken before its first read: a snapshot, a copy) are its state as they are.

The positions travel with the replica's state, so a rank that receives state first loads the
state a *peer* saved. That is right for the usual loader states (batch counters, a
``DistributedSampler`` of this rank, which keeps its own rank) but not for a state that differs
per rank: a ``shuffle=True`` sampler whose generator was seeded from the per-rank global seed, a
per-rank file offset. So each rank also keeps its own positions with its generator records, on
its host and with its keeper on another (recovery/rank_data.py), and a rank that received state
loads its own record's positions over the peer's (``version`` tells the record keeping when they
moved).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sized
from typing import Any

from torch.utils.data import IterableDataset

from checkpointless.errors import ConfigError
from checkpointless.recovery.rng import batch_rng

__all__ = ["StatefulStepLoader", "is_stateful_loader"]


def is_stateful_loader(obj: object) -> bool:
    """True for torchdata's StatefulDataLoader (checked by name: torchdata is an optional extra)."""
    return any(
        c.__name__ == "StatefulDataLoader" and c.__module__.startswith("torchdata.")
        for c in type(obj).__mro__
    )


def _stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class StatefulStepLoader:
    """``batch(step)`` for a ``StatefulDataLoader``; build it with :meth:`checkpointless.Job.loader`."""

    def __init__(
        self,
        loader: Any,
        next_step: Callable[[], int] | None = None,
        slot_of: Callable[[], int | None] | None = None,
    ) -> None:
        if not is_stateful_loader(loader):
            raise ConfigError(
                f"StatefulStepLoader takes torchdata's StatefulDataLoader, got {type(loader).__name__}"
            )
        dataset = loader.dataset
        if isinstance(dataset, IterableDataset) and not _stateful(dataset):
            # the loader would "resume" by reading and dropping every sample before the position
            raise ConfigError(
                f"job.loader() cannot seek in the iterable dataset {type(dataset).__name__}: it has no "
                "state_dict()/load_state_dict(), so a replacement rank would have to read every sample "
                "before its position. Give the dataset state_dict()/load_state_dict() that save and "
                "restore its position, use a map-style Dataset (__getitem__ + __len__) with a "
                "DistributedSampler, or make the batch a pure function of the step "
                "(checkpointless.data.BatchLoader)"
            )
        if loader.batch_sampler is None and not isinstance(dataset, IterableDataset):
            raise ConfigError(
                "job.loader() needs batches: the StatefulDataLoader was built with batch_size=None; "
                "give it a batch_size (or a batch_sampler)"
            )
        if getattr(loader, "num_workers", 0) > 0 and not getattr(loader, "in_order", True):
            raise ConfigError(
                "the StatefulDataLoader was built with in_order=False: its workers hand batches out "
                "in the order they finish, so step s's batch would change from one run (and one "
                "replay) to the next; leave in_order at its default (True)"
            )
        self.loader = loader
        # degraded mode's held slot whose pass is running (None: this rank's own), the job's
        self._slot_of = slot_of
        self._next_step = next_step  # the job's next step: the one a loader that has not read is before
        # step.epoch needs it; an iterable dataset's loader may have no length
        self.batches_per_epoch: int | None = None
        if isinstance(loader, Sized):
            try:
                self.batches_per_epoch = len(loader) or None
            except TypeError:
                pass
        self._iter: Iterator[Any] | None = None
        self._epoch = 0
        self._next = 0  # the step whose batch the live iterator yields next
        self._held: tuple[int, Any] | None = None  # the last batch handed out, for a replay
        self._before: dict[str, Any] | None = None  # position before the held batch
        self._restored: dict[int, dict[str, Any]] = {}  # step -> position, from load_state_dict
        self._restored_first: dict[str, Any] | None = None  # a position for the first step asked
        self.seeks = 0  # positions loaded into the loader after it had started
        self._changes = 0  # reads, seeks and loads: what may have moved state_dict()'s answer

    @property
    def version(self) -> tuple[int, int | None]:
        """Changes whenever :meth:`state_dict` may answer differently (a read, a load, the job's
        next step while nothing was read): the per-rank record keeping captures only then."""
        unread = self._next_step() if self._iter is None and self._next_step is not None else None
        return self._changes, unread

    def batch(self, step: int) -> Any:
        """The batch of ``step``: held for a replay, next from the loader, or from a restored position."""
        if step < 0:
            raise ConfigError(f"step {step} is negative; steps count from 0")
        self._changes += 1
        slot = self._slot_of() if self._slot_of is not None else None
        if slot is not None:
            # Its position is a state of this rank's loader, not a function of (slot, step): a
            # held slot's share has no position here to read from.
            raise ConfigError(
                f"a StatefulDataLoader cannot read held slot {slot}'s batch in degraded mode (its "
                "position is its own state, not a function of the step); use a DataLoader over a "
                "map-style dataset with a DistributedSampler, or run with --when-no-spare fail"
            )
        restoring = bool(self._restored) or self._restored_first is not None
        if self._held is not None and self._held[0] == step and not restoring:
            return self._held[1]  # a replay trains on the very batch it had
        if restoring or self._iter is None or step != self._next:
            self._seek(step)
        data, before = self._read(step)
        self._before = before
        self._next = step + 1
        self._held = (step, data)
        return data

    def _read(self, step: int) -> tuple[Any, dict[str, Any]]:
        # Each iter() and each read runs on the global generators seeded from the step
        # (rng.batch_rng), never on the step's own stream: iter() draws its base seed there
        # unless the loader has a generator of its own, and without workers the read itself
        # draws (augmentation). Seeded apart, a read draws the same whether or not an iterator
        # was just made for it (a replacement's seek makes one; the run without the fault did not).
        assert self._iter is not None
        before = self._position()
        try:
            with batch_rng(step):
                data = next(self._iter)
        except StopIteration:  # the epoch ended: the next one starts with this step
            self._epoch += 1
            self._iter = self._make_iter()
            before = self._position()
            try:
                with batch_rng(step):
                    data = next(self._iter)
            except StopIteration:
                raise ConfigError(
                    f"the StatefulDataLoader yielded no batch in epoch {self._epoch}; job.loader() "
                    "needs at least one batch per epoch"
                ) from None
        return data, before

    def _position(self) -> dict[str, Any]:
        # deep-copied: the loader may update the dicts of its state in place as it goes on
        return {"step": self._next, "epoch": self._epoch, "loader": copy.deepcopy(self.loader.state_dict())}

    def _seek(self, step: int) -> None:
        pos = self._restored.get(step)
        if pos is None:
            pos = self._restored_first
        if pos is None and self._restored:
            raise ConfigError(
                f"the received StatefulDataLoader position is for step(s) {sorted(self._restored)}, "
                f"not for step {step}: the loader cannot be placed there"
            )
        self._restored.clear()
        self._restored_first = None
        self._held = None
        per = self.batches_per_epoch
        if pos is not None:
            self.loader.load_state_dict(pos["loader"])  # consumed by the next iter()
            if not pos["loader"]:
                # {} puts the loader back at its start, provided no state is pending
                self.loader.next_iter_state = None
            epoch = pos["epoch"]
            self._epoch = int(epoch) if epoch is not None else (step // per if per else 0)
            if self._iter is not None:
                self.seeks += 1
        elif self._iter is None:
            # the first batch of the run: the loader is where the script put it (at its start,
            # or at a state the script restored with its own checkpoint, for job.steps(start=))
            self._epoch = step // per if per else 0
        else:
            raise ConfigError(
                f"the StatefulDataLoader is before step {self._next}, and step {step} was asked for with "
                "no saved position for it; with a StatefulDataLoader, ask for the steps in order "
                "(loader.batch(step.index) once per step)"
            )
        self._next = step
        self._iter = self._make_iter()

    def _make_iter(self) -> Iterator[Any]:
        with batch_rng(-1 - self._epoch):  # whatever it draws, away from the step's stream
            return iter(self._start_epoch())

    def _start_epoch(self) -> Any:
        # what a `for epoch: sampler.set_epoch(epoch); for batch in loader` loop does
        sampler = self.loader.sampler
        batch_sampler = self.loader.batch_sampler
        for obj in (sampler, getattr(batch_sampler, "sampler", None), batch_sampler):
            set_epoch = getattr(obj, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self._epoch)
        return self.loader

    # -- tracked state: the positions travel to a replacement ----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The loader's position before the held step's batch and its position now."""
        if self._restored or self._restored_first is not None:  # received, not used yet
            pending = list(self._restored.values())
            if self._restored_first is not None:
                pending.append(self._restored_first)
            return {"positions": copy.deepcopy(pending)}
        if self._iter is None:
            step = self._next_step() if self._next_step is not None else None
            return {"positions": [{"step": step, "epoch": None, "loader": self._unread()}]}
        positions = [self._position()]
        if self._before is not None and self._held is not None:
            positions.insert(0, self._before)
        return {"positions": positions}

    def _unread(self) -> dict[str, Any]:
        """Where the loader stands before this wrapper's first read, without starting it."""
        pending = getattr(self.loader, "next_iter_state", None)
        if pending is not None:  # the script's checkpoint, loaded and not used yet
            return copy.deepcopy(pending)
        if getattr(self.loader, "_initial_iter_for_state_dict", False):
            # the script asked the loader for its state before iterating: that made an iterator
            # (drawing its seed), which our first iter() takes over, so its state is the answer.
            # Any other iterator the script made is replaced by a fresh one at our first iter().
            return copy.deepcopy(self.loader.state_dict())
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._changes += 1
        positions = state["positions"]
        self._restored = {int(p["step"]): p for p in positions if p["step"] is not None}
        self._restored_first = next((p for p in positions if p["step"] is None), None)

    def close(self) -> None:
        """Drop the iterator (its workers stop unless the loader keeps them persistent)."""
        self._changes += 1
        self._iter = None
        self._held = None
