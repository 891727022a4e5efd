"""Recovery of a 3-D parallel job (replicate x FSDP x TP) from a SIGKILL: checkpointless versus
torchrun + DCP checkpoints (issue 37).

One job, ``examples/llama_3d.py`` (a Llama-style model on ``init_device_mesh(("dp", "shard",
"tp"))``: tensor parallel inside each (dp, shard) pair, FSDP2's HSDP over (dp, shard); 2 x 2 x 2 = 8
ranks), runs, per repeat, side by side:

* (a) ``checkpointless run --nproc 8 --spares 1 --inject kill:rank=R:step=F``: the survivors abort
  their in-flight TP and FSDP collectives, a hot spare takes rank R and receives its (shard, tp)
  state from the rank with the same coordinates in the other replica, and the step is replayed;
* (b) ``torchrun --max-restarts 3 benchmarks/baseline/train_3d_ckpt.py``: the same model, mesh,
  batches and optimizer on plain gloo, with ``torch.distributed.checkpoint.save`` of the sharded
  state dict (TP and FSDP DTensors, AdamW state) every K steps; the kill makes torchrun restart
  every worker, which loads the newest checkpoint and redoes the steps after it;
* (c) each design without the fault: the bitwise check, the job time, and the steady-state step
  time of checkpointless against plain torchrun on the same workload.

Measured as benchmarks/sharded_recovery.py measures the HSDP job (the readers of
benchmarks/_harness/downtime.py): downtime from the kill to the next step completed on every rank,
its phases, steps computed twice, and whether every rank's final shards are bitwise (c)'s.

    .venv/bin/python benchmarks/parallel_recovery.py             # 1 repeat: 4 jobs
    .venv/bin/python benchmarks/parallel_recovery.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "baseline"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as bl
import recovery as rv
import shardlib as sl
from _harness import downtime as dt
from sharded_recovery import collect, recovery_notes

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
    return bl.run_job(
        command(a, cfg, kind, run_dir), run_dir, timeout=a.run_timeout, env=bl.bench_env(a.threads)
    )


def build_notes(a: argparse.Namespace, agg: dict[str, Any], runs: list[dt.RunRecord]) -> list[str]:
    notes = recovery_notes(a, agg)
    if not a.no_reference:
        steps = {k: c["no_fault"]["step_s"]["median"] for k, c in agg["configs"].items() if "no_fault" in c}
        ours, theirs = steps.get("a"), steps.get(f"b{a.ckpt_every[0]}")
        if ours and theirs:
            notes.append(
                f"Steady-state step time without faults, checkpointless / torchrun: {ours / theirs:.3f} "
                f"({ours:.3f} s / {theirs:.3f} s; target ≤ 1.02; torchrun's saves are not in its step time)."
            )
    srcs = [
        r.metrics.get("sources") for r in runs if r.config.design == "checkpointless" and r.kind == "kill"
    ]
    if srcs:
        _, shard, tp = a.mesh
        notes.append(
            f"checkpointless plans (receiver, source): {srcs}; rank r has (dp, shard, tp) = "
            f"(r // {shard * tp}, r // {tp} % {shard}, r % {tp}): a source must differ in dp only."
        )
    resume = ", ".join(
        f"K={k} resumes from step {a.fault_step // k * k} and redoes {a.fault_step % k}" for k in a.ckpt_every
    )
    notes.append(f"SIGKILL of rank {a.fault_rank} as it begins step {a.fault_step} of {a.steps}: {resume}.")
    failed = [f"{r.config.label} {r.kind} #{r.repeat}: {r.error}" for r in runs if r.error]
    if failed:
        notes.append("Failed runs: " + "; ".join(failed))
    return notes


def parse_mesh(text: str) -> tuple[int, int, int]:
    dp, shard, tp = (int(x) for x in text.split(","))
    if dp < 2 or shard < 1 or tp < 1:
        raise ValueError(f"--mesh {text}: use DP,SHARD,TP with DP >= 2 (a lost rank needs a replica)")
    return dp, shard, tp


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="2,2,2", help="DP,SHARD,TP of the job")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--ckpt-every", default="10", help="checkpoint intervals K of the baseline")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument(
        "--fault-step", type=int, default=35, help="default 35: K/2 steps after a checkpoint for K=10"
    )
    ap.add_argument("--fault-rank", type=int, default=5, help="default 5: (dp, shard, tp) = (1, 0, 1)")
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--hang-timeout", type=float, default=5.0, help="same value for both designs")
    ap.add_argument("--no-reference", action="store_true", help="skip the fault-free runs (c)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every training process")
    bl.add_run_args(ap, run_timeout=400.0, out=str(bl.RESULTS / "parallel_recovery.json"))
    a = ap.parse_args(argv)
    try:
        a.mesh = parse_mesh(a.mesh)
    except ValueError as e:
        ap.error(str(e))
    a.nproc = a.mesh[0] * a.mesh[1] * a.mesh[2]
    if not 0 <= a.fault_rank < a.nproc:
        ap.error(f"--fault-rank {a.fault_rank} is not a rank of a {a.nproc}-rank mesh")
    if not 0 < a.fault_step < a.steps:
        ap.error(f"--fault-step {a.fault_step} must be inside the job (0 < fault-step < --steps {a.steps})")
    a.ckpt_every = [int(x) for x in str(a.ckpt_every).split(",") if x]
    a.kinds = ["kill"]  # what benchmarks/recovery.py's aggregation iterates over

    configs = [dt.Config("a", "checkpointless")] + [dt.Config(f"b{k}", "torchrun", k) for k in a.ckpt_every]
    cmd = "python benchmarks/parallel_recovery.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    info = bl.machine_info()
    load0 = os.getloadavg()
    t0 = time.monotonic()
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="cl-bench-3d-"))
    work.mkdir(parents=True, exist_ok=True)
    kinds = ["kill"] if a.no_reference else ["none", "kill"]
    runs: list[dt.RunRecord] = []
    print(f"3-D recovery: {a.repeats * len(configs) * len(kinds)} job runs in {work}", flush=True)
    try:
        with bl.cleanup_on_exit(), bl.run_bar(a.repeats * len(configs) * len(kinds), "3-D recovery") as bar:
            for rep, kind, cfg in dt.schedule(a.repeats, kinds, configs):
                runs.append(collect(a, cfg, kind, rep, work, launch))
                bar.update()
    finally:
        if not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    agg, tables, notes = rv.summarize(a, runs, configs, build_notes, info, load0, t0)
    result = {
        "benchmark": "parallel_recovery",
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
