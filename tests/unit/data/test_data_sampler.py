"""Sampler and loader exactness: every sample once per epoch, whatever the data-parallel size."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from checkpointless.data import BatchLoader, GlobalSampler, TokenDataset, batch_digest, write_token_file
from checkpointless.data.sampler import feistel_permute
from checkpointless.errors import ConfigError


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> TokenDataset:
    path = tmp_path_factory.mktemp("sampler") / "d.tokens"
    rng = np.random.default_rng(7)
    write_token_file(path, [rng.integers(0, 257, size=5000)], vocab_size=257)
    return TokenDataset.open(path)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 100, 1000, 4097])
def test_feistel_is_a_bijection(n: int) -> None:
    for seed, epoch in [(0, 0), (1, 0), (1, 1), (-3, 9)]:
        perm = feistel_permute(np.arange(n), n, seed, epoch)
        assert sorted(perm.tolist()) == list(range(n))


@pytest.mark.timeout(20)
def test_order_depends_on_seed_and_epoch_only() -> None:
    n = 1000
    base = feistel_permute(np.arange(n), n, 1, 0)
    np.testing.assert_array_equal(base, feistel_permute(np.arange(n), n, 1, 0))
    assert not np.array_equal(base, feistel_permute(np.arange(n), n, 2, 0))
    assert not np.array_equal(base, feistel_permute(np.arange(n), n, 1, 1))
    assert not np.array_equal(base, np.arange(n))
    # Any subset of positions maps as it does within the whole epoch (no hidden state).
    np.testing.assert_array_equal(feistel_permute([999, 5], n, 1, 0), base[[999, 5]])


@pytest.mark.timeout(20)
def test_every_sample_exactly_once_per_epoch() -> None:
    n, gb, dp = 50, 8, 4
    s = GlobalSampler(n, gb, seed=3)
    steps = 3 * n // gb + 2  # over three epochs; 50 is not a multiple of 8, so batches straddle epochs
    seen = np.concatenate([np.concatenate([s.ids(step, r, dp) for r in range(dp)]) for step in range(steps)])
    for epoch in range(3):
        assert sorted(seen[epoch * n : (epoch + 1) * n].tolist()) == list(range(n))
    assert not np.array_equal(seen[:n], seen[n : 2 * n])
    assert [s.epoch_of(step) for step in (0, 6, 7, 12, 13)] == [0, 0, 1, 1, 2]


@pytest.mark.timeout(20)
def test_dataset_smaller_than_a_batch_spans_epochs() -> None:
    s = GlobalSampler(3, 8, seed=0)
    ids = np.concatenate([s.ids(step) for step in range(3)])  # 24 samples = 8 epochs of 3
    assert Counter(ids.tolist()) == {0: 8, 1: 8, 2: 8}


@pytest.mark.timeout(20)
def test_changing_dp_size_neither_skips_nor_repeats() -> None:
    n, gb = 97, 12
    s = GlobalSampler(n, gb, seed=11)
    reference = np.concatenate([s.ids(step, 0, 1) for step in range(30)])
    plan = [4] * 10 + [2] * 10 + [3] * 10  # shrink 4 -> 2, then grow to 3, same global batch
    got = []
    for step, dp in enumerate(plan):
        per_rank = [s.ids(step, r, dp) for r in range(dp)]
        assert all(len(p) == gb // dp for p in per_rank)
        got.append(np.concatenate(per_rank))
    np.testing.assert_array_equal(np.concatenate(got), reference)
    counts = Counter(reference.tolist())
    assert set(counts) == set(range(n))  # 360 samples over 97: every sample seen 3 or 4 times
    assert set(counts.values()) == {3, 4} and sorted(reference[: 3 * n].tolist()) == sorted(
        list(range(n)) * 3
    )


@pytest.mark.timeout(20)
def test_unshuffled_order_is_sequential() -> None:
    s = GlobalSampler(10, 4, seed=0, shuffle=False)
    assert s.ids(2).tolist() == [8, 9, 0, 1]


@pytest.mark.timeout(20)
def test_bad_sharding_is_a_config_error() -> None:
    s = GlobalSampler(100, 12, seed=0)
    with pytest.raises(ConfigError, match="not divisible by dp_size 5"):
        s.ids(0, 0, 5)
    with pytest.raises(ConfigError, match="dp_rank 4"):
        s.ids(0, 4, 4)
    with pytest.raises(ConfigError, match="no whole sample"):
        GlobalSampler(0, 4, seed=0)


@pytest.mark.timeout(30)
def test_loader_batch_is_inputs_and_next_token_targets(dataset: TokenDataset) -> None:
    loader = BatchLoader(dataset, seq_len=16, global_batch=8, seed=5, dp_rank=1, dp_size=2)
    x, y = loader.batch(3)
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    assert x.shape == (4, 16) and y.shape == (4, 16) and x.is_contiguous() and y.is_contiguous()
    for row, sample in enumerate(loader.sample_ids(3).tolist()):
        window = dataset.sample(sample, 16)
        assert x[row].tolist() == window[:-1].tolist()
        assert y[row].tolist() == window[1:].tolist()
    assert loader.last_source == "built" and loader.last_digest is None


@pytest.mark.timeout(30)
def test_batch_is_a_pure_function_of_the_step(dataset: TokenDataset) -> None:
    a = BatchLoader(dataset, seq_len=32, global_batch=8, seed=9, dp_rank=2, dp_size=4)
    walked = [batch_digest(*a.batch(step)) for step in range(40)]  # 40*8*32 tokens > 5000: several epochs
    b = BatchLoader(dataset, seq_len=32, global_batch=8, seed=9, dp_rank=2, dp_size=4)
    assert batch_digest(*b.batch(37)) == walked[37]
    assert batch_digest(*b.batch(2)) == walked[2]
    other_seed = BatchLoader(dataset, seq_len=32, global_batch=8, seed=10, dp_rank=2, dp_size=4)
    assert batch_digest(*other_seed.batch(37)) != walked[37]


@pytest.mark.timeout(30)
def test_resharded_loaders_assemble_the_same_global_batch(dataset: TokenDataset) -> None:
    def global_batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [BatchLoader(dataset, 16, 12, 1, r, dp).batch(step) for r in range(dp)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    for step in (0, 5, 31):
        expected = batch_digest(*global_batch(step, 1))
        assert batch_digest(*global_batch(step, 4)) == expected
        assert batch_digest(*global_batch(step, 2)) == expected
        assert batch_digest(*global_batch(step, 3)) == expected
