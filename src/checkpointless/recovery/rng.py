"""Per-rank random streams that a replacement reproduces exactly.

The job's global generators (Python, NumPy, torch) are the same on every rank: the initial round
copies rank 0's to everyone, and a recovery hands them on with the rest of the state. Randomness
that must differ between ranks (dropout on per-rank data, augmentation, synthetic samples) comes
from :meth:`checkpointless.Job.generator` instead: a ``torch.Generator`` seeded from
(seed, name, rank, step). Nothing about it has to be sent: whoever holds rank ``r`` at step ``s``
(the original process, a replay, a replacement) derives the very same seed.
"""

from __future__ import annotations

import hashlib

import torch

from checkpointless.errors import ConfigError

__all__ = ["StepStreams", "stream_seed"]


def stream_seed(seed: int, name: str, rank: int, step: int) -> int:
    """A 63-bit seed that is a pure function of its arguments (stable across processes and
    Python versions, unlike ``hash()``)."""
    text = f"{seed}\x00{name}\x00{rank}\x00{step}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


class StepStreams:
    """The named generators of the step being run; forgotten when the next step (or a replay of
    the same one) begins, so every entry into a step draws from the start of its stream."""

    def __init__(self) -> None:
        self._live: dict[tuple[str, int, str], torch.Generator] = {}

    def begin_step(self) -> None:
        self._live.clear()

    def get(
        self, name: str, *, seed: int, rank: int, step: int | None, device: torch.device | str
    ) -> torch.Generator:
        if step is None:
            raise ConfigError(
                f"job.generator({name!r}) was called outside a step: its stream is keyed by the step "
                "index, so call it inside `with step:`"
            )
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError(f"job.generator seed must be an int, got {seed!r}")
        dev = torch.device(device)
        key = (name, int(seed), str(dev))
        gen = self._live.get(key)
        if gen is None:
            # one call per step and name gives a fresh generator; later calls in the same step
            # continue its stream rather than repeat it
            gen = torch.Generator(device=dev)
            gen.manual_seed(stream_seed(seed, name, rank, step))
            self._live[key] = gen
        return gen
