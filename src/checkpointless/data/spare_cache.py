"""A hot spare fills its own host's batch cache for the ranks it may take.

The batch cache (``shm_cache.py``) lives in each host's ``/dev/shm``. On one machine a replacement
finds the failed rank's prefetched batches there. On a spare *host* nothing has been written: the
lost rank's files died with their host, so the replacement would build its first batch from the
token file, whose pages that host has never read (on shared storage, a network read).

So a spare prefetches while it waits. The coordinator tells each idle spare on a spare host the
job's current step and the ranks it may become (``Prefetch``): a spare host takes a lost host's
ranks in order, so its i-th spare becomes local rank i of whichever node is lost, that is one of
ranks ``i, P + i, 2P + i, ...``. The spare builds those ranks' next ``ahead`` batches into the
cache in a background thread, with the same keys and bytes as the ranks' own loaders; after a
host loss, the replacement's first ``loader.batch(step)`` is a shared-memory hit.

The script opts in before ``init()`` (where a spare waits), with what its loader will be built
from; data-parallel jobs only (a mesh's data rank is not its rank)::

    ds = TokenDataset.open(path)
    checkpointless.data.prefetch_as_spare(ds, seq_len=1024, global_batch=256, seed=1234)
    job = checkpointless.init()

Nothing here runs unless the process is a spare that received a hint; the thread stops (bounded)
when the spare is given its rank.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from checkpointless.data.dataset import TokenDataset
from checkpointless.data.loader import BatchLoader
from checkpointless.data.shm_cache import ShmBatchCache
from checkpointless.errors import ConfigError

__all__ = ["SparePrefetcher", "SpareRecipe", "hint", "prefetch_as_spare", "stop"]

log = logging.getLogger(__name__)

_CAPACITY = 8  # the example's cache capacity: a spare's files must fit the rank's own window


@dataclass(frozen=True)
class SpareRecipe:
    """What the ranks' loaders are built from (everything but the rank)."""

    dataset: TokenDataset
    seq_len: int
    global_batch: int
    seed: int
    shuffle: bool = True
    ahead: int = 2  # steps from the hinted one on, per candidate rank

    def loader(self, job_id: str, rank: int, world: int) -> BatchLoader:
        cache = ShmBatchCache(job_id=job_id, rank=rank, capacity=max(_CAPACITY, self.ahead))
        # prefetch=0: this loader only computes keys and bytes; the spare's thread does the work
        return BatchLoader(
            self.dataset,
            seq_len=self.seq_len,
            global_batch=self.global_batch,
            seed=self.seed,
            dp_rank=rank,
            dp_size=world,
            cache=cache,
            prefetch=0,
            shuffle=self.shuffle,
        )


class SparePrefetcher:
    """One thread that publishes the hinted ranks' next batches; a newer hint replaces the old."""

    def __init__(self, recipe: SpareRecipe, job_id: str) -> None:
        self.recipe = recipe
        self.job_id = job_id
        self._cond = threading.Condition()
        self._want: tuple[int, tuple[int, ...], int] | None = None  # (step, ranks, world)
        self._stop = False
        self._loaders: dict[tuple[int, int], BatchLoader] = {}
        self.published = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="checkpointless-spare-prefetch", daemon=True)
        self._thread.start()

    def hint(self, step: int, ranks: Sequence[int], world: int) -> None:
        with self._cond:
            self._want = (step, tuple(ranks), world)
            self._cond.notify_all()

    def stop(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stop and self._want is None:
                        self._cond.wait(1.0)
                    if self._stop:
                        return
                    want, self._want = self._want, None
                assert want is not None
                self._fill(*want)
        except Exception as e:  # prefetching is an optimisation: the replacement builds on a miss
            self.error = e
            log.warning("spare prefetching stopped: %s", e)

    def _fill(self, step: int, ranks: tuple[int, ...], world: int) -> None:
        # step-major: the very next step of every candidate rank first, the one a replacement
        # reads first, before any rank's later steps
        for s in range(step, step + self.recipe.ahead):
            for rank in ranks:
                with self._cond:
                    if self._stop or self._want is not None:
                        return  # a newer hint (or the assignment) supersedes this one
                loader = self._loaders.get((rank, world))
                if loader is None:
                    loader = self._loaders[(rank, world)] = self.recipe.loader(self.job_id, rank, world)
                assert loader.cache is not None
                key = loader.key(s)
                if not loader.cache.contains(key):
                    loader.cache.trim(s)
                    x, y = loader.build_arrays(s)
                    loader.cache.put(key, x, y)
                    self.published += 1


_RECIPE: SpareRecipe | None = None
_ACTIVE: SparePrefetcher | None = None
_LOCK = threading.Lock()


def prefetch_as_spare(
    dataset: TokenDataset, *, seq_len: int, global_batch: int, seed: int, shuffle: bool = True, ahead: int = 2
) -> None:
    """Let this process, if it is a hot spare, fill its host's cache for the ranks it may take.

    Call before ``checkpointless.init()`` with the arguments the script's ``BatchLoader`` gets."""
    global _RECIPE
    if ahead < 1:
        raise ConfigError(f"prefetch_as_spare: ahead must be at least 1 step (got {ahead})")
    if seq_len < 1 or global_batch < 1:
        raise ConfigError(
            f"prefetch_as_spare: seq_len and global_batch must be positive (got {seq_len}, {global_batch})"
        )
    _RECIPE = SpareRecipe(dataset, seq_len, global_batch, seed, shuffle, ahead)


def hint(job_id: str, step: int, ranks: Sequence[int], world: int) -> bool:
    """The coordinator's hint to a waiting spare; False when the script registered no recipe."""
    global _ACTIVE
    if _RECIPE is None or not job_id:
        return False
    with _LOCK:
        if _ACTIVE is None:
            _ACTIVE = SparePrefetcher(_RECIPE, job_id)
        _ACTIVE.hint(step, ranks, world)
    return True


def stop(timeout: float = 2.0) -> int:
    """The spare got its rank: stop prefetching (bounded); return how many batches it published."""
    global _ACTIVE
    with _LOCK:
        active, _ACTIVE = _ACTIVE, None
    if active is None:
        return 0
    if not active.stop(timeout):
        log.warning("spare prefetch thread did not stop within %.1f s", timeout)
    log.info("as a spare, published %d batches for the ranks it could take", active.published)
    return active.published
