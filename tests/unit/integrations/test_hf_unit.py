"""The Trainer integration's pure parts, the versions it is tested with, and the adoption's size."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib

from checkpointless.errors import ConfigError
from checkpointless.integrations._hf_state import LossLedger, StepPlan, TrainerStateCarrier
from tests.helpers.jobs import ROOT

transformers = pytest.importorskip("transformers", reason="the `hf` extra is not installed")


@pytest.mark.timeout(30)
def test_the_installed_pair_is_the_tested_one_and_the_extra_pins_it() -> None:
    """The integration reaches into Trainer's loop (integrations/_hf_internals.py); a new release
    must fail here, not in a training job."""
    from checkpointless.integrations._hf_internals import TESTED_ACCELERATE, TESTED_TRANSFORMERS

    assert importlib.metadata.version("transformers") == TESTED_TRANSFORMERS
    assert importlib.metadata.version("accelerate") == TESTED_ACCELERATE
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert sorted(extras["hf"]) == [
        f"accelerate=={TESTED_ACCELERATE}",
        f"transformers=={TESTED_TRANSFORMERS}",
    ]
    assert ",hf]" in (ROOT / "Makefile").read_text() or ",hf," in (ROOT / "Makefile").read_text()


@pytest.mark.timeout(60)
def test_the_trainer_internals_the_integration_uses_are_there() -> None:
    from accelerate.state import GradientState
    from transformers import Trainer, TrainingArguments

    from checkpointless.integrations._hf_internals import RUN_EPOCH_PARAMS, run_epoch_params

    assert run_epoch_params(Trainer) == RUN_EPOCH_PARAMS
    for name in (
        "_get_num_items_in_batch",
        "_remove_unused_columns",
        "_get_collator_with_removed_columns",
        "_evaluate",
        "_determine_best_metric",
        "_save_checkpoint",
        "_finalize_training",
    ):
        assert callable(getattr(Trainer, name, None)), f"Trainer.{name} is gone"
    assert callable(getattr(GradientState, "_set_sync_gradients", None))
    assert "_setup_devices" in vars(TrainingArguments), "TrainingArguments' device set-up moved"


@pytest.mark.timeout(30)
def test_step_plan_maps_optimizer_steps_to_micro_batches() -> None:
    plan = StepPlan(batches_per_epoch=5, accumulation=2)  # 3 steps per epoch, the last one short
    assert plan.steps_per_epoch == 3
    assert [list(plan.micro_batches(s)) for s in range(4)] == [[0, 1], [2, 3], [4], [5, 6]]
    assert [plan.epoch(s) for s in (0, 2, 3, 5, 6)] == [0, 0, 1, 1, 2]
    assert [plan.epoch_progress(s) for s in (0, 1, 2, 3)] == [0.4, 0.8, 1.0, 1.4]
    with pytest.raises(ConfigError, match="both must be positive"):
        StepPlan(batches_per_epoch=0, accumulation=2)


@pytest.mark.timeout(30)
def test_loss_ledger_averages_over_the_logging_interval_and_travels() -> None:
    ledger = LossLedger()
    for loss in (1.0, 2.0, 3.0):
        ledger.add(loss)
    assert ledger.drain(global_step=3) == 2.0 and ledger.last_logged == 3
    ledger.add(5.0)
    received = LossLedger()
    received.load_state_dict(ledger.state_dict())
    assert received == ledger
    assert received.drain(global_step=4) == 5.0 and received.total_loss == 11.0


@pytest.mark.timeout(60)
def test_trainer_state_control_and_exportable_callbacks_travel_but_not_the_rank() -> None:
    from transformers import EarlyStoppingCallback, TrainerControl, TrainerState

    def make() -> tuple[TrainerState, TrainerControl, list[Any]]:
        early = EarlyStoppingCallback(early_stopping_patience=3)
        return TrainerState(), TrainerControl(), [early, object()]

    src_state, src_control, src_cbs = make()
    src_state.global_step, src_state.epoch, src_state.is_world_process_zero = 7, 1.5, True
    src_state.log_history.append({"loss": 2.5, "step": 7})
    src_control.should_training_stop = True
    src_cbs[0].early_stopping_patience_counter = 2
    carrier = TrainerStateCarrier(lambda: src_state, lambda: src_control, lambda: src_cbs)
    sent = carrier.state_dict()

    dst_state, dst_control, dst_cbs = make()
    dst_state.is_world_process_zero = False
    TrainerStateCarrier(lambda: dst_state, lambda: dst_control, lambda: dst_cbs).load_state_dict(sent)
    assert (dst_state.global_step, dst_state.epoch) == (7, 1.5)
    assert dst_state.log_history == [{"loss": 2.5, "step": 7}]
    assert dst_state.is_world_process_zero is False, "a rank's place in the job must not travel"
    assert dst_control.should_training_stop is True
    assert dst_cbs[0].early_stopping_patience_counter == 2
    src_state.log_history.append({"loss": 1.0, "step": 8})
    assert len(dst_state.log_history) == 1, "the received history must be a copy"

    with pytest.raises(ConfigError, match="same callbacks"):
        TrainerStateCarrier(lambda: dst_state, lambda: dst_control, lambda: []).load_state_dict(sent)


@pytest.mark.timeout(30)
def test_the_trainer_adoption_is_at_most_three_lines() -> None:
    """Computed from the example: the lines marked `# checkpointless` are the whole change from
    a plain Trainer script (the import and the class)."""
    text = (ROOT / "examples" / "hf_trainer.py").read_text()
    marked = [line for line in text.splitlines() if re.search(r"#\s*checkpointless\s*$", line)]
    assert len(marked) == 2, marked
    assert "import CheckpointlessTrainer" in marked[0] and "CheckpointlessTrainer(" in marked[1]


@pytest.mark.timeout(30)
def test_the_accelerate_adoption_is_at_most_five_lines() -> None:
    """The import, the class, the protected evaluation and end_training(): the loop itself does
    not change."""
    text = (ROOT / "examples" / "hf_accelerate.py").read_text()
    marked = [line for line in text.splitlines() if re.search(r"#\s*checkpointless\b", line)]
    assert len(marked) == 4, marked
    assert "import CheckpointlessAccelerator" in marked[0] and "CheckpointlessAccelerator(" in marked[1]
    assert "accelerator.protect(evaluate)" in marked[2] and "end_training()" in marked[3]


@pytest.mark.timeout(60)
def test_accelerate_save_and_load_state_are_refused_naming_the_alternative(tmp_path: Path) -> None:
    """Refused before anything is written, naming the launcher's durable checkpoints, and
    save_model for exporting the weights."""
    from checkpointless.integrations.hf_accelerate import CheckpointlessAccelerator

    acc = object.__new__(CheckpointlessAccelerator)  # the refusals need no job
    with pytest.raises(ConfigError, match=r"save_state\(\) is not supported") as saved:
        acc.save_state(str(tmp_path / "out"))
    assert "--checkpoint-dir" in str(saved.value) and "save_model" in str(saved.value)
    with pytest.raises(ConfigError, match=r"load_state\(\) is not supported") as loaded:
        acc.load_state(str(tmp_path / "out"))
    assert "--checkpoint-dir" in str(loaded.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(60)
def test_ddp_comes_through_trainers_and_accelerates_own_path() -> None:
    """Neither integration wraps the model itself: Trainer's ``_wrap_model`` and accelerate's
    ``prepare_model`` build torch's DDP over the job's group (the e2e jobs check its type), and
    accelerate's own ``unwrap_model`` takes it off."""
    from accelerate import Accelerator
    from transformers import Trainer

    from checkpointless.integrations.hf import CheckpointlessTrainer
    from checkpointless.integrations.hf_accelerate import CheckpointlessAccelerator

    assert CheckpointlessTrainer._wrap_model is Trainer._wrap_model
    assert CheckpointlessAccelerator.unwrap_model is Accelerator.unwrap_model


