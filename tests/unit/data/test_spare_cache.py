"""A spare on a spare host fills its own host's batch cache for the ranks it may take:
the slot rule (coordinator/rules/prefetch.py), the coordinator's hints, and the spare's prefetcher
(data/spare_cache.py) writing real files that the rank's own loader then serves."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from checkpointless.coordinator import Coordinator, Send
from checkpointless.coordinator.rules.prefetch import slot_ranks
from checkpointless.data import BatchLoader, ShmBatchCache, TokenDataset, spare_cache
from checkpointless.data.shm_cache import job_cache_dir
from checkpointless.errors import ConfigError
from checkpointless.protocol import Heartbeat, Prefetch
from tests.helpers.coordinator import formed_host_job


@pytest.mark.timeout(10)
def test_slot_ranks_are_one_local_rank_of_every_node() -> None:
    assert slot_ranks(0, 2, 3) == [0, 2, 4]
    assert slot_ranks(1, 2, 3) == [1, 3, 5]
    assert slot_ranks(2, 2, 3) == []  # a third spare for 2-rank nodes takes no host-shaped slot
    assert slot_ranks(1, 8, 1000, limit=4) == [1, 9, 17, 25]


def _hints(c: Coordinator, step: int, now: float) -> dict[int, Any]:
    for wid in range(4):
        c.on_message(wid, Heartbeat(step=step, progress_age=0.0), now, 1e9)
    for h in range(3):
        c.on_agent_seen(h, now)
    c.tick(now, 1e9 + now)
    return {
        x.worker_id: x.message for x in c.drain() if isinstance(x, Send) and isinstance(x.message, Prefetch)
    }


@pytest.mark.timeout(10)
def test_coordinator_hints_each_spare_its_slot_once_per_step() -> None:
    c, spares = formed_host_job()
    got = _hints(c, 7, 102.0)
    assert {w: (p.step, p.ranks, p.world_size) for w, p in got.items()} == {
        spares[0]: (7, [0, 2], 4),
        spares[1]: (7, [1, 3], 4),
    }
    assert _hints(c, 7, 102.2) == {}, "one hint per step, not per heartbeat"
    assert set(_hints(c, 8, 102.4)) == set(spares)


@pytest.mark.timeout(30)
def test_prefetcher_fills_the_cache_the_ranks_own_loader_reads(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHECKPOINTLESS_SHM_DIR", str(tmp_path))
    # a Launcher built in this process by another test sets the job's private key; not ours
    monkeypatch.delenv("CHECKPOINTLESS_SHM_KEY", raising=False)
    ds = TokenDataset.open(corpus)
    assert not spare_cache.hint("job1", 5, [1], 4), "no recipe registered: nothing to do"
    spare_cache.prefetch_as_spare(ds, seq_len=32, global_batch=8, seed=3, ahead=2)
    try:
        assert spare_cache.hint("job1", 5, [1, 3], 4)
        dirs = [job_cache_dir("job1") / f"rank{r:05d}" for r in (1, 3)]
        deadline = time.monotonic() + 20
        while sum(len(list(d.glob("step*.batch"))) for d in dirs if d.exists()) < 4:
            assert time.monotonic() < deadline, "the spare did not publish its 4 batches"
            time.sleep(0.01)
        published = spare_cache.stop()
        assert published == 4, published
    finally:
        spare_cache._RECIPE = None
    # rank 3, as a replacement, reads steps 5 and 6 from shared memory: same bytes as built
    loader = BatchLoader(
        ds, 32, 8, 3, dp_rank=3, dp_size=4, cache=ShmBatchCache("job1", 3, capacity=8), prefetch=0
    )
    for step in (5, 6):
        x, y = loader.batch(step)
        assert loader.last_source == "cache", step
        bx, by = loader.build_arrays(step)
        assert np.array_equal(x.numpy(), bx) and np.array_equal(y.numpy(), by)
    loader.batch(7)
    assert loader.last_source == "built", "only the hinted steps were prefetched"
    loader.close()


@pytest.mark.timeout(10)
def test_prefetch_as_spare_rejects_bad_values(corpus: Path) -> None:
    ds = TokenDataset.open(corpus)
    with pytest.raises(ConfigError, match="ahead must be at least 1"):
        spare_cache.prefetch_as_spare(ds, seq_len=32, global_batch=8, seed=0, ahead=0)
    with pytest.raises(ConfigError, match="seq_len and global_batch"):
        spare_cache.prefetch_as_spare(ds, seq_len=0, global_batch=8, seed=0)
