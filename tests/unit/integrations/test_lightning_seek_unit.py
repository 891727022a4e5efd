"""integrations/_lightning_seek.py: a fit put at step C has the uninterrupted fit's loop from C on.

Each case fits a small module twice in this process, with plain Lightning: once from batch 0,
recording at every batch the loop's whole state (what Lightning writes into a checkpoint), the
step, epoch and batch index, and the samples; once put at step C as the fit starts. From C on
the two records must be equal, the loop's final state too, and the sought fit must have read no
sample of a batch before C.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

pytest.importorskip("lightning", reason="the `lightning` extra is not installed")

import lightning.pytorch as pl

from checkpointless.integrations._lightning_seek import fit_position, seek, seek_refusal

pytestmark = pytest.mark.timeout(120)


class Counted(Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.reads += 1
        return torch.tensor([float(i)])


class Tiny(pl.LightningModule):
    def __init__(self, manual: bool, schedulers: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)
        self.automatic_optimization = not manual
        self.schedulers = schedulers

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
        loss = self.lin(batch).pow(2).mean()
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]
        return None

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        if not self.schedulers:
            return opt
        every2 = torch.optim.lr_scheduler.StepLR(opt, 3)
        per_epoch = torch.optim.lr_scheduler.StepLR(opt, 2)
        return [opt], [
            {"scheduler": every2, "interval": "step", "frequency": 2},
            {"scheduler": per_epoch, "interval": "epoch"},
        ]


class Validated(Tiny):
    """Tiny with a validation loop: its runs must not move the sought fit off the
    uninterrupted one (the loop's counters include the validation loop's)."""

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val", self.lin(batch).pow(2).mean())


class Record(pl.Callback):
    def __init__(self, to_step: int | None, manual_count: Any = None) -> None:
        self.to_step = to_step  # put the fit there as it starts
        self.manual_count = manual_count  # the manual step count, which comes with the replica
        self.seen: list[tuple[Any, ...]] = []

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.to_step is not None:
            manual = not module.automatic_optimization
            assert seek_refusal(trainer) is None, seek_refusal(trainer)
            seek(trainer, fit_position(trainer, self.to_step, manual), manual)
            if manual:
                trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress.load_state_dict(
                    self.manual_count
                )

    def on_train_batch_start(
        self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, idx: int
    ) -> None:
        loops = copy.deepcopy(trainer.fit_loop.state_dict())
        self.seen.append((trainer.global_step, trainer.current_epoch, idx, batch.flatten().tolist(), loops))


def fit(
    to_step: int | None,
    *,
    accumulate: int,
    manual: bool,
    steps: int,
    manual_count: Any = None,
    val: dict[str, Any] | None = None,
) -> Any:
    data = Counted(30)
    # rank 1 of 2, shuffled: what Lightning injects on a real rank
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, 2, 1, shuffle=True, seed=5))
    record = Record(to_step, manual_count)
    module = Tiny(manual, schedulers=not manual) if val is None else Validated(manual, schedulers=not manual)
    # 11 samples: 3 validation batches of 4, the last short
    loaders = [] if val is None else [DataLoader(Counted(11), batch_size=4)]
    trainer = pl.Trainer(
        **(val or {}),
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        use_distributed_sampler=False,
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader, *loaders)
    return record.seen, trainer.fit_loop.state_dict(), data.reads


# 15 samples per rank, 8 batches per epoch (the last one short)
@pytest.mark.parametrize(
    ("accumulate", "manual", "to_step", "steps"),
    [
        pytest.param(1, False, 5, 12, id="epoch0-mid"),
        pytest.param(1, False, 19, 26, id="epoch2-mid"),
        pytest.param(1, False, 16, 20, id="epoch-boundary"),
        pytest.param(3, False, 7, 10, id="accumulate-epoch2"),  # 3 updates an epoch, the last short
        pytest.param(3, False, 6, 8, id="accumulate-boundary"),
        pytest.param(1, True, 11, 15, id="manual-epoch1"),
    ],
)
def test_a_sought_fit_goes_on_as_the_uninterrupted_one(
    accumulate: int, manual: bool, to_step: int, steps: int, val: dict[str, Any] | None = None
) -> None:
    ref, ref_end, _ = fit(None, accumulate=accumulate, manual=manual, steps=steps, val=val)
    pos = fit_position_of(accumulate, manual, to_step)
    count = copy.deepcopy(ref[pos][4]["epoch_loop.manual_optimization.optim_step_progress"])
    got, got_end, reads = fit(
        to_step, accumulate=accumulate, manual=manual, steps=steps, manual_count=count, val=val
    )
    later = ref[pos:]
    assert got and len(got) == len(later)
    for mine, theirs in zip(got, later, strict=True):
        assert mine[:4] == theirs[:4]
        assert mine[4] == theirs[4], "the loop's counters differ from the uninterrupted fit's"
    assert got_end == ref_end
    assert reads == sum(len(seen[3]) for seen in got), "a batch before the sought step was read"


OVER_THE_FIT = {"val_check_interval": 5, "check_val_every_n_epoch": None, "num_sanity_val_steps": 0}


# validation in the fit, in each way Lightning schedules it by batches (8 batches an epoch)
@pytest.mark.parametrize(
    ("accumulate", "manual", "to_step", "steps", "val"),
    [
        # at each epoch's end, the sought step past two of them
        pytest.param(1, False, 19, 24, {}, id="val-epoch-end"),
        # every 3 batches in each epoch (2 an epoch: after batches 2 and 5), mid-epoch between two
        pytest.param(1, False, 12, 20, {"val_check_interval": 3}, id="val-every-3"),
        # every 5 batches over the fit, across epoch ends; no sanity check, so the seek builds
        # the validation loaders itself
        pytest.param(1, False, 18, 24, OVER_THE_FIT, id="val-every-5-over-the-fit"),
        # half an epoch, every second epoch, with accumulation
        pytest.param(
            3,
            False,
            10,
            13,
            {"val_check_interval": 0.5, "check_val_every_n_epoch": 2},
            id="val-half-every-2nd",
        ),
        pytest.param(1, True, 13, 17, {"val_check_interval": 4, "limit_val_batches": 2}, id="val-manual"),
    ],
)
def test_a_sought_fit_that_validates_goes_on_as_the_uninterrupted_one(
    accumulate: int, manual: bool, to_step: int, steps: int, val: dict[str, Any]
) -> None:
    test_a_sought_fit_goes_on_as_the_uninterrupted_one(accumulate, manual, to_step, steps, val)


def test_validation_on_a_time_interval_is_refused() -> None:
    seen: list[str | None] = []

    class Ask(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            seen.append(seek_refusal(trainer))

    data = Counted(8)
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, 1, 0, shuffle=False))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        callbacks=[Ask()], val_check_interval="00:00:00:30", use_distributed_sampler=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Validated(False, False), loader, DataLoader(Counted(4), batch_size=2))
    assert seen and seen[0] is not None and "time interval" in seen[0], seen


def fit_position_of(accumulate: int, manual: bool, step: int) -> int:
    """The batch of the fit where ``step`` begins (8 batches per epoch)."""
    if manual:
        return step
    epoch, window = divmod(step, -(-8 // accumulate))
    return epoch * 8 + window * accumulate


def test_a_sampler_not_addressable_by_epoch_is_refused() -> None:
    data = Counted(8)
    loader = DataLoader(data, batch_size=2, sampler=RandomSampler(data))
    seen: list[str | None] = []

    class Ask(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            seen.append(seek_refusal(trainer))

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False, callbacks=[Ask()]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Tiny(False, False), loader)
    assert seen and seen[0] is not None and "RandomSampler" in seen[0], seen
