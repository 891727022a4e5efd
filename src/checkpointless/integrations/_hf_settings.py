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
    "CheckpointlessTrainer trains the model replicated, data-parallel under torch's "
    "DistributedDataParallel, and does not support sharding through TrainingArguments yet"
)
# Found with transformers 5.25.0 and accelerate 1.16.0 (docs/adoption.md, "Hugging Face"): on CPU
# Trainer's fsdp settings shard nothing, so refusing them costs a CPU user no sharding; on a GPU
# they would shard, which the integration's state transfer does not handle yet.
_FSDP_ON_CPU = (
    "On CPU, Trainer does not shard either: accelerate (1.16.0) turns FSDP on only for accelerator "
    "devices (AcceleratorState.__init__ leaves DistributedType.MULTI_CPU out of that list), so the "
    "FSDP plugin Trainer builds from these settings is dropped without a warning and Trainer trains "
    "the model replicated under DistributedDataParallel"
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
            f"{_FSDP_ON_CPU}. Leave fsdp unset (fsdp=False, no fsdp_config) to train replicated; "
            f"{_FSDP2_INSTEAD}"
        )
    sizes = _model_parallel_sizes(getattr(args, "parallelism_config", None))
    if sizes:
        shown = ", ".join(f"{name}={size}" for name, size in sizes.items())
        raise ConfigError(
            f"TrainingArguments(parallelism_config=ParallelismConfig({shown})): {_SHARDED}; on CPU "
            "accelerate refuses it too (a ValueError from ParallelismConfig._validate_accelerator: "
            "it needs FSDP2 or an accelerator device). Leave parallelism_config unset (None) to "
            f"train replicated; {_FSDP2_INSTEAD}"
        )
    if args.auto_find_batch_size:
        raise ConfigError(
            "TrainingArguments(auto_find_batch_size=True) is not supported by CheckpointlessTrainer: "
            "it restarts training with a smaller batch after an out-of-memory error, which a job "
            "cannot follow; set per_device_train_batch_size yourself"
        )


def _model_parallel_sizes(config: Any) -> dict[str, int]:
    """The sizes above 1 of an accelerate ``ParallelismConfig`` other than plain replication."""
    if config is None:
        return {}
    names = ("dp_shard_size", "tp_size", "cp_size", "sp_size")
    return {name: size for name in names if (size := getattr(config, name, None) or 1) > 1}


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
