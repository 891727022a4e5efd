"""The timeline PNG: one lane per rank (steps, faults, recovery phases, spare swaps) above the
goodput curve. matplotlib is imported here only, so the rest of ``observe`` runs without it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from checkpointless.errors import ConfigError
from checkpointless.observe.ledger import BUCKET_LABELS, Ledger, goodput_curve

__all__ = ["COLORS", "MAX_LANES", "write_timeline"]

MAX_LANES = 64  # ranks (and recoveries) drawn: more would not be readable, or fit an image

# one colour per badput bucket; steps alternate two greys so that step boundaries show
COLORS: dict[str, str] = {
    "startup": "#9e9e9e",
    "detection": "#e53935",
    "replayed": "#ff8a65",
    "abort": "#fb8c00",
    "spare_wait": "#8e24aa",
    "rebuild": "#1e88e5",
    "transfer": "#00acc1",
    "coordination": "#fdd835",
    "first_step": "#7cb342",
    "unrecovered": "#b71c1c",
    "shutdown": "#bdbdbd",
}
_STEP_SHADES = ("#43a047", "#2e7d32")
_ALPHA = 0.6  # recovery spans are drawn over the step bars; the legend uses the same alpha
# a recovery's phases in the order they happen, for the breakdown panel
_PHASE_ORDER: tuple[str, ...] = ("replayed", "detection", "abort", "spare_wait", "rebuild", "transfer")
_PHASE_ORDER += ("coordination", "first_step", "unrecovered")
_LABEL_BOX = {"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8}


def _lanes(
    ax: Any,
    ledger: Ledger,
    events: Sequence[Mapping[str, Any]],
    commits: Sequence[Mapping[str, Any]],
    nproc: int,
) -> None:
    """One lane per rank: committed steps, the recovery spans across every lane, faults and swaps."""
    t0 = ledger.start
    # steps: a bar from a rank's previous commit (or the end of the last badput stretch) to this one
    prev: dict[int, float] = {}
    for c in commits:
        r, t = int(c.get("rank", 0)), float(c["time"])
        if r >= nproc:
            continue  # past the lanes drawn
        start = prev.get(r, t)
        for s in ledger.segments:
            if start < s.end <= t:
                start = s.end  # a step never begins inside a recovery
        if t > start:
            shade = _STEP_SHADES[int(c["step"]) % 2]
            ax.barh(r, t - start, left=start - t0, height=0.6, color=shade, linewidth=0)
        prev[r] = t
    # recovery phases span every lane: the whole job waits for them
    for s in ledger.segments:
        ax.axvspan(s.start - t0, s.end - t0, ymin=0.02, ymax=0.9, color=COLORS[s.bucket], alpha=_ALPHA, lw=0)
    # number each recovery above the lanes, so the breakdown panel below can be matched to it
    for i in range(len(ledger.faults)):
        mine = [s for s in ledger.segments if s.fault == i]
        if mine:
            ax.annotate(
                f"#{i + 1}",
                (mine[0].start - t0, -0.62),
                ha="center",
                va="center",
                fontsize=9,
                fontweight="bold",
                color="#37474f",
            )
    for e in events:
        t = float(e["time"]) - t0
        rank = e.get("rank")
        if not isinstance(rank, int) or rank >= nproc:
            continue  # a fault of no one rank (a host's), or a lane not drawn
        if e.get("event") == "fault" and e.get("kind") != "comm":
            ax.plot(t, int(e["rank"]), marker="X", color="black", markersize=11, zorder=5)
            ax.annotate(
                str(e["kind"]),
                (t, int(e["rank"])),
                xytext=(7, 7),
                textcoords="offset points",
                fontsize=8,
                bbox=_LABEL_BOX,
                zorder=6,
            )
        elif e.get("event") == "spare_assigned":
            ax.plot(t, int(e["rank"]) + 0.22, marker="v", color="#6a1b9a", markersize=9, zorder=5)
            ax.annotate(
                f"spare {e['worker']} takes over",
                (t, int(e["rank"]) + 0.22),
                xytext=(7, -4),
                textcoords="offset points",
                fontsize=8,
                va="top",
                bbox=_LABEL_BOX,
                zorder=6,
            )
    ax.set_yticks(range(nproc), [f"rank {r}" for r in range(nproc)])
    ax.set_ylim(nproc - 0.4, -0.85)
    ax.tick_params(axis="y", length=0)
    ax.set_xlim(left=0)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)


def _breakdown(bx: Any, ledger: Ledger) -> None:
    """Each recovery's phases end to end, in milliseconds: far too short to read on the job's scale."""
    rows = list(enumerate(ledger.faults))[-MAX_LANES:]  # the last ones: a plot has a readable height
    for i, f in rows:
        left = 0.0
        for bucket in _PHASE_ORDER:
            ms = 1e3 * f.phases.get(bucket, 0.0)
            if ms > 0:
                bx.barh(i, ms, left=left, height=0.6, color=COLORS[bucket], alpha=_ALPHA, lw=0)
                left += ms
        bx.annotate(
            f"{left:,.0f} ms" + ("" if f.recovered else " (not recovered)"),
            (left, i),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )
    bx.set_yticks([i for i, _ in rows], [f"#{i + 1} {f.causes}" for i, f in rows], fontsize=8)
    bx.set_ylim(rows[-1][0] + 0.6, rows[0][0] - 0.6)
    bx.tick_params(axis="y", length=0)
    longest = max((1e3 * f.total_s for f in ledger.faults), default=1.0)
    bx.set_xlim(0, 1.18 * max(longest, 1e-3))  # room for the total after the longest bar
    bx.set_xlabel("milliseconds from the last commit before the fault to the first step after it")
    bx.set_title("each recovery, phase by phase", fontsize=10, loc="left")
    bx.grid(axis="x", alpha=0.3)
    bx.set_axisbelow(True)


def write_timeline(
    ledger: Ledger, events: Sequence[Mapping[str, Any]], commits: Sequence[Mapping[str, Any]], path: Path
) -> None:
    """Draw the job's timeline to ``path`` (PNG), written whole or not at all."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: a file is all we make
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError(
            "the timeline needs matplotlib: pip install 'checkpointless[report]' (or pass --no-plot)"
        ) from None
    ranks = max(ledger.nproc, 1 + max((int(c.get("rank", 0)) for c in commits), default=0))
    nproc = min(ranks, MAX_LANES)
    nrec = min(len(ledger.faults), MAX_LANES)
    heights = [nproc + 1.5, 2.2] + ([0.9 + 0.45 * nrec] if nrec else [])
    fig = plt.figure(figsize=(13, 1.2 + 0.55 * sum(heights)), layout="constrained")
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights)
    ax = fig.add_subplot(grid[0])
    gx = fig.add_subplot(grid[1], sharex=ax)
    _lanes(ax, ledger, events, commits, nproc)
    ax.tick_params(axis="x", labelbottom=False)
    shown = f" (ranks 0-{nproc - 1} of {ranks} drawn)" if ranks > nproc else ""
    ax.set_title(
        f"{ledger.steps_committed} steps, {len(ledger.faults)} recoveries, goodput {100 * ledger.goodput:.1f}% "
        f"of {ledger.wall_s:.1f} s (job {ledger.status}){shown}"
    )
    used = [b for b in COLORS if ledger.totals.get(b, 0.0) > 0]
    handles: list[Any] = [Patch(color=_STEP_SHADES[0], label="committed step (shades alternate)")]
    handles += [Patch(color=COLORS[b], alpha=_ALPHA, label=BUCKET_LABELS[b]) for b in used]
    kinds = {e.get("event") for e in events if e.get("kind") != "comm"}
    if "fault" in kinds:
        handles.append(Line2D([], [], marker="X", color="black", ls="", label="fault (when noticed)"))
    if "spare_assigned" in kinds:
        handles.append(Line2D([], [], marker="v", color="#6a1b9a", ls="", label="hot spare takes the rank"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    curve = goodput_curve(ledger)
    if curve:
        gx.plot([x for x, _ in curve], [100 * y for _, y in curve], color="#2e7d32")
    gx.set_ylabel("goodput so far (%)")
    gx.set_ylim(0, 100)
    gx.set_xlabel("seconds since launch")
    gx.grid(alpha=0.3)
    if nrec:
        _breakdown(fig.add_subplot(grid[2]), ledger)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, dpi=110, format="png")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)
