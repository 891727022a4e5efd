"""The Lightning strategy's pure rules, and the Lightning version it is tested with."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from checkpointless.errors import ConfigError
from checkpointless.integrations._lightning_state import (
    TESTED_LIGHTNING,
    BatchAction,
    LoopAheadOfState,
    SchedulerLedger,
    batch_action,
)
from tests.helpers.jobs import ROOT


@pytest.mark.timeout(30)
def test_batch_action_trains_the_jobs_next_step_and_skips_what_the_state_holds() -> None:
    assert batch_action(5, 5) is BatchAction.TRAIN
    assert batch_action(0, 4) is BatchAction.SKIP  # a replacement walking Lightning's loop forward
    assert batch_action(3, 4) is BatchAction.SKIP  # a survivor whose update was rolled forward
    # every replica lost and an older snapshot restored, this rank alive with its loop past it:
    # not a setting (a ConfigError would end the job at once), so the process leaves and a spare
    # takes its rank with a fresh loop put at the restored step
    with pytest.raises(LoopAheadOfState, match=r"optimizer step 6 but .* only 4 updates") as err:
        batch_action(6, 4)
    assert not isinstance(err.value, ConfigError) and "spare takes its rank" in str(err.value)


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
def test_callback_state_travels_with_its_position_and_no_hook_reaches_it_twice() -> None:
    """A replacement loads the callback state it receives and leaves the stateful callbacks out
    of Lightning's hooks until its loop trains the state's batch or walks past it; a checkpoint
    callback walks along and gets the received state back. A rank that has trained keeps its own
    (rolled forward, it gets the later hooks of its batch from Lightning). A callback with a hook
    inside the closure is put back as the step began when the step is replayed."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint

    from checkpointless.integrations._lightning_callbacks import CallbackReplica, has_state

    class GradNorms(pl.Callback):  # changes its state inside the closure
        def __init__(self) -> None:
            self.seen = 0

        def on_after_backward(self, trainer: Any, module: Any) -> None:
            self.seen += 1

        def state_dict(self) -> dict[str, Any]:
            return {"seen": self.seen}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.seen = state["seen"]

    def trainer() -> tuple[Any, EarlyStopping, ModelCheckpoint, LearningRateMonitor, GradNorms]:
        stop, ckpt, lr, norms = (
            EarlyStopping(monitor="val"),
            ModelCheckpoint(monitor="val"),
            LearningRateMonitor(),
            GradNorms(),
        )
        callbacks = [stop, lr, norms, ckpt]
        t = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, callbacks=callbacks)
        return t, stop, ckpt, lr, norms

    sender_trainer, stop, ckpt, lr, _ = trainer()
    assert has_state(stop) and has_state(ckpt) and not has_state(lr)
    sender = CallbackReplica(sender_trainer)
    assert [type(cb) for cb in sender.callbacks] == [EarlyStopping, GradNorms, ModelCheckpoint]
    sender.at(5)
    stop.wait_count, ckpt.best_model_path = 2, "best.ckpt"
    state = sender.state_dict()

    t, stop2, ckpt2, lr2, _ = trainer()
    replacement = CallbackReplica(t)  # a replacement: its loop has not started
    replacement.load_state_dict(state)
    assert (stop2.wait_count, ckpt2.best_model_path) == (2, "best.ckpt") and replacement.behind
    assert stop2 not in t.callbacks and {lr2, ckpt2} <= set(t.callbacks), "EarlyStopping sits out"
    ckpt2.best_model_path = "changed by the walk"
    replacement.at(4)
    replacement.passed(4)
    assert stop2 not in t.callbacks, "batch 4's hooks are in the received state already"
    replacement.at(5)
    replacement.train(5)
    assert stop2 in t.callbacks and not replacement.behind
    assert ckpt2.best_model_path == "best.ckpt", "the checkpoint callback gets the received state back"

    t, stop3, _, _, _ = trainer()
    past = CallbackReplica(t)  # the sender was past batch 5's update, inside its optimizer_step
    past.load_state_dict(state)
    past.at(5)
    past.passed(5)
    assert stop3 in t.callbacks, "batch 5's later hooks are still to come: they take them"

    t, stop4, _, _, norms4 = trainer()
    survivor = CallbackReplica(t)
    survivor.at(4)  # rolled forward: it faulted in batch 4, the state is of batch 5
    survivor.train(4)
    stop4.wait_count = 1  # its own: batch 4's later hooks are still to come, from Lightning
    norms4.seen = 3  # the closure's hooks of the failed attempt
    survivor.load_state_dict(state)
    assert stop4.wait_count == 1 and not survivor.behind and stop4 in t.callbacks
    survivor.rewind()
    assert norms4.seen == 0, "a replay starts from the state the step began with"
    with pytest.raises(ValueError, match="same Trainer callbacks"):
        CallbackReplica(t).load_state_dict({"batch": 9, "callbacks": [{}]})


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


@pytest.mark.timeout(60)
def test_manual_progress_mark_and_step_count_cover_global_step() -> None:
    """Under manual optimization Lightning's global_step is its count of optimizer steps: a replay
    puts it back (ProgressMark) and the count travels with the state (ManualStepCount)."""
    pl = pytest.importorskip("lightning.pytorch")
    from checkpointless.integrations._lightning_internals import ManualStepCount, ProgressMark

    class Manual(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    trainer.strategy.connect(Manual())
    trainer.lightning_module.trainer = trainer
    progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
    mark = ProgressMark(trainer)
    sent = ManualStepCount(trainer).state_dict()
    for _ in range(2):  # the two updates of a step that is then replayed
        progress.increment_ready()
        progress.increment_completed()
    assert trainer.global_step == 2
    mark.restore()
    assert trainer.global_step == 0
    ManualStepCount(trainer).load_state_dict({**sent, "total": {"ready": 7, "completed": 7}})
    assert trainer.global_step == 7


@pytest.mark.timeout(120)
def test_sigterm_still_ends_a_worker_during_fit(tmp_path: Path) -> None:
    """Lightning's own SIGTERM handler turns the signal into a quiet end of fit (exit code 0 here,
    as if training had finished); the strategy puts the previous handler back, so the launcher's
    SIGTERM ends a worker in the middle of fit, as it ends any other worker."""
    pytest.importorskip("lightning")
    cmd = [sys.executable, str(ROOT / "examples" / "lightning_gpt.py"), "--steps", "100000"]
    cmd += ["--dim", "16", "--layers", "1", "--heads", "2", "--seq-len", "8", "--step-times"]
    log = tmp_path / "out"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 90
        while "steptime 3 " not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == -signal.SIGTERM, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
