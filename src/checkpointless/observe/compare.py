"""What checkpoint-restart would have cost for the same faults: an estimate, not a measurement.

The model is the simulator's (``simulate.models.restart_phases`` and Young's interval), fed with
this job's own numbers: its measured step time, its state size, its first step's warm-up, and how
often it actually faulted. The fixed costs of a restart (process start and imports, communicator
start, checkpoint load, save) default to what ``benchmarks/recovery.py`` measured for torchrun on
one machine (``benchmarks/results/calibration.json``); ``--calibration FILE`` replaces them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from checkpointless.observe.ledger import Ledger
from checkpointless.simulate.calibration import Calibration
from checkpointless.simulate.models import (
    IntervalRule,
    checkpoint_interval,
    restart_phases,
    save_cost_s,
)
from checkpointless.simulate.topology import JobShape

__all__ = ["ONE_MACHINE", "RestartEstimate", "estimate_restart"]

# torchrun on this repository's benchmark machine (benchmarks/results/calibration.json):
# detection of a dead rank, tearing the group down, process start + imports + model/DDP/AdamW
# build, process-group start-up, a torch.distributed.checkpoint load and a blocking save. The
# data loader maps a token file, so its cold start is taken as free.
ONE_MACHINE = Calibration(
    detect_s=0.6103,
    requeue_s=0.2467,
    restart_s=5.5169,
    init_s=0.506,
    load_s=0.3499,
    save_s=0.1405,
    restart_data_s=0.0,
    restart_first_step_s=0.0,
)


@dataclass(frozen=True)
class RestartEstimate:
    interval_s: float  # compute time between checkpoints (Young's optimum for this job)
    interval_steps: int
    per_fault_s: list[float]  # detection + restart phases + half an interval of lost work
    phases: dict[str, float]  # one restart's phases by label (seconds)
    lost_work_s: float  # per fault, on average
    save_overhead_s: float  # blocking saves over the whole run
    wall_s: float  # the same job's estimated wall time under checkpoint-restart
    goodput: float


def estimate_restart(
    ledger: Ledger, cal: Calibration = ONE_MACHINE, interval_steps: int | None = None
) -> RestartEstimate | None:
    """The same productive work and faults under checkpoint-restart; None without a step time."""
    step = ledger.step_time_s
    if step is None or step <= 0:
        return None
    warmup = max(0.0, (ledger.first_step_s or step) - step)
    cal = replace(cal, restart_first_step_s=cal.restart_first_step_s or warmup)
    nproc = max(1, ledger.nproc)
    shape = JobShape(
        gpus=nproc,
        gpus_per_node=nproc,
        replicas=1,
        dp_replica_gpus=nproc,  # the run's machine is one node and one replica
        step_s=step,
        checkpoint_gb=max(ledger.state_bytes, 1.0) / 1e9,
    )
    save = save_cost_s(shape, cal)
    faults = len(ledger.faults)
    productive = ledger.totals["productive"]
    if interval_steps is not None:
        interval = max(1, interval_steps) * step
    else:
        # the observed fault rate stands in for the MTBF; without faults, save rarely
        mtbf = ledger.wall_s / faults if faults else max(ledger.wall_s, step) * 10
        interval = checkpoint_interval(IntervalRule.YOUNG, save, max(mtbf, 1e-6), step)
    phases = {p.label: p.seconds for p in restart_phases(shape, cal, 0.0)}
    lost = interval / 2.0
    per_fault = []
    for f in ledger.faults:
        # the same detector for a hang (a timeout either way); torchrun's own for an exit
        detect = f.phases.get("detection", 0.0) if "hang" in f.causes else cal.detect_s
        per_fault.append(detect + sum(phases.values()) + lost)
    saves = math.floor(productive / interval) * save
    wall = ledger.wall_s - sum(f.total_s for f in ledger.faults) + sum(per_fault) + saves
    return RestartEstimate(
        interval_s=interval,
        interval_steps=round(interval / step),
        per_fault_s=per_fault,
        phases=phases,
        lost_work_s=lost,
        save_overhead_s=saves,
        wall_s=wall,
        goodput=productive / wall if wall > 0 else 0.0,
    )
