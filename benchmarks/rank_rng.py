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
    .venv/bin/python benchmarks/rank_rng.py --lightning      # in a Lightning fit: 3 x 300 steps

``--lightning`` measures what a Lightning rank keeps (its generators; its loader position is not
kept: a replacement seeks to the job's step) inside a real single-process ``fit`` of
examples/lightning_gpt.py's GPT, one rank's share of its 2-rank batch: a callback does the
keeping at the points the strategy's step does (entry, first collective and update, commit),
fits with and without it interleaved, and the share is of the Lightning step measured alongside
(not of the overhead benchmark's step).

It writes ``benchmarks/results/rank_rng.json`` (``--lightning``: ``rank_rng_lightning.json``;
``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


# -- a Lightning rank -----------------------------------------------------------------------------
def lightning_fit(steps: int, keeper: RankRngKeeper | None) -> dict[str, Any]:
    """One single-process fit of examples/lightning_gpt.py's GPT (its default size, 6 sequences
    a step: one rank's share of its 12 on 2 ranks) whose callback does a rank's keeping at the
    step's points (``keeper``; None: none), on the fit's own generators (Lightning's seeding,
    dropout). Returns the steps' wall times (batch start to batch start) and the keeping's."""
    import lightning.pytorch as pl
    from lightning_gpt import LitGPT, TokenWindows
    from torch.utils.data import DataLoader

    starts: list[float] = []
    keep_s: list[float] = []  # per step: entry, first collective and update, commit (wall)
    keep_cpu: list[float] = []  # the same, in this thread's CPU time
    sizes = {"record_bytes": 0, "position_bytes": 0}

    def timed(work: Callable[[], None]) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        work()
        keep_s[-1] += time.perf_counter() - t0
        keep_cpu[-1] += time.thread_time() - c0

    class Keeping(pl.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            starts.append(time.perf_counter())
            if keeper is not None:
                rng = capture_rng()  # StepRecord.begin's capture: there before this work, not counted
                keep_s.append(0.0)
                keep_cpu.append(0.0)
                timed(lambda: keeper.at_entry(trainer.global_step, rng))

        def on_before_optimizer_step(self, trainer: Any, *args: Any) -> None:
            if keeper is not None:
                index = trainer.global_step

                def update() -> None:
                    keeper.at_collective(index)  # a gradient bucket's all-reduce, under DDP
                    keeper.at_update(index)  # the optimizer's pre-hook

                timed(update)

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if keeper is not None:
                index = trainer.global_step - 1  # Lightning has counted the update already
                timed(lambda: keeper.at_commit(index))
                kept = keeper.load(index + 1) if not sizes["record_bytes"] else None
                if kept is not None:  # what a Lightning rank keeps: no loop or sampler position
                    sizes["record_bytes"] = len(encode_record(kept))
                    sizes["position_bytes"] = len(kept.data or b"")

    pl.seed_everything(1234, workers=True, verbose=False)
    data = TokenWindows(None, 32, 1234)
    args = argparse.Namespace(  # the example's defaults
        dim=64, layers=2, heads=2, seq_len=32, dropout=0.1, lr=3e-3, steps=steps, print_batches=False
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=[Keeping()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(LitGPT(data.vocab, args), DataLoader(data, batch_size=6, shuffle=True, drop_last=True))
    step_s = [b - a for a, b in itertools.pairwise(starts)][5:]  # past the first steps
    return {
        "step_us": statistics.median(step_s) * 1e6,
        "keep_s": keep_s[5:],
        "keep_cpu_s": keep_cpu[5:],
        **sizes,
    }


def lightning_main(args: argparse.Namespace) -> dict[str, Any]:
    """The Lightning part: fits with and without the keeping, interleaved."""
    sys.path.insert(0, str(bl.REPO / "examples"))
    import warnings

    warnings.filterwarnings("ignore", module="lightning")  # its hints about workers and logging
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        keep: list[dict[str, Any]] = []
        plain: list[float] = []
        loop_us: list[float] = []  # the plain loop's keeping, timed in each round: the load's yardstick
        for i in range(args.rounds):
            for loop in bl.interleaved(("keep", "plain"), i):
                if loop == "keep":
                    keeper = RankRngKeeper()
                    keeper.configure(Path(d), 0)
                    keep.append(lightning_fit(args.steps, keeper))
                else:
                    plain.append(lightning_fit(args.steps, None)["step_us"])
            r = one_round(2000, False, Path(d))
            loop_us.append(r["entry_us"] + r["update_us"] + r["commit_us"])
    per_step = [statistics.median(r["keep_s"]) * 1e6 for r in keep]
    per_step_cpu = [statistics.mean(r["keep_cpu_s"]) * 1e6 for r in keep]
    step_us = statistics.median(plain)
    return {
        "record_bytes": keep[-1]["record_bytes"],
        "position_bytes": keep[-1]["position_bytes"],
        "keep_us": [round(x, 1) for x in per_step],
        "keep_cpu_us": [round(x, 1) for x in per_step_cpu],
        "step_us_plain": [round(x, 1) for x in plain],
        "step_us_keeping": [round(r["step_us"], 1) for r in keep],
        "per_step_us_median": round(statistics.median(per_step), 1),
        "per_step_cpu_us_median": round(statistics.median(per_step_cpu), 1),
        "step_us_median": round(step_us, 1),
        "share_of_step_median": statistics.median(per_step) / step_us,
        "share_of_overhead_step": statistics.median(per_step) / (args.step_ms * 1e3),
        # the loop the default mode times (no first-collective capture, no full check at the
        # update), run between the fits: compare with its low-load figure to see the load's share
        "loop_us": [round(x, 1) for x in loop_us],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, help="steps a round (default 2000; with --lightning 300 a fit)")
    ap.add_argument("--rounds", type=int, help="rounds (default 5; with --lightning 3)")
    ap.add_argument("--step-ms", type=float, default=47.6, help="the step time to compare with")
    ap.add_argument("--draw-between", action="store_true")
    ap.add_argument("--cuda", action="store_true", help="initialise CUDA: its generators are kept too")
    ap.add_argument("--lightning", action="store_true", help="in a Lightning fit, against its step")
    ap.add_argument("--out", help="JSON output (default results/rank_rng.json, rank_rng_lightning.json)")
    args = ap.parse_args()
    args.steps = args.steps or (300 if args.lightning else 2000)
    args.rounds = args.rounds or (3 if args.lightning else 5)
    args.out = args.out or str(
        bl.RESULTS / ("rank_rng_lightning.json" if args.lightning else "rank_rng.json")
    )
    machine = bl.machine_info()
    t_start = time.monotonic()
    torch.set_num_threads(1)
    if args.lightning:
        measured = lightning_main(args)
        machine["bench_wall_s"] = time.monotonic() - t_start
        machine["load_note"] = bl.load_note(machine["loadavg_start"], [round(x, 2) for x in os.getloadavg()])
        command = "python benchmarks/rank_rng.py " + " ".join(sys.argv[1:])
        result = {
            "benchmark": "rank_rng_lightning",
            "command": command,
            "machine": machine,
            "params": vars(args),
        }
        print(json.dumps(measured, indent=1))
        bl.save_result(args.out, {**result, **measured})
        return
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
