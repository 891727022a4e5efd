"""Degraded mode with a ``BatchLoader`` (issue 39): a loader built for the job's own share serves
a held slot's share in that slot's pass, byte for byte what the slot's own loader serves, and from
the slot's cache directory, where the lost rank's prefetched batches are still found; a loader of
another share (a spare's prefetcher's) is not redirected."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from checkpointless.data import BatchLoader, ShmBatchCache, TokenDataset, held_slot

pytestmark = pytest.mark.timeout(30)


class Passes:
    """The held slot whose pass runs (None: the rank's own), as the job's clock says."""

    def __init__(self) -> None:
        self.held: int | None = None

    def __call__(self) -> int | None:
        return self.held


@pytest.fixture
def passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Passes]:
    monkeypatch.setenv("CHECKPOINTLESS_SHM_DIR", str(tmp_path))
    monkeypatch.delenv("CHECKPOINTLESS_SHM_KEY", raising=False)
    p = Passes()
    held_slot.follow_job(0, 4, p)
    yield p
    held_slot.follow_job(-1, 0, lambda: None)


def _loader(ds: TokenDataset, rank: int) -> BatchLoader:
    return BatchLoader(ds, 32, 8, 3, dp_rank=rank, dp_size=4, cache=ShmBatchCache("job1", rank), prefetch=0)


def test_a_held_slot_s_pass_serves_the_slot_s_share_from_its_cache(corpus: Path, passes: Passes) -> None:
    ds = TokenDataset.open(corpus)
    lost = _loader(ds, 2)  # slot 2's own loader built steps 5 and 6 before its rank was lost
    want = {s: [t.numpy().copy() for t in lost.batch(s)] for s in (5, 6, 7)}
    lost.close()
    mine = _loader(ds, 0)
    own = mine.batch(5)
    assert not np.array_equal(own[0].numpy(), want[5][0])  # the shares differ
    passes.held = 2
    for step in (5, 6, 7):
        x, y = mine.batch(step)
        assert mine.last_source == "cache", step  # the lost rank's files, in its directory
        assert np.array_equal(x.numpy(), want[step][0]) and np.array_equal(y.numpy(), want[step][1])
    x, _ = mine.batch(8)
    assert mine.last_source == "built"
    assert np.array_equal(x.numpy(), _loader(ds, 2).build_arrays(8)[0])
    passes.held = None
    assert np.array_equal(mine.batch(5)[0].numpy(), own[0].numpy())  # its own pass: its own share
    other = _loader(ds, 1)  # not the job's own share: never redirected
    passes.held = 2
    assert np.array_equal(other.batch(5)[0].numpy(), other.build_arrays(5)[0])
    mine.close()
    other.close()
