"""Silent divergence caught: replicas compare a digest of their state every N steps.

Data-parallel replicas must hold bitwise identical parameters and optimizer state after every
step. A bug can break that without raising anything: per-rank randomness that leaks into the
update, hidden state a recovery did not carry (a GradScaler stage), a bit flip. Nothing fails; the
replicas just drift apart and the final weights depend on which rank saves them. So every N
committed steps each rank hashes its parameters, buffers and optimizer state (XXH3, at memory
speed) and the ranks exchange the 64-bit digests in one all-gather of a single int64 each. A rank
whose digest differs from the majority's is reported as a fault that names it; the recovery plan
treats it as an invalid replica, so it receives the majority's state.

The rules (which ranks are the odd ones out) are a pure function, unit-tested in
tests/unit/coordinator/test_divergence.py; the job wires them into the step loop (recovery/commit.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import xxhash
from torch import nn

__all__ = ["DEFAULT_EVERY", "Verdict", "due", "judge", "state_digest"]

# Every 100 steps: the hash reads the replica's state once (a few ms per 100 MB), so spread over
# 100 steps it stays far below the 0.5 % overhead budget (BENCHMARKS.md), while a drift is still
# caught within minutes rather than at the end of a week-long run.
DEFAULT_EVERY = 100


def due(committed_steps: int, every: int) -> bool:
    """Whether the check runs once ``committed_steps`` steps have committed (0: never)."""
    return every > 0 and committed_steps > 0 and committed_steps % every == 0


def _tensors(
    modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer]
) -> Iterable[torch.Tensor]:
    for module in modules:
        yield from module.state_dict().values()
    for opt in optimizers:
        state = opt.state_dict()["state"]
        for key in sorted(state):  # parameter ids: one order on every rank
            for name in sorted(state[key]):
                value = state[key][name]
                if isinstance(value, torch.Tensor):
                    yield value
                else:  # a plain number (a step count kept as a float): hash its text
                    yield torch.tensor(list(repr(value).encode()), dtype=torch.uint8)


def state_digest(modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """A 63-bit digest of the modules' state (parameters and buffers) and the optimizers' state:
    equal on two replicas exactly when their bytes are (short of a hash collision)."""
    h = xxhash.xxh3_64()
    for t in _tensors(modules, optimizers):
        # a sharded module's DTensor: this rank's own shard is its replica's state (recovery/sharded.py)
        local = getattr(t, "to_local", None)
        c = (local() if callable(local) else t).detach()
        if c.device.type != "cpu":
            c = c.cpu()
        c = c.contiguous().reshape(-1)
        h.update(f"{c.dtype}{c.numel()};".encode())
        if c.numel():
            # the raw bytes, read in place (numpy has no bfloat16, bytes view every dtype)
            h.update(memoryview(c.view(torch.uint8).numpy()))
    return h.intdigest() & ((1 << 63) - 1)  # fits the int64 the ranks exchange


@dataclass(frozen=True)
class Verdict:
    """The outcome of one comparison."""

    divergent: tuple[int, ...]  # ranks whose state must be replaced (empty: all agree)
    has_majority: bool  # False: no digest is held by more than half the ranks

    def describe(self, step: int) -> str:
        if self.has_majority:
            return (
                f"silent divergence after step {step - 1}: the state of rank(s) {list(self.divergent)} "
                "differs from the majority's; healing it from the majority"
            )
        return (
            f"silent divergence after step {step - 1}: no state is held by a majority of ranks "
            "(ranks differ pairwise); no replica can be trusted, restoring the newest snapshot or "
            "checkpoint"
        )


def judge(digests: Sequence[int]) -> Verdict:
    """Which ranks diverge, given every rank's digest (index = rank).

    The digest held by more than half of the ranks is the truth; every other rank diverged. With
    no strict majority (two ranks that differ, or a three-way split) there is no telling which
    replica is right, so every rank is divergent and the job falls back to a snapshot.
    """
    if not digests:
        raise ValueError("judge() needs at least one rank's digest")
    value, count = Counter(digests).most_common(1)[0]
    if count == len(digests):
        return Verdict((), True)
    if 2 * count > len(digests):
        return Verdict(tuple(r for r, d in enumerate(digests) if d != value), True)
    return Verdict(tuple(range(len(digests))), False)
