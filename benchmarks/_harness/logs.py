"""Reading what a benchmark's jobs wrote: JSON-lines logs, and from the ranks' commit events the
step times and the job's CPU per step."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from .cpu import cpu_at

__all__ = ["cpu_error", "cpu_per_step", "read_jsonl", "run_error", "steady_start", "step_times"]


# -- logs --------------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
    return out


def step_times(run_dir: Path, warmup: int) -> tuple[list[float], dict[int, float]]:
    """Durations of steps ``warmup..`` measured between completions on every rank, and the
    completion time of every step."""
    done_per_rank = []
    for f in sorted(run_dir.glob("rank-*.jsonl")):
        first: dict[int, float] = {}
        for e in read_jsonl(f):
            if e.get("event") == "commit":
                first.setdefault(int(e["step"]), float(e["time"]))
        done_per_rank.append(first)
    if not done_per_rank:
        return [], {}
    steps = sorted(set.intersection(*(set(d) for d in done_per_rank)))
    done = {s: max(d[s] for d in done_per_rank) for s in steps}
    return [done[b] - done[a] for a, b in itertools.pairwise(steps) if b == a + 1 and a >= warmup], done


def steady_start(run_dir: Path, done: dict[int, float], warmup: int) -> int:
    """The first step of the steady state: after the warm-up and, on the checkpointless side,
    after every hot spare has finished starting (``spare_ready`` events). A spare imports torch
    on the same cores while the first steps run; that is start-up, not the cost of each step."""
    ready = [
        float(e["time"]) for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == "spare_ready"
    ]
    if not ready:
        return warmup
    after = [s for s in sorted(done) if s - 1 in done and done[s - 1] >= max(ready)]
    return max(warmup, after[0]) if after else warmup


def cpu_per_step(samples: list[tuple[float, float]], done: dict[int, float], warmup: int) -> float | None:
    """CPU seconds of the whole job (every process it started) per step, after the warm-up:
    unlike wall time, hardly moved by other work on a shared machine."""
    # Only steps inside the sampled span: a job that exits within a sampling interval of its last
    # step leaves no sample after it (every process gone), and the tree's CPU there is unknown.
    span = (samples[0][0], samples[-1][0]) if samples else (0.0, -1.0)
    steps = sorted(s for s in done if s >= warmup and span[0] <= done[s] <= span[1])
    if len(steps) < 2:
        return None
    c0, c1 = cpu_at(samples, done[steps[0]]), cpu_at(samples, done[steps[-1]])
    if c0 is None or c1 is None:
        return None
    return (c1 - c0) / (steps[-1] - steps[0])


def cpu_error(cpu_error: str | None, cps: float | None) -> str | None:
    """Why a run's CPU per step is not a data point: the account's own error, or no CPU counted
    over the steady steps (a run that trained steps used CPU)."""
    if cpu_error:
        return f"incomplete CPU measurement: {cpu_error}"
    if cps is None:
        return "incomplete CPU measurement: no CPU samples around the steady steps"
    if cps <= 0.0:
        return f"incomplete CPU measurement: {cps * 1000:.1f} ms of CPU per step"
    return None


def run_error(
    timed_out: bool,
    rc: int | None,
    steps_measured: int,
    steps_needed: int,
    cpu: tuple[str | None, float | None],
) -> str | None:
    """Why a timed run is not a data point, or None: it timed out, failed, left too few step
    times, or its CPU was not fully counted (``cpu``: the account's error and the CPU per step)."""
    if timed_out:
        return "timed out"
    if rc != 0:
        return f"exit code {rc}"
    if steps_measured < steps_needed:
        return f"only {steps_measured} step times in the logs"
    return cpu_error(*cpu)
