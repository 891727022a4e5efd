"""Durable DCP checkpoints: their steady-state cost, and the downtime of a restore from one.

Part 1 (in one process, no launcher): the example GPT (bench size: dim 128, 4 layers, AdamW) runs
its training step with a checkpoint started as every step begins (the worst case, K=1) and
without, alternating blocks of steps. The checkpoint goes through the job's own path
(``collect_state``, ``CheckpointWriter.start``, the optimizer pre-hook waiting for DCP's staging);
a save due while the previous one is still being written is skipped, as in a job, so part 1 also
reports how many were taken. Each block waits for the last save to be published, so DCP's
writing, fsync and the rename are counted too. Overhead of ``--checkpoint-every K`` = extra time
per save / (K x step).

Part 2 (real jobs under the launcher, 3 ranks, ``--snapshot-every 0 --checkpoint-every 3``, rank 0 sleeping 4 s as step 3 begins): one
rank SIGKILLed (a spare receives the state from a peer) versus every rank SIGKILLed at once (every
rank loads the checkpoint from disk); the launcher's ``recovery`` event gives the downtime.

    .venv/bin/python benchmarks/checkpoint.py                  # ~2 min on a busy 2-core machine
    .venv/bin/python benchmarks/checkpoint.py --skip-downtime  # part 1 only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import statebench as sb

from checkpointless.state.durable import CheckpointEvery, CheckpointWriter, list_checkpoints
from checkpointless.state.snapshot import capture_rng, collect_state
from checkpointless.state.staging import guarded_pointers

__all__ = ["main"]

REPO = sb.REPO


def cost(steps: int, blocks: int, every: int) -> dict[str, Any]:
    m = sb.bench_model()
    work = Path(tempfile.mkdtemp(prefix="cl-ckptbench-"))  # on disk, not /dev/shm: what a job writes
    writer = CheckpointWriter(work / "ck", CheckpointEvery(steps=every))
    waits: list[float] = []
    m.opt.register_step_pre_hook(lambda *a: waits.append(writer.wait_staged(60.0)))
    step_no = 0
    taken = 0
    sizes: list[int] = []
    totals: list[float] = []

    def published() -> None:
        info = writer.take_published()
        if info is not None:
            sizes.append(info.nbytes)
            totals.append(info.total_s)

    def block(save: bool) -> tuple[float, float, int]:
        nonlocal taken
        n = 0

        def one_step() -> None:
            nonlocal step_no, n
            step_no += 1
            if save and writer.due(step_no, time.monotonic()):
                state = collect_state(m.objects, step_no, capture_rng())
                n += writer.start(step_no, state, guarded_pointers([m.opt]))
            m.step()
            published()

        def settle() -> None:
            writer.wait_idle(60.0)
            published()

        wall, cpu = sb.timed_steps(steps, one_step, settle)
        taken += n
        return wall, cpu, n

    off, on = sb.alternate(blocks, block)
    writer.close(60.0)
    shutil.rmtree(work, ignore_errors=True)
    step_s = statistics.median(w for w, _, _ in off)
    per_block = statistics.median(n for _, _, n in on) or 1
    # the extra time of a block, spread over the saves it actually took
    extra = (statistics.median(w for w, _, _ in on) - step_s) * steps / per_block
    extra_cpu = (
        (statistics.median(c for _, c, _ in on) - statistics.median(c for _, c, _ in off)) * steps / per_block
    )
    return {
        "checkpoint_bytes": sizes[-1] if sizes else None,
        "step_s": step_s,
        "saves_per_block": per_block,
        "save_total_s_median": statistics.median(totals) if totals else None,
        "extra_wall_s_per_save": extra,
        "extra_cpu_s_per_save": extra_cpu,
        "optimizer_wait_s_median": statistics.median(waits) if waits else None,
        "overhead_pct": {k: 100 * max(extra, extra_cpu) / (k * step_s) for k in (10, 20, 50, 100, 500)},
    }


def _job(work: Path, corpus: Path, name: str, kill_all: bool) -> dict[str, Any]:
    run_dir = work / name
    launcher_args = ["--snapshot-every", "0", "--checkpoint-every", "3"]
    launcher_args += ["--inject", "slow:rank=0:step=3:seconds=4"]

    def workers_once_saved(text: str) -> list[int] | None:
        events = [json.loads(x) for x in text.splitlines()]
        if 3 not in list_checkpoints(run_dir / "checkpoints" / events[0]["job"]):
            return None  # the kill waits for the step-3 checkpoint to be published
        return [int(e["pid"]) for e in events if e["event"] == "spawn" and e["role"] == "worker"]

    cmd = sb.job_command(run_dir, corpus, launcher_args)
    return sb.run_killed_job(run_dir, cmd, workers_once_saved, kill_all)


def downtime() -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="cl-ckptbench-jobs-"))
    try:
        corpus = sb.prepare_corpus(work)
        return {
            "peer (1 rank killed)": _job(work, corpus, "peer", kill_all=False),
            "checkpoint (3 ranks killed)": _job(work, corpus, "ckpt", kill_all=True),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="steps per block")
    ap.add_argument("--blocks", type=int, default=4, help="blocks of each arm, alternating")
    ap.add_argument("--every", type=int, default=1, help="K inside part 1 (1: a save every step if free)")
    ap.add_argument("--skip-downtime", action="store_true")
    a = ap.parse_args()
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count()}
    result["cost"] = cost(a.steps, a.blocks, a.every)
    print(json.dumps(result["cost"], indent=1), flush=True)
    if not a.skip_downtime:
        result["downtime"] = downtime()
        print(json.dumps(result["downtime"], indent=1), flush=True)
    out = REPO / "benchmarks" / "results" / "checkpoint.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
