"""Statistics of paired benchmark rounds: medians with their spread, ratios with bootstrap
intervals, verdicts against a target, and the Markdown tables they are printed as."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["fmt", "fmt_spread", "interleaved", "ratio_ci", "summary", "table", "verdict"]


def interleaved(designs: Sequence[str], round_no: int) -> list[str]:
    """The order of the designs in one round: A B C, then C B A, ..., so that every design sees
    the same drift of a shared machine's load."""
    return list(designs) if round_no % 2 == 0 else list(reversed(designs))


# -- paired rounds --------------------------------------------------------------------------------
def summary(values: Sequence[float | None]) -> dict[str, Any]:
    """Median with its spread (min, max) over the repeats that produced a value."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
        "values": [round(x, 4) for x in xs],
    }


def ratio_ci(ratios: Sequence[float], level: float = 0.95, resamples: int = 10_000) -> dict[str, Any]:
    """Geometric mean of paired ratios (one per round: design / baseline, run next to each other)
    with a percentile-bootstrap confidence interval.

    Why a bootstrap: the round ratios on a shared machine are skewed by load bursts, so an interval
    from a normal or t model would be wrong in an unknown direction; resampling the rounds assumes
    only that they are independent. The seed is fixed so that the same runs give the same interval.
    Why paired and geometric: each ratio already cancels the load both runs of a round saw, and
    ratios compose by multiplication (1.1 and 1/1.1 average to parity)."""
    logs = [math.log(r) for r in ratios if r and r > 0]
    if len(logs) < 3:
        return {
            "n": len(logs),
            "geomean": math.exp(statistics.fmean(logs)) if logs else None,
            "lo": None,
            "hi": None,
        }
    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
    tail = (1.0 - level) / 2
    return {
        "n": len(logs),
        "level": level,
        "geomean": math.exp(statistics.fmean(logs)),
        "lo": math.exp(means[int(tail * resamples)]),
        "hi": math.exp(means[min(resamples - 1, int((1.0 - tail) * resamples))]),
    }


def verdict(ci: dict[str, Any], target_pct: float) -> str:
    """'met' when the whole interval is within the target, 'NOT met' when all of it is over, and
    'undecided' when the interval straddles it: the runs cannot tell at this machine's noise."""
    if ci["lo"] is None:
        return "undecided (fewer than 3 rounds)"
    limit = 1.0 + target_pct / 100
    if ci["hi"] <= limit:
        return "met"
    if ci["lo"] > limit:
        return "NOT met"
    return "undecided"


def fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def fmt_spread(s: dict[str, Any], nd: int = 2) -> str:
    if s["median"] is None:
        return "-"
    if s["n"] == 1:
        return fmt(s["median"], nd)
    return f"{fmt(s['median'], nd)} [{fmt(s['min'], nd)}-{fmt(s['max'], nd)}]"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table whose columns line up on screen too."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])
