"""Pure parts of the adoption helpers: StepLoader's index arithmetic, per-rank streams, the
torchrun variables, the early loop end, GradScaler bookkeeping. Real DataLoaders and real
GradScalers, in one process; the end-to-end fault tests are in test_adoption_e2e.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from checkpointless.errors import ConfigError
from checkpointless.recovery.amp import finish_cut_off_update, reset_step_state
from checkpointless.recovery.loader import StepLoader
from checkpointless.recovery.loop import LoopControl
from checkpointless.recovery.rng import StepStreams, stream_seed
from checkpointless.recovery.torchrun import torchrun_env


class Counting(Dataset[int]):
    """Sample i is i; remembers which samples were read."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.read: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.read.append(i)
        return i


def make(n: int = 40, batch: int = 3, rank: int = 0, world: int = 2) -> tuple[Counting, DataLoader[int]]:
    ds = Counting(n)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=5)
    return ds, DataLoader(ds, batch_size=batch, sampler=sampler, drop_last=True)


def plain_epochs(dl: DataLoader[int], epochs: int) -> list[list[int]]:
    """What a user's own `for epoch: sampler.set_epoch(epoch); for batch in dl` loop sees."""
    out: list[list[int]] = []
    for e in range(epochs):
        dl.sampler.set_epoch(e)  # type: ignore[attr-defined]
        out += [b.tolist() for b in dl]
    return out


@pytest.mark.timeout(60)
def test_batches_follow_the_plain_epoch_loop_across_epochs() -> None:
    _, dl = make()
    want = plain_epochs(dl, 3)
    loader = StepLoader(dl, dp_rank=0, dp_size=2)
    assert loader.batches_per_epoch == 6  # 20 samples per rank, batches of 3, last dropped
    assert [loader.batch(s).tolist() for s in range(18)] == want
    assert loader.seeks == 0
    loader.close()


@pytest.mark.timeout(60)
@settings(max_examples=25, deadline=None)
@given(step=st.integers(0, 17))
def test_a_seek_reads_no_sample_before_its_position(step: int) -> None:
    _, ref = make()
    want = plain_epochs(ref, 3)
    ds, dl = make()
    loader = StepLoader(dl)
    assert loader.batch(step).tolist() == want[step]
    # only the batch itself was read: the skipped part of the epoch cost index arithmetic alone
    assert sorted(ds.read) == sorted(want[step])
    assert loader.position(step) == divmod(step, 6)


@pytest.mark.timeout(60)
def test_a_replay_returns_the_batch_it_holds_and_a_jump_back_seeks() -> None:
    ds, dl = make()
    loader = StepLoader(dl)
    first = loader.batch(4)
    n_read = len(ds.read)
    assert loader.batch(4) is first and len(ds.read) == n_read  # replay: nothing read again
    loader.batch(5)
    again = loader.batch(2)  # a restore from an older snapshot goes back
    assert loader.seeks == 1
    assert again.tolist() == plain_epochs(make()[1], 1)[2]


@pytest.mark.timeout(60)
def test_workers_and_prefetch_give_the_same_batches() -> None:
    _, dl = make()
    want = plain_epochs(dl, 2)
    ds = Counting(40)
    sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=5)
    dlw = DataLoader(ds, batch_size=3, sampler=sampler, drop_last=True, num_workers=2, prefetch_factor=2)
    loader = StepLoader(dlw)
    try:
        assert [loader.batch(s).tolist() for s in (7, 8, 9, 10, 11)] == want[7:12]
    finally:
        loader.close()


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(10))


