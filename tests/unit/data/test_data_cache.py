"""Shared-memory batch cache: hits, misses, stale files, bounds, and survival across process death."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpointless.data import (
    BatchLoader,
    ShmBatchCache,
    TokenDataset,
    batch_digest,
    job_cache_dir,
    remove_job_cache,
    start_cache_janitor,
    write_token_file,
)
from checkpointless.errors import ConfigError, DataError
from tests.helpers.wait import deadline_in, wait_for

SEQ, GB, SEED = 16, 8, 1234


@pytest.fixture(scope="module")
def token_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cache") / "d.tokens"
    rng = np.random.default_rng(3)
    write_token_file(path, [rng.integers(0, 257, size=int(n)) for n in rng.integers(10, 400, size=50)], 257)
    return path


@pytest.fixture(scope="module")
def dataset(token_path: Path) -> TokenDataset:
    return TokenDataset.open(token_path)


@pytest.fixture
def job() -> Iterator[str]:
    job_id = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield job_id
    remove_job_cache(job_id)
    assert not job_cache_dir(job_id).exists()


def _reference(dataset: TokenDataset, step: int, rank: int = 0, dp: int = 1, seed: int = SEED) -> str:
    """Digest of the fault-free batch, computed without any cache."""
    return batch_digest(*BatchLoader(dataset, SEQ, GB, seed, rank, dp).batch(step))


@pytest.mark.timeout(30)
def test_miss_then_hit_across_loaders(dataset: TokenDataset, job: str) -> None:
    cache = ShmBatchCache(job, rank=0, capacity=4)
    first = BatchLoader(dataset, SEQ, GB, SEED, cache=cache, prefetch=0)
    x, y = first.batch(5)
    assert first.last_source == "built" and cache.stats.misses == 1 and cache.stats.writes == 1
    assert first.last_digest == batch_digest(x, y) == _reference(dataset, 5)
    again = BatchLoader(dataset, SEQ, GB, SEED, cache=ShmBatchCache(job, rank=0, capacity=4), prefetch=0)
    x2, y2 = again.batch(5)
    assert again.last_source == "cache" and batch_digest(x2, y2) == _reference(dataset, 5)
    assert again.cache is not None and again.cache.stats.hits == 1


@pytest.mark.timeout(30)
def test_rerun_of_a_step_in_the_same_process_hits(dataset: TokenDataset, job: str) -> None:
    loader = BatchLoader(dataset, SEQ, GB, SEED, 1, 2, cache=ShmBatchCache(job, rank=1, capacity=4))
    expected = [batch_digest(*loader.batch(s)) for s in range(4)]
    x, y = loader.batch(3)  # the recovery re-runs the interrupted step
    assert loader.last_source == "cache" and batch_digest(x, y) == expected[3] == _reference(dataset, 3, 1, 2)
    loader.close()
    x, y = loader.batch(3)  # a closed loader still serves (close only stops the prefetch thread)
    assert loader.last_source == "cache" and batch_digest(x, y) == expected[3]
    loader.close()
    rebuilt = BatchLoader(dataset, SEQ, GB, SEED, 1, 2, cache=ShmBatchCache(job, rank=1, capacity=4))
    x, y = rebuilt.batch(3)
    assert rebuilt.last_source == "cache" and batch_digest(x, y) == expected[3]
    rebuilt.close()


@pytest.mark.timeout(30)
def test_cached_tensors_are_writable_without_touching_the_file(dataset: TokenDataset, job: str) -> None:
    BatchLoader(dataset, SEQ, GB, SEED, cache=ShmBatchCache(job, 0), prefetch=0).batch(0)
    reader = BatchLoader(dataset, SEQ, GB, SEED, cache=ShmBatchCache(job, 0), prefetch=0)
    x, _ = reader.batch(0)
    assert reader.last_source == "cache"
    x.add_(1)  # copy-on-write mapping: the process gets private pages, the file keeps its bytes
    x2, y2 = reader.batch(0)
    assert reader.last_source == "cache" and batch_digest(x2, y2) == _reference(dataset, 0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "change",
    [{"seed": SEED + 1}, {"dp_size": 2}, {"dataset": "other"}, {"corrupt": True}, {"truncate": True}],
    ids=["seed", "dp_size", "dataset", "corrupt", "truncated"],
)
def test_stale_or_inconsistent_file_is_rebuilt_not_served(
    dataset: TokenDataset, job: str, tmp_path: Path, change: dict[str, object]
) -> None:
    writer = BatchLoader(dataset, SEQ, GB, SEED, cache=ShmBatchCache(job, 0), prefetch=0)
    writer.batch(7)
    path = ShmBatchCache(job, 0).path_for(7)
    ds, seed, dp = dataset, SEED, 1
    if "seed" in change:
        seed = SEED + 1
    if "dp_size" in change:
        dp = 2
    if "dataset" in change:
        other = tmp_path / "other.tokens"
        write_token_file(other, [np.arange(5000) % 257], 257)
        ds = TokenDataset.open(other)
    if "corrupt" in change:
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0xFF
        path.write_bytes(bytes(raw))
    if "truncate" in change:
        path.write_bytes(path.read_bytes()[:-8])
    cache = ShmBatchCache(job, 0)
    reader = BatchLoader(ds, SEQ, GB, seed, 0, dp, cache=cache, prefetch=0)
    x, y = reader.batch(7)
    assert reader.last_source == "built" and cache.stats.stale == 1 and cache.stats.hits == 0
    expected = batch_digest(*BatchLoader(ds, SEQ, GB, seed, 0, dp).batch(7))
    assert batch_digest(x, y) == expected
    # The rebuilt batch replaced the bad file, so the next reader hits.
    again = BatchLoader(ds, SEQ, GB, seed, 0, dp, cache=ShmBatchCache(job, 0), prefetch=0)
    assert batch_digest(*again.batch(7)) == expected and again.last_source == "cache"


@pytest.mark.timeout(30)
def test_prefetch_fills_ahead_and_size_stays_bounded(dataset: TokenDataset, job: str) -> None:
    cache = ShmBatchCache(job, rank=3, capacity=3, behind=1)
    loader = BatchLoader(dataset, SEQ, GB, SEED, 3, 4, cache=cache)
    loader.batch(0)
    assert cache.steps() == [0]  # the first batch after a start is served before any thread starts
    loader.batch(1)
    wait_for(
        lambda: cache.steps() == [0, 1, 2, 3, 4],
        deadline_in(10),
        "steps 0-4 cached",
        interval=0.01,
        details=cache.steps,
    )
    for step in range(2, 5):
        loader.batch(step)
        assert loader.last_source == "cache"
    for step in range(5, 30):
        loader.batch(step)
        assert len(cache.steps()) <= 1 + 1 + 3  # behind + current + capacity
    wait_for(
        lambda: cache.steps() == [28, 29, 30, 31, 32],
        deadline_in(10),
        "steps 28-32 cached",
        interval=0.01,
        details=cache.steps,
    )
    loader.close()
    assert loader.prefetch_error is None
    leftovers = [p.name for p in cache.dir.iterdir()]
    assert sorted(leftovers) == [f"step{s:012d}.batch" for s in range(28, 33)]  # no temporary files
    assert cache.stats.evictions > 0


@pytest.mark.timeout(30)
def test_recovery_of_one_rank_gives_fault_free_batches(dataset: TokenDataset, job: str) -> None:
    dp, steps, fault_step = 4, 8, 4
    clean = {(r, s): _reference(dataset, s, r, dp) for r in range(dp) for s in range(steps)}
    loaders = [BatchLoader(dataset, SEQ, GB, SEED, r, dp, cache=ShmBatchCache(job, r, 4)) for r in range(dp)]
    got: dict[tuple[int, int], str] = {}
    for s in range(steps):
        if s == fault_step:
            loaders[2].close()  # rank 2 fails mid-step; its replacement re-runs step s from the cache
            loaders[2] = BatchLoader(dataset, SEQ, GB, SEED, 2, dp, cache=ShmBatchCache(job, 2, 4))
        for r in range(dp):
            got[(r, s)] = batch_digest(*loaders[r].batch(s))
            if s == fault_step and r == 2:
                assert loaders[2].last_source == "cache"
    for loader in loaders:
        loader.close()
    assert got == clean
    # After the fault the job continues with dp_size 2 and the same global batch: identical samples.
    x0, y0 = BatchLoader(dataset, SEQ, GB, SEED, 0, 2, cache=ShmBatchCache(job, 0, 4)).batch(steps)
    x1, y1 = BatchLoader(dataset, SEQ, GB, SEED, 1, 2, cache=ShmBatchCache(job, 1, 4)).batch(steps)
    four = [BatchLoader(dataset, SEQ, GB, SEED, r, dp).batch(steps) for r in range(dp)]
    assert batch_digest(torch.cat([x0, x1]), torch.cat([y0, y1])) == batch_digest(
        torch.cat([b[0] for b in four]), torch.cat([b[1] for b in four])
    )


@pytest.mark.timeout(30)
def test_job_cache_removed_while_prefetching_stays_removed(dataset: TokenDataset, job: str) -> None:
    loader = BatchLoader(dataset, SEQ, GB, SEED, cache=ShmBatchCache(job, rank=0, capacity=8))
    loader.batch(0)
    loader.batch(1)  # starts the prefetch thread
    assert remove_job_cache(job)  # the launcher ends the job while the prefetch thread is busy
    for step in range(2, 6):  # training still gets correct batches, and nothing is re-created
        assert batch_digest(*loader.batch(step)) == _reference(dataset, step)
    loader.close()
    assert loader.prefetch_error is None and not job_cache_dir(job).exists()


@pytest.mark.timeout(20)
def test_root_override_and_planted_directory(dataset: TokenDataset, tmp_path: Path) -> None:
    root = tmp_path / "shm"
    cache = ShmBatchCache("rooted", rank=0, root=root)
    BatchLoader(dataset, SEQ, GB, SEED, cache=cache, prefetch=0).batch(0)
    assert cache.steps() == [0] and cache.dir.parent == root / "checkpointless-rooted"
    assert remove_job_cache("rooted", root=root) and list(root.iterdir()) == []
    planted = job_cache_dir("planted", root)
    planted.mkdir()
    planted.chmod(0o777)  # someone else could drop batch files in here
    with pytest.raises(DataError, match="not a private directory"):
        ShmBatchCache("planted", rank=0, root=root)


@pytest.mark.timeout(20)
def test_bad_configuration(dataset: TokenDataset, job: str) -> None:
    with pytest.raises(ConfigError, match="job_id"):
        ShmBatchCache("../escape", rank=0)
    with pytest.raises(ConfigError, match="rank"):
        ShmBatchCache(job, rank=-1)
    with pytest.raises(ConfigError, match="needs a cache"):
        BatchLoader(dataset, SEQ, GB, SEED, prefetch=2)
    with pytest.raises(ConfigError, match="cache capacity 4"):
        BatchLoader(dataset, SEQ, GB, SEED, cache=ShmBatchCache(job, 0, capacity=4), prefetch=5)


_WRITER = """
import sys, time
from checkpointless.data import BatchLoader, ShmBatchCache, TokenDataset
path, job = sys.argv[1], sys.argv[2]
cache = ShmBatchCache(job, rank=2, capacity=4)
loader = BatchLoader(TokenDataset.open(path, verify="quick"), {seq}, {gb}, {seed}, 2, 4, cache=cache)
for step in range(6):
    loader.batch(step)
