"""torch's own ``DistributedDataParallel`` on the job's resilient groups, through faults.

Where a framework builds the DDP itself (``transformers.Trainer`` and Accelerate's ``prepare``),
the integration lets it, and this module makes that DDP fit the job. Three things stand in the
way, each found with torch 2.13 (docs/adoption.md, "Hugging Face"):

- **Construction.** DDP's C++ logger reads the thread count of the group's gloo backend
  (``getBackend(GLOO)``), and a :class:`~checkpointless.comm.process_group.ResilientProcessGroup`
  has no c10d backend of its own (each generation's gloo group is held inside it): "Could not
  find backend type 1". :func:`serve_ddp` registers a one-rank gloo group under the ``meta``
  device, which only that lookup reaches; every collective still goes through the resilient group.
- **An aborted backward.** The reducer expects every backward it prepared to finish; after an
  exception or an aborted all-reduce mid-backward the next forward fails ("Expected to have
  finished reduction in the prior iteration", or an internal assert). :func:`reset_ddp` clears
  that state (``Reducer._reset_state``, the reset torch gives a reducer whose group changed).
- **One bucket layout everywhere.** Without ``find_unused_parameters`` a reducer regroups its
  buckets once, in the order gradients became ready in its first backward, and a reset asks for
  that again. A replacement's fresh DDP would reduce in its first layout while the survivors
  reduce in the regrouped one: the same bucket sizes for a small model, the elements in another
  order, so gradients would be summed with the wrong peers' ones, silently. :func:`fix_layout`
  regroups every DDP in parameter order (``_push_all_rebuilt_params``, DDP's static-graph path)
  at its first forward, and again at the first forward after each reset, on every rank at once:
  one layout, a function of the parameters, in every generation and every process. With
  ``find_unused_parameters`` (Trainer's default for a Hugging Face model) DDP never regroups, and
  its first layout is already such a function.

A fourth is the group's: an aborted all-reduce's future must fail in C++ too, or the reducer
reads its bucket out of the exception (``AbortableWork.get_future`` in comm/work.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from checkpointless.comm.process_group import ResilientProcessGroup
from checkpointless.errors import ConfigError

__all__ = ["fix_layout", "reset_ddp", "serve_ddp"]

# torch.device("meta") is never a collective's device: a backend registered under it is seen by
# getBackend(BackendType) lookups alone
_LOOKUP_ONLY = torch.device("meta")


def serve_ddp(group: Any) -> None:
    """Let torch's DDP be built on ``group``, a resilient group (idempotent, ~10 ms once);
    any other group (torchrun's own, or None) is left as it is."""
    if not isinstance(group, ResilientProcessGroup) or group.ddp_served:
        return
    opts = dist.ProcessGroupGloo._Options()
    opts._threads = 1
    # one rank: nothing connects; loopback, so a host without a resolvable name is no problem
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    solo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, opts)
    group._register_backend(_LOOKUP_ONLY, dist.ProcessGroup.BackendType.GLOO, solo)
    group.ddp_served = True


def fix_layout(ddp: DistributedDataParallel) -> None:
    """Make ``ddp`` regroup its buckets in parameter order at its next forward (see above).

    Raises:
        ConfigError: ``ddp`` was built with ``static_graph=True``, whose first iteration
            differs from the others: a replacement in its first step would reduce unlike the
            survivors."""
    if ddp.static_graph:
        raise ConfigError(
            "DistributedDataParallel(static_graph=True) cannot be recovered in process: its first "
            "iteration reduces differently from the later ones, and a replacement starts with a "
            "first one; leave it off (TrainingArguments(ddp_static_graph=None), or "
            "DistributedDataParallelKwargs(static_graph=False) for Accelerate)"
        )
    ddp.reducer._push_all_rebuilt_params()


def reset_ddp(ddp: DistributedDataParallel) -> None:
    """Forget what an abandoned forward or backward left in ``ddp``'s reducer, so that the
    step's replay (or the next step) runs it afresh, in the layout :func:`fix_layout` gives."""
    ddp.reducer._reset_state()
    fix_layout(ddp)
