"""Runs the simulation over seeds, job sizes and what-if cases, into a :class:`Report`.

Both policies (and every variant) see the same fault traces for a given seed and job size
(common random numbers), so the differences between columns come from the policies, not from
luck in the draw.

Rendering a report (tables, markdown, JSON, the plot) is ``render.py``: it only reads a finished
:class:`Report`, and keeping it apart keeps the study free of presentation.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tqdm import tqdm

from checkpointless.simulate.calibration import CommModel
from checkpointless.simulate.capacity import AfterRetries, CapacityPolicy, DegradedDesign, NoSparePolicy
from checkpointless.simulate.des import SimConfig, simulate_run
from checkpointless.simulate.failures import META_RSC_RATE_PER_GPU_HOUR, sample_faults
from checkpointless.simulate.models import (
    BADPUT_BUCKETS,
    IntervalRule,
    Policy,
    analytic_goodput,
    policy_interval,
)

__all__ = [
    "CL",
    "CL_POLICY",
    "CL_POLICY_STORE",
    "CL_STORE",
    "CL_TODAY",
    "CR",
    "DEFAULT_GPUS",
    "SCALE_CASES",
    "SCALE_GPUS",
    "SENSITIVITY_CASES",
    "TODAY",
    "Report",
    "ScaleRow",
    "SensitivityRow",
    "Summary",
    "full_mesh",
    "run_report",
    "scale_study",
    "sensitivity",
    "store_based",
    "summarise",
    "sweep",
]

DEFAULT_GPUS: tuple[int, ...] = (16, 64, 256, 1024, 2304, 4096, 8192, 16384, 32768, 100000)
# the sizes of issue 39's targets, each under a few repair times (the scale table)
SCALE_GPUS: tuple[int, ...] = (2304, 16384, 100000)

CR = "checkpoint-restart"
# the model so far: a lost host with no spare ready waits for a repaired one, however long
CL = "checkpointless"
# the same with a store-based rebuild and restart (the launcher's --rendezvous tcp; this model's
# default until session 32)
CL_STORE = "checkpointless, store-based rebuild"
# the launcher before issue 39 (--when-no-spare fail): it waits --spare-wait (60 s) for a host,
# then the job fails
CL_TODAY = "checkpointless, fails when the spares run out"
# the policy chosen on the command line (default: shrink, grow back, health-checked admission)
CL_POLICY = "checkpointless, chosen policy"
CL_POLICY_STORE = "checkpointless, chosen policy, store-based rebuild"

TODAY = CapacityPolicy(NoSparePolicy.FAIL, spare_wait_s=60.0)


def store_based(c: SimConfig) -> SimConfig:
    """The launcher under ``--rendezvous tcp``: one TCPStore for every rebuild and restart."""
    return replace(
        c, cal=replace(c.cal, rebuild_model=CommModel.STORE_LINEAR, restart_model=CommModel.STORE_LINEAR)
    )


@dataclass(frozen=True)
class Summary:
    """Mean outcome of one (variant, job size) over the seeds."""

    variant: str
    policy: Policy
    gpus: int
    goodput_mean: float
    goodput_sd: float
    analytic: float
    interval_s: float
    faults_mean: float
    fallbacks_mean: float
    spare_waits_mean: float
    badput_share: dict[str, float]  # bucket -> share of wall time, mean over seeds
    shrinks_mean: float = 0.0
    grows_mean: float = 0.0
    quarantined_mean: float = 0.0
    bad_hosts_promoted_mean: float = 0.0
    min_replicas_seen: float = math.nan  # fewest replicas at work in any seed


def summarise(variant: str, policy: Policy, cfg: SimConfig, seeds: Sequence[int]) -> Summary:
    """Run ``cfg`` under ``policy`` once per seed and average."""
    runs = [
        simulate_run(cfg, policy, sample_faults(cfg.failures, cfg.shape, cfg.horizon_s, seed))
        for seed in seeds
    ]
    goodputs = [r.goodput for r in runs]
    cap = cfg.capacity if policy is Policy.CHECKPOINTLESS else None
    interval = policy_interval(
        policy, cfg.interval_rule, cfg.failures, cfg.shape, cfg.cal, cfg.max_interval_s, cap
    )
    return Summary(
        variant=variant,
        policy=policy,
        gpus=cfg.shape.gpus,
        goodput_mean=statistics.fmean(goodputs),
        goodput_sd=statistics.stdev(goodputs) if len(goodputs) > 1 else 0.0,
        analytic=analytic_goodput(policy, cfg.failures, cfg.shape, cfg.cal, interval, cap),
        interval_s=interval,
        faults_mean=statistics.fmean(r.faults for r in runs),
        fallbacks_mean=statistics.fmean(r.fallbacks for r in runs),
        spare_waits_mean=statistics.fmean(r.spare_waits for r in runs),
        badput_share={
            b.value: statistics.fmean(r.seconds[b] / r.wall_s for r in runs) for b in BADPUT_BUCKETS
        },
        shrinks_mean=statistics.fmean(r.shrinks for r in runs),
        grows_mean=statistics.fmean(r.grows for r in runs),
        quarantined_mean=statistics.fmean(r.quarantined for r in runs),
        bad_hosts_promoted_mean=statistics.fmean(r.bad_hosts_promoted for r in runs),
        min_replicas_seen=min(r.min_replicas_seen for r in runs),
    )


def _variants(cfg: SimConfig) -> list[tuple[str, Policy, SimConfig]]:
    """Every column; ``cfg.capacity`` is the chosen policy, the others are fixed references."""
    store = store_based(cfg)
    so_far, today = replace(cfg, capacity=CapacityPolicy()), replace(cfg, capacity=TODAY)
    return [
        (CR, Policy.CHECKPOINT_RESTART, cfg),
        (CL, Policy.CHECKPOINTLESS, so_far),
        (CL_STORE, Policy.CHECKPOINTLESS, replace(store, capacity=CapacityPolicy())),
        (CL_TODAY, Policy.CHECKPOINTLESS, today),
        (CL_POLICY, Policy.CHECKPOINTLESS, cfg),
        (CL_POLICY_STORE, Policy.CHECKPOINTLESS, store),
    ]


def sweep(base: SimConfig, gpus: Sequence[int], seeds: Sequence[int]) -> list[Summary]:
    """Goodput of every variant at every job size."""
    out: list[Summary] = []
    # a bar on a terminal only (disable=None): long sweeps show where they are, logs stay clean
    for n in tqdm(gpus, desc="simulate: job sizes", unit="size", disable=None, leave=False):
        cfg = replace(base, shape=replace(base.shape, gpus=n))
        out.extend(summarise(name, policy, c, seeds) for name, policy, c in _variants(cfg))
    return out


def _scale_rate(factor: float) -> Callable[[SimConfig], SimConfig]:
    def apply(c: SimConfig) -> SimConfig:
        return replace(
            c, failures=replace(c.failures, rate_per_gpu_hour=c.failures.rate_per_gpu_hour * factor)
        )

    return apply


def _cal(**changes: Any) -> Callable[[SimConfig], SimConfig]:
    return lambda c: replace(c, cal=replace(c.cal, **changes))


def _shape(**changes: Any) -> Callable[[SimConfig], SimConfig]:
    return lambda c: replace(c, shape=replace(c.shape, **changes))


def _all_bugs_recur(c: SimConfig) -> SimConfig:
    causes = tuple(
        replace(k, recurring=True) if k.name.startswith("software") else k for k in c.failures.causes
    )
    return replace(c, failures=replace(c.failures, causes=causes))


def _bad_repairs(fraction: float) -> Callable[[SimConfig], SimConfig]:
    return lambda c: replace(c, failures=replace(c.failures, bad_repair_fraction=fraction))


def _save_x(factor: float) -> Callable[[SimConfig], SimConfig]:
    # Scales both terms of the save cost, so the blocking time changes by exactly ``factor``.
    def apply(c: SimConfig) -> SimConfig:
        cal = replace(
            c.cal, save_s=c.cal.save_s * factor, storage_write_gbps=c.cal.storage_write_gbps / factor
        )
        return replace(c, cal=cal)

    return apply


def _state_x4(c: SimConfig) -> SimConfig:
    return replace(c, shape=replace(c.shape, checkpoint_gb=c.shape.checkpoint_gb * 4))


def full_mesh(c: SimConfig) -> SimConfig:
    """The launcher under ``CHECKPOINTLESS_GLOO_CONNECT=full``: every rank reads all N keys at
    each rebuild and restart (the model as built until gloo's lazy connection was made safe and
    the default, session 35)."""
    return _cal(rebuild_model=CommModel.ROOTLESS_MEASURED, restart_model=CommModel.ROOTLESS_MEASURED)(c)


def _fast_restart(c: SimConfig) -> SimConfig:
    return replace(c, cal=replace(c.cal, requeue_s=c.cal.requeue_s / 4, restart_s=c.cal.restart_s / 4))


# Each case changes one assumption of the base configuration (names say what and by how much).
SENSITIVITY_CASES: tuple[tuple[str, Callable[[SimConfig], SimConfig]], ...] = (
    ("baseline", lambda c: c),
    ("MTBF x0.5 (failure rate x2)", _scale_rate(2.0)),
    ("MTBF x2 (failure rate x0.5)", _scale_rate(0.5)),
    (
        "Meta research-cluster rate (MTTF 7.9 h at 1,024 GPUs)",
        lambda c: replace(c, failures=replace(c.failures, rate_per_gpu_hour=META_RSC_RATE_PER_GPU_HOUR)),
    ),
    ("no hot spare nodes (wait 1 h per node)", _shape(spare_nodes=0)),
    ("one hot spare node", _shape(spare_nodes=1)),
    ("state size x4 (4.5 TB checkpoint)", _state_x4),
    ("save cost x4", _save_x(4.0)),
    ("save cost x0.25 (asynchronous save)", _save_x(0.25)),
    ("fast detection 2 s (exits/exceptions)", _cal(detect_s=2.0)),
    ("slow detection 30 s (exits/exceptions)", _cal(detect_s=30.0)),
    ("hang timeout 60 s", _cal(hang_timeout_s=60.0)),
    ("hang timeout 600 s (PyTorch's NCCL default)", _cal(hang_timeout_s=600.0)),
    (
        "checkpointless rebuild root-less O(log N), 1 s per doubling",
        _cal(rebuild_model=CommModel.ROOTLESS_LOG),
    ),
    ("checkpointless store-based rebuild and restart (--rendezvous tcp)", store_based),
    ("checkpointless rebuild and restart with gloo's full mesh (every rank reads N keys)", full_mesh),
    ("checkpoint-restart's start-up root-less too", _cal(init_model=CommModel.ROOTLESS_MEASURED)),
    ("a recurring bug retried once, not 3 times", _cal(step_retries=1)),
    ("requeue and process start x0.25", _fast_restart),
    ("every software bug recurs in-process", _all_bugs_recur),
    ("one copy of the state (replicas=1)", _shape(replicas=1)),
    ("Daly interval instead of Young", lambda c: replace(c, interval_rule=IntervalRule.DALY)),
    ("repairs take 24 h", _shape(replace_s=24 * 3600.0)),
    ("repairs take 72 h", _shape(replace_s=72 * 3600.0)),
    ("no repair comes back faulty", _bad_repairs(0.0)),
    ("20% of repairs come back faulty", _bad_repairs(0.2)),
    ("a replica is one node (DDP, 8 GPUs)", _shape(dp_replica_gpus=8)),
    ("a replica is 1,024 GPUs", _shape(dp_replica_gpus=1024)),
    ("measured shrink and grow: 1.28 s (host_loss.json)", _cal(shrink_s=1.28, grow_s=1.28)),
)


@dataclass(frozen=True)
class SensitivityRow:
    case: str
    checkpoint_restart: Summary
    checkpointless: Summary
    policy: Summary  # the chosen no-spare policy (CL_POLICY)


def sensitivity(base: SimConfig, gpus: int, seeds: Sequence[int]) -> list[SensitivityRow]:
    """C-R, CL (the model so far) and the chosen policy at ``gpus`` under each case."""
    cfg0 = replace(base, shape=replace(base.shape, gpus=gpus))
    rows = []
    for name, change in tqdm(SENSITIVITY_CASES, desc="simulate: what-if cases", disable=None, leave=False):
        cfg = change(cfg0)
        rows.append(
            SensitivityRow(
                name,
                summarise(CR, Policy.CHECKPOINT_RESTART, cfg, seeds),
                summarise(CL, Policy.CHECKPOINTLESS, replace(cfg, capacity=CapacityPolicy()), seeds),
                summarise(CL_POLICY, Policy.CHECKPOINTLESS, cfg, seeds),
            )
        )
    return rows


def _no_bug_recurs(c: SimConfig) -> SimConfig:
    causes = tuple(replace(k, recurring=False) for k in c.failures.causes)
    return replace(c, failures=replace(c.failures, causes=causes))


def _stop_after_retries(c: SimConfig) -> SimConfig:
    # the launcher before --fresh-process-retries (or with it 0): a recurring bug stops the job
    return replace(c, capacity=replace(c.capacity, after_retries=AfterRetries.STOP))


def _split(c: SimConfig) -> SimConfig:
    return replace(c, capacity=replace(c.capacity, design=DegradedDesign.SPLIT))


def _previous_model(c: SimConfig) -> SimConfig:
    # this study's default until session 32: a store-based rebuild and restart, one retry
    return _cal(step_retries=1)(store_based(c))


# benchmarks/results/host_loss.json: a whole host lost, one recovery round of 1.28 s on this
# machine: detection 0.22 s, rebuild 0.05 s, transfer 0.33 s (bandwidth: still modelled here),
# first step 0.59 s, 0.09 s the rest (charged to the swap). Only the fixed parts; what grows with
# N (the rebuild's per-rank term, the state over the network) keeps its model.
_MEASURED_ROUND = _cal(
    detect_s=0.22, abort_s=0.0, swap_s=0.09, rebuild_s=0.05, data_resume_s=0.0, first_step_s=0.59
)


# The scale table: repair times (the default is an assumption, then a day, three days), the
# issue's ideal degraded step against the measured one, the previous default model beside the
# system as built, and what-ifs that remove what limits the largest jobs (not defaults: they show
# the limits and what would close the gap to the targets).
SCALE_CASES: tuple[tuple[str, Callable[[SimConfig], SimConfig]], ...] = (
    ("repairs take 1 h (default)", lambda c: c),
    ("repairs take 24 h", _shape(replace_s=24 * 3600.0)),
    ("repairs take 72 h", _shape(replace_s=72 * 3600.0)),
    (
        "repairs take 72 h, degraded step at the issue's ideal (split)",
        lambda c: _split(_shape(replace_s=72 * 3600.0)(c)),
    ),
    ("the previous model: store-based rebuild and restarts, one retry of a recurring bug", _previous_model),
    (
        "before lazy connection: gloo's full mesh, every rank reads all N keys at each rebuild",
        full_mesh,
    ),
    ("what-if: no software bug recurs in-process", _no_bug_recurs),
    (
        "before fresh-process retries: after its 3 retries a recurring bug stops the job, which restarts",
        _stop_after_retries,
    ),
    ("what-if: the round's fixed costs as measured here (host_loss.json)", _MEASURED_ROUND),
)


@dataclass(frozen=True)
class ScaleRow:
    case: str
    gpus: int
    checkpoint_restart: Summary
    today: Summary  # CL_TODAY
    policy: Summary  # CL_POLICY
    policy_store: Summary  # CL_POLICY_STORE


def scale_study(base: SimConfig, gpus: Sequence[int], seeds: Sequence[int]) -> list[ScaleRow]:
    """C-R, today's launcher and the chosen policy at the target sizes, per repair time."""
    rows = []
    for name, change in tqdm(SCALE_CASES, desc="simulate: scale cases", disable=None, leave=False):
        for n in gpus:
            cfg = change(replace(base, shape=replace(base.shape, gpus=n)))
            v = {
                label: summarise(label, p, c, seeds)
                for label, p, c in _variants(cfg)
                if label != CL and label != CL_STORE
            }
            rows.append(ScaleRow(name, n, v[CR], v[CL_TODAY], v[CL_POLICY], v[CL_POLICY_STORE]))
    return rows


@dataclass(frozen=True)
class Report:
    base: SimConfig
    gpus: tuple[int, ...]
    focus_gpus: int
    seeds: tuple[int, ...]
    sweep: list[Summary]
    sensitivity: list[SensitivityRow]
    scale: list[ScaleRow] = field(default_factory=list)

    def at(self, variant: str, gpus: int) -> Summary:
        return next(s for s in self.sweep if s.variant == variant and s.gpus == gpus)


def run_report(
    base: SimConfig, gpus: Sequence[int], focus_gpus: int, seeds: Sequence[int], with_sensitivity: bool
) -> Report:
    """The whole study: the sweep (which always includes ``focus_gpus``) and the what-if table."""
    sizes = tuple(sorted(set(gpus) | {focus_gpus}))
    return Report(
        base=base,
        gpus=sizes,
        focus_gpus=focus_gpus,
        seeds=tuple(seeds),
        sweep=sweep(base, sizes, seeds),
        sensitivity=sensitivity(base, focus_gpus, seeds) if with_sensitivity else [],
        scale=scale_study(base, SCALE_GPUS, seeds) if with_sensitivity else [],
    )
