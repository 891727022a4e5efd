"""CPU that a rank spends waiting on a gloo collective whose peer is late, four ways.

Two processes, one gloo group; each round, rank 1 joins an all-reduce ``--late-ms`` after rank 0
issued it, and rank 0's process CPU over the wait is read (``time.process_time``: the waiting
thread and gloo's own threads, so a callback on gloo's thread is counted), with its wake-up: from
the moment rank 1 joined to rank 0's return (the same machine's monotonic clock).

* ``blocking``: torch's ``work.wait()`` (what plain torch does; cannot be woken by an abort);
* ``slices``: bounded 10 ms ``work.wait(timeout)`` calls until it completes, each timeout ending
  in c10d's error: what checkpointless's :class:`~checkpointless.comm.handle.Handle` did until
  session 35, checking for an abort between slices;
* ``callback``: asleep at once on an event that the work's future callback (or an abort) sets;
* ``first_wait``: what the handle does now: one bounded 10 ms wait, then ``callback``.

A fifth way, polling ``is_completed()`` with sleeps from 50 µs to 1 ms, cost more than all of
these (4.5 ms a 100 ms wait, session 35) and is left out. Why it matters: on two busy cores a
collective waits for a descheduled peer for tens of milliseconds, and a pipeline stage waits for
the slower stage every step; whatever a wait costs per millisecond becomes step time there.

Run: ``python benchmarks/wait_cost.py`` (~1.5 min); writes benchmarks/results/wait_cost.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent / "baseline"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as bl

MODES = ("blocking", "slices", "callback", "first_wait")
_SLICE = datetime.timedelta(milliseconds=10)


def _wait(mode: str, work: Any) -> int:
    """Wait for ``work`` the ``mode`` way; return how many bounded waits timed out."""
    if mode == "blocking":
        work.wait()
        return 0
    timeouts = 0
    if mode in ("slices", "first_wait"):
        while True:
            try:
                work.wait(_SLICE)
                return timeouts
            except Exception:
                timeouts += 1
                if work.is_completed():
                    return timeouts
            if mode == "first_wait":
                break
    if not work.is_completed():
        done = threading.Event()
        work.get_future().add_done_callback(lambda _: done.set())
        done.wait(60.0)
    return timeouts


def _worker(rank: int, path: str, mode: str, rounds: int, lates: list[float], q: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    t = torch.zeros(2, dtype=torch.float64)
    for late_s in lates:
        cpu, wake, timeouts = [], [], 0
        for _ in range(rounds):
            dist.barrier()
            t.zero_()
            if rank == 1:
                time.sleep(late_s)
                t[0] = time.monotonic()  # when the late peer joins: rank 0 reads it in the sum
                dist.all_reduce(t)
                continue
            work = dist.all_reduce(t, async_op=True)
            c0 = time.process_time()
            timeouts += _wait(mode, work)
            woke = time.monotonic()
            cpu.append(time.process_time() - c0)
            wake.append(woke - float(t[0]))
        if rank == 0:
            q.put(
                {
                    "mode": mode,
                    "late_ms": late_s * 1e3,
                    "cpu_ms": statistics.fmean(cpu) * 1e3,
                    "wake_ms": statistics.median(wake) * 1e3,
                    "timeouts_per_wait": timeouts / rounds,
                }
            )
    dist.destroy_process_group()


def measure(mode: str, rounds: int, lates: list[float]) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    got: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cl-wait-cost-") as d:
        path = os.path.join(d, "store")
        procs = [ctx.Process(target=_worker, args=(r, path, mode, rounds, lates, q)) for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 120 + rounds * sum(lates)
        try:
            while len(got) < len(lates):
                try:
                    got.append(q.get(timeout=1))
                except queue.Empty:
                    if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                        codes = [p.exitcode for p in procs]
                        raise RuntimeError(f"wait_cost {mode}: a rank failed or hung ({codes})") from None
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    return got


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--late-ms", type=float, nargs="+", default=[2.0, 20.0, 100.0], help="how late the peer joins"
    )
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="the ways to wait")
    ap.add_argument("--rounds", type=int, default=30, help="waits per measurement")
    ap.add_argument("--repeats", type=int, default=3, help="measurements of each mode, alternating")
    ap.add_argument("--out", default=str(bl.RESULTS / "wait_cost.json"))
    a = ap.parse_args(argv)
    lates = [ms / 1000 for ms in a.late_ms]
    runs = [r for _ in range(a.repeats) for m in a.modes for r in measure(m, a.rounds, lates)]
    summary: dict[str, dict[str, Any]] = {}
    for late in a.late_ms:
        for m in a.modes:
            mine = [r for r in runs if r["mode"] == m and r["late_ms"] == late]
            summary[f"{m} {late:g}"] = {
                "mode": m,
                "late_ms": late,
                "cpu_ms_per_wait": statistics.median(r["cpu_ms"] for r in mine),
                "wake_ms": statistics.median(r["wake_ms"] for r in mine),
                "timeouts_per_wait": statistics.median(r["timeouts_per_wait"] for r in mine),
            }
    res = {
        "benchmark": "wait_cost",
        "command": "python benchmarks/wait_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": bl.machine_info(),
        "load_end": list(os.getloadavg()),
        "params": vars(a),
        "summary": summary,
        "runs": runs,
    }
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(
        f"process CPU of the waiting rank per wait, and its wake-up after the late peer joined (median of {a.repeats}):"
    )
    for s in summary.values():
        print(
            f"  late {s['late_ms']:5g} ms  {s['mode']:9s} CPU {s['cpu_ms_per_wait']:6.3f} ms  "
            f"wake {s['wake_ms']:6.3f} ms  ({s['timeouts_per_wait']:.1f} timed-out bounded waits)"
        )
    return res


if __name__ == "__main__":
    main()
