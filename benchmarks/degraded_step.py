"""Degraded mode's step time against its ideal (issue 39), measured in one job.

A data-parallel job (benchmarks/degraded_job.py: an MLP, every micro-batch a function of
(slot, step)) runs under ``checkpointless run --spares 0 --when-no-spare shrink``; the last rank
is SIGKILLed at step ``--kill-step`` (``--inject kill``), a survivor holds its slot and trains
that micro-batch as an extra pass each step, and the spare the coordinator starts waits until
rank 0 has committed step ``--spare-at-step`` before it joins, so the job then grows back. From
the ranks' commit times (every rank that was never killed; a step ends when the last of them
commits it) it takes the median step time in three windows of the same job:

* full: the steps after the warm-up and before the kill;
* degraded: the steps after the shrink's recovery and before the spare is ready (and only while
  the spare waits: not while it starts, nor once it goes on to join, when it shares the cores);
* grown back: the steps after the grow's recovery
(``--skip`` steps after each recovery are left out: the first step of a generation).

The ideal degraded step time is ``coordinator/rules/width.py``'s ``ideal_step_time``: the most
loaded process runs one pass per slot it holds, so 4 -> 3 and 2 -> 1 both give 2x the full step.
The issue's ``full width / remaining width`` (4/3 for 4 -> 3) is what splitting the lost
micro-batch across every survivor would give; this design trains whole micro-batches (the
bitwise-equal weights need each slot's gradient reduced on its own group), so 2x is its bound,
and the result file reports the measured ratio against both.

Three workloads, interleaved round by round (A B C, C B A, ...):

* ``device4``: 4 ranks; each pass is a small MLP plus a ``--device-ms`` sleep that stands for a
  pass on the rank's own accelerator, which the machine's shared cores do not slow down;
* ``cpu2``: 2 ranks, one per core, a compute-bound pass (~tens of ms on one thread);
* ``cpu4``: 4 ranks of the same compute-bound pass on 2 cores. Both widths then run 4 passes per
  step on the same 2 cores, so the ratio there is a shared-CPU number, near 1, not the design's.

Each job also writes every pass's phase times (the job's ``--timeline``): as the loop yields it,
its body begins, after forward, backward (which waits for the all-reduce in a reducing pass), the
optimizer step and the sleep, and once ``with step:`` has exited (the commit in the last pass).
The result file keeps their medians per role: a rank at full width; in the degraded window the
holder's first pass (its own slot's, whose gradient is kept), its last pass (the held slot's,
which reduces every slot's gradient and updates) and the ranks that hold one slot.

``--before SRC`` also runs each workload with the library from another checkout's ``SRC/src``
(the same job script), interleaved with this tree's in every round: a before/after comparison
under the same load, reported as extra workloads named ``<workload>@before``.

    .venv/bin/python benchmarks/degraded_step.py                 # 3 rounds, ~3 min on 2 cores
    .venv/bin/python benchmarks/degraded_step.py --rounds 1 --workloads cpu2
    .venv/bin/python benchmarks/degraded_step.py --workloads device4 --before /tmp/main-checkout

It writes ``benchmarks/results/degraded_step.json`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as bl

from checkpointless.coordinator.rules.width import ideal_step_time

JOB = bl.BENCH / "degraded_job.py"
WORKLOADS = ("device4", "cpu2", "cpu4")


def workload(name: str, a: argparse.Namespace) -> tuple[int, list[str]]:
    """(ranks, the job script's model arguments) of one workload."""
    if name == "device4":
        return 4, ["--dim", "64", "--batch", "64", "--layers", "2", "--sleep", str(a.device_ms / 1000)]
    cpu = ["--dim", str(a.dim), "--batch", str(a.batch), "--layers", str(a.layers)]
    return (2, cpu) if name == "cpu2" else (4, cpu)


def commit_times(run_dir: Path, ranks: list[int]) -> dict[int, float]:
    """step -> when the last of ``ranks`` committed it (its first commit on each rank)."""
    per_rank = []
    for r in ranks:
        first: dict[int, float] = {}
        for e in bl.read_jsonl(run_dir / f"rank-{r}.jsonl"):
            if e.get("event") == "commit":
                first.setdefault(int(e["step"]), float(e["time"]))
        per_rank.append(first)
    steps = set.intersection(*(set(d) for d in per_rank)) if per_rank else set()
    return {s: max(d[s] for d in per_rank) for s in sorted(steps)}


def window(done: dict[int, float], lo_t: float, hi_t: float, skip: int) -> list[float]:
    """Step times of the steps that began (the previous step committed) after ``lo_t`` and
    committed by ``hi_t``, less the first ``skip`` of them."""
    return [done[s] - done[s - 1] for s in window_steps(done, lo_t, hi_t, skip)]


def window_steps(done: dict[int, float], lo_t: float, hi_t: float, skip: int) -> list[int]:
    """The steps :func:`window` times."""
    steps = [s for s in sorted(done) if s - 1 in done and done[s - 1] >= lo_t and done[s] <= hi_t]
    return steps[skip:]


# a pass's phases, as (name, the timeline mark it begins at, the one it ends at)
PHASES = (
    ("loop", "prev_end", "yield"),  # job.steps() between one pass's exit and the next's yield
    ("enter", "yield", "body"),  # `with step:` entering (the step's entry, a held slot's swap-in)
    ("forward", "body", "forward"),
    ("backward", "forward", "backward"),  # a reducing pass waits for the all-reduce in it
    ("optimizer", "backward", "optimizer"),
    ("sleep", "optimizer", "sleep"),
    ("exit", "sleep", "exit"),  # `with step:` exiting (the commit in the last pass)
)


def phases(
    run_dir: Path, ranks: list[int], full: list[int], degraded: list[int], holders: dict[int, list[int]]
) -> dict[str, Any]:
    """Median ms per phase of each role's passes (see the module's docstring); ``full`` and
    ``degraded``: the steps of those windows, ``holders``: rank -> the slots it holds."""
    rows: dict[str, list[dict[str, float]]] = {
        "full": [],
        "holder_first": [],
        "holder_last": [],
        "others": [],
    }
    full_s, deg_s = set(full), set(degraded)
    for r in ranks:
        path = run_dir / f"timeline-{r}.jsonl"
        if not path.exists():
            continue
        held = len(holders.get(r, [r])) > 1
        for t in bl.read_jsonl(path):
            step, last = int(t["step"]), t["pass"] == t["passes"] - 1
            if step in full_s and t["passes"] == 1:
                role = "full"
            elif step in deg_s and held:
                role = "holder_last" if last else "holder_first"
            elif step in deg_s and t["passes"] == 1:
                role = "others"
            else:
                continue
            rows[role].append({name: t[b] - t[a] for name, a, b in PHASES} | {"pass": t["exit"] - t["yield"]})
    return {
        role: {k: round(statistics.median(x[k] for x in rs) * 1e3, 2) for k in rs[0]} if rs else None
        for role, rs in rows.items()
    }


def analyse(run_dir: Path, nproc: int, a: argparse.Namespace) -> dict[str, Any]:
    events = bl.read_jsonl(run_dir / "events.jsonl")
    killed = nproc - 1
    widths = [e for e in events if e["event"] == "width"]
    recs = [float(e["time"]) for e in events if e["event"] == "recovery"]
    faults = [float(e["time"]) for e in events if e["event"] == "fault"]
    grows = [float(e["time"]) for e in events if e["event"] == "grow"]
    out: dict[str, Any] = {"widths": [int(e["width"]) for e in widths]}
    if [w["width"] for w in widths] != [nproc - 1, nproc] or len(recs) < 2 or not faults or not grows:
        out["error"] = f"expected one shrink to {nproc - 1} and a grow back: widths {out['widths']}"
        return out
    held = [tuple(h) for h in widths[0]["holders"]]  # [slot, holder]
    holders: dict[int, list[int]] = {r: [r] for r in range(nproc) if r != killed}
    for slot, holder in held:
        holders[holder].append(slot)
    done = commit_times(run_dir, [r for r in range(nproc) if r != killed])
    first = min(done) if done else 0
    full_steps = window_steps(done, done.get(first + a.warmup, float("inf")), faults[0], 0)
    full = [done[s] - done[s - 1] for s in full_steps]
    # the spare's own start (before it waits, and from when it goes on to join) shares the cores
    spare = {e["event"]: float(e["time"]) for e in bl.read_jsonl(run_dir / "spare.jsonl")}
    lo = max(recs[0], spare.get("waiting", recs[0]))
    degraded_steps = window_steps(done, lo, min(grows[0], spare.get("released", grows[0])), a.skip)
    degraded = [done[s] - done[s - 1] for s in degraded_steps]
    after = window(done, recs[1], float("inf"), a.skip)
    out.update(
        holders={str(k): v for k, v in sorted(holders.items())},
        steps={"full": len(full), "degraded": len(degraded), "grown_back": len(after)},
    )
    if min(len(full), len(degraded), len(after)) < a.min_steps:
        out["error"] = f"too few steps in a window: {out['steps']}"
        return out
    f, d, g = (statistics.median(x) for x in (full, degraded, after))
    ideal = ideal_step_time(f, nproc, holders)
    out.update(
        full_ms=round(f * 1e3, 2),
        degraded_ms=round(d * 1e3, 2),
        grown_back_ms=round(g * 1e3, 2),
        ratio=round(d / f, 4),
        ideal_ms=round(ideal * 1e3, 2),
        ideal_ratio=round(ideal / f, 4),
        measured_over_ideal=round(d / ideal, 4),
        issue_ratio=round(nproc / (nproc - 1), 4),
        measured_over_issue=round(d / f / (nproc / (nproc - 1)), 4),
        grown_back_over_full=round(g / f, 4),
        degraded_window_s=round(grows[0] - recs[0], 2),
        phases=phases(run_dir, [r for r in range(nproc) if r != killed], full_steps, degraded_steps, holders),
    )
    return out


def one_run(name: str, a: argparse.Namespace, work: Path, round_no: int) -> dict[str, Any]:
    base, _, before = name.partition("@")
    nproc, model = workload(base, a)
    run_dir = work / f"{name.replace('@', '-')}-r{round_no}"
    cmd = [
        bl.PYTHON, "-m", "checkpointless", "run", "--nproc", str(nproc), "--spares", "0",
        "--when-no-spare", "shrink", "--run-dir", str(run_dir / "run"), "--hang-timeout", "30",
        "--inject", f"kill:rank={nproc - 1}:step={a.kill_step}",
        str(JOB), "--steps", str(a.steps), "--spare-at-step", str(a.spare_at_step),
        "--run-dir", str(run_dir / "run"), "--timeline", "1", *model,
    ]  # fmt: skip
    env = bl.bench_env(1)
    if before:  # the other checkout's library first on the path: the job script stays this one
        env["PYTHONPATH"] = os.pathsep.join([str(Path(a.before) / "src"), env["PYTHONPATH"]])
    fin = bl.run_job(cmd, run_dir, timeout=a.run_timeout, env=env)
    res: dict[str, Any] = {"round": round_no, "rc": fin.rc, "wall_s": round(fin.wall_s, 2)}
    if fin.timed_out or fin.rc != 0:
        res["error"] = "timed out" if fin.timed_out else f"exit code {fin.rc}"
        return res
    res.update(analyse(run_dir / "run", nproc, a))
    return res


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    keys = ("full_ms", "degraded_ms", "grown_back_ms", "ratio", "measured_over_ideal", "measured_over_issue",
            "grown_back_over_full")  # fmt: skip
    out: dict[str, Any] = {k: bl.summary([r[k] for r in ok]) for k in keys}
    roles = ("full", "holder_first", "holder_last", "others")
    out["phases_ms"] = {
        role: {k: bl.summary([r["phases"][role][k] for r in ok if r.get("phases", {}).get(role)])
               for k in [*(p[0] for p in PHASES), "pass"]}
        for role in roles
        if any(r.get("phases", {}).get(role) for r in ok)
    }  # fmt: skip
    out["ideal_ratio"] = ok[0]["ideal_ratio"] if ok else None
    out["issue_ratio"] = ok[0]["issue_ratio"] if ok else None
    out["failed"] = len(runs) - len(ok)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--kill-step", type=int, default=25)
    ap.add_argument("--spare-at-step", type=int, default=75, help="the spare joins after this step")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--skip", type=int, default=2, help="steps left out after each recovery")
    ap.add_argument("--min-steps", type=int, default=8, help="fewest step times in each window")
    ap.add_argument("--device-ms", type=float, default=40.0, help="device4: the sleep per pass")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--before",
        default="",
        help="a checkout of the library to compare with: each workload also runs on SRC/src, interleaved",
    )
    bl.add_run_args(ap, run_timeout=120, out=str(bl.RESULTS / "degraded_step.json"))
    args = ap.parse_args()
    if args.before and not (Path(args.before) / "src" / "checkpointless").is_dir():
        ap.error(f"--before {args.before}: no src/checkpointless there; give a checkout's root")
    if args.before:
        args.workloads = [x for w in args.workloads for x in (w, f"{w}@before")]
    machine = bl.machine_info()
    t_start = time.monotonic()
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="cpl-degraded-"))
    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in args.workloads}
    try:
        with bl.cleanup_on_exit():
            for i in range(args.rounds):
                for name in bl.interleaved(args.workloads, i):
                    res = one_run(name, args, work, i)
                    runs[name].append(res)
                    bl.say(
                        f"round {i} {name}: " + json.dumps({k: v for k, v in res.items() if k != "holders"})
                    )
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    machine["bench_wall_s"] = round(time.monotonic() - t_start, 1)
    machine["load_note"] = bl.load_note(machine["loadavg_start"], [round(x, 2) for x in os.getloadavg()])
    workloads = {
        w: {"nproc": workload(w.partition("@")[0], args)[0], "summary": summarise(r), "runs": r}
        for w, r in runs.items()
    }
    result = {
        "benchmark": "degraded_step",
        "command": "python benchmarks/degraded_step.py " + " ".join(sys.argv[1:]),
        "machine": machine,
        "params": vars(args),
        "note": (
            "4 ranks on 2 cores share the CPUs: cpu4's times are shared-CPU times (both widths run "
            "4 passes per step on the same 2 cores); device4's sleep stands for each rank's own device"
        ),
        "workloads": workloads,
    }
    if args.before:
        git = subprocess.run(["git", "-C", args.before, "describe", "--always", "--dirty"],
                             capture_output=True, text=True, check=False)  # fmt: skip
        result["before"] = {"path": args.before, "git": git.stdout.strip() or None}
    print(
        json.dumps(
            {w: {k: x for k, x in v["summary"].items() if k != "phases_ms"} for w, v in workloads.items()},
            indent=1,
        )
    )
    bl.save_result(args.out, result)


if __name__ == "__main__":
    main()
