"""torchdata's StatefulDataLoader under job.loader(): its position travels through its own state.

Units here use real StatefulDataLoaders (with real worker processes) and the real state codec: a
position saved by one loader, packed as for a peer transfer, and loaded into a fresh loader (what
a replacement does) must yield exactly the batches the first loader goes on to yield. The e2e test
kills ranks of a real job that trains from a StatefulDataLoader.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from checkpointless.errors import ConfigError
from checkpointless.recovery.stateful_loader import StatefulStepLoader, is_stateful_loader
from checkpointless.state.codec import layout, unpack
from tests.helpers.jobs import ROOT, run_job
from tests.helpers.reference import ReferenceRuns

torchdata = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = torchdata.StatefulDataLoader
SCRIPT = ROOT / "tests" / "scripts" / "adopt.py"
NOWHERE = Path("/nonexistent")
# the jobs of the two tests below: 8 steps an epoch (64 samples, 2 ranks, batches of 4), 20 steps,
# 2 worker processes per rank; one fault-free run (plain DataLoader) serves both
JOB = ["--steps", "20", "--samples", "64", "--batch", "4", "--workers", "2"]


class Squares(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i * i])


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(10))


def make(workers: int) -> Any:
    sampler = DistributedSampler(Squares(), num_replicas=2, rank=1, shuffle=True, seed=3)
    return StatefulDataLoader(Squares(), batch_size=3, sampler=sampler, num_workers=workers, drop_last=True)


def through_codec(state: Any) -> Any:
    """The state as a peer receives it: packed into messages and a JSON manifest, then rebuilt."""
    lay = layout(state)
    manifest = json.loads(lay.manifest_bytes())
    return unpack(manifest, [m.clone() for m in lay.messages])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_position_survives_the_codec_into_a_fresh_loader(workers: int) -> None:
    # 20 samples on this rank in batches of 3: 6 batches an epoch; 15 steps cross two boundaries
    first = StatefulStepLoader(make(workers))
    assert first.batches_per_epoch == 6
    seen = [first.batch(s) for s in range(9)]
    assert torch.equal(first.batch(8), seen[8]) and first.batch(8) is seen[8], "a replay reuses the batch"
    state = through_codec(first.state_dict())
    rest = [first.batch(s) for s in range(9, 15)]
    # the epochs differ: set_epoch() was called at the boundary
    assert not torch.equal(torch.cat(seen[:6]).sort(0).values, torch.cat(seen[6:9] + rest[:3]).sort(0).values)

    # a replacement that resumes at the interrupted step 8, and one that resumes after it
    for resume, want in ((8, [seen[8], *rest]), (9, rest)):
        other = StatefulStepLoader(make(workers))
        other.load_state_dict(state)
        got = [other.batch(s) for s in range(resume, 15)]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), f"resume at {resume}"
        other.close()
    first.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("resumed", ["no", "checkpoint", "checkpoint, asked"])
def test_a_state_taken_before_the_first_read_places_the_loader_at_the_first_step(
    workers: int, resumed: str
) -> None:
    """A snapshot (or a peer's state) taken as the job's first step begins, before any batch was
    read: the step is not known yet (a resumed job starts where the script's checkpoint put the
    loader). Restored into the same loader after it has gone on (a rollback), and into a fresh
    loader (a replacement, which skips the script's checkpoint), it yields the batches from the
    first step on. Taking it starts no iterator and draws nothing from the global generator
    ("asked": the script itself called the loader's state_dict() before the first read, which
    made the iterator that the first read goes on with)."""
    start = 0 if resumed == "no" else 5

    def at_start() -> Any:
        loader = make(workers)
        if start:  # the script's own checkpoint, saved after 5 batches
            ckpt = StatefulStepLoader(make(workers))
            for s in range(start):
                ckpt.batch(s)
            loader.load_state_dict(ckpt.loader.state_dict())
            ckpt.close()
        if resumed == "checkpoint, asked":
            loader.state_dict()
        return loader

    # the job tells the loader its next step; a loader on its own tags the position with none
    first = StatefulStepLoader(at_start(), next_step=(lambda: start) if workers else None)
    made = first.loader._iterator
    torch.manual_seed(11)
    rng = torch.get_rng_state()
    snap = through_codec(first.state_dict())
    assert [p["step"] for p in snap["positions"]] == [start if workers else None]
    assert torch.equal(torch.get_rng_state(), rng), "taking the state drew from the global generator"
    assert first.loader._iterator is made, "taking the state started an iterator"
    seen = [first.batch(s) for s in range(start, start + 4)]
    first.load_state_dict(snap)  # a rollback to the snapshot of the first step
    again = [first.batch(s) for s in range(start, start + 4)]
    assert all(torch.equal(a, b) for a, b in zip(again, seen, strict=True)), "rollback"
    other = StatefulStepLoader(make(workers))  # a replacement: the script's checkpoint is not loaded
    other.load_state_dict(snap)
    got = [other.batch(s) for s in range(start, start + 4)]
    assert all(torch.equal(a, b) for a, b in zip(got, seen, strict=True)), "replacement"
    reference = StatefulStepLoader(make(workers))
    want = [reference.batch(s) for s in range(start + 4)][start:]
    assert all(torch.equal(a, b) for a, b in zip(seen, want, strict=True)), "the resumed batches"
    for loader in (first, other, reference):
        loader.close()


@pytest.mark.timeout(60)
def test_positions_received_and_not_used_yet_are_the_state_passed_on() -> None:
    """A replacement's state is taken before its first read (its snapshot or copy as its first
    step begins): it must be the positions it received, not its own loader's start."""
    first = StatefulStepLoader(make(0))
    seen = [first.batch(s) for s in range(6)]
    received = StatefulStepLoader(make(0), next_step=lambda: 5)
    received.load_state_dict(through_codec(first.state_dict()))
    passed = through_codec(received.state_dict())
    assert sorted(p["step"] for p in passed["positions"]) == [5, 6]
    later = StatefulStepLoader(make(0))
    later.load_state_dict(passed)
    assert torch.equal(later.batch(5), seen[5]) and torch.equal(received.batch(5), seen[5])
    for loader in (first, received, later):
        loader.close()


@pytest.mark.timeout(60)
def test_a_position_for_another_step_is_refused() -> None:
    first = StatefulStepLoader(make(0))
    for s in range(3):
        first.batch(s)
    other = StatefulStepLoader(make(0))
    other.load_state_dict(first.state_dict())
    with pytest.raises(ConfigError, match=r"position is for step\(s\) \[2, 3\], not for step 5"):
        other.batch(5)
    with pytest.raises(ConfigError, match="ask for the steps in order"):
        first.batch(7)


@pytest.mark.timeout(60)
def test_an_iterable_dataset_that_cannot_seek_is_refused_with_the_fix() -> None:
    dl = StatefulDataLoader(Stream(), batch_size=2)
    assert is_stateful_loader(dl)
    with pytest.raises(ConfigError, match=r"cannot seek in the iterable dataset Stream.*state_dict\(\)"):
        StatefulStepLoader(dl)
    unordered = StatefulDataLoader(Squares(), batch_size=3, num_workers=1, in_order=False)
    with pytest.raises(ConfigError, match=r"in_order=False.*leave in_order at its default"):
        StatefulStepLoader(unordered)


class SeekableStream(IterableDataset[int]):
    """An iterable dataset that saves and restores its own position (the stateful kind)."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self) -> Iterator[int]:
        while self.pos < 12:
            self.pos += 1
            yield self.pos - 1
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


@pytest.mark.timeout(60)
def test_a_stateful_iterable_dataset_resumes_from_its_own_state() -> None:
    first = StatefulStepLoader(StatefulDataLoader(SeekableStream(), batch_size=2))
    assert first.batches_per_epoch is None  # no length: step.epoch needs steps_per_epoch
    seen = [first.batch(s).tolist() for s in range(4)]
    assert seen == [[0, 1], [2, 3], [4, 5], [6, 7]]
    other = StatefulStepLoader(StatefulDataLoader(SeekableStream(), batch_size=2))
    other.load_state_dict(through_codec(first.state_dict()))
    # the next epoch starts over after the 6th batch
    assert [other.batch(s).tolist() for s in range(4, 8)] == [[8, 9], [10, 11], [0, 1], [2, 3]]


@pytest.mark.timeout(400)
def test_job_on_a_stateful_dataloader_with_workers_survives_kills_and_an_exception_bitwise(
    tmp_path: Path, reference: ReferenceRuns
) -> None:
    base = JOB
    ref = reference(2, data=NOWHERE, script=SCRIPT, script_args=base)
    # a kill mid-epoch, an exception (the survivor's replay), a kill on an epoch's first step
    faults = ["kill:rank=1:step=5", "raise:rank=0:step=11", "kill:rank=0:step=16"]
    res = run_job(tmp_path / "run", NOWHERE, 2, 2, faults, script=SCRIPT, script_args=[*base, "--stateful"])
    assert res.rc == 0, res.output[-6000:]
    assert len(res.of("fault_injected")) == 3 and len(res.of("recovery")) >= 3, res.output[-4000:]
    assert {e["rank"] for e in res.of("spare_assigned")} == {0, 1}, "each killed rank is taken by a spare"
    # every (rank, step) trained on the batch of the fault-free run (a plain DataLoader's, even)
    assert res.batches() == ref.batches(), "some rank trained on other samples than the fault-free run"
    assert len(res.batches()) == 40
    res.assert_same_weights(ref, nproc=2)
    assert not res.left_behind(), "processes of the job were left behind"


@pytest.mark.timeout(400)
def test_every_rank_killed_resumes_a_stateful_dataloader_from_the_snapshot(
    tmp_path: Path, reference: ReferenceRuns
) -> None:
    """No replica survives: the loader's position must come back from the shared-memory snapshot
    with the model, not from a peer (the path the other tests take)."""
    base = JOB  # 20 steps (14 before the fault-free run was shared: the steps cost nothing)
    ref = reference(2, data=NOWHERE, script=SCRIPT, script_args=base)
    # killall: as step 6 begins, each rank waits for the others and for the snapshot of step 6
    # to be written, then every process holding a rank SIGKILLs itself
    res = run_job(
        tmp_path / "run",
        NOWHERE,
        2,
        2,
        ["killall:step=6"],
        script=SCRIPT,
        script_args=[*base, "--stateful"],
        extra=["--snapshot-every", "2"],
        timeout=300,
    )
    assert res.rc == 0, res.output[-6000:]
    assert {e["rank"] for e in res.of("spare_assigned")} == {0, 1}, "every rank must have been replaced"
    assert {e["rank"] for e in res.of("fault_injected") if e["kind"] == "killall"} == {0, 1}
    plans = [(p["target_step"], p["receivers"]) for p in res.of("plan") if p.get("from_snapshot")]
    assert plans == [(6, [0, 1])], res.of("plan")
    assert res.batches() == ref.batches(), "a rank trained on other samples than the fault-free run"
    res.assert_same_weights(ref, nproc=2)
    assert not res.left_behind(), "processes of the job were left behind"
