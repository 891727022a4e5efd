"""Degraded HSDP (issue 39): a replicate group whose every member is this process.

When an HSDP job on a (2, S) mesh loses a rank and no spare is ready, the plan of
``coordinator/rules/mesh_width.py`` lets the lost rank's whole replica group leave: each survivor
(replica g, shard s) also trains the lost group's micro-batch of the same shard coordinate, as a
second pass of the step (docs/fault-model.md, "Degraded mode on a mesh"). The survivor is then
both members of its group along the replicate dimension, {(0, s), (1, s)}.

FSDP2 reduces an HSDP gradient in two stages: a reduce-scatter inside the shard group, then an
all-reduce over the replicate group (``ReduceOp.AVG`` for an fp32 or bf16 reduce dtype; SUM with
its own pre/post division otherwise). The held pass runs in the survivor's own shard group, whose
other members hold the same replica's other shards, so its reduce-scatter is the one the lost
group would have made. With :func:`~checkpointless.comm.mesh.hold_replica_reduce` FSDP2 keeps
each earlier pass's reduce-scattered gradient (``set_requires_all_reduce(False)``) and adds it to
the last pass's before the all-reduce: the tensor handed to the replicate all-reduce is then
already the sum over both replicas. A folded group completes that all-reduce locally: SUM leaves
the tensor as it is, AVG divides it by the group's size, as gloo's AVG divides the sum.

Why this is bitwise: the full-width job's all-reduce of two replicas computes ``r0 + r1`` (one
addition, commutative in IEEE arithmetic), the folded one ``r1 + r0``; the division that follows
is the same. With three or more replica groups the association of the sum would differ, which is
why the rule folds only two (``mesh_width.py``).

Only FSDP2's own all-reduce is finished this way (:func:`called_by_fsdp` looks for FSDP2's reduce
on the calling stack). Any other collective on a folded group raises, an all-reduce the script
issues itself included: its other members' parts would come from passes that have not run, so
it is refused in degraded mode, never answered with this process's part alone.
"""

from __future__ import annotations

import inspect
from types import FrameType

import torch
import torch.distributed as dist

from checkpointless.errors import ConfigError

__all__ = ["called_by_fsdp", "fold_all_reduce", "folded_refusal"]

# where FSDP2 issues its HSDP all-reduce (torch 2.11 and 2.13): the module and the function
_FSDP_REDUCE = ("_fsdp_collectives.py", "foreach_reduce")


def called_by_fsdp(depth: int = 12) -> bool:
    """Whether FSDP2's gradient reduce is among the ``depth`` innermost callers: the one
    all-reduce whose tensor already sums every replica pass (c10d's ``all_reduce`` and its
    logging wrapper sit between it and the group)."""
    here = inspect.currentframe()
    frame: FrameType | None = here.f_back if here is not None else None
    for _ in range(depth):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == _FSDP_REDUCE[1] and code.co_filename.endswith(_FSDP_REDUCE[0]):
            return True
        frame = frame.f_back
    return False


def fold_all_reduce(tensors: list[torch.Tensor], op: object, size: int, key: str) -> None:
    """Finish an all-reduce over a folded group of ``size`` members in place: each tensor
    already holds the sum of every member's part (FSDP2's accumulated replica passes). Any
    other caller's all-reduce is refused (ConfigError)."""
    if not called_by_fsdp():
        raise ConfigError(folded_refusal(key))
    if op == dist.ReduceOp.SUM:
        return
    if op == dist.ReduceOp.AVG:
        with torch.no_grad():
            for t in tensors:
                t.div_(size)
        return
    raise ConfigError(
        f"all-reduce with {op} on the folded replicate group {key} (degraded HSDP): only FSDP2's "
        "SUM or AVG of its accumulated replica passes can be finished locally; reduce over the "
        "shard group instead, or run with a spare ready (--spares) so the job stays at full width"
    )


def folded_refusal(key: str) -> str:
    """The error for any collective but FSDP2's all-reduce on a folded group."""
    return (
        f"a collective on the folded replicate group {key} (degraded HSDP: this process holds every "
        "member of it, and the other members' parts come from passes still to run); only FSDP2's "
        "own gradient all-reduce is supported there in degraded mode (docs/fault-model.md)"
    )
