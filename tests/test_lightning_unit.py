"""The Lightning strategy's pure rules, and the Lightning version it is tested with."""

from __future__ import annotations

import pytest

from checkpointless.errors import ConfigError
from checkpointless.integrations._lightning_state import (
    TESTED_LIGHTNING,
    BatchAction,
    SchedulerLedger,
    batch_action,
)


@pytest.mark.timeout(30)
def test_batch_action_trains_the_jobs_next_step_and_skips_what_the_state_holds() -> None:
    assert batch_action(5, 5) is BatchAction.TRAIN
    assert batch_action(0, 4) is BatchAction.SKIP  # a replacement walking Lightning's loop forward
    assert batch_action(3, 4) is BatchAction.SKIP  # a survivor whose update was rolled forward
    with pytest.raises(ConfigError, match=r"optimizer step 6 but .* only 4 updates"):
        batch_action(6, 4)


@pytest.mark.timeout(30)
def test_scheduler_ledger_never_applies_a_call_twice_and_travels() -> None:
    ledger = SchedulerLedger()
    assert [ledger.should_step("0", m) for m in (1, 2, 3)] == [True, True, True]
    received = SchedulerLedger()
    received.load_state_dict(ledger.state_dict())
    # a replacement walking past batches 0..2 must not step the scheduler it received again
    assert [received.should_step("0", m) for m in (1, 2, 3, 4)] == [False, False, False, True]
    assert received.should_step("1", 1), "schedulers are counted separately"


@pytest.mark.timeout(60)
def test_installed_lightning_is_the_tested_version() -> None:
    """CheckpointlessStrategy relies on Lightning's hook order (closure inside optimizer_step,
    schedulers stepped after it, training_step through the strategy); a new Lightning must be
    re-tested before this pin moves."""
    lightning = pytest.importorskip("lightning")
    assert lightning.__version__ == TESTED_LIGHTNING


@pytest.mark.timeout(60)
def test_progress_mark_puts_back_what_a_replayed_closure_counted() -> None:
    """The one reach into Lightning's internals (integrations/_lightning_internals.py)."""
    pl = pytest.importorskip("lightning.pytorch")
    from checkpointless.integrations._lightning_internals import ProgressMark

    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
    before = progress.state_dict()
    mark = ProgressMark(trainer)
    progress.optimizer.zero_grad.increment_ready()  # what a closure that ran again counts
    progress.optimizer.zero_grad.increment_completed()
    assert progress.state_dict() != before
    mark.restore()
    assert progress.state_dict() == before
