"""Never stop (issue 39): a job that loses two ranks and gets no spare, checkpointless' degraded mode
against torchrun's elastic restarts, side by side on the same workload.

The example GPT (examples/train_gpt.py: same model, seed, data and AdamW in both designs), N = 4
ranks, a global batch of 12 sequences (divisible by 4, 3 and 2), runs per repeat, interleaved:

* (a) ``checkpointless run --nproc 4 --spares 0 --when-no-spare shrink`` (job:
  benchmarks/degraded_gpt.py, which holds the spares back):
  - ``none``: no fault, the reference of the bits and of the full-width step;
  - ``two``: rank 3 SIGKILLed as it begins step F1, rank 2 at F2, and no spare ever becomes ready
    (no capacity comes back): the survivors train the lost slots' micro-batches as held passes,
    4 -> 3 -> 2 processes, to the end;
  - ``grow``: rank 3 SIGKILLed at F1, its spare ready once step G is committed: shrink, then grow
    back to 4.
* (b) torchrun elastic, ``--nnodes 2:4 --nproc-per-node 1``: four agents, each a "node" of one
  worker, meeting through a c10d rendezvous store this script hosts (standing for etcd or any
  store outside the nodes, so that any node may be lost), running
  benchmarks/baseline/train_ddp_ckpt.py (gloo DDP, DCP checkpoint every K steps):
  - ``none``: no fault;
  - ``two``: the nodes of ranks 3 and 2 lost whole at F1 and F2 (``--inject node:...``: the
    worker SIGKILLs its agent and itself). The survivors' collectives fail, their agents restart
    them, the rendezvous closes with the nodes left, and every new worker loads the newest
    checkpoint and redoes the steps after it. The baseline keeps the global batch (12: 3, 4, then
    6 sequences per rank), but a rank's batch is a function of (step, rank, per-rank size), so the
    samples of a step change with the world: its weights cannot be the fault-free run's.

It reports, per design, from the ranks' commit logs and the launcher's events: the whole job's
wall time against the same design's fault-free run, the downtime of each fault (the fault to the
next step completed on every live rank), the time until the step the fault hit is done again, the
steps redone, the step time at each width against the full-width step and against the issue's
ideal (full width / width x the full step) and the design's own (the most slots one process holds
x the full step), the time to shrink and to grow back, and whether the final weights are bitwise
the fault-free run's.

    .venv/bin/python benchmarks/degraded.py             # 2 repeats, 10 jobs, ~10 min on 2 shared cores
    .venv/bin/python benchmarks/degraded.py --quick     # smoke run: 1 repeat of short jobs

It writes ``benchmarks/results/degraded.json`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "baseline"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as bl
import shardlib as sl
from _harness import downtime as dt

from checkpointless.coordinator.rules.width import ideal_step_time

__all__ = ["main"]

JOB = bl.BENCH / "degraded_gpt.py"
RUNS = ("a:none", "b:none", "a:two", "b:two", "a:grow")  # design:scenario, in a round's order
LABEL = {"a": "(a) checkpointless degraded", "b": "(b) torchrun --nnodes 2:4 + DCP"}


# -- launching ---------------------------------------------------------------------------------
def model_args(a: argparse.Namespace) -> list[str]:
    return [
        "--steps", str(a.steps), "--dim", str(a.dim), "--layers", str(a.layers), "--heads", str(a.heads),
        "--seq-len", str(a.seq_len), "--seed", str(a.seed), "--global-batch", str(a.global_batch),
    ]  # fmt: skip


def faults(a: argparse.Namespace, scenario: str, kind: str) -> list[str]:
    """The injected faults: the last rank at F1, then (``two``) the one before it at F2."""
    lost = [(a.nproc - 1, a.fault_steps[0])]
    if scenario == "two":
        lost.append((a.nproc - 2, a.fault_steps[1]))
    return [x for rank, step in ([] if scenario == "none" else lost) for x in ("--inject", f"{kind}:rank={rank}:step={step}")]  # fmt: skip


def launch_checkpointless(a: argparse.Namespace, scenario: str, run_dir: Path) -> bl.Finished:
    spare_at = a.grow_at if scenario == "grow" else -1
    cmd = [
        bl.PYTHON, "-m", "checkpointless", "run", "--nproc", str(a.nproc), "--spares", "0",
        "--when-no-spare", "shrink", "--run-dir", str(run_dir), "--hang-timeout", str(a.hang_timeout),
        "--port-base", str(sl.port_base(run_dir)), "--port-range", "200", *faults(a, scenario, "kill"),
        str(JOB), "--spare-at-step", str(spare_at), "--gate-dir", str(run_dir), *model_args(a),
        "--digest-out", str(run_dir / "digest.{rank}"),
    ]  # fmt: skip
    return bl.run_job(cmd, run_dir, timeout=a.run_timeout, env=bl.bench_env(a.threads))


def launch_torchrun(a: argparse.Namespace, scenario: str, run_dir: Path) -> bl.Finished:
    import torch.distributed as dist  # the rendezvous store outside the nodes

    port = bl.free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)
    conf = f"is_host=false,last_call_timeout={a.last_call},keep_alive_interval=1,keep_alive_max_attempt=3"
    agent = [
        bl.TORCHRUN, "--nnodes", f"{a.nproc - 2}:{a.nproc}", "--nproc-per-node", "1",
        "--max-restarts", "3", "--monitor-interval", "0.1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_dir.name, "--rdzv-conf", conf,
        str(bl.BASELINE), *model_args(a), "--ckpt-every", str(a.ckpt_every), "--log-dir", str(run_dir),
        "--hang-timeout", str(a.hang_timeout), *faults(a, scenario, "node"),
    ]  # fmt: skip
    # every agent in the background, each exit status kept (a lost node's is 137), then wait
    lines = [
        f"({shlex.join(agent)} >{shlex.quote(f'{run_dir}/agent-{i}.log')} 2>&1; "
        f"echo $? >{shlex.quote(f'{run_dir}/agent-{i}.rc')}) &"
        for i in range(a.nproc)
    ]
    try:
        return bl.run_job(["bash", "-c", "\n".join([*lines, "wait"])], run_dir, timeout=a.run_timeout,
                          env=bl.bench_env(a.threads))  # fmt: skip
    finally:
        del store


# -- reading the logs --------------------------------------------------------------------------
def fault_times(design: str, run_dir: Path) -> list[float]:
    if design == "a":
        return sorted(float(e["fired_at"]) for e in bl.read_jsonl(run_dir / "events.jsonl")
                      if e["event"] == "fault_injected")  # fmt: skip
    logs = dt.rank_logs(run_dir)
    return sorted(float(e["fired_at"]) for evs in logs.values() for e in evs if e["event"] == "fault")


def segment(cm: dict[int, list[dict[str, Any]]], lo: float, hi: float) -> dict[int, float]:
    """step -> when the last rank that committed anything in (lo, hi) first committed it there."""
    per_rank = []
    for evs in cm.values():
        first: dict[int, float] = {}
        for e in evs:
            if lo < e["time"] < hi:
                first.setdefault(int(e["step"]), float(e["time"]))
        if first:
            per_rank.append(first)
    if not per_rank:
        return {}
    return {s: max(d[s] for d in per_rank) for s in set.intersection(*(set(d) for d in per_rank))}


def step_times(done: dict[int, float], skip: int) -> list[float]:
    """The times between consecutive completed steps, less the first ``skip`` steps."""
    steps = sorted(done)[skip:]
    return [done[s] - done[s - 1] for s in steps if s - 1 in done]


def digests(design: str, run_dir: Path) -> list[str]:
    """Every live rank's final weights' digest at the end of the job."""
    if design == "a":
        return sorted(p.read_text().strip() for p in run_dir.glob("digest.*"))
    logs = dt.rank_logs(run_dir)
    return [e["digest"] for evs in logs.values() for e in evs if e["event"] == "done"]


def after_fault(cm: dict[int, list[dict[str, Any]]], hit: int) -> dict[int, list[dict[str, Any]]]:
    """The commits without a fault's tail: a rank still finishing the step before the one the
    fault ``hit`` logs its commit after the fault fired (the killed rank began the next step
    first); a step the rank had committed before and commits again is a redone step, kept."""
    out: dict[int, list[dict[str, Any]]] = {}
    for r, evs in cm.items():
        seen: set[int] = set()
        out[r] = []
        for e in sorted(evs, key=lambda e: e["time"]):
            step = int(e["step"])
            if step >= hit or step in seen:
                out[r].append(e)
            seen.add(step)
    return out


def read_metrics(a: argparse.Namespace, design: str, run_dir: Path) -> dict[str, Any]:
    cm = dt.commits(dt.rank_logs(run_dir))
    fired = fault_times(design, run_dir)
    m: dict[str, Any] = {"digests": sorted(set(digests(design, run_dir))), "faults": []}
    if design == "a":
        m.update(checkpointless_events(run_dir))
    # the width changes at each fault (which hit a known step) and at the grow round: one window
    # of steps per width
    splits = sorted([(f, hit) for f, hit in zip(fired, a.fault_steps, strict=False)]
                    + [(g, None) for g in m.get("grow_at", [])])  # fmt: skip
    bounds: list[tuple[float, int | None]] = [(0.0, None), *splits, (float("inf"), None)]
    m["widths"] = []
    for i in range(len(bounds) - 1):
        (lo, hit), hi = bounds[i], bounds[i + 1][0]
        done = segment(cm if hit is None else after_fault(cm, hit), lo, hi)
        times = step_times(done, a.warmup if i == 0 else a.skip)
        ranks = {r for r, evs in cm.items() if any(lo < e["time"] < hi for e in evs)}
        m["widths"].append({"ranks": len(ranks), "steps": len(times),
                            "step_s": statistics.median(times) if times else None})  # fmt: skip
        if hit is not None:
            m["faults"].append({
                "step": hit,
                "downtime_s": (min(done.values()) - lo) if done else None,
                "back_s": (done[hit] - lo) if hit in done else None,
                "redone": (hit - min(done)) if done else None,
            })  # fmt: skip
    return m


def checkpointless_events(run_dir: Path) -> dict[str, Any]:
    """The widths and holders the launcher reported, and the grow round's timing."""
    events = bl.read_jsonl(run_dir / "events.jsonl")
    out: dict[str, Any] = {
        "width_events": [{"width": e["width"], "holders": e["holders"]} for e in events if e["event"] == "width"],
        "recovery_downtime_s": [e.get("downtime_s") for e in events if e["event"] == "recovery"],
        "job_end": next((e.get("status") for e in events if e["event"] == "job_end"), None),
    }  # fmt: skip
    grows = [float(e["time"]) for e in events if e["event"] == "grow"]
    out["grow_at"] = grows[:1]
    if grows:
        cm = dt.commits(dt.rank_logs(run_dir))
        last = max(e["time"] for evs in cm.values() for e in evs if e["time"] < grows[0])
        full = segment(cm, grows[0], float("inf"))
        # from the last degraded step's commit to the first step every rank, the spare too,
        # committed: the pause the grow round put into training (one step of it is a step)
        out["grow_gap_s"] = (min(full.values()) - last) if full else None
    return out


