"""The global sample order: a pure function of (seed, epoch, position), sharded by the global step.

Global sample number ``g = step * global_batch + i`` (``i`` in the global batch) lives in epoch
``g // num_samples`` at position ``g % num_samples``, and the position is mapped to a sample id by a
keyed bijection of ``[0, num_samples)``. Data-parallel rank ``r`` of ``dp_size`` takes positions
``i`` in ``[r * b, (r + 1) * b)`` of each global batch, ``b = global_batch // dp_size``. Hence:

* nothing is stored: a replacement process knows its next samples from the step alone;
* each epoch visits every sample exactly once (the map is a bijection);
* changing ``dp_size`` at a step boundary with the same global batch changes only who reads which
  part of the same global batch, so no sample is skipped or repeated.

The bijection is a Feistel network over the smallest even-bit power of two that covers
``num_samples``, with cycle-walking to stay inside the range. It costs O(batch) per step and no
memory, where a materialised permutation would cost 8 bytes per sample per rank (hundreds of MB
for a large corpus) and a second of start-up for every replacement process.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

from checkpointless.errors import ConfigError

__all__ = ["GlobalSampler", "feistel_permute"]

_ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)

U64 = npt.NDArray[np.uint64]


def _mix(z: U64) -> U64:
    # The splitmix64 finaliser: a cheap full-avalanche mix of 64 bits (wrapping uint64 arithmetic).
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _round_keys(seed: int, epoch: int) -> tuple[np.uint64, ...]:
    digest = hashlib.blake2b(
        f"checkpointless-sampler:{seed}:{epoch}".encode(), digest_size=8 * _ROUNDS
    ).digest()
    return tuple(np.uint64(int.from_bytes(digest[8 * k : 8 * k + 8], "little")) for k in range(_ROUNDS))


def _feistel(x: U64, keys: tuple[np.uint64, ...], half_bits: int) -> U64:
    mask = np.uint64((1 << half_bits) - 1)
    shift = np.uint64(half_bits)
    left, right = x >> shift, x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & mask)
    out: U64 = (left << shift) | right
    return out


def feistel_permute(positions: npt.ArrayLike, n: int, seed: int, epoch: int) -> npt.NDArray[np.int64]:
    """Map positions in ``[0, n)`` to sample ids by the (seed, epoch)-keyed bijection of ``[0, n)``."""
    pos = np.asarray(positions, dtype=np.uint64)
    if n < 1:
        raise ConfigError(f"cannot permute an empty range (n={n})")
    if pos.size and int(pos.max()) >= n:
        raise ConfigError(f"position {int(pos.max())} is outside [0, {n})")
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
    keys = _round_keys(seed, epoch)
    out = _feistel(pos, keys, half_bits)
    # Cycle-walking: a value that lands outside [0, n) is permuted again; since the Feistel map is a
    # bijection of the larger domain, following the cycle always comes back into [0, n), and the
    # result is a bijection of [0, n). The domain is < 4n, so few values need more than one pass.
    outside = np.flatnonzero(out >= np.uint64(n))
    while outside.size:
        out[outside] = _feistel(out[outside], keys, half_bits)
        outside = outside[out[outside] >= np.uint64(n)]
    return out.astype(np.int64)


class GlobalSampler:
    """Which sample ids data-parallel rank ``dp_rank`` of ``dp_size`` trains on at a global step."""

    def __init__(self, num_samples: int, global_batch: int, seed: int, *, shuffle: bool = True) -> None:
        if num_samples < 1:
            raise ConfigError(
                f"the dataset has no whole sample (num_samples={num_samples}); use a shorter seq_len"
            )
        if global_batch < 1:
            raise ConfigError(f"global_batch must be at least 1, got {global_batch}")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle

    def check_shard(self, dp_rank: int, dp_size: int) -> int:
        """Validate a sharding and return the per-rank batch size."""
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        if self.global_batch % dp_size:
            raise ConfigError(
                f"global_batch {self.global_batch} is not divisible by dp_size {dp_size}; "
                "choose a global batch that every data-parallel size you may shrink or grow to divides"
            )
        return self.global_batch // dp_size

    def ids_for_global(self, first: int, count: int) -> npt.NDArray[np.int64]:
        """Sample ids of global sample numbers ``first .. first + count - 1`` (epochs roll over)."""
        if first < 0 or count < 0:
            raise ConfigError(f"global sample range must be non-negative, got first={first}, count={count}")
        g = np.arange(first, first + count, dtype=np.uint64)
        if not self.shuffle:
            return (g % np.uint64(self.num_samples)).astype(np.int64)
        epochs = g // np.uint64(self.num_samples)
        pos = g % np.uint64(self.num_samples)
        out = np.empty(count, dtype=np.int64)
        # A batch spans at most a few epochs (several only when the dataset is smaller than a batch).
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = feistel_permute(pos[sel], self.num_samples, self.seed, int(epoch))
        return out

    def ids(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> npt.NDArray[np.int64]:
        """Sample ids of rank ``dp_rank``'s share of the global batch at ``step``."""
        if step < 0:
            raise ConfigError(f"step must be non-negative, got {step}")
        per_rank = self.check_shard(dp_rank, dp_size)
        return self.ids_for_global(step * self.global_batch + dp_rank * per_rank, per_rank)

    def epoch_of(self, step: int) -> int:
        """The epoch that the first sample of ``step`` belongs to."""
        return step * self.global_batch // self.num_samples
