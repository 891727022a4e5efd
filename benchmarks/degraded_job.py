"""The job of benchmarks/degraded_step.py: a data-parallel MLP whose every micro-batch is a function
of (slot, step) (read through ``step.slot``, so a survivor holding a lost rank's slot trains that
slot's batch), with a compute-bound pass (``--dim``, ``--batch``, ``--layers``) and optionally a
fixed sleep per pass (``--sleep``: stands for a pass on a device of the rank's own, which the
machine's shared cores do not slow down).

A spare (``CHECKPOINTLESS_ROLE=spare``) waits, before it joins, until rank 0 has committed step
``--spare-at-step`` (read from ``--run-dir``'s ``rank-0.jsonl``), so the degraded window the
benchmark measures is long enough and the grow-back still comes before the end."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import checkpointless as cl

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--dim", type=int, default=256)
parser.add_argument("--batch", type=int, default=512)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--spare-at-step", type=int, default=-1)
parser.add_argument("--run-dir", default="")
parser.add_argument(
    "--timeline", default="", help="write each pass's phase times to <run-dir>/timeline-<rank>.jsonl"
)
args = parser.parse_args()


def committed(run_dir: Path) -> int:
    last = -1
    try:
        lines = (run_dir / "rank-0.jsonl").read_text(errors="replace").splitlines()
    except OSError:
        return last
    for line in lines:
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if e.get("event") == "commit":
            last = max(last, int(e["step"]))
    return last


def mark(run_dir: Path, what: str) -> None:
    """When the spare began to wait and when it went on to join (``spare.jsonl``): the benchmark
    leaves the steps outside that span out of the degraded window, when the spare's own start
    would share the cores with them."""
    with open(run_dir / "spare.jsonl", "a") as f:
        f.write(json.dumps({"event": what, "time": time.time()}) + "\n")


if args.spare_at_step >= 0 and os.environ.get("CHECKPOINTLESS_ROLE") == "spare":
    mark(Path(args.run_dir), "waiting")
    while committed(Path(args.run_dir)) < args.spare_at_step:
        time.sleep(0.2)  # the launcher kills it with the job if the job ends first
    mark(Path(args.run_dir), "released")

torch.set_num_threads(1)
job = cl.init()
torch.manual_seed(0)
layers: list[torch.nn.Module] = []
for _ in range(args.layers):
    layers += [torch.nn.Linear(args.dim, args.dim), torch.nn.Tanh()]
model = torch.nn.Sequential(*layers, torch.nn.Linear(args.dim, 8))
dp = job.data_parallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
job.track(model=model, optimizer=opt)

# --timeline: per pass, the times (time.time()) as the loop yields it, as its body begins,
# after forward, backward (the last pass's waits for the all-reduce in it), the optimizer step
# and the sleep, and as `with step:` has exited (its commit in the last pass)
timeline: list[dict[str, float | int]] = []
t_yield = time.time()
for step in job.steps(args.steps):
    t = {"step": step.index, "pass": step.pass_index, "passes": step.passes, "yield": time.time()}
    t["prev_end"] = t_yield
    with step:
        t["body"] = time.time()
        g = torch.Generator().manual_seed(1000 * step.index + step.slot)
        x = torch.randn(args.batch, args.dim, generator=g)
        y = torch.randint(0, 8, (args.batch,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(dp(x), y)
        t["forward"] = time.time()
        loss.backward()
        t["backward"] = time.time()
        opt.step()
        t["optimizer"] = time.time()
        if args.sleep:
            time.sleep(args.sleep)
        t["sleep"] = time.time()
    t_yield = t["exit"] = time.time()
    if args.timeline:
        timeline.append(t)
if args.timeline:
    with open(Path(args.run_dir) / f"timeline-{job.rank}.jsonl", "w") as f:
        f.writelines(json.dumps(t) + "\n" for t in timeline)
