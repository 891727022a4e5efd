"""integrations/_lightning_seek.py: a fit with several training loaders (a ``CombinedLoader``, or a
list Lightning combines) put at step C goes on as the uninterrupted fit, in each of Lightning's
modes for fitting, a shorter loader started again (``max_size_cycle``) or run out (``max_size``)
before C included, from batch 0 and resumed from a checkpoint.

As in test_lightning_seek_unit.py: the loop's whole state, step, epoch, batch index and every
loader's samples are recorded at every batch of a fit from batch 0 (or resumed) and of one put at
C as it starts; from C on they must be equal, and no sample before C read from any loader.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

pytest.importorskip("lightning", reason="the `lightning` extra is not installed")

import lightning.pytorch as pl
from lightning.pytorch.utilities import CombinedLoader

from checkpointless.integrations._lightning_seek import fit_position, seek, seek_refusal
from tests.unit.integrations.test_lightning_seek_resume_unit import Save
from tests.unit.integrations.test_lightning_seek_unit import Counted

pytestmark = pytest.mark.timeout(120)


class Two(pl.LightningModule):
    """Trains on the sum of both loaders' batches (a run-out loader's is None)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)

    def training_step(self, batch: list[Any], batch_idx: int) -> Any:
        return sum(self.lin(b).pow(2).mean() for b in batch if b is not None)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3), "interval": "step"}]


class Record(pl.Callback):
    def __init__(self, to_step: int | None) -> None:
        self.to_step = to_step
        self.refusal: str | None = None
        self.seen: list[tuple[Any, ...]] = []

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.refusal = seek_refusal(trainer)
        if self.to_step is not None and self.refusal is None:
            seek(trainer, fit_position(trainer, self.to_step, False), False)

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, idx: int) -> None:
        samples = [None if b is None else b.flatten().tolist() for b in batch]
        loops = copy.deepcopy(trainer.fit_loop.state_dict())
        self.seen.append((trainer.global_step, trainer.current_epoch, idx, samples, loops))


def fit(mode: str, callbacks: list[pl.Callback], steps: int, ckpt: Path | None = None) -> tuple[Any, int]:
    long = Counted(30)  # rank 1 of 2, shuffled: 8 batches an epoch
    short = Counted(10)  # 5 batches
    loaders = [
        DataLoader(long, batch_size=2, sampler=DistributedSampler(long, 2, 1, shuffle=True, seed=5)),
        DataLoader(short, batch_size=2),
    ]
    data: Any = loaders if mode == "list" else CombinedLoader(loaders, mode)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, use_distributed_sampler=False, callbacks=callbacks,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Two(), data, ckpt_path=ckpt)
    return trainer.fit_loop.state_dict(), long.reads + short.reads


@pytest.mark.parametrize(
    ("mode", "to_step", "steps", "resume_at"),
    [
        # the short loader started again at batch 5 of each epoch: C past it, two epochs in
        pytest.param("list", 22, 28, None, id="list-cycled"),
        pytest.param("max_size_cycle", 3, 10, None, id="cycle-before-restart"),
        pytest.param("max_size", 14, 20, None, id="max-size-run-out"),
        pytest.param("min_size", 7, 12, None, id="min-size"),  # 5 batches an epoch
        # resumed from a checkpoint at batch 2: the loaders read that epoch from their first batch
        pytest.param("max_size_cycle", 7, 12, 2, id="resumed-cycle"),
    ],
)
def test_a_sought_fit_with_several_loaders_goes_on_as_the_uninterrupted_one(
    tmp_path: Path, mode: str, to_step: int, steps: int, resume_at: int | None
) -> None:
    ckpt = None
    if resume_at is not None:
        ckpt = tmp_path / "at.ckpt"
        fit(mode, [Save(ckpt, resume_at, "batch")], resume_at + 1)
    ref = Record(None)
    ref_end, _ = fit(mode, [ref], steps, ckpt)
    got = Record(to_step)
    got_end, reads = fit(mode, [got], steps, ckpt)
    assert got.refusal is None, got.refusal
    first = next(i for i, seen in enumerate(ref.seen) if seen[0] == to_step)
    later = ref.seen[first:]
    assert got.seen and len(got.seen) == len(later)
    for mine, theirs in zip(got.seen, later, strict=True):
        assert mine[:4] == theirs[:4], "another batch than the uninterrupted fit's"
        assert mine[4] == theirs[4], "the loop's counters differ from the uninterrupted fit's"
    assert got_end == ref_end
    read = sum(len(s) for seen in got.seen for s in seen[3] if s is not None)
    assert reads == read, "a batch before the sought step was read"
