"""Recovery of a sharded (HSDP) job from a SIGKILL: checkpointless versus torchrun + DCP checkpoints.

One HSDP job (``examples/train_gpt.py --fsdp 2,2``: 4 ranks, two replica groups of two shards)
runs, per repeat, side by side:

* (a) ``checkpointless run --nproc 4 --spares 1 --inject kill:rank=1:step=F``: the survivors abort
  the in-flight collectives, a hot spare takes rank 1 and receives shard 1 from its replica peer
  (rank 3), and the interrupted step is replayed;
* (b) ``torchrun --max-restarts 3 benchmarks/baseline/train_fsdp_ckpt.py --fsdp 2,2`` with
  ``torch.distributed.checkpoint.save`` of the FSDP2 state dict (each rank's shards of model and
  AdamW state) every K steps, once per K (default 10 and 50): the same kill makes torchrun restart
  every worker, which loads the newest checkpoint and redoes the steps after it;
* (c) each design without the fault, for the bitwise check and the job-time comparison
  (``--no-reference`` leaves it out).

Measured from the per-rank commit logs and the launchers' records, with the readers of
benchmarks/_harness/downtime.py (shared with benchmarks/recovery.py, whose tables it prints too): downtime from the kill to the next step completed on every rank and its
phases (detect, abort, rebuild, state, first batch, first step), steps computed twice, the time to
be back at the fault's step, and whether every rank's final shards are bitwise (c)'s.

    .venv/bin/python benchmarks/sharded_recovery.py             # 1 repeat: 6 jobs (~3 min)
    .venv/bin/python benchmarks/sharded_recovery.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "baseline"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as bl
import recovery as rv
import shardlib as sl
from _harness import downtime as dt

__all__ = ["main"]


def launch(a: argparse.Namespace, cfg: dt.Config, kind: str, run_dir: Path) -> bl.Finished:
    inject = dt.inject_spec(a, kind)
    if cfg.design == "checkpointless":
        cmd = sl.checkpointless_command(
            a,
            a.mesh,
            run_dir,
            spares=a.spares,
            launcher_args=["--hang-timeout", str(a.hang_timeout), *inject],
        )
    else:
        cmd = sl.torchrun_command(
            a, a.mesh, run_dir, ckpt_every=cfg.ckpt_every, max_restarts=3,
            script_args=["--hang-timeout", str(a.hang_timeout), *inject],
        )  # fmt: skip
    return bl.run_job(cmd, run_dir, timeout=a.run_timeout, env=bl.bench_env(a.threads))


def plan_sources(run_dir: Path) -> list[list[int]]:
    """[receiver, source] pairs of every recovery plan after the first generation."""
    out: list[list[int]] = []
    for e in bl.read_jsonl(run_dir / "events.jsonl"):
        if e.get("event") == "plan" and int(e.get("generation", 0)) > 0:
            out.extend([int(r), int(s)] for r, s in e.get("sources", []))
    return out


def collect(
    a: argparse.Namespace,
    cfg: dt.Config,
    kind: str,
    repeat: int,
    work: Path,
    launcher: Callable[[argparse.Namespace, dt.Config, str, Path], bl.Finished] = launch,
) -> dt.RunRecord:
    """Run one job (``launcher``: this benchmark's HSDP job by default; parallel_recovery.py
    passes its 3-D one) and read it, every rank's shard digests combined into one."""
    run_dir = work / f"{cfg.key}-{kind}-{repeat}"
    shutil.rmtree(run_dir, ignore_errors=True)
    fin = launcher(a, cfg, kind, run_dir)
    sl.combine_digests(run_dir, a.nproc)  # every rank's shards, into run_dir/digest
    return dt.read_run(
        cfg, kind, repeat, fin, run_dir, fault_step=a.fault_step, run_timeout=a.run_timeout,
        checkpointless_extra=lambda d: {"sources": plan_sources(d)}, kind_width=9, logs_in_error=True,
    )  # fmt: skip


def recovery_notes(a: argparse.Namespace, agg: dict[str, Any]) -> list[str]:
    """The notes every sharded recovery benchmark gives (here and in parallel_recovery.py): each
    downtime ratio against its target, checkpointless' lost steps, and each design's final
    shards against its fault-free run's."""
    notes = []
    for key, r in agg["ratios"].items():
        if r["downtime"] is not None:
            verdict = "met" if r["downtime"] <= 0.1 else "NOT met"
            notes.append(
                f"Downtime ratio (a)/(b) against target ≤ 0.1, K={key.split('/b')[1]}: {r['downtime']:.3f} ({verdict})."
            )
    cl = agg["configs"]["a"]["kinds"]["kill"]
    if cl["n"]:
        lost = cl["lost_steps"]["max"]
        notes.append(
            f"Lost steps of checkpointless, target 0: max {lost:.0f} ({'met' if lost == 0 else 'NOT met'})."
        )
    if not a.no_reference:
        for c in agg["configs"].values():
            k = c["kinds"]["kill"]
            if k["n"] and not k["digest_equal"]:
                notes.append(f"{c['label']}: final shards differ from the fault-free run's.")
            elif k["n"]:
                notes.append(
                    f"{c['label']}: every rank's final shards bitwise equal to the fault-free run's."
                )
    return notes


