"""The ``TrainingArguments`` that ``CheckpointlessTrainer`` refuses, checked before it joins the job.

Each refusal names the setting, its value and what to do instead, and comes before
``checkpointless.init()``: a script with a setting the integration cannot honour stops at once,
on every rank, without forming a job first. What only Trainer's set-up reveals (its default
arguments, accelerate's own configuration, the GPUs one process drives) is checked after it.
"""

from __future__ import annotations

from typing import Any

from checkpointless.errors import ConfigError

__all__ = ["refuse_unsupported", "refuse_unsupported_setup"]

_SHARDED = (
    "CheckpointlessTrainer trains the model replicated, data-parallel under the job's abortable "
    "DataParallel, and does not support sharding through TrainingArguments yet"
)
_FSDP2_INSTEAD = (
    "for a model too big for one rank, write the loop with job.device_mesh and torch's fully_shard "
    "(docs/adoption.md, 'Sharded models: FSDP2 and HSDP')"
)


def refuse_unsupported(args: Any) -> None:
    """Raise a :class:`ConfigError` for a ``TrainingArguments`` setting the integration cannot honour."""
    if args.deepspeed:
        raise ConfigError(
            f"TrainingArguments(deepspeed={args.deepspeed!r}): {_SHARDED}. Leave deepspeed unset "
            f"(None) to train replicated; {_FSDP2_INSTEAD}"
        )
    if args.fsdp:
        config = {k: v for k, v in (args.fsdp_config or {}).items() if k in ("version", "fsdp_version")}
        raise ConfigError(
            f"TrainingArguments(fsdp={args.fsdp!r}, fsdp_config {config or 'default'}): {_SHARDED}. "
            f"Leave fsdp unset (fsdp=False, no fsdp_config) to train replicated; {_FSDP2_INSTEAD}"
        )
    if args.auto_find_batch_size:
        raise ConfigError(
            "TrainingArguments(auto_find_batch_size=True) is not supported by CheckpointlessTrainer: "
            "it restarts training with a smaller batch after an out-of-memory error, which a job "
            "cannot follow; set per_device_train_batch_size yourself"
        )


def refuse_unsupported_setup(trainer: Any) -> None:
    """After Trainer's set-up: its arguments again (the defaults it filled in, or changed since),
    DeepSpeed or FSDP enabled through accelerate's configuration, and one process driving several
    GPUs."""
    refuse_unsupported(trainer.args)
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        raise ConfigError(
            "accelerate's configuration enables DeepSpeed or FSDP, which CheckpointlessTrainer "
            "does not support yet: it trains data-parallel; unset them (ACCELERATE_USE_FSDP, "
            "ACCELERATE_USE_DEEPSPEED, `accelerate config`)"
        )
    if trainer.args.n_gpu > 1:
        raise ConfigError(
            "one process drives several GPUs (nn.DataParallel): run one rank per GPU with "
            "`checkpointless run --nproc N` instead"
        )
