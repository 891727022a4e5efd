"""Renders a :class:`~checkpointless.simulate.report.Report`: markdown tables, JSON and the plot.

Separate from the study (``report.py``) because it only reads a finished report: the command line
chooses which of these to write, and nothing here runs the simulation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import Any

from checkpointless.simulate.models import BADPUT_BUCKETS, fallback_probability
from checkpointless.simulate.report import CL, CL_ROOTLESS, CR, Report

__all__ = [
    "breakdown_table",
    "headline",
    "render_markdown",
    "sensitivity_table",
    "sweep_table",
    "to_json",
    "write_plot",
]


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