# -- one run, the summary ------------------------------------------------------------------------
def collect(a: argparse.Namespace, job: str, repeat: int, work: Path) -> dict[str, Any]:
    design, scenario = job.split(":")
    run_dir = work / f"{design}-{scenario}-{repeat}"
    launch = launch_checkpointless if design == "a" else launch_torchrun
    fin = launch(a, scenario, run_dir)
    rec: dict[str, Any] = {"design": design, "scenario": scenario, "repeat": repeat, "rc": fin.rc,
                           "wall_s": round(fin.wall_s, 3), "error": None}  # fmt: skip
    try:
        rec["metrics"] = read_metrics(a, design, run_dir)
    except Exception as e:  # a broken log is a failed run, reported
        rec["metrics"], rec["error"] = {}, f"could not read the logs: {type(e).__name__}: {e}"
    lost = {"none": 0, "two": 2, "grow": 1}[scenario]
    if design == "b":
        rcs = sorted(int(p.read_text()) for p in run_dir.glob("agent-*.rc"))
        rec["agent_rcs"] = rcs
        if rcs != sorted([0] * (a.nproc - lost) + [137] * lost):
            rec["error"] = rec["error"] or f"agents' exit codes {rcs}"
    if fin.timed_out:
        rec["error"] = f"timed out after {a.run_timeout:.0f} s"
    elif fin.rc != 0:
        rec["error"] = rec["error"] or f"exit code {fin.rc}"
    elif len(rec["metrics"].get("faults", [])) != lost:
        rec["error"] = rec["error"] or f"{len(rec['metrics'].get('faults', []))} faults fired, not {lost}"
    if rec["error"]:
        rec["error"] += f" (logs in {run_dir})"
    bl.say(f"  {job:<7} #{repeat}: {fin.wall_s:6.1f} s, "
           + ", ".join(f"down {f['downtime_s']:.2f} s redone {f['redone']}" for f in rec["metrics"].get("faults", [])
                       if f["downtime_s"] is not None)
           + (f" FAILED: {rec['error']}" if rec["error"] else " ok"))  # fmt: skip
    return rec