deadline = time.monotonic() + 20
while max(cache.steps(), default=-1) < 9 and time.monotonic() < deadline:
    time.sleep(0.01)
print("ready", cache.steps(), flush=True)
time.sleep(60)
"""

_REPLACEMENT = """
import json, sys, time
t0 = time.perf_counter()
from checkpointless.data import BatchLoader, ShmBatchCache, TokenDataset, batch_digest
path, job = sys.argv[1], sys.argv[2]
loader = BatchLoader(TokenDataset.open(path, verify="quick"), {seq}, {gb}, {seed}, 2, 4,
                     cache=ShmBatchCache(job, rank=2, capacity=4))
out = []
for step in (6, 7):
    x, y = loader.batch(step)
    out.append({{"step": step, "source": loader.last_source, "digest": batch_digest(x, y)}})
loader.close()
print(json.dumps(out), flush=True)
"""


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"child printed nothing within {timeout} s"
    return proc.stdout.readline()


@pytest.mark.timeout(60)
def test_cache_survives_sigkill_of_its_writer(dataset: TokenDataset, token_path: Path, job: str) -> None:
    fmt = {"seq": SEQ, "gb": GB, "seed": SEED}
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_WRITER.format(**fmt)), str(token_path), job],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = _read_line(writer, 40)
        assert line.startswith("ready"), line
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(10)
        assert writer.stdout is not None
        writer.stdout.close()
    rank_dir = job_cache_dir(job) / "rank00002"
    assert {f"step{s:012d}.batch" for s in range(6, 10)} <= {p.name for p in rank_dir.iterdir()}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_REPLACEMENT.format(**fmt)), str(token_path), job],
        capture_output=True,
        text=True,
        timeout=40,
    )
    assert result.returncode == 0, result.stderr
    served = json.loads(result.stdout)
    for item in served:
        assert item["source"] == "cache"
        assert item["digest"] == _reference(dataset, item["step"], 2, 4)
    assert remove_job_cache(job)
    assert not any(p.name == f"checkpointless-{job}" for p in Path("/dev/shm").iterdir())


_LAUNCHER = """
import sys, time
from checkpointless.data import ShmBatchCache, start_cache_janitor
janitor = start_cache_janitor(sys.argv[1])
ShmBatchCache(sys.argv[1], rank=0).path_for(0).write_bytes(b"x")
print(janitor.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_janitor_removes_cache_when_launcher_is_sigkilled(job: str) -> None:
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, job], stdout=subprocess.PIPE, text=True)
    try:
        _read_line(launcher, 40)
        assert job_cache_dir(job).is_dir()
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        assert launcher.stdout is not None
        launcher.stdout.close()
    wait_for(
        lambda: not job_cache_dir(job).exists(),
        deadline_in(10),
        "the job's cache folder to go",
        interval=0.01,
    )


@pytest.mark.timeout(30)
def test_janitor_removes_cache_at_normal_end(job: str) -> None:
    janitor = start_cache_janitor(job)
    ShmBatchCache(job, rank=1).path_for(3).write_bytes(b"x")
    assert janitor.stdin is not None
    janitor.stdin.close()  # the launcher ends the job
    assert janitor.wait(10) == 0
    assert not job_cache_dir(job).exists()
