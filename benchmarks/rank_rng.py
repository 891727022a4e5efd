"""What keeping each rank's own generators costs a step (recovery/rank_rng.py), measured alone.

Per step a rank (1) as its update begins captures its generators and keeps them (encoded,
~12.7 KB, one write to its file in shared memory), (2) as the step commits checks torch's
generators against that record, and (3) as the next step begins compares the state it captures
anyway (``StepRecord.begin``) with the kept one, writing again only if something drew in
between. This times that work in a loop, the way the step loop does it, and divides it by the
overhead benchmark's median step (``benchmarks/overhead.py``: 2 ranks, the example GPT,
~47.6 ms on the development machine; pass ``--step-ms``) for the share. The CPU time per step
(the loop's thread CPU time less the same loop without the keeping) is the figure a loaded
machine disturbs least.

    .venv/bin/python benchmarks/rank_rng.py                  # 5 rounds of 2000 steps, /dev/shm
    .venv/bin/python benchmarks/rank_rng.py --draw-between   # something draws between steps: two writes

It writes ``benchmarks/results/rank_rng.json`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as bl

from checkpointless.recovery.rank_rng import RankRngKeeper, RngRecord, encode_record
from checkpointless.state.snapshot import capture_rng


def one_round(steps: int, draw_between: bool, directory: Path) -> dict[str, float]:
    keeper = RankRngKeeper()
    keeper.configure(directory, 0)
    commit_s = entry_s = update_s = 0.0
    cpu0 = time.thread_time()
    for index in range(steps):
        rng = capture_rng()  # StepRecord.begin's capture: there before this work, not counted
        t0 = time.perf_counter()
        keeper.keep(index, rng)
        entry_s += time.perf_counter() - t0
        torch.rand(64)  # the step draws (dropout, batches)
        t0 = time.perf_counter()
        keeper.at_update(index)  # the optimizer's pre-hook (guard.py)
        update_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        keeper.at_commit(index)  # commit.py
        commit_s += time.perf_counter() - t0
        if draw_between:
            torch.rand(1)  # e.g. rank 0's evaluation: the next entry writes again
    # the loop's CPU time less the step's own stand-in work: robust to a loaded machine, where
    # the wall times above also count the time other processes held the core
    loop_cpu = time.thread_time() - cpu0
    return {
        "update_us": update_s / steps * 1e6,
        "commit_us": commit_s / steps * 1e6,
        "entry_us": entry_s / steps * 1e6,
        "loop_cpu_us": loop_cpu / steps * 1e6,
    }


def baseline(steps: int) -> float:
    """The loop's CPU time per step without the keeping: the entry capture and the step's draw."""
    cpu0 = time.thread_time()
    for _ in range(steps):
        capture_rng()
        torch.rand(64)
    return (time.thread_time() - cpu0) / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--step-ms", type=float, default=47.6, help="the step time to compare with")
    ap.add_argument("--draw-between", action="store_true")
    ap.add_argument("--cuda", action="store_true", help="initialise CUDA: its generators are kept too")
    ap.add_argument("--out", default=str(bl.RESULTS / "rank_rng.json"), help="JSON output")
    args = ap.parse_args()
    machine = bl.machine_info()
    t_start = time.monotonic()
    torch.set_num_threads(1)
    if args.cuda:
        torch.rand(1, device="cuda")  # CUDA initialised: capture_rng() takes every device's state
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        one_round(200, args.draw_between, Path(d))  # warm-up
        rounds: list[dict[str, float]] = []
        base: list[float] = []
        for i in range(args.rounds):  # the two loops interleaved, so both see the same load
            for loop in bl.interleaved(("keep", "base"), i):
                if loop == "keep":
                    rounds.append(one_round(args.steps, args.draw_between, Path(d)))
                else:
                    base.append(baseline(args.steps))
    per_step = [r["update_us"] + r["commit_us"] + r["entry_us"] for r in rounds]
    machine["bench_wall_s"] = time.monotonic() - t_start
    machine["load_note"] = bl.load_note(machine["loadavg_start"], [round(x, 2) for x in os.getloadavg()])
    machine["cuda_state"] = torch.cuda.is_available() and torch.cuda.is_initialized()
    result = {
        "benchmark": "rank_rng",
        "command": "python benchmarks/rank_rng.py " + " ".join(sys.argv[1:]),
        "machine": machine,
        "params": vars(args),
        "record_bytes": len(encode_record(RngRecord(0, capture_rng()))),
        "update_us": [round(r["update_us"], 1) for r in rounds],
        "commit_us": [round(r["commit_us"], 1) for r in rounds],
        "entry_us": [round(r["entry_us"], 1) for r in rounds],
        "loop_cpu_us": [round(r["loop_cpu_us"], 1) for r in rounds],
        "base_cpu_us": [round(x, 1) for x in base],
        "per_step_us_median": round(statistics.median(per_step), 1),
        # CPU per step: the loop's, less the same loop without the keeping (capture at entry, draws)
        "per_step_cpu_us_median": round(
            statistics.median(r["loop_cpu_us"] for r in rounds) - statistics.median(base), 1
        ),
        "per_step_us_min": round(min(per_step), 1),
        "share_of_step_median": statistics.median(per_step) / (args.step_ms * 1e3),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    bl.save_result(args.out, result)


if __name__ == "__main__":
    main()
