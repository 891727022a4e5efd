"""Lightning Fabric under checkpointless: ``Fabric(strategy=CheckpointlessFabricStrategy())``.

Fabric leaves the training loop to the script, so this fits the core as a plain PyTorch script
does: the loop is ``job.steps()``, and the strategy only makes Fabric's distributed parts the
job's.

- ``__init__`` joins the job (``checkpointless.init()``; a hot spare blocks there until it is
  given a rank), and the cluster environment reports the job's rank and world size, so Fabric's
  rank-zero helpers and the ``DistributedSampler`` that ``setup_dataloaders`` injects see the
  right numbers whatever ``devices`` says.
- Fabric does not make a process group of its own: ``init()`` has made torch's default group, a
  resilient one, and Fabric's collectives (``fabric.all_reduce``, ``barrier``, ``broadcast``) run
  on it.
- ``setup_module`` wraps the model in the job's abortable ``DataParallel`` instead of DDP.
- :meth:`~CheckpointlessFabricStrategy.loader` makes the ``DataLoader`` that
  ``fabric.setup_dataloaders`` returns step-addressable, as ``job.loader()`` does a plain one.

What the script adds, beyond Fabric's own calls: track the model and optimizer, and run the loop
as ``for step in job.steps(N): with step: ...`` (docs/adoption.md, "Lightning Fabric").
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.strategies.ddp import DDPStrategy
from torch import nn

import checkpointless
from checkpointless.integrations._lightning_environment import CheckpointlessEnvironment
from checkpointless.integrations._lightning_state import warn_if_untested
from checkpointless.recovery.job import Job
from checkpointless.recovery.loader import StepLoader
from checkpointless.recovery.stateful_loader import StatefulStepLoader

__all__ = ["CheckpointlessFabricStrategy"]


class CheckpointlessFabricStrategy(DDPStrategy):
    """Data parallel under Fabric that survives faults in process. ``rendezvous_timeout`` and
    ``max_step_retries`` are passed to ``checkpointless.init()``; :attr:`job` is the job, whose
    ``steps()`` the script's loop runs."""

    def __init__(self, *, rendezvous_timeout: float = 60.0, max_step_retries: int = 3, **kwargs: Any) -> None:
        warn_if_untested("CheckpointlessFabricStrategy")
        # join at construction: a spare then waits before the script builds anything, and
        # Fabric's rank-zero helpers see the real rank from the start
        self.job: Job = checkpointless.init(
            rendezvous_timeout=rendezvous_timeout, max_step_retries=max_step_retries
        )
        super().__init__(cluster_environment=CheckpointlessEnvironment(self.job), **kwargs)

    @property
    def root_device(self) -> torch.device:
        return self.job.device

    @property
    def num_processes(self) -> int:
        # the launcher's ranks, not Fabric's `devices` (which would be 1 on a CPU by default)
        return self.job.world_size

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.job.world_size, "rank": self.job.rank}

    def _setup_distributed(self) -> None:
        # torch's default group is the job's (made by init()): Fabric must not make another one,
        # which no recovery could abort or re-form
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        rank_zero_only.rank = self.job.rank  # type: ignore[attr-defined]
        self._process_group_backend = "nccl" if self.job.device.type == "cuda" else "gloo"

    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]
        return self.job.data_parallel(module)

    def loader(self, dataloader: Any) -> StepLoader | StatefulStepLoader:
        """``job.loader()`` for what ``fabric.setup_dataloaders`` returns: the ``DataLoader`` it
        made (with the ``DistributedSampler`` it injected), step-addressable. Its batches stay
        where the dataset puts them: move them to ``fabric.device`` in the step on a GPU."""
        # Fabric's wrapper keeps the loader it made in `_dataloader` (lightning 2.6), its only
        # other work being the device move and the sampler's epoch, which job.loader does itself
        inner = getattr(dataloader, "_dataloader", dataloader)
        return self.job.loader(inner)