def kill_notes(
    a: argparse.Namespace, agg: dict[str, Any], runs: list[dt.RunRecord], *, holds: str, killed: str = ""
) -> list[str]:
    """The notes of a sharded recovery benchmark that kills one rank (here, parallel_recovery.py and
    parallel_pp.py): :func:`recovery_notes`, the plans' sources with ``holds`` saying which rank
    holds what (so a reader can check each source holds the receiver's state), what each
    checkpoint interval redoes, and the runs that failed. ``killed`` adds to "SIGKILL of rank R"
    (its stage, for a pipeline)."""
    notes = recovery_notes(a, agg)
    srcs = [
        r.metrics.get("sources") for r in runs if r.config.design == "checkpointless" and r.kind == "kill"
    ]
    if srcs:
        notes.append(f"checkpointless plans (receiver, source): {srcs}; {holds}")
    resume = ", ".join(
        f"K={k} resumes from step {a.fault_step // k * k} and redoes {a.fault_step % k}" for k in a.ckpt_every
    )
    notes.append(
        f"SIGKILL of rank {a.fault_rank}{killed} as it begins step {a.fault_step} of {a.steps}: {resume}."
    )
    failed = [f"{r.config.label} {r.kind} #{r.repeat}: {r.error}" for r in runs if r.error]
    if failed:
        notes.append("Failed runs: " + "; ".join(failed))
    return notes


def build_notes(a: argparse.Namespace, agg: dict[str, Any], runs: list[dt.RunRecord]) -> list[str]:
    return kill_notes(a, agg, runs, holds=f"rank r holds shard r % {a.mesh[1]}.")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="2,2", help="R,S of the HSDP job (R >= 2: a shard needs a replica)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--ckpt-every", default="10,50", help="checkpoint intervals K of the baseline")
    ap.add_argument("--steps", type=int, default=78)
    ap.add_argument(
        "--fault-step",
        type=int,
        default=75,
        help="default 75: K/2 steps after a checkpoint for K=10 and K=50",
    )
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--hang-timeout", type=float, default=5.0, help="same value for both designs")
    ap.add_argument("--no-reference", action="store_true", help="skip the fault-free runs (c)")
    sl.add_model_args(ap)
    bl.add_run_args(ap, run_timeout=300.0, out=str(bl.RESULTS / "sharded_recovery.json"))
    a = ap.parse_args(argv)
    try:
        a.mesh = sl.parse_mesh(a.mesh)
    except ValueError as e:
        ap.error(str(e))
    if a.mesh[0] < 2:
        ap.error(
            f"--mesh {a.mesh[0]},{a.mesh[1]}: R must be >= 2, a shard with no replica is not recoverable"
        )
    if not 0 <= a.fault_rank < a.mesh[0] * a.mesh[1]:
        ap.error(f"--fault-rank {a.fault_rank} is not a rank of a {a.mesh[0]}x{a.mesh[1]} mesh")
    if not 0 < a.fault_step < a.steps:
        ap.error(f"--fault-step {a.fault_step} must be inside the job (0 < fault-step < --steps {a.steps})")
    a.ckpt_every = [int(x) for x in str(a.ckpt_every).split(",") if x]
    a.kinds = ["kill"]  # what benchmarks/recovery.py's aggregation iterates over
    a.nproc = a.mesh[0] * a.mesh[1]

    configs = [dt.Config("a", "checkpointless")] + [dt.Config(f"b{k}", "torchrun", k) for k in a.ckpt_every]
    cmd = "python benchmarks/sharded_recovery.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    info = bl.machine_info()
    load0 = os.getloadavg()
    t0 = time.monotonic()
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="cl-bench-shrec-"))
    work.mkdir(parents=True, exist_ok=True)
    kinds = ["kill"] if a.no_reference else ["none", "kill"]
    runs: list[dt.RunRecord] = []
    print(f"sharded recovery: {a.repeats * len(configs) * len(kinds)} job runs in {work}", flush=True)
    try:
        with (
            bl.cleanup_on_exit(),
            bl.run_bar(a.repeats * len(configs) * len(kinds), "sharded recovery") as bar,
        ):
            for rep, kind, cfg in dt.schedule(a.repeats, kinds, configs):
                runs.append(collect(a, cfg, kind, rep, work))
                bar.update()
    finally:
        if not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    agg, tables, notes = rv.summarize(a, runs, configs, build_notes, info, load0, t0)
    result = {
        "benchmark": "sharded_recovery",
        "command": cmd,
        "machine": info,
        "params": {k: v for k, v in vars(a).items() if k != "out"},
        "summary": agg,
        "tables": tables,
        "notes": notes,
        "runs": dt.run_rows(runs),
    }
    return bl.save_result(a.out, result)


if __name__ == "__main__":
    res = main()
    sys.exit(1 if any(r["error"] for r in res["runs"]) else 0)
