"""What ``job.track()`` registered: the replica's state, and the objects the job drives.

Every tracked object travels to a replacement by name (``objects``); the job also drives some of
them by kind: the modules (FSDP2's state reset after an abandoned step, the divergence digest),
the optimizers (gradients dropped, the update guard's hooks), the grad scalers (their per-step
bookkeeping), the data-parallel wrappers, the job's own and torch's DDP where a framework built
one (their buckets reset), and the step loaders (closed at the end). :class:`Tracked` owns these lists; ``Job`` fills them and puts its hooks on what it adds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from checkpointless.comm.data_parallel import DataParallel
from checkpointless.comm.torch_ddp import fix_layout, reset_ddp
from checkpointless.errors import ConfigError
from checkpointless.recovery.amp import is_grad_scaler
from checkpointless.recovery.loader import StepLoader
from checkpointless.recovery.pipeline import is_schedule, restart_schedule
from checkpointless.recovery.rank_data import LoaderPositions
from checkpointless.recovery.sharded import local_stateful
from checkpointless.recovery.stateful_loader import StatefulStepLoader
from checkpointless.state.snapshot import Stateful, check_stateful

__all__ = ["Tracked"]


class Tracked:
    """The replica's state by name, and the modules, optimizers, scalers, wrappers and loaders."""

    def __init__(self) -> None:
        self.objects: dict[str, Stateful] = {}  # what travels to a replacement, by name
        self._names: dict[int, str] = {}  # id(object) -> its name in track()
        self.modules: list[nn.Module] = []
        self.dps: list[DataParallel] = []
        self.ddps: list[Any] = []  # torch's DistributedDataParallel (comm/torch_ddp.py)
        self.optimizers: list[torch.optim.Optimizer] = []
        self.scalers: list[Any] = []  # GradScalers: per-step bookkeeping reset on a restart
        self.loaders: list[StepLoader | StatefulStepLoader] = []
        # the stateful loaders' positions, per rank: kept with this rank's generator records
        self.positions = LoaderPositions()
        self.schedules: list[Any] = []  # pipeline schedules: restarted after an abandoned step

    def add(self, name: str, obj: Any) -> bool:
        """Track ``obj`` as ``name``; False when it is tracked under that name already.

        Raises:
            ConfigError: ``obj`` is tracked under another name, or has no state to track."""
        known = self._names.get(id(obj))
        if known == name:
            return False  # tracked already (data_parallel(..., optimizer=) tracks both)
        if known is not None:
            raise ConfigError(
                f"{name!r} is already tracked as {known!r} (data_parallel(..., optimizer=...) tracks "
                "the model as 'model' and the optimizer as 'optimizer'); track each object once"
            )
        self._names[id(obj)] = name
        if is_schedule(obj):  # no state of its own; names the pipeline (recovery/pipeline.py)
            self.schedules.append(obj)
            return True
        # a sharded module or optimizer travels as its local shards (recovery/sharded.py)
        self.objects[name] = local_stateful(check_stateful(name, obj))
        if isinstance(obj, nn.Module):
            self.modules.append(obj)
        if isinstance(obj, torch.optim.Optimizer):
            self.optimizers.append(obj)
        if is_grad_scaler(obj):
            self.scalers.append(obj)
        return True

    def add_ddp(self, ddp: Any) -> None:
        """Drive torch's ``DistributedDataParallel`` ``ddp`` (built by a framework on the job's
        group): one bucket layout in every generation, its reducer reset after an abandoned step.

        Raises:
            ConfigError: ``ddp`` cannot be recovered (``static_graph``: comm/torch_ddp.py)."""
        if any(d is ddp for d in self.ddps):
            return
        fix_layout(ddp)
        self.ddps.append(ddp)

    def drop_step(self, reset_mesh: Callable[[list[nn.Module]], None]) -> None:
        """What an abandoned step left: the wrappers' buckets, FSDP2's state (``reset_mesh``
        given the modules) and the gradients."""
        for dp in self.dps:
            dp.reset()
        for ddp in self.ddps:
            reset_ddp(ddp)
        reset_mesh(self.modules)
        for schedule in self.schedules:
            restart_schedule(schedule)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
