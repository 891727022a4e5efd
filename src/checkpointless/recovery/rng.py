"""Per-rank random streams that a replacement reproduces exactly.

The job's global generators (Python, NumPy, torch) are each rank's own: a rank keeps its own
through the first round and through every recovery, and a replacement resumes the ones its
predecessor kept (``rank_rng.py``), so a script may seed them per rank and draw per rank, as
under DDP. :meth:`checkpointless.Job.generator` is another way to draw per rank: a
``torch.Generator`` seeded from (seed, name, rank, step), in a step or a section. Nothing about
it has to be kept or sent: whoever holds rank ``r`` at step ``s`` (the original process, a
replay, a replacement) derives the very same seed.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from numpy.random.mtrand import get_bit_generator, set_bit_generator

from checkpointless.errors import ConfigError
from checkpointless.state.rng_read import numpy_gauss, python_getstate

__all__ = ["StepStreams", "batch_rng", "stream_seed"]


def stream_seed(seed: int, name: str, rank: int, step: int) -> int:
    """A 63-bit seed that is a pure function of its arguments (stable across processes and
    Python versions, unlike ``hash()``)."""
    text = f"{seed}\x00{name}\x00{rank}\x00{step}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


class StepStreams:
    """The named generators of the step being run; forgotten when the next step (or a replay of
    the same one) begins, so every entry into a step draws from the start of its stream."""

    def __init__(self) -> None:
        self._live: dict[tuple[str, int, str, int], torch.Generator] = {}

    def begin_step(self) -> None:
        self._live.clear()

    def get(
        self,
        name: str,
        *,
        seed: int,
        rank: int,
        step: int | None,
        device: torch.device | str,
        section: str | None = None,
    ) -> torch.Generator:
        """``name``'s generator in step ``step``, or in section ``section`` at the boundary after
        ``step`` steps (a stream of its own: the step that follows draws another)."""
        if step is None:
            raise ConfigError(
                f"job.generator({name!r}) was called outside a step or a section: its stream is "
                "keyed by the step index, so call it inside `with step:` or a job.section() function"
            )
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError(f"job.generator seed must be an int, got {seed!r}")
        dev = torch.device(device)
        # a section's streams are named apart from the step's (the step's names keep their seeds)
        full = name if section is None else f"{name}\x00section\x00{section}"
        key = (full, int(seed), str(dev), rank)  # a degraded holder draws for two ranks a step
        gen = self._live.get(key)
        if gen is None:
            # one call per step and name gives a fresh generator; later calls in the same step
            # continue its stream rather than repeat it
            gen = torch.Generator(device=dev)
            gen.manual_seed(stream_seed(seed, full, rank, step))
            self._live[key] = gen
        return gen


class _Seeder:
    """NumPy's global generator seeded from a step without touching its own state: a bit
    generator of our own, seeded as ``np.random.seed`` seeds (the legacy seeding), is lent to
    the global ``RandomState`` and the rank's own is given back afterwards. The public
    ``get_state()`` and ``set_state()`` copy the 624 key words one at a time (~150 µs the pair,
    most of a batch read's keeping); the swap costs ~5 µs and leaves the own words untouched.
    The swap resets the cached Gaussian, so a state with one is put back whole."""

    def __init__(self) -> None:
        self.bits = np.random.MT19937(0)
        self._seeding = np.random.RandomState(self.bits)

    def lend(self, seed: int) -> None:
        self._seeding.seed(seed)  # the legacy seeding, as np.random.seed(seed) does it
        set_bit_generator(self.bits)


_seeder: _Seeder | None = None


def _numpy_seeder() -> _Seeder:
    global _seeder
    if _seeder is None:
        _seeder = _Seeder()
    return _seeder


@contextlib.contextmanager
def batch_rng(step: int) -> Iterator[None]:
    """Fetch step ``step``'s batch with the global generators (torch's CPU one, NumPy's, Python's)
    seeded from the step, and put them back afterwards.

    Why: a DataLoader without workers runs ``__getitem__`` (and its random augmentation) in the
    training process, inside the step, on the global generators. A replay hands out the batch
    it holds without reading it again, and a replacement reads it at a seek: either way the
    draws would differ from the run without the fault, and so would every random number the step
    draws after them (dropout). Seeded per step, a batch is the same whoever reads it and
    whenever, and the step's own stream never sees the fetch, as with workers (whose seeds do not
    come from the step's stream either). The same seed on every rank, as the global generators
    are the same on every rank (each rank reads other samples).

    This runs every step (recovery/loader.py, stateful_loader.py), so the generators are put
    aside cheaply: NumPy's by lending it a bit generator of ours (:class:`_Seeder`), Python's
    words read back as they were last built when nothing drew since (rng_read.python_getstate).
    The draws inside and the state after are those of ``get_state()``, ``seed()`` and
    ``set_state()`` (tests/unit/recovery/test_batch_rng.py)."""
    seed = stream_seed(0, "batch", 0, step)
    cpu, py = torch.get_rng_state(), python_getstate()
    seeder = _numpy_seeder()
    own = get_bit_generator()
    # a cached Gaussian (which the swap resets) or a nested read (whose generator is ours, and
    # is seeded again): the whole state, through the public getter, as before
    whole = own is seeder.bits or numpy_gauss() != (0, 0.0)
    npy: Any = np.random.get_state(legacy=False) if whole else None
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    seeder.lend(seed % (1 << 32))
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        random.setstate(py)
        set_bit_generator(own)
        if npy is not None:
            np.random.set_state(npy)