@pytest.mark.timeout(60)
def test_loaders_that_cannot_seek_are_refused_with_what_to_do() -> None:
    with pytest.raises(ConfigError, match=r"cannot seek in the iterable dataset Stream.*map-style"):
        StepLoader(DataLoader(Stream(), batch_size=2))
    with pytest.raises(ConfigError, match=r"RandomSampler has no set_epoch.*DistributedSampler"):
        StepLoader(DataLoader(Counting(8), batch_size=2, shuffle=True))
    with pytest.raises(ConfigError, match="batch_size=None"):
        StepLoader(DataLoader(Counting(8), batch_size=None))
    with pytest.raises(ConfigError, match=r"takes a torch\.utils\.data\.DataLoader, got list"):
        StepLoader([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"num_replicas=2, but this job has 4.*num_replicas=job.world_size"):
        StepLoader(make()[1], dp_rank=0, dp_size=4)
    with pytest.raises(ConfigError, match=r"rank=1, but this job has 0"):
        StepLoader(make(rank=1)[1], dp_rank=0, dp_size=2)
    with pytest.raises(ConfigError, match="non-zero number of batches"):
        StepLoader(DataLoader(Counting(2), batch_size=3, drop_last=True))
    with pytest.raises(ConfigError, match=r"in_order=False.*leave in_order at its default"):
        StepLoader(DataLoader(Counting(8), batch_size=2, num_workers=1, in_order=False))
    # sequential order is a function of nothing: accepted
    assert StepLoader(DataLoader(Counting(8), batch_size=2)).batch(3).tolist() == [6, 7]


@pytest.mark.timeout(60)
def test_streams_are_keyed_by_seed_name_rank_and_step() -> None:
    seeds = {stream_seed(s, n, r, t) for s in (0, 1) for n in ("a", "b") for r in (0, 1) for t in (0, 1)}
    assert len(seeds) == 16 and all(0 <= x < 2**63 for x in seeds)
    assert stream_seed(3, "drop", 1, 9) == stream_seed(3, "drop", 1, 9)
    streams = StepStreams()
    g = streams.get("d", seed=1, rank=2, step=5, device="cpu")
    first = torch.rand(4, generator=g)
    # the same step, asked again: the stream continues; a replay (begin_step) starts it over
    assert streams.get("d", seed=1, rank=2, step=5, device="cpu") is g
    streams.begin_step()
    again = torch.rand(4, generator=streams.get("d", seed=1, rank=2, step=5, device="cpu"))
    assert torch.equal(first, again)
    other_rank = torch.rand(4, generator=StepStreams().get("d", seed=1, rank=3, step=5, device="cpu"))
    assert not torch.equal(first, other_rank)
    with pytest.raises(ConfigError, match="outside a step"):
        streams.get("d", seed=1, rank=0, step=None, device="cpu")
    with pytest.raises(ConfigError, match="seed must be an int, got '7'"):
        streams.get("d", seed="7", rank=0, step=1, device="cpu")  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_torchrun_variables_for_one_machine() -> None:
    assert torchrun_env(2, 4) == {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "0",
        "NODE_RANK": "0",
    }
    with pytest.raises(ValueError, match="rank 4 is outside a world of 4"):
        torchrun_env(4, 4)


@pytest.mark.timeout(60)
def test_loop_end_is_the_earliest_request_and_travels_as_state() -> None:
    loop = LoopControl()
    assert loop.end(20) == 20
    loop.request_stop(7)
    loop.request_stop(9)  # a later request never moves the end later
    assert loop.end(20) == 7 and loop.end(5) == 5
    other = LoopControl()
    other.load_state_dict(loop.state_dict())
    assert other.end(20) == 7


@pytest.mark.timeout(60)
def test_scaler_bookkeeping_reset_and_cut_off_update() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.unscale_(opt)  # what a replay hits without the reset
    assert not finish_cut_off_update(scaler)  # unscaled, not stepped: no update to finish
    reset_step_state(scaler)
    opt.zero_grad()
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    assert torch.equal(p.grad, torch.ones(3))  # unscaled exactly once
    scaler.step(opt)
    assert finish_cut_off_update(scaler)  # stepped, update cut off: the scale grows as it would
    assert scaler.get_scale() == 8.0


# -- job.epochs() / job.epoch_steps(): the step loop split into epochs (recovery/epochs.py) ---------
class _FakeStep:
    """What EpochDriver reads of a Step: its index, and whether its body committed."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.committed = False


def _steps_of(indices: list[int], closed: list[bool]) -> Iterator[_FakeStep]:
    # stands for job.steps(): yields the step at the committed position; records close()
    try:
        for i in indices:
            yield _FakeStep(i)
    finally:
        closed.append(True)


def _run_epochs(indices: list[int], per: int, fail: set[int], stop_after_epoch: int = -1) -> list[Any]:
    """Drive EpochDriver like a script does; the n-th steps yielded, n in ``fail``, do not commit."""
    from checkpointless.recovery.epochs import EpochDriver

    closed: list[bool] = []
    driver = EpochDriver(_steps_of(indices, closed), per)
    trace: list[Any] = []
    n = 0
    for epoch in driver.epochs():
        for step in driver.epoch_steps():
            step.committed, n = n not in fail, n + 1
            trace.append(step.index)
        trace.append(f"end {epoch}")  # the script's per-epoch work
        if epoch == stop_after_epoch:
            break
    trace.append(f"closed={bool(closed)}")
    return trace


def test_epoch_loops_run_per_epoch_work_after_each_epochs_last_commit() -> None:
    assert _run_epochs([0, 1, 2, 3, 4, 5], per=3, fail=set()) == [
        0,
        1,
        2,
        "end 0",
        3,
        4,
        5,
        "end 1",
        "closed=True",
    ]
    # a replayed step (step 1 faulted, then ran again) stays in its epoch
    assert _run_epochs([0, 1, 1, 2, 3], per=3, fail={1}) == [0, 1, 1, 2, "end 0", 3, "end 1", "closed=True"]
    # a replacement that resumes at step 4 starts in epoch 1
    assert _run_epochs([4, 5, 6], per=3, fail=set()) == [4, 5, "end 1", 6, "end 2", "closed=True"]


def test_a_rolled_forward_last_step_still_ends_its_epoch() -> None:
    # step 2 faulted after its update was applied: the recovery resumed at 3, so 2 never commits here
    trace = _run_epochs([0, 1, 2, 3, 4, 5], per=3, fail={2})
    assert trace[:4] == [0, 1, 2, "end 0"]
    assert trace == [0, 1, 2, "end 0", 3, 4, 5, "end 1", "closed=True"]


def test_a_replacement_placed_after_a_rolled_forward_epoch_end_runs_that_epochs_work() -> None:
    # Steps 0-2 are epoch 0. Step 2 faulted after its update was applied (rolled forward to 3);
    # the survivors sent their state from inside step 2, before their epoch-0 work, and run that
    # work as they leave the recovery. The replacement placed at step 3 runs it too, with no
    # steps, so a scheduler stepped after each epoch steps as often on every rank.
    from checkpointless.recovery.epochs import EpochDriver
    from checkpointless.recovery.loop import LoopControl

    def run(sent_epochs_done: int) -> list[Any]:
        loop = LoopControl()

        def joined() -> Iterator[_FakeStep]:
            loop.epochs_done = sent_epochs_done  # what the join's transfer loads
            for i in (3, 4, 5):
                yield _FakeStep(i)

        driver = EpochDriver(joined(), 3, loop, start_epoch=0)
        trace: list[Any] = []
        for epoch in driver.epochs():
            for step in driver.epoch_steps():
                step.committed = True
                trace.append(step.index)
            trace.append(f"end {epoch}")
        return [*trace, loop.epochs_done]

    assert run(sent_epochs_done=-1) == ["end 0", 3, 4, 5, "end 1", 1]
    # sent after the epoch-0 work had run (a fault in step 3): nothing extra
    assert run(sent_epochs_done=0) == [3, 4, 5, "end 1", 1]
    # a job resumed at epoch 1 by the script (start=1) runs no work for epoch 0
    loop = LoopControl()
    driver = EpochDriver(iter([_FakeStep(3), _FakeStep(4), _FakeStep(5)]), 3, loop, start_epoch=1)
    seen: list[tuple[int, int]] = []
    for epoch in driver.epochs():
        for step in driver.epoch_steps():
            step.committed = True
            seen.append((epoch, step.index))
    assert seen == [(1, 3), (1, 4), (1, 5)] and loop.epochs_done == 1


def test_break_out_of_the_epoch_loop_closes_the_step_loop_at_a_committed_step() -> None:
    assert _run_epochs([0, 1, 2, 3, 4, 5], per=3, fail=set(), stop_after_epoch=0) == [
        0,
        1,
        2,
        "end 0",
        "closed=True",
    ]


def test_an_epoch_without_its_inner_loop_is_an_error() -> None:
    from checkpointless.recovery.epochs import EpochDriver

    driver = EpochDriver(_steps_of([0, 1], []), 2)
    with pytest.raises(ConfigError, match="ran none of its steps"):
        for _epoch in driver.epochs():
            pass


def test_data_parallel_with_optimizer_tracks_the_replica_once() -> None:
    from checkpointless.recovery.job import Job

    job = Job(None)  # not joined: only the registration is exercised
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    job.data_parallel(net, optimizer=opt)
    assert list(job.internals.tracked.objects) == ["model", "optimizer"]
    job.track(model=net, optimizer=opt)  # what scripts written before the shortcut also do
    tracked = job.internals.tracked
    assert list(tracked.objects) == ["model", "optimizer"] and tracked.optimizers == [opt]
    with pytest.raises(ConfigError, match="'net' is already tracked as 'model'"):
        job.track(net=net)
