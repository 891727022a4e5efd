"""Goodput at scale: a discrete-event simulation of checkpoint-restart versus checkpointless.

Modules, one concept each: ``calibration`` (per-event costs, JSON loading), ``topology`` (job
shape, where state copies live), ``failures`` (fault rates and causes, seeded traces),
``capacity`` (spare hosts, repairs, quarantine, the no-spare policy and degraded width),
``plans`` (recovery, shrink and grow plans), ``models`` (checkpoint intervals and the closed
form), ``des`` (the event simulation), ``report`` (sweeps and what-if cases), ``render``
(tables, JSON, plot) and ``command`` (the command line, :func:`main`).
"""

from __future__ import annotations

from checkpointless.simulate.calibration import Calibration, CommModel, load_calibration
from checkpointless.simulate.capacity import CapacityPolicy, NoSparePolicy
from checkpointless.simulate.command import main
from checkpointless.simulate.des import RunResult, SimConfig, simulate_run
from checkpointless.simulate.failures import FailureCause, FailureModel, Fault, sample_faults
from checkpointless.simulate.models import Bucket, IntervalRule, Policy, daly_interval, young_interval
from checkpointless.simulate.topology import JobShape

__all__ = [
    "Bucket",
    "Calibration",
    "CapacityPolicy",
    "CommModel",
    "FailureCause",
    "FailureModel",
    "Fault",
    "IntervalRule",
    "JobShape",
    "NoSparePolicy",
    "Policy",
    "RunResult",
    "SimConfig",
    "daly_interval",
    "load_calibration",
    "main",
    "sample_faults",
    "simulate_run",
    "young_interval",
]
