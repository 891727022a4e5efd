"""What fails, how often, how it is noticed and how much of the job it takes down.

The rate and the mix of causes come from the Llama 3 report (Meta, 2024): 419 unexpected
interruptions in 54 days of pre-training on 16,384 H100 GPUs, with a table of root causes. Faults
are assumed independent per GPU, so the job-level rate is the per-GPU-hour rate times N and
inter-arrival times are exponential. The grouping of the report's causes into the categories
below (and the split of two of them) is ours; docs/goodput.md lists it line by line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import numpy as np

from checkpointless.errors import ConfigError
from checkpointless.simulate.topology import JobShape, switch_block

__all__ = [
    "BAD_REPAIR_FRACTION",
    "LLAMA3_CAUSES",
    "LLAMA3_RATE_PER_GPU_HOUR",
    "META_RSC_RATE_PER_GPU_HOUR",
    "Blast",
    "Detection",
    "FailureCause",
    "FailureModel",
    "Fault",
    "sample_faults",
]

# 419 interruptions / (54 days x 24 h x 16,384 GPUs): about one per 50,700 GPU-hours.
LLAMA3_RATE_PER_GPU_HOUR = 419 / (54 * 24 * 16384)
# Meta's research clusters: job mean time to failure of 7.9 h at 1,024 GPUs (a harsher rate,
# about 6x Llama 3's, used as a sensitivity case).
META_RSC_RATE_PER_GPU_HOUR = 1 / (7.9 * 1024)


class Blast(str, Enum):
    """How much of the job one fault takes down."""

    GPU = "gpu"  # one GPU; the node is swapped because spares come as whole nodes
    NODE = "node"  # one server
    SWITCH = "switch"  # every node behind one leaf switch
    JOB = "job"  # every rank at once (software); no node is lost, no state is destroyed


class Detection(str, Enum):
    """How a fault is noticed."""

    FAST = "fast"  # a process exits or raises: seen within ``detect_s``
    HANG = "hang"  # nothing exits; only a watchdog timeout (``hang_timeout_s``) notices


@dataclass(frozen=True)
class FailureCause:
    """One category of fault with its weight in the observed mix."""

    name: str
    weight: float  # interruptions of this kind in the Llama 3 run (shares are weight / total)
    blast: Blast
    detection: Detection = Detection.FAST
    # Only for JOB faults: the bug lives in process state (a leak, a corrupted cache) and fires
    # again if the same processes re-run the step; a fresh process start clears it. So an
    # in-process retry fails and checkpointless must fall back to a restart.
    recurring: bool = False


# Grouping of the report's 419 interruptions (its table's counts, which sum to 419).
LLAMA3_CAUSES: tuple[FailureCause, ...] = (
    # faulty GPU 148, HBM3 72, SRAM 19, GPU system processor 17, silent data corruption 6,
    # thermal interface/sensor 6
    FailureCause("gpu", 268, Blast.GPU),
    # host maintenance 32, SSD 3, power supply 3, chassis 2, IO board 2, CPU 2, system memory 2
    FailureCause("host", 46, Blast.NODE),
    FailureCause("nic", 7, Blast.NODE),
    # network switch/cable 35: we assume half are a cable or port (one node) and half a whole
    # switch; the report does not split them.
    FailureCause("network-link", 17.5, Blast.NODE),
    FailureCause("network-switch", 17.5, Blast.SWITCH),
    FailureCause("nccl-hang", 7, Blast.NODE, Detection.HANG),
    # software bugs 54: we assume half recur in the same processes (see ``recurring``).
    FailureCause("software-transient", 27, Blast.JOB),
    FailureCause("software-recurring", 27, Blast.JOB, recurring=True),
    FailureCause("dependency", 2, Blast.JOB),
)


# **Assumption** (no published figure found): share of repairs after which the host comes back
# still faulty. Such a host fails again as soon as it trains, unless a health check quarantines
# it first. Varied 0 ... 20% in the sensitivity table.
BAD_REPAIR_FRACTION = 0.05


@dataclass(frozen=True)
class FailureModel:
    """The job's fault process: a per-GPU rate, a mix of causes, and how often repairs fail."""

    rate_per_gpu_hour: float = LLAMA3_RATE_PER_GPU_HOUR
    causes: tuple[FailureCause, ...] = LLAMA3_CAUSES
    bad_repair_fraction: float = BAD_REPAIR_FRACTION

    def __post_init__(self) -> None:
        if not math.isfinite(self.rate_per_gpu_hour) or self.rate_per_gpu_hour <= 0:
            raise ConfigError(
                f"rate_per_gpu_hour={self.rate_per_gpu_hour} must be > 0; the Llama 3 figure is "
                f"{LLAMA3_RATE_PER_GPU_HOUR:.3g}"
            )
        if not self.causes or any(c.weight < 0 for c in self.causes) or self.total_weight <= 0:
            raise ConfigError("causes must be a non-empty list with weights >= 0 and a positive sum")
        if any(c.recurring and c.blast is not Blast.JOB for c in self.causes):
            raise ConfigError("only JOB-wide causes can be 'recurring'; set recurring=False for the others")
        if not 0.0 <= self.bad_repair_fraction < 1.0:
            raise ConfigError(
                f"bad_repair_fraction={self.bad_repair_fraction} must lie in [0, 1); e.g. {BAD_REPAIR_FRACTION}"
            )

    @property
    def total_weight(self) -> float:
        return sum(c.weight for c in self.causes)

    def shares(self) -> list[float]:
        total = self.total_weight
        return [c.weight / total for c in self.causes]

    def host_fault_cause(self) -> int:
        """Index of the cause charged when a faulty host fails again: the one-GPU (else one-node) kind."""
        for blast in (Blast.GPU, Blast.NODE):
            for i, c in enumerate(self.causes):
                if c.blast is blast:
                    return i
        return 0

    def job_mtbf_s(self, gpus: int) -> float:
        """Mean time between faults of a job on ``gpus`` GPUs, in seconds."""
        return 3600.0 / (self.rate_per_gpu_hour * gpus)


