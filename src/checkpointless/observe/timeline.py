"""The timeline PNG: one lane per rank (steps, faults, recovery phases, spare swaps) above the
goodput curve. matplotlib is imported here only, so the rest of ``observe`` runs without it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from checkpointless.errors import ConfigError
from checkpointless.observe.ledger import BUCKET_LABELS, Ledger, goodput_curve

__all__ = ["COLORS", "write_timeline"]

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
    t0 = ledger.start
    nproc = max(ledger.nproc, 1 + max((int(c.get("rank", 0)) for c in commits), default=0))
    fig, (ax, gx) = plt.subplots(
        2,
        1,
        figsize=(12, 1.6 + 0.55 * nproc + 2.2),
        sharex=True,
        gridspec_kw={"height_ratios": [nproc + 1.5, 2.2]},
    )
    # steps: a bar from a rank's previous commit (or the end of the last badput stretch) to this one
    prev: dict[int, float] = {}
    for c in commits:
        r, t = int(c.get("rank", 0)), float(c["time"])
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
        ax.axvspan(s.start - t0, s.end - t0, ymin=0.02, ymax=0.98, color=COLORS[s.bucket], alpha=0.55, lw=0)
    for e in events:
        t = float(e["time"]) - t0
        if e.get("event") == "fault" and e.get("kind") != "comm":
            ax.plot(t, int(e["rank"]), marker="X", color="black", markersize=11, zorder=5)
            ax.annotate(
                f"{e['kind']}", (t, int(e["rank"])), xytext=(4, 9), textcoords="offset points", fontsize=8
            )
        elif e.get("event") == "spare_assigned":
            ax.plot(t, int(e["rank"]) + 0.22, marker="v", color="#6a1b9a", markersize=9, zorder=5)
            ax.annotate(
                f"spare {e['worker']}",
                (t, int(e["rank"])),
                xytext=(4, -13),
                textcoords="offset points",
                fontsize=8,
            )
    ax.set_yticks(range(nproc), [f"rank {r}" for r in range(nproc)])
    ax.set_ylim(nproc - 0.4, -0.8)
    ax.set_title(
        f"{ledger.steps_committed} steps, {len(ledger.faults)} recoveries, goodput {100 * ledger.goodput:.1f}% "
        f"of {ledger.wall_s:.1f} s ({ledger.status})"
    )
    used = [b for b in COLORS if ledger.totals.get(b, 0.0) > 0]
    handles: list[Any] = [Patch(color=_STEP_SHADES[0], label="committed step")]
    handles += [Patch(color=COLORS[b], alpha=0.55, label=BUCKET_LABELS[b]) for b in used]
    handles += [
        Line2D([], [], marker="X", color="black", ls="", label="fault"),
        Line2D([], [], marker="v", color="#6a1b9a", ls="", label="spare swap"),
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    curve = goodput_curve(ledger)
    if curve:
        gx.plot([x for x, _ in curve], [100 * y for _, y in curve], color="#2e7d32")
    gx.set_ylabel("goodput so far (%)")
    gx.set_ylim(0, 100)
    gx.set_xlabel("seconds since launch")
    gx.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, dpi=110, format="png")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)
