"""Batches by global step: ``loader.batch(step)`` is a pure function of (dataset, seed, step, sharding).

With a :class:`ShmBatchCache`, a background thread keeps the next ``prefetch`` batches of this rank
published in shared memory, and ``batch`` serves a file from there when one matches (zero-copy);
otherwise it assembles the batch from the memory-mapped tokens and publishes it too, so that a
re-run of the same step, in this process or in a replacement, finds it in memory.

Degraded mode: in the pass of a slot this process holds for a lost rank (``held_slot.py``), a
loader built for the job's own share serves that slot's share, through a loader of the slot's
own (``dp_rank`` the slot) whose cache is the slot's directory: on the lost rank's host, the
batches it had prefetched are still there, and a spare that later takes the slot back finds the
ones built meanwhile. That loader does not prefetch (a thread per held slot, for a stretch that
ends when a spare is ready, is not worth its clean-up); it builds on a miss and publishes.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from checkpointless.data.dataset import TokenDataset
from checkpointless.data.held_slot import held_slot_for
from checkpointless.data.sampler import GlobalSampler
from checkpointless.data.shm_cache import BatchKey, ShmBatchCache
from checkpointless.errors import ConfigError

__all__ = ["BatchLoader"]

log = logging.getLogger(__name__)

# torch sets up its numpy bridge on the first from_numpy (~0.1 ms here): pay it at import, in a
# spare that is waiting, instead of in the first batch after a recovery.
torch.from_numpy(np.zeros(1, dtype=np.int64))

I64 = npt.NDArray[np.int64]
# How long batch() waits for the prefetch thread when it is building exactly the wanted step; beyond
# this, building the batch in the caller is cheaper than waiting on a slow or stuck thread.
_WAIT_FOR_PREFETCH_S = 2.0
# An idle prefetch thread re-checks its state this often even if a notification were ever lost.
_IDLE_WAKE_S = 1.0


class _Prefetcher:
    """A thread that keeps steps (target, target + ahead] published in the cache."""

    def __init__(
        self,
        cache: ShmBatchCache,
        ahead: int,
        key: Callable[[int], BatchKey],
        build: Callable[[int], tuple[I64, I64]],
    ) -> None:
        self._cache = cache
        self._ahead = ahead
        self._key = key
        self._build = build
        self._cond = threading.Condition()
        self._target: int | None = None
        self._building: int | None = None
        self._stop = False
        # Steps this thread has seen published, so that advancing by one step costs one build
        # instead of re-reading the headers of the K - 1 files that are already there.
        self._published: set[int] = set()
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"checkpointless-prefetch-r{cache.rank}", daemon=True
        )
        self._thread.start()

    def request(self, step: int) -> None:
        with self._cond:
            self._target = step
            self._cond.notify_all()

    def wait_if_building(self, step: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._building == step and not self._stop:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._cond.wait(remaining)

    def _run(self) -> None:
        done: int | None = None
        try:
            while True:
                with self._cond:
                    while not self._stop and (self._target is None or self._target == done):
                        self._cond.wait(_IDLE_WAKE_S)
                    if self._stop:
                        return
                    base = self._target
                assert base is not None
                if self._fill(base):
                    done = base
        except Exception as e:  # the caller still builds batches itself; record why prefetching stopped
            self.error = e
            log.warning("batch prefetching stopped for rank %d: %s", self._cache.rank, e)
        finally:
            with self._cond:
                self._building = None
                self._cond.notify_all()

    def _fill(self, base: int) -> bool:
        """Publish steps after ``base``; False if a newer target or a stop interrupted it."""
        wanted = range(base + 1, base + self._ahead + 1)
        # trim() only deletes outside [current - behind, current + capacity], which contains
        # ``wanted`` (ahead <= capacity), so a step published earlier and still wanted is still there.
        self._published.intersection_update(wanted)
        for step in wanted:
            if step in self._published:
                continue
            with self._cond:
                if self._stop or self._target != base:
                    return False
                self._building = step
            try:
                key = self._key(step)
                if not self._cache.contains(key):
                    x, y = self._build(step)
                    self._cache.put(key, x, y)
                self._published.add(step)
            finally:
                with self._cond:
                    self._building = None
                    self._cond.notify_all()
        return True

    def stop(self, timeout: float) -> bool:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive()


class BatchLoader:
    """Rank ``dp_rank``'s share of the global batch at any step, optionally prefetched into shared memory."""

    def __init__(
        self,
        dataset: TokenDataset,
        seq_len: int,
        global_batch: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        cache: ShmBatchCache | None = None,
        *,
        prefetch: int | None = None,
        shuffle: bool = True,
    ) -> None:
        self.dataset = dataset
        self.seq_len = seq_len
        self.sampler = GlobalSampler(dataset.num_samples(seq_len), global_batch, seed, shuffle=shuffle)
        self.per_rank = self.sampler.check_shard(dp_rank, dp_size)
        self.global_batch = global_batch
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.cache = cache
        ahead = (cache.capacity if cache is not None else 0) if prefetch is None else prefetch
        if ahead and cache is None:
            raise ConfigError("prefetch needs a cache to prefetch into; pass cache=ShmBatchCache(...)")
        if cache is not None and not 0 <= ahead <= cache.capacity:
            raise ConfigError(f"prefetch {ahead} must be between 0 and the cache capacity {cache.capacity}")
        self.prefetch = ahead
        self._prefetcher: _Prefetcher | None = None
        self._served = False
        self._prefetch_error: BaseException | None = None
        #: Where the last batch came from: "cache" (shared memory) or "built" (assembled from the mmap).
        self.last_source: Literal["cache", "built", ""] = ""
        #: Digest of the last batch when the cache computed it anyway (None without a cache).
        self.last_digest: str | None = None
        self._slots: dict[int, BatchLoader] = {}  # degraded mode: held slots' loaders

    @functools.cached_property
    def _tokens(self) -> npt.NDArray[Any]:
        # A plain ndarray view of the same mapping: slicing an np.memmap builds a memmap object per
        # slice, which costs more than copying the slice itself for short rows. Made on the first
        # build, so that a cache hit never maps the file.
        return np.asarray(self.dataset.tokens)

    def key(self, step: int) -> BatchKey:
        return BatchKey(
            fingerprint=self.dataset.fingerprint,
            seed=self.seed,
            shuffle=self.sampler.shuffle,
            seq_len=self.seq_len,
            global_batch=self.global_batch,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            step=step,
        )

    def sample_ids(self, step: int) -> npt.NDArray[np.int64]:
        """The dataset sample ids of this rank's rows at ``step``, in row order."""
        return self.sampler.ids(step, self.dp_rank, self.dp_size)

    def build_arrays(self, step: int) -> tuple[I64, I64]:
        """Assemble the batch from the memory-mapped tokens (the only copy is into the int64 result)."""
        ids = self.sample_ids(step)
        x = np.empty((len(ids), self.seq_len), dtype=np.int64)
        y = np.empty((len(ids), self.seq_len), dtype=np.int64)
        tokens = self._tokens
        for row, sample in enumerate(ids.tolist()):
            window = tokens[sample * self.seq_len : (sample + 1) * self.seq_len + 1]
            x[row] = window[:-1]
            y[row] = window[1:]
        return x, y

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 of shape [global_batch // dp_size, seq_len], for global ``step``."""
        if step < 0:
            raise ConfigError(f"step must be non-negative, got {step}")
        slot = held_slot_for(self.dp_rank, self.dp_size)
        if slot is not None and slot != self.dp_rank:  # degraded mode: a held slot's pass
            held = self._slot_loader(slot)
            x_held, y_held = held.batch(step)
            self.last_source, self.last_digest = held.last_source, held.last_digest
            return x_held, y_held
        cache = self.cache
        key = self.key(step)
        got = None
        if cache is not None:
            got = cache.get(key)
            if got is None and self._prefetcher is not None:
                self._prefetcher.wait_if_building(step, _WAIT_FOR_PREFETCH_S)
                got = cache.get(key)
        if got is not None:
            x, y, self.last_digest = got
            self.last_source = "cache"
        else:
            x, y = self.build_arrays(step)
            self.last_digest = None
            self.last_source = "built"
        if cache is not None:
            # Move the window first, so that a re-run of an old step is cached too and the
            # number of files never exceeds behind + 1 + capacity. A first call that hit the cache
            # (a replacement's first batch) leaves the directory scan to the next call: nothing is
            # published before then, and the batch is wanted now.
            if got is None or self._served:
                cache.trim(step)
            if got is None:
                self.last_digest = cache.put(key, x, y)
            if self._prefetcher is not None:
                self._prefetcher.request(step)
            elif self.prefetch and self._served:
                # The thread starts at the second call, not the first: starting a thread costs
                # 0.1-1 ms here, which would double the latency of the first batch after a
                # recovery, and the steps right after it are normally in the cache already.
                self._prefetcher = _Prefetcher(cache, self.prefetch, self.key, self.build_arrays)
                self._prefetcher.request(step)
        self._served = True
        return torch.from_numpy(x), torch.from_numpy(y)

    def _slot_loader(self, slot: int) -> BatchLoader:
        """The loader of held slot ``slot``'s share: the same data, seed and sampler, the slot's
        rank, and the slot's own cache directory (no prefetch thread)."""
        loader = self._slots.get(slot)
        if loader is None:
            cache = self.cache
            slot_cache = None
            if cache is not None:
                slot_cache = ShmBatchCache(
                    cache.job_id,
                    slot,
                    cache.capacity,
                    behind=cache.behind,
                    root=cache.job_dir.parent,
                    verify_checksum=cache.verify_checksum,
                )
            loader = self._slots[slot] = BatchLoader(
                self.dataset,
                self.seq_len,
                self.global_batch,
                self.seed,
                dp_rank=slot,
                dp_size=self.dp_size,
                cache=slot_cache,
                prefetch=0,
                shuffle=self.sampler.shuffle,
            )
        return loader

    @property
    def prefetch_error(self) -> BaseException | None:
        """Why the last prefetch thread stopped on its own, if it did (batches are then built on demand)."""
        return self._prefetcher.error if self._prefetcher is not None else self._prefetch_error

    def close(self, timeout: float = 5.0) -> None:
        """Stop the prefetch thread within ``timeout``; the cache files stay for a replacement or a re-run.

        A recovery may close the loader while it aborts the step and keep using it afterwards:
        a later ``batch`` serves as usual and starts a new thread from its second call.
        """
        if self._prefetcher is not None:
            if not self._prefetcher.stop(timeout):
                log.warning("prefetch thread of rank %d did not stop within %.1f s", self.dp_rank, timeout)
            self._prefetch_error = self._prefetcher.error
        self._prefetcher = None
        self._served = False
        self._slots.clear()  # nothing of theirs runs: they hold no thread

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()
