"""Recovery of the parallel jobs of issue 37 from a SIGKILL: checkpointless versus torchrun + DCP
checkpoints, with the step time and the state transfer of each.

Two jobs (``--jobs 3d,pp``), each run per repeat with both designs side by side:

* the 3-D job, ``examples/llama_3d.py``: a Llama-style model on ``init_device_mesh(("dp", "shard",
  "tp"))``, tensor parallel inside each (dp, shard) pair, FSDP2's HSDP over (dp, shard); 2 x 2 x 2
  = 8 ranks; its torchrun baseline is ``benchmarks/baseline/train_3d_ckpt.py`` (the sharded state
  dict, TP and FSDP DTensors and AdamW state, saved by DCP every K steps);
* the PP job, ``tests/scripts/pp_mlp.py --schedule 1f1b`` (benchmarks/parallel_pp.py): two
  pipeline stages x two replicas, ``Schedule1F1B``; its baseline is
  ``benchmarks/baseline/train_pp_ckpt.py`` (each rank's stage saved by DCP every K steps).

For each job:

* (a) ``checkpointless run --spares 1 --inject kill:rank=R:step=F``: the survivors abort their
  in-flight collectives and pipeline sends and receives, a hot spare takes rank R and receives its
  state from the rank with the same coordinates in the other replica, and the step is replayed;
* (b) ``torchrun --max-restarts 3`` on the baseline: the kill makes torchrun restart every worker,
  which loads the newest checkpoint and redoes the steps after it;
* (c) each design without the fault: the bitwise check, and the steady-state step time of
  checkpointless against the same training under plain torchrun.

Measured as benchmarks/sharded_recovery.py measures the HSDP job (the readers of
benchmarks/_harness/downtime.py): downtime from the kill to the next step completed on every rank,
its phases, steps computed twice, and whether every rank's final shards are bitwise (c)'s; and
(benchmarks/parallel_measure.py) the step-time ratio with its interval and the state the spare
received against a raw loopback copy of the same bytes. A job left out by ``--jobs`` keeps its
figures from the result file, with the command and date that made them.

    .venv/bin/python benchmarks/parallel_recovery.py --jobs pp --repeats 3   # 12 runs of 4 ranks
    .venv/bin/python benchmarks/parallel_recovery.py                         # both jobs, 1 repeat: 8 runs
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
import parallel_measure as pm
import parallel_pp
import recovery as rv
import shardlib as sl
from _harness import downtime as dt
from parallel_pp import PP
from sharded_recovery import collect, kill_notes

__all__ = ["main"]

LLAMA = bl.REPO / "examples" / "llama_3d.py"
BASELINE = bl.REPO / "benchmarks" / "baseline" / "train_3d_ckpt.py"


def model_args(a: argparse.Namespace) -> list[str]:
    return [
        "--steps", str(a.steps), "--dim", str(a.dim), "--layers", str(a.layers), "--heads", str(a.heads),
        "--seq-len", str(a.seq_len), "--vocab", str(a.vocab),
    ]  # fmt: skip


def command(a: argparse.Namespace, cfg: dt.Config, kind: str, run_dir: Path) -> list[str]:
    inject = dt.inject_spec(a, kind)
    dp, shard, tp = a.mesh
    digest = ["--digest-out", str(run_dir / "digest.{rank}")]
    if cfg.design == "checkpointless":
        return [
            bl.PYTHON, "-m", "checkpointless", "run", "--nproc", str(a.nproc), "--spares", str(a.spares),
            "--run-dir", str(run_dir), "--port-base", str(sl.port_base(run_dir)), "--port-range", "200",
            "--hang-timeout", str(a.hang_timeout), *inject, str(LLAMA), *model_args(a),
            "--dp", str(dp), "--fsdp", str(shard), "--tp", str(tp), *digest,
        ]  # fmt: skip
    return [
        bl.TORCHRUN, "--nproc-per-node", str(a.nproc), "--max-restarts", "3", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{bl.free_port()}", str(BASELINE), *model_args(a),
        "--mesh", f"{dp},{shard},{tp}", "--ckpt-every", str(cfg.ckpt_every), "--log-dir", str(run_dir),
        "--hang-timeout", str(a.hang_timeout), *inject, *digest,
    ]  # fmt: skip


def launch(a: argparse.Namespace, cfg: dt.Config, kind: str, run_dir: Path) -> bl.Finished:
    return pm.launch_sampled(command(a, cfg, kind, run_dir), run_dir, a, kind)


def build_notes(a: argparse.Namespace, agg: dict[str, Any], runs: list[dt.RunRecord]) -> list[str]:
    _, shard, tp = a.mesh
    return kill_notes(
        a,
        agg,
        runs,
        holds=f"rank r has (dp, shard, tp) = (r // {shard * tp}, r // {tp} % {shard}, r % {tp}): a source "
        "must differ in dp only.",
    )


def parse_mesh(text: str) -> tuple[int, int, int]:
    dp, shard, tp = (int(x) for x in text.split(","))
    if dp < 2 or shard < 1 or tp < 1:
        raise ValueError(f"--mesh {text}: use DP,SHARD,TP with DP >= 2 (a lost rank needs a replica)")
    return dp, shard, tp


def run_job(
    a: argparse.Namespace,
    name: str,
    launcher: Callable[[argparse.Namespace, dt.Config, str, Path], bl.Finished],
    notes_of: Callable[[argparse.Namespace, dict[str, Any], list[dt.RunRecord]], list[str]],
    work: Path,
    info: dict[str, Any],
    cmd: str,
) -> dict[str, Any]:
    """One job's runs, both designs, with and without the kill, and its part of the result."""
    configs = [dt.Config("a", "checkpointless")] + [dt.Config(f"b{k}", "torchrun", k) for k in a.ckpt_every]
    kinds = ["kill"] if a.no_reference else ["none", "kill"]
    runs: list[dt.RunRecord] = []
    load0, t0 = os.getloadavg(), time.monotonic()
    with bl.run_bar(a.repeats * len(configs) * len(kinds), name) as bar:
        for rep, kind, cfg in dt.schedule(a.repeats, kinds, configs):
            load = [round(x, 2) for x in os.getloadavg()]  # the shared machine's load before each run
            bl.say(f"  {name}: load {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f} before the next run")
            rec = collect(a, cfg, kind, rep, work, launcher)
            rec.metrics["load_before"] = load
            run_dir = work / f"{cfg.key}-{kind}-{rep}"  # the directory collect() ran it in
            rec.metrics.update(pm.after_run(a, cfg, kind, run_dir))
            runs.append(rec)
            bar.update()
    part = pm.job_summary(a, runs)
    agg, tables, notes = rv.summarize(a, runs, configs, notes_of, dict(info), load0, t0)
    more = [pm.step_note(name, part["step_time"]), pm.cpu_note(name, part["step_time"])]
    more.append(pm.transfer_note(name, part["transfer"]))
    if part["designs_bitwise_equal"] is not None:
        same = "the same bits" if part["designs_bitwise_equal"] else "DIFFERENT bits"
        more.append(f"{name}: the two designs' fault-free runs end with {same} on every rank.")
    for n in more:
        print(f"- {n}")
    notes += more
    return {
        "params": {k: v for k, v in vars(a).items() if k != "out"},
        "measured": pm.measured(cmd, info),
        "load_note": bl.load_note(load0, os.getloadavg()),
        "summary": agg,
        **part,
        "tables": tables,
        "notes": notes,
        "runs": dt.run_rows(runs),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", default="3d,pp", help="which jobs: 3d, pp or both")
    ap.add_argument("--mesh", default="2,2,2", help="DP,SHARD,TP of the 3-D job")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--ckpt-every", default="10", help="checkpoint intervals K of the baseline")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument(
        "--fault-step", type=int, default=35, help="default 35: K/2 steps after a checkpoint for K=10"
    )
    ap.add_argument(
        "--fault-rank", type=int, default=5, help="3-D job; default 5: (dp, shard, tp) = (1, 0, 1)"
    )
    ap.add_argument("--pp-fault-rank", type=int, default=3, help="PP job; default 3: (dp, pp) = (1, 1)")
    ap.add_argument("--pp-hidden", type=int, default=1024, help="PP job: the MLP's hidden width")
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--hang-timeout", type=float, default=5.0, help="same value for both designs")
    ap.add_argument("--no-reference", action="store_true", help="skip the fault-free runs (c)")
    ap.add_argument("--loopback-repeats", type=int, default=3, help="raw loopback copies per transfer")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every training process")
    bl.add_run_args(ap, run_timeout=400.0, out=str(bl.RESULTS / "parallel_recovery.json"))
    a = ap.parse_args(argv)
    jobs = [j for j in a.jobs.split(",") if j]
    if not jobs or set(jobs) - {"3d", "pp"}:
        ap.error(f"--jobs {a.jobs}: name 3d, pp or 3d,pp")
    try:
        a.mesh = parse_mesh(a.mesh)
    except ValueError as e:
        ap.error(str(e))
    a.nproc = a.mesh[0] * a.mesh[1] * a.mesh[2]
    if not 0 <= a.fault_rank < a.nproc:
        ap.error(f"--fault-rank {a.fault_rank} is not a rank of a {a.nproc}-rank mesh")
    if not 0 <= a.pp_fault_rank < 2 * PP:
        ap.error(f"--pp-fault-rank {a.pp_fault_rank} is not a rank of the {2 * PP}-rank PP job")
    if not 0 < a.fault_step < a.steps:
        ap.error(f"--fault-step {a.fault_step} must be inside the job (0 < fault-step < --steps {a.steps})")
    a.ckpt_every = [int(x) for x in str(a.ckpt_every).split(",") if x]
    a.kinds = ["kill"]  # what benchmarks/recovery.py's aggregation iterates over

    cmd = (
        "python benchmarks/parallel_recovery.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    ).strip()
    info = bl.machine_info()
    load0 = os.getloadavg()
    t0 = time.monotonic()
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="cl-bench-par-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"parallel recovery: jobs {jobs} in {work}", flush=True)
    out: dict[str, Any] = {}
    try:
        with bl.cleanup_on_exit():
            if "3d" in jobs:
                (work / "3d").mkdir(exist_ok=True)
                out["3d"] = run_job(a, "3-D", launch, build_notes, work / "3d", info, cmd)
            if "pp" in jobs:
                pp = argparse.Namespace(**vars(a))
                pp.nproc, pp.fault_rank, pp.mesh = 2 * PP, a.pp_fault_rank, (2, PP)
                (work / "pp").mkdir(exist_ok=True)
                out["pp"] = run_job(
                    pp, "PP", parallel_pp.launch, parallel_pp.build_notes, work / "pp", info, cmd
                )
    finally:
        if not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    info["bench_wall_s"] = time.monotonic() - t0
    info["load_note"] = bl.load_note(load0, os.getloadavg())
    result = {
        "benchmark": "parallel_recovery",
        "command": cmd,
        "machine": info,
        "params": {k: v for k, v in vars(a).items() if k != "out"},
        # a job left out by --jobs keeps its last figures, with the command and date that made them
        "jobs": {**pm.carried_jobs(Path(a.out), jobs), **out},
    }
    return bl.save_result(a.out, result)


if __name__ == "__main__":
    res = main()
    ran = res["params"]["jobs"].split(",")
    sys.exit(1 if any(r["error"] for n in ran for r in res["jobs"][n]["runs"]) else 0)
