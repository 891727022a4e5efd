"""The shape of the simulated job and cluster, and where copies of the training state live.

Placement rule (an assumption, written down in docs/goodput.md): the job's nodes are split into
``replicas`` equal groups; node ``i`` of group ``g`` holds the same state shard as node ``i`` of
every other group. A set of failed nodes therefore destroys a shard only when it contains that
shard's node in *every* group; then no healthy peer can send the state and the job must go back
to a checkpoint. A fault confined to one node never does this when there are two or more
replicas; a switch that serves more nodes than one group holds (a small job) can.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from checkpointless.errors import ConfigError

__all__ = ["JobShape", "spans_all_replicas", "switch_block", "switch_fallback_fraction"]


@dataclass(frozen=True)
class JobShape:
    """Size and layout of the job, the training state it carries and the spare pool."""

    gpus: int = 2304  # the size of AWS's published HyperPod example
    gpus_per_node: int = 8
    replicas: int = 2  # copies of every state shard (HyperPod keeps two optimizer instances)
    switch_nodes: int = 16  # nodes behind one leaf switch: the blast radius of a switch fault
    step_s: float = 6.0  # one training step (a 405B-class model at ~16M tokens per step)
    checkpoint_gb: float = 1120.0  # one full copy of the state: 70B parameters x 16 bytes (Adam)
    hbm_gb: float = 80.0  # a GPU cannot hold more state than its memory (H100 80GB)
    spare_nodes: int | None = None  # None: derived from spare_fraction
    spare_fraction: float = 0.02  # hot spare nodes as a share of the job's nodes (at least one)
    replace_s: float = 3600.0  # a failed node is repaired or replaced and back in the pool
    # GPUs of one data-parallel replica: the unit that degraded mode drops when a host is lost and
    # no spare is ready. Llama 3 405B trained on 16,384 GPUs as TP 8 x PP 16 x DP 128, so one
    # replica is 8 x 16 = 128 GPUs (16 nodes).
    dp_replica_gpus: int = 128

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.replicas < 1 or self.switch_nodes < 1:
            raise ConfigError(
                f"gpus_per_node={self.gpus_per_node}, replicas={self.replicas}, "
                f"switch_nodes={self.switch_nodes} must all be >= 1"
            )
        unit = self.gpus_per_node * self.replicas
        if self.gpus < unit or self.gpus % unit:
            raise ConfigError(
                f"gpus={self.gpus} must be a positive multiple of gpus_per_node x replicas = {unit} "
                f"(whole nodes, equal replica groups); e.g. {max(unit, self.gpus // unit * unit)}"
            )
        for name in ("step_s", "checkpoint_gb", "hbm_gb", "replace_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name}={value} must be a finite number > 0")
        if not 0.0 <= self.spare_fraction <= 1.0:
            raise ConfigError(f"spare_fraction={self.spare_fraction} must lie in [0, 1]")
        if self.dp_replica_gpus < self.gpus_per_node or self.dp_replica_gpus % self.gpus_per_node:
            raise ConfigError(
                f"dp_replica_gpus={self.dp_replica_gpus} must be a positive multiple of "
                f"gpus_per_node={self.gpus_per_node} (a replica is whole nodes)"
            )
        if self.spare_nodes is not None and self.spare_nodes < 0:
            raise ConfigError(f"spare_nodes={self.spare_nodes} must be >= 0 (or None to derive it)")

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def nodes_per_replica(self) -> int:
        return self.nodes // self.replicas

    @property
    def dp_group_nodes(self) -> int:
        """Nodes of one data-parallel replica (a job smaller than one replica is one replica)."""
        return min(self.dp_replica_gpus // self.gpus_per_node, self.nodes)

    @property
    def dp_width(self) -> float:
        """Data-parallel replicas at full width (fractional when the job is not whole replicas)."""
        return self.nodes / self.dp_group_nodes

    @property
    def spares(self) -> int:
        """Hot spare nodes at the start of the run."""
        if self.spare_nodes is not None:
            return self.spare_nodes
        return max(1, math.ceil(self.nodes * self.spare_fraction))

    @property
    def state_gb_per_gpu(self) -> float:
        """State one GPU holds, and so receives after a swap: ``replicas`` copies spread over N.

        For small N this exceeds any real GPU's memory (the default model would not fit), so it
        is capped at ``hbm_gb``: the most a replaced GPU could ever have to receive.
        """
        return min(self.hbm_gb, self.replicas * self.checkpoint_gb / self.gpus)


def switch_block(shape: JobShape, index: int) -> tuple[int, ...]:
    """The nodes behind switch ``index`` (aligned blocks; the last one may be partial)."""
    start = index * shape.switch_nodes
    return tuple(range(start, min(start + shape.switch_nodes, shape.nodes)))


def spans_all_replicas(nodes: Iterable[int], shape: JobShape) -> bool:
    """True when the failed ``nodes`` include every copy of at least one state shard."""
    per_group = shape.nodes_per_replica
    positions = Counter(n % per_group for n in set(nodes))
    return any(count >= shape.replicas for count in positions.values())


def switch_fallback_fraction(shape: JobShape) -> float:
    """Share of switch faults (uniform over switches) that destroy every copy of some shard."""
    blocks = math.ceil(shape.nodes / shape.switch_nodes)
    hit = sum(spans_all_replicas(switch_block(shape, b), shape) for b in range(blocks))
    return hit / blocks
