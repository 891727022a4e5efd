"""integrations/_lightning_seek.py: a fit resumed from a checkpoint (``fit(ckpt_path=...)``), and
a fit with ``ReduceLROnPlateau`` schedulers, put at step C go on as the uninterrupted fit.

As in test_lightning_seek_unit.py, plain Lightning fits run in this process: a fit from batch 0
writes a checkpoint at step S (after an update, as ``ModelCheckpoint(every_n_train_steps)`` does,
or as an epoch ends); the fit resumed from it is recorded at every batch (the loop's whole state,
step, epoch, batch index, samples); a second fit resumed from it is put at step C > S as it starts.
From C on the two records must be equal, the loop's final state too, and the sought fit must
have read no sample of a batch before C. A resumed fit reads its first epoch from the loader's
first batch, and its counters are not all a fit from 0's, so a seek that ignored either fails.
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

from checkpointless.integrations._lightning_seek import fit_position, seek, seek_refusal
from tests.unit.integrations.test_lightning_seek_unit import Counted, Tiny, Validated

pytestmark = pytest.mark.timeout(180)


class Plateaus(Validated):
    """Tiny, validated, with a step-wise ``StepLR`` and two strict ``ReduceLROnPlateau``: one every
    2 batches, one every epoch, on the training loss (logged at every step)."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
        return [opt], [
            {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3), "interval": "step"},
            {"scheduler": plateau(opt, patience=0), "monitor": "loss", "interval": "step", "frequency": 2},
            {"scheduler": plateau(opt, patience=0), "monitor": "loss", "interval": "epoch"},
        ]


class Save(pl.Callback):
    """Writes the checkpoint once, at step ``at``: after its update, or as its epoch ends."""

    def __init__(self, path: Path, at: int, hook: str) -> None:
        self.path, self.at, self.hook, self.done = path, at, hook, False

    def _save(self, trainer: pl.Trainer) -> None:
        if not self.done and trainer.global_step == self.at:
            self.done = True
            trainer.save_checkpoint(self.path)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.hook == "batch":
            self._save(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.hook == "epoch":
            self._save(trainer)

    def on_validation_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.hook == "validation":
            self._save(trainer)


class Record(pl.Callback):
    def __init__(self, to_step: int | None, manual_count: Any = None) -> None:
        self.to_step, self.manual_count = to_step, manual_count
        self.refusal: str | None = None
        self.seen: list[tuple[Any, ...]] = []

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.refusal = seek_refusal(trainer)
        if self.to_step is not None and self.refusal is None:
            manual = not module.automatic_optimization
            seek(trainer, fit_position(trainer, self.to_step, manual), manual)
            if manual:  # comes with the replica
                progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
                progress.load_state_dict(self.manual_count)

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, idx: int) -> None:
        loops = copy.deepcopy(trainer.fit_loop.state_dict())
        self.seen.append((trainer.global_step, trainer.current_epoch, idx, batch.flatten().tolist(), loops))


def fit(
    module: pl.LightningModule,
    callbacks: list[pl.Callback],
    *,
    steps: int,
    accumulate: int = 1,
    ckpt: Path | None = None,
    **trainer_args: Any,
) -> tuple[Any, Counted]:
    data = Counted(30)  # rank 1 of 2, shuffled: 8 batches an epoch, the last short
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, 2, 1, shuffle=True, seed=5))
    loaders = [DataLoader(Counted(11), batch_size=4)] if isinstance(module, Validated) else []
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=accumulate,
        use_distributed_sampler=False, callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **trainer_args,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader, *loaders, ckpt_path=ckpt)
    return trainer.fit_loop.state_dict(), data


def make(kind: str) -> pl.LightningModule:
    torch.manual_seed(0)
    return {
        "plain": lambda: Tiny(False, True),
        "manual": lambda: Tiny(True, False),
        "val": lambda: Validated(False, True),
    }.get(kind, lambda: Plateaus(False, False))()


def check_sought_resumed_fit(
    tmp_path: Path, kind: str, at: int, hook: str, to_step: int, steps: int, **args: Any
) -> None:
    ckpt = tmp_path / "at.ckpt"
    fit(make(kind), [Save(ckpt, at, hook)], steps=at + 1, **args)
    assert ckpt.exists()
    ref = Record(None)
    ref_end, _ = fit(make(kind), [ref], steps=steps, ckpt=ckpt, **args)
    assert ref.refusal is None, ref.refusal
    first = next(i for i, seen in enumerate(ref.seen) if seen[0] == to_step)
    count = copy.deepcopy(ref.seen[first][4]["epoch_loop.manual_optimization.optim_step_progress"])
    got = Record(to_step, count)
    got_end, data = fit(make(kind), [got], steps=steps, ckpt=ckpt, **args)
    assert got.refusal is None, got.refusal
    later = ref.seen[first:]
    assert got.seen and len(got.seen) == len(later)
    for mine, theirs in zip(got.seen, later, strict=True):
        assert mine[:4] == theirs[:4], "another batch than the resumed fit's"
        assert mine[4] == theirs[4], "the loop's counters differ from the resumed fit's"
    assert got_end == ref_end
    assert data.reads == sum(len(seen[3]) for seen in got.seen), "a batch before the sought step was read"


