"""Step time of torch's DDP on a plain gloo group against the same DDP on a resilient group.

Hugging Face Trainer and Accelerate build torch's own ``DistributedDataParallel`` over the job's
resilient default group (``comm/torch_ddp.py``). Its reducer issues each bucket's all-reduce from
a backward hook and asks for the work's future there; on a plain gloo group that future completes
later, and the all-reduces overlap the rest of backward. Every rank here holds three copies of one
MLP and trains them side by side in one run, on the same batches, in interleaved rounds:

* ``torch``: DDP on a plain ``ProcessGroupGloo`` (the baseline);
* ``ours``: DDP on a :class:`~checkpointless.comm.process_group.ResilientProcessGroup`, whose
  futures complete when the abortable work does, without waiting in the hook (the default);
* ``ours_waited``: the same with ``AbortableWork.defer_futures = False``: each future waited for
  in the hook that asks for it, so each bucket is reduced before backward goes on (what the
  resilient group did until session 36).

Each DDP regroups its buckets in parameter order (``fix_layout``), so all three reduce alike and
their final weights must be bitwise equal; the run fails otherwise. Reported: rank 0's wall time
per step (forward, backward, SGD update) of each design, and per round the ratios to ``torch``
with a bootstrap interval.

Run: ``python benchmarks/ddp_overlap.py`` (2 and 3 ranks, ~4 min on 2 cores); writes
benchmarks/results/ddp_overlap.json.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import queue
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as bl

DESIGNS = ("torch", "ours", "ours_waited")


def _mlp(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights in every copy on every rank
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods)


def _worker(rank: int, port: int, nproc: int, a: argparse.Namespace, q: Any) -> None:
    try:
        q.put(("ok", rank, _train(rank, port, nproc, a)))
    except BaseException:
        q.put(("error", rank, traceback.format_exc()))


def _train(rank: int, port: int, nproc: int, a: argparse.Namespace) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from checkpointless.comm.process_group import ResilientProcessGroup
    from checkpointless.comm.torch_ddp import fix_layout, serve_ddp
    from checkpointless.comm.work import AbortableWork

    torch.set_num_threads(a.threads)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, nproc, rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("plain", store), rank=rank, world_size=nproc)
    plain = dist.group.WORLD
    ours = ResilientProcessGroup(rank, nproc, range(nproc), timeout, key="bench")
    ours.configure(0, dist.PrefixStore("ours", store), deadline=time.monotonic() + 120)
    serve_ddp(ours)
    cap = a.bucket_mb
    models = {
        "torch": DistributedDataParallel(_mlp(a.width, a.layers), process_group=plain, bucket_cap_mb=cap),
        "ours": DistributedDataParallel(_mlp(a.width, a.layers), process_group=ours, bucket_cap_mb=cap),
        "ours_waited": DistributedDataParallel(
            _mlp(a.width, a.layers), process_group=ours, bucket_cap_mb=cap
        ),
    }
    opts = {d: torch.optim.SGD(m.parameters(), lr=1e-3) for d, m in models.items()}
    for m in models.values():
        fix_layout(m)
    step_no = dict.fromkeys(DESIGNS, 0)
    gate = torch.zeros(1)

    def step(design: str) -> None:
        g = torch.Generator().manual_seed(1000 * step_no[design] + rank)
        x = torch.randn(a.batch, a.width, generator=g)
        AbortableWork.defer_futures = design != "ours_waited"
        models[design](x).square().mean().backward()
        opts[design].step()
        opts[design].zero_grad()
        step_no[design] += 1

    rounds: list[dict[str, float]] = []
    for r in range(a.warmup_rounds + a.rounds):
        times: dict[str, float] = {}
        for design in bl.interleaved(DESIGNS, r):
            step(design)  # settles the previous design's threads and caches
            dist.all_reduce(gate)  # every rank starts the timed steps together
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step(design)
            times[design] = (time.perf_counter() - t0) / a.steps
        if r >= a.warmup_rounds:
            rounds.append(times)
    digests = {}
    for design, m in models.items():
        h = hashlib.sha256()
        for p in m.parameters():
            h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
        digests[design] = h.hexdigest()
    ours.close()
    dist.destroy_process_group()
    n_buckets = len(models["ours"].reducer._get_zeros_like_grad_buckets())
    return {"rounds": rounds, "digests": digests, "steps": step_no, "buckets": n_buckets}


def measure(a: argparse.Namespace, nproc: int) -> dict[int, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = bl.free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, nproc, a, q)) for r in range(nproc)]
    for p in procs:
        p.start()
    got: dict[int, dict[str, Any]] = {}
    try:
        deadline = time.monotonic() + a.timeout
        while len(got) < nproc:
            try:
                status, rank, res = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"ddp_overlap: ranks {sorted(got)} of {nproc} reported in time") from None
            if status != "ok":
                raise RuntimeError(f"ddp_overlap rank {rank} failed:\n{res}")
            got[rank] = res
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return got


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 3], help="ranks (processes), one run each")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    ap.add_argument("--bucket-mb", type=float, default=4.0, help="DDP's bucket_cap_mb")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each rank")
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each design per round")
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds (each design once, interleaved)")
    ap.add_argument("--warmup-rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600, help="the whole run's limit, seconds")
    ap.add_argument("--out", default=str(bl.RESULTS / "ddp_overlap.json"))
    a = ap.parse_args(argv)
    machine = bl.machine_info()
    runs = [_run(a, n) for n in a.nproc]
    res = {
        "benchmark": "ddp_overlap",
        "command": "python benchmarks/ddp_overlap.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine,
        "load_end": [round(x, 2) for x in os.getloadavg()],
        "params": {k: v for k, v in vars(a).items() if k != "out"},
        "params_mb": sum(p.numel() for p in _mlp(a.width, a.layers).parameters()) * 4 / 2**20,
        "runs": runs,
    }
    bl.save_result(a.out, res)
    for run in runs:
        print(
            f"{run['nproc']} ranks, {run['buckets']} buckets of {res['params_mb']:.0f} MB; ms per step (rank 0):"
        )
        for d in DESIGNS:
            s = run["step_ms"][d]
            line = f"  {d:12s} {s['median']:7.1f} [{s['min']:.1f}-{s['max']:.1f}]"
            c = run["ratio_to_torch"].get(d)
            if c and c["lo"] is not None:
                line += f"   x torch {c['geomean']:.3f} ({c['lo']:.3f}-{c['hi']:.3f})"
            print(line)
        print(f"  final weights bitwise equal across designs and ranks: {run['bitwise_equal']}")
    if not all(run["bitwise_equal"] for run in runs):
        raise SystemExit("the designs' final weights differ: the overlap changed a result")
    return res


def _run(a: argparse.Namespace, nproc: int) -> dict[str, Any]:
    got = measure(a, nproc)
    digests = {r: res["digests"] for r, res in got.items()}
    rounds = got[0]["rounds"]
    return {
        "nproc": nproc,
        "buckets": got[0]["buckets"],
        "step_ms": {d: bl.summary([t[d] * 1e3 for t in rounds]) for d in DESIGNS},  # rank 0's
        "ratio_to_torch": {d: bl.ratio_ci([t[d] / t["torch"] for t in rounds]) for d in DESIGNS[1:]},
        "bitwise_equal": len({d for ds in digests.values() for d in ds.values()}) == 1,
        "digests": {str(r): d for r, d in digests.items()},
        "rounds": rounds,
    }


if __name__ == "__main__":
    main()
