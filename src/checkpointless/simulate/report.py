"""Runs the simulation over seeds, job sizes and what-if cases, and renders the results.

Both policies (and every variant) see the same fault traces for a given seed and job size
(common random numbers), so the differences between columns come from the policies, not from
luck in the draw.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

from tqdm import tqdm

from checkpointless.simulate.calibration import CommModel
from checkpointless.simulate.des import SimConfig, simulate_run
from checkpointless.simulate.failures import META_RSC_RATE_PER_GPU_HOUR, sample_faults
from checkpointless.simulate.models import (
    BADPUT_BUCKETS,
    IntervalRule,
    Policy,
    analytic_goodput,
    fallback_probability,
    policy_interval,
)

__all__ = [
    "DEFAULT_GPUS",
    "SENSITIVITY_CASES",
    "Report",
    "SensitivityRow",
    "Summary",
    "render_markdown",
    "run_report",
    "sensitivity",
    "summarise",
    "sweep",
    "to_json",
    "write_plot",
]

DEFAULT_GPUS: tuple[int, ...] = (16, 64, 256, 1024, 2304, 4096, 8192, 16384)

CR = "checkpoint-restart"
CL = "checkpointless"
CL_ROOTLESS = "checkpointless, root-less rebuild"


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


def summarise(variant: str, policy: Policy, cfg: SimConfig, seeds: Sequence[int]) -> Summary:
    """Run ``cfg`` under ``policy`` once per seed and average."""
    runs = [
        simulate_run(cfg, policy, sample_faults(cfg.failures, cfg.shape, cfg.horizon_s, seed))
        for seed in seeds
    ]
    goodputs = [r.goodput for r in runs]
    interval = policy_interval(
        policy, cfg.interval_rule, cfg.failures, cfg.shape, cfg.cal, cfg.max_interval_s
    )
    return Summary(
        variant=variant,
        policy=policy,
        gpus=cfg.shape.gpus,
        goodput_mean=statistics.fmean(goodputs),
        goodput_sd=statistics.stdev(goodputs) if len(goodputs) > 1 else 0.0,
        analytic=analytic_goodput(policy, cfg.failures, cfg.shape, cfg.cal, interval),
        interval_s=interval,
        faults_mean=statistics.fmean(r.faults for r in runs),
        fallbacks_mean=statistics.fmean(r.fallbacks for r in runs),
        spare_waits_mean=statistics.fmean(r.spare_waits for r in runs),
        badput_share={
            b.value: statistics.fmean(r.seconds[b] / r.wall_s for r in runs) for b in BADPUT_BUCKETS
        },
    )


def _variants(cfg: SimConfig) -> list[tuple[str, Policy, SimConfig]]:
    rootless = replace(cfg, cal=replace(cfg.cal, rebuild_model=CommModel.ROOTLESS_LOG))
    return [
        (CR, Policy.CHECKPOINT_RESTART, cfg),
        (CL, Policy.CHECKPOINTLESS, cfg),
        (CL_ROOTLESS, Policy.CHECKPOINTLESS, rootless),
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
    ("checkpointless rebuild root-less O(log N)", _cal(rebuild_model=CommModel.ROOTLESS_LOG)),
    (
        "both paths root-less O(log N) start-up",
        _cal(rebuild_model=CommModel.ROOTLESS_LOG, init_model=CommModel.ROOTLESS_LOG),
    ),
    ("requeue and process start x0.25", _fast_restart),
    ("every software bug recurs in-process", _all_bugs_recur),
    ("one copy of the state (replicas=1)", _shape(replicas=1)),
    ("Daly interval instead of Young", lambda c: replace(c, interval_rule=IntervalRule.DALY)),
)


@dataclass(frozen=True)
class SensitivityRow:
    case: str
    checkpoint_restart: Summary
    checkpointless: Summary


def sensitivity(base: SimConfig, gpus: int, seeds: Sequence[int]) -> list[SensitivityRow]:
    """Both policies at ``gpus`` under each case of :data:`SENSITIVITY_CASES`."""
    cfg0 = replace(base, shape=replace(base.shape, gpus=gpus))
    rows = []
    for name, change in tqdm(SENSITIVITY_CASES, desc="simulate: what-if cases", disable=None, leave=False):
        cfg = change(cfg0)
        rows.append(
            SensitivityRow(
                name,
                summarise(CR, Policy.CHECKPOINT_RESTART, cfg, seeds),
                summarise(CL, Policy.CHECKPOINTLESS, cfg, seeds),
            )
        )
    return rows


@dataclass(frozen=True)
class Report:
    base: SimConfig
    gpus: tuple[int, ...]
    focus_gpus: int
    seeds: tuple[int, ...]
    sweep: list[Summary]
    sensitivity: list[SensitivityRow]

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
    )


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------
def _pct(x: float) -> str:
    return f"{100 * x:.2f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def sweep_table(rep: Report) -> str:
    header = [
        "GPUs",
        "job MTBF (h)",
        "faults / run",
        "C-R ckpt every (min)",
        "C-R goodput %",
        "CL goodput %",
        "CL root-less %",
        "CL - C-R (points)",
        "C-R closed form %",
        "CL closed form %",
        "CL fallbacks / run",
    ]
    rows = []
    for n in rep.gpus:
        cr, cl, rl = rep.at(CR, n), rep.at(CL, n), rep.at(CL_ROOTLESS, n)
        mtbf_h = rep.base.failures.job_mtbf_s(n) / 3600
        rows.append(
            [
                f"{n:,}",
                f"{mtbf_h:.1f}",
                f"{cr.faults_mean:.1f}",
                f"{cr.interval_s / 60:.0f}",
                f"{_pct(cr.goodput_mean)} ± {_pct(cr.goodput_sd)}",
                f"{_pct(cl.goodput_mean)} ± {_pct(cl.goodput_sd)}",
                _pct(rl.goodput_mean),
                f"{100 * (cl.goodput_mean - cr.goodput_mean):+.2f}",
                _pct(cr.analytic),
                _pct(cl.analytic),
                f"{cl.fallbacks_mean:.1f}",
            ]
        )
    return _table(header, rows)


def breakdown_table(rep: Report) -> str:
    n = rep.focus_gpus
    summaries = [rep.at(CR, n), rep.at(CL, n), rep.at(CL_ROOTLESS, n)]
    header = ["% of wall time", *(s.variant for s in summaries)]
    rows = [["productive (goodput)", *(_pct(s.goodput_mean) for s in summaries)]]
    rows += [[b.value, *(_pct(s.badput_share[b.value]) for s in summaries)] for b in BADPUT_BUCKETS]
    return _table(header, rows)


def sensitivity_table(rep: Report) -> str:
    header = ["case", "C-R goodput %", "CL goodput %", "CL - C-R (points)", "CL fallbacks / run"]
    rows = [
        [
            r.case,
            _pct(r.checkpoint_restart.goodput_mean),
            _pct(r.checkpointless.goodput_mean),
            f"{100 * (r.checkpointless.goodput_mean - r.checkpoint_restart.goodput_mean):+.2f}",
            f"{r.checkpointless.fallbacks_mean:.1f}",
        ]
        for r in rep.sensitivity
    ]
    return _table(header, rows)


def headline(rep: Report) -> str:
    n = rep.focus_gpus
    cr, cl = rep.at(CR, n), rep.at(CL, n)
    p_fb = fallback_probability(rep.base.failures, replace(rep.base.shape, gpus=n))
    return (
        f"At {n:,} GPUs over {rep.base.days:g} days ({len(rep.seeds)} seeds): checkpoint-restart "
        f"goodput {_pct(cr.goodput_mean)}% (checkpoint every {cr.interval_s / 60:.0f} min), "
        f"checkpointless {_pct(cl.goodput_mean)}% (checkpoint every {cl.interval_s / 60:.0f} min; "
        f"{100 * p_fb:.1f}% of single faults are expected to fall back to it)."
    )


def render_markdown(rep: Report, command: str, machine: str, runtime_s: float) -> str:
    parts = [
        "# Goodput at scale: checkpoint-restart versus checkpointless",
        "",
        "Simulated, not measured: assumptions, sources and formulas are in `docs/goodput.md`.",
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine}; simulation took {runtime_s:.1f} s",
        f"- Run length {rep.base.days:g} days per seed; seeds {list(rep.seeds)}; "
        f"interval rule {rep.base.interval_rule.value}",
        "",
        "**" + headline(rep) + "**",
        "",
        "## Goodput versus job size",
        "",
        "Mean ± standard deviation over seeds. CL = checkpointless with this repository's store-based",
        "communicator rebuild (O(N)); 'root-less' uses an O(log N) rebuild instead.",
        "",
        sweep_table(rep),
        "",
        f"## Where the time goes at {rep.focus_gpus:,} GPUs",
        "",
        breakdown_table(rep),
    ]
    if rep.sensitivity:
        parts += [
            "",
            f"## Sensitivity at {rep.focus_gpus:,} GPUs (one assumption changed per row)",
            "",
            sensitivity_table(rep),
        ]
    return "\n".join(parts) + "\n"


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(_jsonable(k)): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj


def to_json(rep: Report, command: str, machine: str, runtime_s: float) -> dict[str, Any]:
    n = rep.focus_gpus
    return {
        "command": command,
        "machine": machine,
        "runtime_s": round(runtime_s, 2),
        "headline": {
            "gpus": n,
            "checkpoint_restart_goodput": rep.at(CR, n).goodput_mean,
            "checkpointless_goodput": rep.at(CL, n).goodput_mean,
            "checkpointless_rootless_goodput": rep.at(CL_ROOTLESS, n).goodput_mean,
        },
        "config": _jsonable(rep.base),
        "seeds": list(rep.seeds),
        "sweep": _jsonable(rep.sweep),
        "sensitivity": _jsonable(rep.sensitivity),
    }


def write_plot(rep: Report, path: Path) -> None:
    """Goodput versus N (left) and the badput breakdown at the focus size (right)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on build machines
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.4), gridspec_kw={"width_ratios": [3, 2]})
    colours = {CR: "tab:red", CL: "tab:blue", CL_ROOTLESS: "tab:green"}
    for k, (variant, colour) in enumerate(colours.items()):
        pts = [rep.at(variant, n) for n in rep.gpus]
        ax.errorbar(
            rep.gpus,
            [100 * s.goodput_mean for s in pts],
            yerr=[100 * s.goodput_sd for s in pts],
            marker="o",
            capsize=3,
            color=colour,
            label=f"{variant} (simulated)",
        )
        ax.plot(
            rep.gpus,
            [100 * s.analytic for s in pts],
            ls="--",
            color=colour,
            alpha=0.6,
            label=None if k else "closed form (dashed, same colour)",
        )
    ax.axvline(rep.focus_gpus, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(rep.gpus), [f"{n:,}" for n in rep.gpus], rotation=45)
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("goodput (% of wall time)")
    ax.set_title("Goodput versus job size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)

    n = rep.focus_gpus
    summaries = [rep.at(CR, n), rep.at(CL, n), rep.at(CL_ROOTLESS, n)]
    left = [0.0] * len(summaries)
    cmap = plt.get_cmap("tab10")
    for i, b in enumerate(BADPUT_BUCKETS):
        widths = [100 * s.badput_share[b.value] for s in summaries]
        bx.barh(range(len(summaries)), widths, left=left, color=cmap(i), label=b.value)
        left = [lo + w for lo, w in zip(left, widths, strict=True)]
    bx.set_yticks(range(len(summaries)), [s.variant for s in summaries], fontsize=8)
    bx.invert_yaxis()  # same top-to-bottom order as the tables
    bx.set_xlabel("badput (% of wall time)")
    bx.set_title(f"Badput at {n:,} GPUs")
    bx.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