# 8 batches an epoch; with accumulate_grad_batches=3, 3 updates an epoch (the last one batch)
@pytest.mark.parametrize(
    ("kind", "at", "hook", "to_step", "steps", "args"),
    [
        # saved mid-epoch 0: the sought step in the same epoch (the loader 3 batches into it)...
        pytest.param("plain", 3, "batch", 6, 12, {}, id="mid-epoch-same-epoch"),
        # ... or two epochs on (the resumed epoch ended early, its schedulers' end)
        pytest.param("plain", 3, "batch", 19, 24, {}, id="mid-epoch-later-epoch"),
        # saved on an epoch's last batch: Lightning's restart counts that epoch one behind
        pytest.param("plain", 8, "batch", 13, 20, {}, id="epoch-last-batch"),
        # saved as epoch 1 ended, in a fit by epochs
        pytest.param("plain", 16, "epoch", 21, -1, {"max_epochs": 4}, id="epoch-end"),
        pytest.param("plain", 4, "batch", 7, 10, {"accumulate": 3}, id="accumulate"),
        pytest.param("manual", 5, "batch", 14, 18, {}, id="manual"),
        pytest.param("val", 4, "batch", 13, 20, {"val_check_interval": 3}, id="validated"),
        # saved at a validation's end (ModelCheckpoint(monitor=...)): the restart runs that
        # batch's end again
        pytest.param("val", 3, "validation", 13, 20, {"val_check_interval": 3}, id="after-validation"),
        # plateau schedulers, and the one at an epoch's end that the resumed fit skips
        pytest.param("plateau", 4, "batch", 7, 12, {"val_check_interval": 3}, id="plateau-same-epoch"),
        pytest.param("plateau", 5, "batch", 19, 22, {"val_check_interval": 3}, id="plateau-later-epoch"),
    ],
)
def test_a_sought_resumed_fit_goes_on_as_the_resumed_one(
    tmp_path: Path, kind: str, at: int, hook: str, to_step: int, steps: int, args: dict[str, Any]
) -> None:
    check_sought_resumed_fit(tmp_path, kind, at, hook, to_step, steps, **args)


@pytest.mark.parametrize(
    ("to_step", "steps", "args"),
    [
        pytest.param(5, 12, {}, id="epoch0"),
        pytest.param(19, 22, {"val_check_interval": 3}, id="epoch2-validated"),
        pytest.param(7, 10, {"accumulate": 3}, id="accumulate"),
    ],
)
def test_a_sought_fit_with_plateau_schedulers_goes_on_as_the_uninterrupted_one(
    to_step: int, steps: int, args: dict[str, Any]
) -> None:
    ref = Record(None)
    ref_end, _ = fit(make("plateau"), [ref], steps=steps, **args)
    got = Record(to_step)
    got_end, data = fit(make("plateau"), [got], steps=steps, **args)
    assert got.refusal is None, got.refusal
    first = next(i for i, seen in enumerate(ref.seen) if seen[0] == to_step)
    later = ref.seen[first:]
    assert len(got.seen) == len(later)
    for mine, theirs in zip(got.seen, later, strict=True):
        assert mine[:4] == theirs[:4] and mine[4] == theirs[4]
    assert got_end == ref_end
    assert data.reads == sum(len(seen[3]) for seen in got.seen)


class Lenient(Plateaus):
    def configure_optimizers(self) -> Any:
        opt, configs = super().configure_optimizers()
        configs[1]["strict"] = False
        return opt, configs


@pytest.mark.parametrize("case", ["epoch-end-validation", "plateau-after-validation", "plateau-not-strict"])
def test_what_cannot_be_counted_is_refused(tmp_path: Path, case: str) -> None:
    """A checkpoint written after a validation at an epoch's end (Lightning's restart runs that
    end as a loop iteration), or with a plateau scheduler every few batches (the restart runs the
    batch's end again, and calls it again), and a plateau scheduler with strict=False (its count
    follows the fit's history): walked."""
    ask = Record(None)
    if case == "epoch-end-validation":  # the restart runs epoch 0's end as an iteration of its own
        ckpt = tmp_path / "at.ckpt"
        fit(make("val"), [Save(ckpt, 8, "validation")], steps=9)
        fit(make("val"), [ask], steps=10, ckpt=ckpt)
        assert ask.refusal is not None and "epoch's last batch" in ask.refusal, ask.refusal
    elif case == "plateau-after-validation":
        ckpt = tmp_path / "at.ckpt"
        fit(make("plateau"), [Save(ckpt, 3, "validation")], steps=5, val_check_interval=3)
        fit(make("plateau"), [ask], steps=6, ckpt=ckpt, val_check_interval=3)
        assert ask.refusal is not None and "calling the plateau schedulers again" in ask.refusal, ask.refusal
    else:
        torch.manual_seed(0)
        fit(Lenient(False, False), [ask], steps=2)
        assert ask.refusal is not None and "strict=False" in ask.refusal, ask.refusal