@pytest.mark.timeout(60)
def test_fsdp_and_deepspeed_through_training_arguments_are_refused_before_joining(tmp_path: Path) -> None:
    """Named with their values and what to do instead; raised before checkpointless.init(), so
    constructing the trainer here forms no job."""
    from torch import nn
    from transformers import TrainingArguments

    from checkpointless.integrations.hf import CheckpointlessTrainer

    def arguments(**kw: Any) -> Any:
        return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw)

    with pytest.raises(ConfigError) as fsdp:
        CheckpointlessTrainer(model=nn.Linear(2, 2), args=arguments(fsdp="full_shard"))
    assert "TrainingArguments(fsdp=True" in str(fsdp.value)
    assert "Leave fsdp unset" in str(fsdp.value) and "job.device_mesh" in str(fsdp.value)
    assert "On CPU, Trainer does not shard either" in str(fsdp.value)
    assert "DistributedType.MULTI_CPU" in str(fsdp.value)
    with pytest.raises(ConfigError, match=r"fsdp_config \{'version': 2\}"):
        CheckpointlessTrainer(
            model=nn.Linear(2, 2), args=arguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2})
        )
    from accelerate.parallelism_config import ParallelismConfig

    sharded = ParallelismConfig(dp_shard_size=2)
    with pytest.raises(ConfigError, match=r"parallelism_config=ParallelismConfig\(dp_shard_size=2\)") as pc:
        CheckpointlessTrainer(model=nn.Linear(2, 2), args=arguments(parallelism_config=sharded))
    assert "Leave parallelism_config unset" in str(pc.value)
    # TrainingArguments itself refuses deepspeed without the package, so set it afterwards
    args = arguments()
    args.deepspeed = {"zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError) as ds:
        CheckpointlessTrainer(model=nn.Linear(2, 2), args=args)
    assert "TrainingArguments(deepspeed={'zero_optimization': {'stage': 2}})" in str(ds.value)
    assert "Leave deepspeed unset" in str(ds.value)
    with pytest.raises(ConfigError, match="auto_find_batch_size=True"):
        CheckpointlessTrainer(model=nn.Linear(2, 2), args=arguments(auto_find_batch_size=True))


# One process of a CPU job as torchrun starts it (a rank, a gloo world of 1): accelerate's MULTI_CPU
_FSDP_ON_CPU_PROBE = """
import json
from torch import nn
from transformers import Trainer, TrainingArguments
args = TrainingArguments(output_dir=".", use_cpu=True, report_to="none", fsdp=True,
                         fsdp_config={"version": 2})
trainer = Trainer(model=nn.Linear(2, 2), args=args)
print(json.dumps({"asked": args.fsdp_plugin_args["fsdp_version"],
                  "type": trainer.accelerator.distributed_type.name,
                  "fsdp": trainer.is_fsdp_enabled}))
"""


@pytest.mark.timeout(120)
def test_trainer_does_not_shard_on_cpu_with_the_pinned_accelerate(tmp_path: Path) -> None:
    """Why FSDP through TrainingArguments is refused rather than supported on CPU: Trainer asks
    for accelerate's FSDP2 plugin, and accelerate drops it on a multi-process CPU job, so Trainer
    trains DDP (docs/adoption.md, "Hugging Face"). A release that shards on CPU fails here: then
    the refusal in integrations/_hf_settings.py should become support."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        **{"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
        **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "HF_HUB_OFFLINE": "1"},
    }
    done = subprocess.run(
        [sys.executable, "-c", _FSDP_ON_CPU_PROBE],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"asked": 2, "type": "MULTI_CPU", "fsdp": False}, seen