def summarise(a: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (design, scenario): medians [min-max] over the repeats of what the runs measured."""
    ok = [r for r in runs if r["error"] is None]
    ref = {(r["design"], r["repeat"]): r["metrics"]["digests"] for r in ok if r["scenario"] == "none"}
    out: dict[str, Any] = {}
    for job in RUNS:
        design, scenario = job.split(":")
        mine = [r for r in ok if (r["design"], r["scenario"]) == (design, scenario)]
        if not mine:
            continue
        s: dict[str, Any] = {"runs": len(mine), "wall_s": bl.summary([r["wall_s"] for r in mine])}
        nones = {r["repeat"]: r["wall_s"] for r in ok if (r["design"], r["scenario"]) == (design, "none")}
        s["added_wall_s"] = bl.summary(
            [r["wall_s"] - nones[r["repeat"]] for r in mine if r["repeat"] in nones]
        )
        s["bitwise"] = [r["metrics"]["digests"] == ref.get((design, r["repeat"])) for r in mine]
        n_faults = len(mine[0]["metrics"]["faults"])
        s["faults"] = [
            {k: bl.summary([r["metrics"]["faults"][i][k] for r in mine]) for k in ("downtime_s", "back_s", "redone")}
            for i in range(n_faults)
        ]  # fmt: skip
        s["widths"] = []
        for i, w in enumerate(mine[0]["metrics"]["widths"]):
            row: dict[str, Any] = {
                "ranks": w["ranks"],
                "step_s": bl.summary([r["metrics"]["widths"][i]["step_s"] for r in mine]),
            }
            full = [r["metrics"]["widths"][0]["step_s"] for r in mine]
            this = [r["metrics"]["widths"][i]["step_s"] for r in mine]
            row["over_full"] = bl.summary([t / f for t, f in zip(this, full, strict=True) if t and f])
            row["issue_ideal"] = a.nproc / w["ranks"]  # full width / width
            row["over_issue_ideal"] = bl.summary([t / f / row["issue_ideal"] for t, f in zip(this, full, strict=True) if t and f])  # fmt: skip
            if design == "a" and i > 0 and scenario == "two":
                held = mine[0]["metrics"]["width_events"][i - 1]["holders"]
                holders: dict[int, list[int]] = {
                    r: [r] for r in range(a.nproc) if r not in {x for x, _ in held}
                }
                for slot, holder in held:
                    holders[holder].append(slot)
                row["rules_ideal"] = ideal_step_time(1.0, a.nproc, holders)
                row["over_rules_ideal"] = bl.summary([t / f / row["rules_ideal"] for t, f in zip(this, full, strict=True) if t and f])  # fmt: skip
            s["widths"].append(row)
        if scenario == "grow":
            s["grow_gap_s"] = bl.summary([r["metrics"].get("grow_gap_s") for r in mine])
            s["recovery_downtime_s"] = [r["metrics"]["recovery_downtime_s"] for r in mine]
        out[job] = s
    return out


def build_notes(a: argparse.Namespace, summ: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    f1, f2 = a.fault_steps
    notes = [
        f"N = {a.nproc} ranks on this machine's cores, global batch {a.global_batch}, {a.steps} steps; faults as "
        f"rank {a.nproc - 1} begins step {f1} and rank {a.nproc - 2} step {f2}; torchrun saves a DCP checkpoint every "
        f"{a.ckpt_every} steps, so it resumes at steps {f1 // a.ckpt_every * a.ckpt_every} and "
        f"{f2 // a.ckpt_every * a.ckpt_every}; rendezvous last call {a.last_call} s, keep-alive 1 s x 3.",
        "torchrun's baseline keeps the global batch (the per-rank batch grows to global/world), but the "
        "sequences a rank draws are a function of (step, rank, per-rank size), so after a loss each step trains "
        "other samples than the fault-free run's: its final weights differ by design, not by accident.",
        "Step times share the CPU: with 4 processes on 2 cores, 3 or 2 processes doing the same total work "
        "take about as long as 4, so the degraded/full ratios here are the shared-CPU ones; "
        "benchmarks/degraded_step.py's device4 job measures the ratio with a device per rank.",
    ]
    grow = summ.get("a:grow")
    if grow and grow["grow_gap_s"]["median"] is not None:
        notes.append(
            f"Growing back (a:grow, spare ready once step {a.grow_at} is committed): "
            f"{grow['grow_gap_s']['median']:.2f} s from the last degraded step's commit to the first step "
            "committed by every rank at full width (one step of it is training)."
        )
    failed = [f"{r['design']}:{r['scenario']} #{r['repeat']}: {r['error']}" for r in runs if r["error"]]
    if failed:
        notes.append("Failed runs: " + "; ".join(failed))
    return notes


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 1 repeat of 24-step jobs, faults at 6 and 14"
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--fault-steps", default="15,35", help="F1,F2: K/2 steps after a checkpoint for K=10")
    ap.add_argument(
        "--grow-at", type=int, default=35, help="a:grow's spare is ready once this step is committed"
    )
    ap.add_argument("--ckpt-every", type=int, default=10, help="torchrun's checkpoint interval K")
    ap.add_argument("--last-call", type=int, default=2, help="torchrun rendezvous last_call_timeout (s)")
    ap.add_argument("--warmup", type=int, default=5, help="full-width steps left out at the start")
    ap.add_argument("--skip", type=int, default=2, help="steps left out after each recovery")
    ap.add_argument(
        "--hang-timeout",
        type=float,
        default=60.0,
        help="both designs; longer than a job, so that checkpointless' rule against a spare wedged "
        "while starting does not kill and restart the spares held back as absent capacity",
    )
    bl.add_model_args(ap)
    ap.set_defaults(global_batch=12)
    bl.add_run_args(ap, run_timeout=300.0, out=str(bl.RESULTS / "degraded.json"))
    a = ap.parse_args(argv)
    if a.quick:
        a.repeats, a.steps, a.fault_steps, a.grow_at, a.ckpt_every, a.warmup = 1, 24, "6,14", 14, 4, 2
    a.fault_steps = [int(x) for x in str(a.fault_steps).split(",")]
    if len(a.fault_steps) != 2 or not 0 < a.fault_steps[0] < a.fault_steps[1] < a.steps:
        ap.error(f"--fault-steps {a.fault_steps}: give F1,F2 with 0 < F1 < F2 < --steps {a.steps}")
    if a.nproc < 3 or any(a.global_batch % w for w in (a.nproc, a.nproc - 1, a.nproc - 2)):
        ap.error(f"--global-batch {a.global_batch} must divide by {a.nproc}, {a.nproc - 1} and {a.nproc - 2} ranks "
                 "(the elastic baseline keeps it at every width); --nproc at least 3")  # fmt: skip
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse(argv)
    cmd = "python benchmarks/degraded.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    info = bl.machine_info()
    t0 = time.monotonic()
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="cl-bench-degraded-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    print(f"degraded mode against torchrun elastic: {a.repeats * len(RUNS)} jobs in {work}", flush=True)
    try:
        with bl.cleanup_on_exit(), bl.run_bar(a.repeats * len(RUNS), "degraded") as bar:
            for rep in range(a.repeats):
                for job in bl.interleaved(RUNS, rep):
                    runs.append(collect(a, job, rep, work))
                    bar.update()
    finally:
        if not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    info["bench_wall_s"] = round(time.monotonic() - t0, 1)
    info["load_note"] = bl.load_note(info["loadavg_start"], [round(x, 2) for x in os.getloadavg()])
    summ = summarise(a, runs)
    result = {
        "benchmark": "degraded",
        "command": cmd,
        "machine": info,
        "params": {k: v for k, v in vars(a).items() if k != "out"},
        "summary": summ,
        "notes": build_notes(a, summ, runs),
        "runs": runs,
    }
    for note in result["notes"]:
        print("- " + note)
    return bl.save_result(a.out, result)


if __name__ == "__main__":
    res = main()
    sys.exit(1 if any(r["error"] for r in res["runs"]) else 0)