@dataclass(frozen=True)
class Fault:
    """One fault of a sampled trace."""

    time_s: float
    cause: int  # index into FailureModel.causes
    nodes: tuple[int, ...]  # nodes whose GPUs (and state) are lost; empty for JOB faults
    # Uniform draw for the repair of these nodes: it comes back faulty when below the model's
    # ``bad_repair_fraction`` q (then ``repair_u / q`` is again uniform and decides the next repair).
    repair_u: float = 1.0


def sample_faults(model: FailureModel, shape: JobShape, horizon_s: float, seed: int) -> list[Fault]:
    """A seeded trace of faults in ``[0, horizon_s)``.

    Times, causes, places and repair outcomes come from four independent streams, and the k-th
    fault always uses the k-th draw of each. So two traces with the same seed and different rates have the same
    sequence of causes and places, with times scaled by the rate ratio: comparisons across
    rates (and across recovery policies, which share one trace) differ only by what is varied.
    """
    if not math.isfinite(horizon_s) or horizon_s <= 0:
        raise ConfigError(f"horizon_s={horizon_s} must be a finite number > 0")
    # spawn(4): the first three children are those of spawn(3), so earlier traces are unchanged
    times_rng, cause_rng, place_rng, repair_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4)
    )
    mean_gap = model.job_mtbf_s(shape.gpus)
    shares = np.asarray(model.shares())
    switches = math.ceil(shape.nodes / shape.switch_nodes)
    faults: list[Fault] = []
    t = 0.0
    while True:
        t += float(times_rng.exponential(mean_gap))
        if t >= horizon_s:
            return faults
        idx = int(cause_rng.choice(len(shares), p=shares))
        u = float(place_rng.random())
        blast = model.causes[idx].blast
        if blast is Blast.JOB:
            nodes: tuple[int, ...] = ()
        elif blast is Blast.SWITCH:
            nodes = switch_block(shape, int(u * switches))
        else:
            nodes = (int(u * shape.nodes),)
        faults.append(Fault(t, idx, nodes, float(repair_rng.random())))
